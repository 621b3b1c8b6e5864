"""Great Expectations suites of the SQL analyst's world, registered under names prefixed ``sql_``.

One suite per table: ``sql_customers``, ``sql_products``, ``sql_orders``, ``sql_order_lines``; ``sql_tasks`` for task
records (reference SQL is a SELECT, its tables exist, ``min_calls`` = tables + 2, a known kind, held-out values
recorded)
and :func:`check_splits` for the rules across splits (ids unique, held-out values disjoint, held-out wording only in
test). Each table is exported
by a query (:data:`EXPORTS`) that adds the columns the cross-table rules need, and each suite derives the boolean
columns it checks from them, so a broken row is named by its id:

- every order's customer exists (``n_customer`` = 1) and every line's order and product exist;
- an order's ``total`` equals the sum of its lines' ``quantity * unit_price`` to the cent (``lines_total``);
- a customer's ``country`` is the country of its ``city``; dates are ISO ``YYYY-MM-DD`` within the world's years;
- categorical columns take only the generator's values, ids and names are unique, numbers lie in their ranges.

:func:`register_suites` is idempotent; :func:`validate_world` registers and runs them all on ``world.sqlite``.
Deliberately left out: the demonstrations (the pipeline's own suite checks those).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from pipeline.core import validation as V
from pipeline.envs.sql.tasks import FAMILY_NAMES
from pipeline.envs.sql.world import (CATEGORIES, CHANNELS, CITIES, CITY_COUNTRY, COUNTRY_CITIES, DB_NAME,
                                     HELDOUT_DIMENSIONS, SEGMENTS, SPLITS, STATUSES, TABLES, connect_ro)

DATE = r"^202[2-4]-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"
SIGNUP_DATE = r"^202[1-4]-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"
EXPORTS = {
    "customers": "SELECT * FROM customers ORDER BY customer_id",
    "products": "SELECT * FROM products ORDER BY product_id",
    "orders": "SELECT o.*, (SELECT COUNT(*) FROM customers c WHERE c.customer_id = o.customer_id) AS n_customer, "
              "(SELECT ROUND(SUM(quantity * unit_price), 2) FROM order_lines l WHERE l.order_id = o.order_id) "
              "AS lines_total FROM orders o ORDER BY order_id",
    "order_lines": "SELECT l.*, (SELECT COUNT(*) FROM orders o WHERE o.order_id = l.order_id) AS n_order, "
                   "(SELECT COUNT(*) FROM products p WHERE p.product_id = l.product_id) AS n_product "
                   "FROM order_lines l ORDER BY line_id",
}


def _derive_customers(df: pd.DataFrame) -> dict[str, list]:
    cities, countries = V.column_values(df, "city"), V.column_values(df, "country")
    return {"country_matches_city": [CITY_COUNTRY.get(c) == k for c, k in zip(cities, countries)]}


def _derive_orders(df: pd.DataFrame) -> dict[str, list]:
    n, total, lines = (V.column_values(df, c) for c in ("n_customer", "total", "lines_total"))
    return {"customer_exists": [x == 1 for x in n],
            "total_matches_lines": [isinstance(t, (int, float)) and isinstance(s, (int, float)) and abs(t - s) < 0.006
                                    for t, s in zip(total, lines)]}


def _derive_lines(df: pd.DataFrame) -> dict[str, list]:
    n_order, n_product = V.column_values(df, "n_order"), V.column_values(df, "n_product")
    return {"order_exists": [x == 1 for x in n_order], "product_exists": [x == 1 for x in n_product]}


def customers_suite() -> list:
    """Rows of the SQL world's `customers` table."""
    import great_expectations.expectations as gxe

    return [
        *V.non_empty_table(gxe),
        *V.number(gxe, "customer_id", 1, None, unique=True),
        *V.text(gxe, "name", unique=True),
        *V.one_of(gxe, "city", CITIES),
        *V.one_of(gxe, "country", COUNTRY_CITIES),
        *V.all_true(gxe, "country_matches_city"),
        *V.one_of(gxe, "segment", SEGMENTS),
        *V.present(gxe, "signup_date", V.STR_TYPES),
        gxe.ExpectColumnValuesToMatchRegex(column="signup_date", regex=SIGNUP_DATE),
    ]


def products_suite() -> list:
    """Rows of the SQL world's `products` table."""
    import great_expectations.expectations as gxe

    return [
        *V.non_empty_table(gxe),
        *V.number(gxe, "product_id", 1, None, unique=True),
        *V.text(gxe, "name", unique=True),
        *V.one_of(gxe, "category", CATEGORIES),
        *V.number(gxe, "price", 1, 10_000, types=V.FLOAT_TYPES),
        *V.number(gxe, "stock", 0, 500),
    ]


def orders_suite() -> list:
    """Rows of the SQL world's `orders` table (with their customer count and the sum of their lines)."""
    import great_expectations.expectations as gxe

    return [
        *V.non_empty_table(gxe),
        *V.number(gxe, "order_id", 1, None, unique=True),
        *V.number(gxe, "customer_id", 1, None),
        *V.all_true(gxe, "customer_exists"),
        *V.present(gxe, "order_date", V.STR_TYPES),
        gxe.ExpectColumnValuesToMatchRegex(column="order_date", regex=DATE),
        *V.one_of(gxe, "status", STATUSES),
        *V.one_of(gxe, "channel", CHANNELS),
        *V.number(gxe, "total", 0.01, None, types=V.FLOAT_TYPES),
        *V.all_true(gxe, "total_matches_lines"),
    ]


def order_lines_suite() -> list:
    """Rows of the SQL world's `order_lines` table (with the counts of their order and product)."""
    import great_expectations.expectations as gxe

    return [
        *V.non_empty_table(gxe),
        *V.number(gxe, "line_id", 1, None, unique=True),
        *V.all_true(gxe, "order_exists"),
        *V.all_true(gxe, "product_exists"),
        *V.number(gxe, "quantity", 1, 9),
        *V.number(gxe, "unit_price", 0.01, None, types=V.FLOAT_TYPES),
    ]


TABLE_SUITES = {  # table -> (suite name, id column, builder, derive)
    "customers": ("sql_customers", "customer_id", customers_suite, _derive_customers),
    "products": ("sql_products", "product_id", products_suite, None),
    "orders": ("sql_orders", "order_id", orders_suite, _derive_orders),
    "order_lines": ("sql_order_lines", "line_id", order_lines_suite, _derive_lines),
}


def register_suites() -> list[str]:
    """Register every ``sql_`` suite the registry lacks (calling it again does nothing); their names."""
    specs = [*TABLE_SUITES.values(), ("sql_tasks", "task_id", tasks_suite, _derive_tasks)]
    for name, id_column, build, derive in specs:
        if name not in V.SUITES:
            V.register_suite(name, id_column=id_column, derive=derive)(build)
    return [s[0] for s in specs]


def table_records(world_dir: Path, table: str) -> list[dict]:
    """The rows of `table` as exported for its suite (:data:`EXPORTS`)."""
    conn = connect_ro(Path(world_dir) / DB_NAME)
    try:
        cur = conn.execute(EXPORTS[table])
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, row)) for row in cur]
    finally:
        conn.close()


def validate_world(world_dir: Path) -> list[V.ValidationReport]:
    """One report per table of ``world_dir/world.sqlite``."""
    register_suites()
    reports = []
    for table, (suite, *_rest) in TABLE_SUITES.items():
        records = table_records(world_dir, table)
        reports.append(V.validate_records(records, suite, dataset=f"{Path(world_dir) / DB_NAME}:{table}"))
    return reports


# ------------------------------------------------------------------------------------------------------- tasks
def _derive_tasks(df: pd.DataFrame) -> dict[str, list]:
    datas = V.column_values(df, "data")
    min_calls = V.column_values(df, "min_calls")

    def get(d, key):
        return d.get(key) if isinstance(d, dict) else None

    tables = [get(d, "tables") for d in datas]
    return {
        "sql_is_select": [isinstance(get(d, "sql"), str) and get(d, "sql").startswith("SELECT ") for d in datas],
        "tables_known": [isinstance(t, list) and bool(t) and set(t) <= set(TABLES) for t in tables],
        "min_calls_matches_plan": [isinstance(t, list) and m == len(t) + 2 for t, m in zip(tables, min_calls)],
        "kind": [get(d, "kind") for d in datas],
        "template_id": [get(d, "template_id") for d in datas],  # the wording, "family/index", kept in `data`
        "heldout_well_formed": [isinstance(get(d, "heldout"), dict) and bool(get(d, "heldout"))
                                and set(get(d, "heldout")) <= set(HELDOUT_DIMENSIONS) for d in datas],
    }


def tasks_suite(split: str | None = None) -> list:
    """Task records of the SQL analyst (data/tasks/{split}.jsonl); `split` pins the `split` column."""
    import great_expectations.expectations as gxe

    return [
        *V.non_empty_table(gxe),
        *V.text(gxe, "task_id", unique=True),
        gxe.ExpectColumnValuesToMatchRegex(column="task_id", regex=r"^sql-(train|validation|test)-\d{6}$"),
        *V.one_of(gxe, "split", [split] if split else SPLITS),
        *V.one_of(gxe, "family", FAMILY_NAMES),
        *V.one_of(gxe, "level", [1, 2, 3, 4], V.INT_TYPES),
        *V.text(gxe, "question", max_len=300),
        *V.text(gxe, "answer", max_len=200),
        *V.number(gxe, "min_calls", 3, 5),
        *V.present(gxe, "template_seen", V.BOOL_TYPES),
        *V.text(gxe, "template_id"),  # a non-blank string of the task's `data` (a number there is refused)
        *V.all_true(gxe, "sql_is_select"),
        *V.all_true(gxe, "tables_known"),
        *V.all_true(gxe, "min_calls_matches_plan"),
        gxe.ExpectColumnValuesToBeInSet(column="kind", value_set=["number", "names"]),
        *V.all_true(gxe, "heldout_well_formed"),
    ]


def check_splits(splits: dict[str, list[dict]]) -> V.ValidationReport:
    """Across splits: task ids unique; no held-out value of a validation or test task in an earlier split's tasks
    (validation against train, test against train and validation); train and validation use seen wordings only."""
    import great_expectations.expectations as gxe
    from great_expectations.expectations.row_conditions import Column

    rows, value_rows = [], []
    values: dict[str, set[str]] = {s: set() for s in SPLITS}
    for split, records in splits.items():
        for i, r in enumerate(records):
            rows.append((split, i, r.get("task_id"), r.get("template_seen")))
            held = (r.get("data") or {}).get("heldout") if isinstance(r.get("data"), dict) else None
            for dim, v in (held or {}).items():
                values.setdefault(split, set()).add(f"{dim}:{v}")
                value_rows.append((split, i, r.get("task_id"), f"{dim}:{v}"))
    tasks = pd.DataFrame(rows, columns=[V.SPLIT, V.ROW, "task_id", "template_seen"], dtype=object)
    index = [V.SPLIT, V.ROW, "task_id"]
    results = V.run_expectations(tasks, [
        gxe.ExpectColumnValuesToBeUnique(column="task_id"),
        gxe.ExpectColumnValuesToBeInSet(column="template_seen", value_set=[True],
                                        row_condition=Column(V.SPLIT) != "test"),
    ], index, name="sql_splits")
    frame = pd.DataFrame(value_rows, columns=[V.SPLIT, V.ROW, "task_id", "value"], dtype=object)
    for split, earlier in (("validation", values["train"]), ("test", values["train"] | values["validation"])):
        part = frame[frame[V.SPLIT] == split]
        if len(part):
            results += V.run_expectations(part, [gxe.ExpectColumnValuesToNotBeInSet(
                column="value", value_set=sorted(earlier))], index, name=f"sql_heldout_{split}")
    return V.ValidationReport("splits", "sql_splits", len(tasks), results)


def validate_tasks(records: list[dict], dataset: str, split: str | None = None) -> V.ValidationReport:
    """The ``sql_tasks`` report on task records (as read back from a file)."""
    register_suites()
    return V.validate_records(records, "sql_tasks", dataset=dataset, split=split)
