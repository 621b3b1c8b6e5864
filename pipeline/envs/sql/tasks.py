"""Tasks of the SQL analyst: question families at four levels, each task with its reference SQL and ground truth.

A task's ground truth is what its reference SQL returns on the built database (run here, once, at build time):
a number (formatted as the ``query`` tool shows it: integers bare, others rounded to 2 decimals) or, for top-k
families, the k names in order, comma-separated. Draws whose answer is empty, zero or NULL, and top-k draws with a tie
among the first k+1 groups (so that any correct query gives the same list), are skipped.

=====  ======================  ===============================================  ======  =========
level  family                  reference SQL                                    tables  min_calls
=====  ======================  ===============================================  ======  =========
1      count_customers         COUNT of customers in a city and segment          1       3
1      count_orders_range      COUNT of orders of a status in a date range       1       3
1      count_products          COUNT of products of a category above a price     1       3
2      revenue_month           SUM(total) of orders of a status in a month       1       3
2      avg_order_month         AVG(total) of orders of a channel in a month      1       3
2      stock_category          SUM(stock) of a category's products above a price 1       3
3      orders_city_status      COUNT, orders JOIN customers                      2       4
3      revenue_city_month      SUM(total), orders JOIN customers                 2       4
3      units_category_month    SUM(quantity), order_lines JOIN products, orders  3       5
4      top_products            top-k product names of a category (GROUP BY)      2       4
4      top_customers           top-k customer names of a city (GROUP BY)         2       4
4      top_products_month      top-k product names by value in a month           3       5
4      max_spend               MAX over a GROUP BY per customer (subquery)       2       4
=====  ======================  ===============================================  ======  =========

`min_calls` is the expert's plan: ``describe_table`` of each table the query reads, ``query``, ``answer``.

Values in questions are written in single quotes exactly as they appear in the SQL (``'Lyon'``, ``'2023-04'``), so
the token before a value is the same in the question and in the query the policy writes, which is what lets a small
model copy values it never saw in training.

Wordings: five fixed ones per family. Index 4 is held out: test draws from 0-4 (``template_seen`` False for 4);
train and validation draw from the first `train_wordings` (1-4) of 0-3 and the family's frames of the wording grammar
(:mod:`pipeline.envs.sql.wordings`), which never writes the held-out wording or its construction. Held-out values: see :mod:`pipeline.envs.sql.world`; each
task records the held-out values it filters on in ``data["heldout"]`` ({"city": ..., "category": ..., "month": ...}).
"""

from __future__ import annotations

import calendar
import sqlite3
from dataclasses import dataclass

import numpy as np

from pipeline.envs.contract import Task
from pipeline.envs.sql.tools import format_number
from pipeline.envs.sql.wordings import draw as draw_wording
from pipeline.envs.sql.world import CHANNELS, SEGMENTS, SPLITS, STATUSES

HELDOUT_TEMPLATE = 4
TRAIN_TEMPLATES = (0, 1, 2, 3)
THRESHOLDS = (10, 25, 50, 100, 200)
TOP_K = (2, 3, 4)
J_CUST = "FROM orders JOIN customers c USING (customer_id)"
J_PROD = "FROM order_lines JOIN products p USING (product_id)"


@dataclass(frozen=True)
class Family:
    name: str
    level: int
    tables: tuple[str, ...]  # what the expert describes, in order
    sql: str  # reference SQL, with {slot} fields
    slots: tuple[str, ...]  # slots drawn per task (see _draw)
    wordings: tuple[str, ...]  # five; index 4 is held out
    kind: str = "number"  # or "names" (top-k)
    check: str = ""  # top-k: SQL returning (name, metric) of the first k+1 groups, to skip ties


TOP_METRICS = {  # slot "metric": (SQL, words)
    "products": {"units": ("SUM(quantity)", "units ordered"), "value": ("SUM(quantity * unit_price)", "order value")},
    "customers": {"spent": ("SUM(total)", "total spent"), "average": ("AVG(total)", "average order total")},
}

FAMILIES: tuple[Family, ...] = (
    Family("count_customers", 1, ("customers",),
           "SELECT COUNT(*) FROM customers WHERE city = '{city}' AND segment = '{segment}'", ("city", "segment"), (
               "How many '{segment}' customers are in '{city}'?",
               "Count the customers in '{city}' whose segment is '{segment}'.",
               "What is the number of customers in '{city}' with segment '{segment}'?",
               "How many customers from '{city}' belong to the '{segment}' segment?",
               "In '{city}', how many customers are in the segment '{segment}'?")),
    Family("count_orders_range", 1, ("orders",),
           "SELECT COUNT(*) FROM orders WHERE status = '{status}' AND order_date BETWEEN '{d1}' AND '{d2}'",
           ("range", "status"), (
               "How many orders with status '{status}' were placed between '{d1}' and '{d2}'?",
               "Count the '{status}' orders dated from '{d1}' to '{d2}'.",
               "What number of orders placed from '{d1}' through '{d2}' have status '{status}'?",
               "Between '{d1}' and '{d2}', how many orders were '{status}'?",
               "Give the count of orders in status '{status}' with an order date between '{d1}' and '{d2}'.")),
    Family("count_products", 1, ("products",),
           "SELECT COUNT(*) FROM products WHERE category = '{category}' AND price > {threshold}",
           ("category", "threshold"), (
               "How many '{category}' products cost more than {threshold}?",
               "Count the products in category '{category}' priced above {threshold}.",
               "What is the number of '{category}' products with a price over {threshold}?",
               "How many products of the '{category}' category have a price above {threshold}?",
               "Of the '{category}' products, how many are more expensive than {threshold}?")),
    Family("revenue_month", 2, ("orders",),
           "SELECT SUM(total) FROM orders WHERE status = '{status}' AND order_date LIKE '{month}%'",
           ("month", "status"), (
               "What is the total value of '{status}' orders placed in '{month}'?",
               "Sum the totals of orders with status '{status}' from '{month}'.",
               "How much did the '{status}' orders of '{month}' come to in total?",
               "What do the order totals of '{status}' orders in '{month}' add up to?",
               "For '{month}', give the combined total of all orders whose status is '{status}'.")),
    Family("avg_order_month", 2, ("orders",),
           "SELECT AVG(total) FROM orders WHERE channel = '{channel}' AND order_date LIKE '{month}%'",
           ("month", "channel"), (
               "What is the average total of '{channel}' orders placed in '{month}'?",
               "Give the mean order total of orders through the '{channel}' channel in '{month}'.",
               "On average, how large was a '{channel}' order in '{month}'?",
               "What was the average order total in '{month}' for the '{channel}' channel?",
               "Across '{channel}' orders from '{month}', what is the mean total?")),
    Family("stock_category", 2, ("products",),
           "SELECT SUM(stock) FROM products WHERE category = '{category}' AND price > {threshold}",
           ("category", "threshold"), (
               "How many units of '{category}' products priced above {threshold} are in stock?",
               "What is the total stock of '{category}' products with a price over {threshold}?",
               "Sum the stock of products in category '{category}' that cost more than {threshold}.",
               "How much stock is there of '{category}' products priced over {threshold}?",
               "Taking '{category}' products more expensive than {threshold}, what stock do they hold together?")),
    Family("orders_city_status", 3, ("orders", "customers"),
           f"SELECT COUNT(*) {J_CUST} WHERE c.city = '{{city}}' AND status = '{{status}}'", ("city", "status"), (
               "How many orders from customers in '{city}' have status '{status}'?",
               "Count the '{status}' orders placed by customers located in '{city}'.",
               "What number of orders by '{city}' customers are '{status}'?",
               "How many '{status}' orders were made by customers from '{city}'?",
               "Customers in '{city}' placed orders; how many of those orders are in status '{status}'?")),
    Family("revenue_city_month", 3, ("orders", "customers"),
           f"SELECT SUM(total) {J_CUST} WHERE c.city = '{{city}}' AND order_date LIKE '{{month}}%'",
           ("city", "month"), (
               "What is the total value of orders placed by customers in '{city}' in '{month}'?",
               "Sum the order totals of customers from '{city}' for '{month}'.",
               "How much did customers in '{city}' order in '{month}', in total?",
               "What do the orders of '{city}' customers in '{month}' add up to?",
               "In '{month}', what was the combined order total of customers located in '{city}'?")),
    Family("units_category_month", 3, ("order_lines", "products", "orders"),
           f"SELECT SUM(quantity) {J_PROD} JOIN orders USING (order_id) WHERE p.category = '{{category}}' "
           "AND order_date LIKE '{month}%'", ("category", "month"), (
               "How many units of '{category}' products were ordered in '{month}'?",
               "Count the units ordered of products in category '{category}' during '{month}'.",
               "What quantity of '{category}' products did orders from '{month}' contain?",
               "In total, how many '{category}' units were on orders placed in '{month}'?",
               "Orders placed in '{month}' included '{category}' products; how many units altogether?")),
    Family("top_products", 4, ("order_lines", "products"),
           f"SELECT p.name {J_PROD} WHERE p.category = '{{category}}' GROUP BY p.name ORDER BY {{m}} DESC LIMIT {{k}}",
           ("category", "metric_products", "k"), (
               "Which {k} '{category}' products have the highest {mw}? List them from the top.",
               "Name the top {k} products in category '{category}' by {mw}, best first.",
               "List the {k} '{category}' products with the most {mw}, in descending order.",
               "What are the top {k} '{category}' products ranked by {mw}?",
               "Rank the '{category}' products by {mw} and give the first {k}."),
           kind="names",
           check=f"SELECT p.name, {{m}} {J_PROD} WHERE p.category = '{{category}}' GROUP BY p.name "
                 "ORDER BY 2 DESC LIMIT {k1}"),
    Family("top_customers", 4, ("orders", "customers"),
           f"SELECT c.name {J_CUST} WHERE c.city = '{{city}}' GROUP BY c.name ORDER BY {{m}} DESC LIMIT {{k}}",
           ("city", "metric_customers", "k"), (
               "Which {k} customers in '{city}' have the highest {mw}? List them from the top.",
               "Name the top {k} customers from '{city}' by {mw}, best first.",
               "List the {k} '{city}' customers with the largest {mw}, in descending order.",
               "Who are the top {k} customers in '{city}' ranked by {mw}?",
               "Rank the customers located in '{city}' by {mw} and give the first {k}."),
           kind="names",
           check=f"SELECT c.name, {{m}} {J_CUST} WHERE c.city = '{{city}}' GROUP BY c.name "
                 "ORDER BY 2 DESC LIMIT {k1}"),
    Family("top_products_month", 4, ("order_lines", "products", "orders"),
           f"SELECT p.name {J_PROD} JOIN orders USING (order_id) WHERE order_date LIKE '{{month}}%' GROUP BY p.name "
           "ORDER BY SUM(quantity * unit_price) DESC LIMIT {k}", ("month", "k"), (
               "Which {k} products had the highest order value in '{month}'? List them from the top.",
               "Name the top {k} products by order value in '{month}', best first.",
               "List the {k} products with the most order value during '{month}', in descending order.",
               "What were the top {k} products of '{month}' ranked by order value?",
               "Rank the products by their order value in '{month}' and give the first {k}."),
           kind="names",
           check=f"SELECT p.name, SUM(quantity * unit_price) {J_PROD} JOIN orders USING (order_id) "
                 "WHERE order_date LIKE '{month}%' GROUP BY p.name ORDER BY 2 DESC LIMIT {k1}"),
    Family("max_spend", 4, ("orders", "customers"),
           f"SELECT MAX(s) FROM (SELECT SUM(total) AS s {J_CUST} WHERE c.city = '{{city}}' AND status = '{{status}}' "
           "GROUP BY customer_id)", ("city", "status"), (
               "What is the most any single customer in '{city}' spent on '{status}' orders?",
               "Among customers from '{city}', what is the largest total of '{status}' orders by one customer?",
               "Which is the highest sum of '{status}' order totals of one customer located in '{city}'?",
               "What is the biggest per-customer total of '{status}' orders among '{city}' customers?",
               "Summing '{status}' orders per customer in '{city}', what is the maximum?")),
)
BY_NAME = {f.name: f for f in FAMILIES}
FAMILY_NAMES = tuple(BY_NAME)


def _draw(family: Family, values: dict[str, list[str]], rng: np.random.Generator) -> tuple[dict, dict]:
    """(slots for the SQL and the wording, held-out values) of one draw; `values` are the split's held-out values."""
    pick = lambda seq: seq[int(rng.integers(len(seq)))]  # noqa: E731
    slots, heldout = {}, {}
    for s in family.slots:
        if s in ("city", "category", "month"):
            slots[s] = heldout[s] = pick(values[s])
        elif s == "range":
            month = heldout["month"] = pick(values["month"])
            last = calendar.monthrange(int(month[:4]), int(month[5:]))[1]
            first = int(rng.integers(1, last - 2))
            end = min(last, first + int(rng.integers(3, 15)))
            slots["d1"], slots["d2"] = f"{month}-{first:02d}", f"{month}-{end:02d}"
        elif s == "segment":
            slots[s] = pick(SEGMENTS)
        elif s == "status":
            slots[s] = pick(STATUSES)
        elif s == "channel":
            slots[s] = pick(CHANNELS)
        elif s == "threshold":
            slots[s] = pick(THRESHOLDS)
        elif s == "k":
            slots["k"] = pick(TOP_K)
            slots["k1"] = slots["k"] + 1
        elif s.startswith("metric_"):
            metrics = TOP_METRICS[s[len("metric_"):]]
            slots["metric"] = pick(sorted(metrics))
            slots["m"], slots["mw"] = metrics[slots["metric"]]
    return slots, heldout


def ground_truth(family: Family, slots: dict, conn: sqlite3.Connection) -> str | None:
    """The answer of the family's reference SQL on `conn`, or None when the draw is unusable (see the docstring)."""
    rows = conn.execute(family.sql.format(**slots)).fetchall()
    if family.kind == "number":
        v = rows[0][0] if rows else None
        if v is None or format_number(v) in ("0", "-0"):
            return None
        return format_number(v)
    if len(rows) < slots["k"]:
        return None
    metrics = [r[1] for r in conn.execute(family.check.format(**slots)).fetchall()]
    if any(round(a, 6) == round(b, 6) for a, b in zip(metrics, metrics[1:])):
        return None
    return ", ".join(str(r[0]) for r in rows)


def generate_tasks(conn: sqlite3.Connection, partition: dict, split: str, n: int, level_mix: dict[int, float],
                   seed: int, train_wordings: int = 4) -> list[Task]:
    """`n` distinct tasks of `split` (ids ``sql-{split}-{i:06d}``); ValueError when the value space is too small."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; splits are {list(SPLITS)}")
    if not 1 <= train_wordings <= len(TRAIN_TEMPLATES):
        raise ValueError(f"train_wordings must be 1-{len(TRAIN_TEMPLATES)}, got {train_wordings}")
    levels = sorted(lv for lv, w in level_mix.items() if w > 0)
    weights = np.array([level_mix[lv] for lv in levels], dtype=float)
    weights /= weights.sum()
    by_level = {lv: [f for f in FAMILIES if f.level == lv] for lv in levels}
    values = {dim: part[split] for dim, part in partition.items()}
    templates = (*TRAIN_TEMPLATES, HELDOUT_TEMPLATE) if split == "test" else TRAIN_TEMPLATES[:train_wordings]
    rng = np.random.default_rng([seed, 12, SPLITS.index(split)])
    tasks: list[Task] = []
    seen: set[str] = set()
    cache: dict[str, str | None] = {}
    attempts = 0
    while len(tasks) < n:
        attempts += 1
        if attempts > 50 * n + 2000:
            raise ValueError(f"could not draw {n} distinct {split} tasks (found {len(tasks)}); the value space is "
                             "too small for this many: lower tasks_per_split or the level-4 weight (level 4 has the "
                             "fewest distinct questions), or change train_wordings / heldout_fraction")
        level = levels[int(rng.choice(len(levels), p=weights))]
        family = by_level[level][int(rng.integers(len(by_level[level])))]
        if split == "test":  # the five fixed wordings, as drawn before the grammar: test is byte for byte the same
            template = templates[int(rng.integers(len(templates)))]
            slots, heldout = _draw(family, values, rng)
            question = family.wordings[template].format(**slots)
        else:
            slots, heldout = _draw(family, values, rng)
            question, template = draw_wording(family.name, slots, list(templates), family.wordings, rng)
        if question in seen:
            continue
        seen.add(question)
        sql = family.sql.format(**slots)
        if sql not in cache:
            cache[sql] = ground_truth(family, slots, conn)
        if cache[sql] is None:
            continue
        tasks.append(Task(
            task_id=f"sql-{split}-{len(tasks):06d}", split=split, level=family.level, question=question,
            answer=cache[sql], family=family.name, min_calls=len(family.tables) + 2,
            template_seen=template != HELDOUT_TEMPLATE,
            data={"sql": sql, "tables": list(family.tables), "kind": family.kind, "heldout": heldout,
                  "template_id": f"{family.name}/{template}"},
        ))
    return tasks
