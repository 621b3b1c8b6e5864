"""The SQL analyst's world: a generated shop database (customers, products, orders, order lines) in real SQLite.

Everything is drawn from one seeded `numpy.random.Generator` (``default_rng([seed, 11])``) and inserted in a fixed
order with one SQLite version, so a seed gives a byte-identical ``world.sqlite`` and ``world.json``.

Held-out filter values: the values a question filters on along three *held-out dimensions* -- the customer's
``city``, the product's ``category`` and the order ``month`` (``YYYY-MM``) -- are partitioned into train / validation
/ test here, before any task exists (`heldout_fraction` of each dimension is held out, half to validation, the rest to
test). A task of a split filters only on values of its own partition, so no validation or test question names a city,
category or month that any training question names. Statuses, channels, segments and price thresholds are shared by
all splits (there are too few of them to hold any out).

The data has the skew of a real shop, so that aggregates and top-k lists are informative: customers' order rates and
products' popularity are gamma-distributed, prices log-normal around a per-category level, 0-20 % line discounts.
``orders.total`` is the rounded sum of its lines (the world suite checks it).

Deliberately left out: returns/refund rows, currencies, time zones, NULLs (every column is NOT NULL), and any table a
question does not need.
"""

from __future__ import annotations

import datetime as dt
import json
import sqlite3
from pathlib import Path

import numpy as np

SPLITS = ("train", "validation", "test")
TABLES = ("customers", "products", "orders", "order_lines")
DB_NAME, META_NAME, CORPUS_NAME = "world.sqlite", "world.json", "corpus.jsonl"
FORMAT_VERSION = 1

COUNTRY_CITIES = {
    "Norway": ("Oslo", "Bergen", "Trondheim", "Stavanger"),
    "France": ("Lyon", "Nantes", "Lille", "Rennes"),
    "Portugal": ("Porto", "Braga", "Coimbra", "Faro"),
    "Austria": ("Graz", "Linz", "Salzburg", "Innsbruck"),
    "Italy": ("Turin", "Genoa", "Bologna", "Verona"),
    "Belgium": ("Ghent", "Bruges", "Liege", "Namur"),
    "Sweden": ("Malmo", "Uppsala", "Orebro", "Lund"),
    "Spain": ("Bilbao", "Seville", "Valencia", "Malaga"),
    "Poland": ("Krakow", "Gdansk", "Poznan", "Lodz"),
    "Finland": ("Tampere", "Turku", "Oulu", "Espoo"),
}
CITY_COUNTRY = {city: country for country, cities in COUNTRY_CITIES.items() for city in cities}
CITIES = tuple(CITY_COUNTRY)
CATEGORY_NOUNS = {
    "lighting": ("Lamp", "Lantern", "Torch", "Bulb"),
    "kitchen": ("Kettle", "Pan", "Mug", "Blender", "Toaster"),
    "tools": ("Hammer", "Drill", "Wrench", "Saw"),
    "outdoor": ("Tent", "Backpack", "Bottle", "Compass"),
    "office": ("Desk", "Chair", "Stapler", "Notebook"),
    "audio": ("Speaker", "Radio", "Headset", "Amplifier"),
    "garden": ("Hose", "Shovel", "Planter", "Rake"),
    "toys": ("Puzzle", "Kite", "Robot", "Yoyo"),
    "books": ("Atlas", "Novel", "Cookbook", "Journal"),
    "sports": ("Racket", "Ball", "Helmet", "Skates"),
    "beauty": ("Soap", "Lotion", "Brush", "Mirror"),
    "pets": ("Leash", "Collar", "Feeder", "Kennel"),
    "bath": ("Towel", "Robe", "Sponge", "Shelf"),
    "travel": ("Suitcase", "Pillow", "Wallet", "Adapter"),
    "music": ("Guitar", "Drum", "Flute", "Metronome"),
    "baby": ("Stroller", "Rattle", "Bib", "Crib"),
}
CATEGORIES = tuple(CATEGORY_NOUNS)
CATEGORY_PRICE = {c: p for c, p in zip(CATEGORIES, (30, 45, 60, 80, 70, 90, 35, 25, 20, 55, 18, 28, 22, 75, 150, 50))}
ADJECTIVES = (
    "Blue", "Red", "Green", "Silver", "Golden", "Quiet", "Rapid", "Compact", "Smart", "Classic", "Bright", "Solid",
    "Tiny", "Grand", "Swift", "Urban", "Rustic", "Modern", "Polar", "Sunny", "Misty", "Amber", "Coral", "Ivory",
    "Cobalt", "Crimson", "Lucky", "Noble", "Prime", "Royal", "Steady", "Wild", "Cosmic", "Velvet", "Arctic", "Copper",
)
FIRST_NAMES = (
    "Anna", "Ben", "Clara", "David", "Elena", "Felix", "Greta", "Hugo", "Ida", "Jonas", "Karin", "Leo", "Maja", "Nils",
    "Olga", "Paul", "Rosa", "Sven", "Tara", "Umar", "Vera", "Wim", "Xenia", "Yusuf", "Zoe", "Amir", "Bea", "Carl",
    "Dina", "Emil", "Freya", "Gustav", "Hanna", "Ivan", "Julia", "Karl", "Lena", "Marco", "Nora", "Oskar",
)
LAST_NAMES = (
    "Berg", "Costa", "Dahl", "Eriksen", "Fischer", "Garcia", "Hansen", "Ivanov", "Jensen", "Kowalski", "Laine",
    "Moreau",
    "Nowak", "Olsen", "Perez", "Quist", "Rossi", "Silva", "Torres", "Urban", "Vogel", "Weber", "Young", "Zeller",
    "Aalto", "Bauer", "Conti", "Dubois", "Engel", "Ferrari", "Gomez", "Holm", "Jansen", "Keller", "Lund", "Martin",
    "Novak", "Ortiz", "Peeters", "Richter",
)
SEGMENTS = ("consumer", "business", "enterprise")
STATUSES = ("delivered", "shipped", "pending", "cancelled", "returned")
STATUS_P = (0.62, 0.14, 0.08, 0.09, 0.07)
CHANNELS = ("web", "store", "phone", "partner")
CHANNEL_P = (0.5, 0.3, 0.12, 0.08)
FIRST_DAY, N_DAYS = dt.date(2022, 1, 1), 1096  # 2022-01-01 .. 2024-12-31
MONTHS = tuple(f"{y}-{m:02d}" for y in (2022, 2023, 2024) for m in range(1, 13))
HELDOUT_DIMENSIONS = {"city": CITIES, "category": CATEGORIES, "month": MONTHS}

SCHEMA = """
CREATE TABLE customers (
    customer_id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    city TEXT NOT NULL,
    country TEXT NOT NULL,
    segment TEXT NOT NULL,
    signup_date TEXT NOT NULL
);
CREATE TABLE products (
    product_id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    category TEXT NOT NULL,
    price REAL NOT NULL CHECK (price > 0),
    stock INTEGER NOT NULL CHECK (stock >= 0)
);
CREATE TABLE orders (
    order_id INTEGER PRIMARY KEY,
    customer_id INTEGER NOT NULL REFERENCES customers(customer_id),
    order_date TEXT NOT NULL,
    status TEXT NOT NULL,
    channel TEXT NOT NULL,
    total REAL NOT NULL
);
CREATE TABLE order_lines (
    line_id INTEGER PRIMARY KEY,
    order_id INTEGER NOT NULL REFERENCES orders(order_id),
    product_id INTEGER NOT NULL REFERENCES products(product_id),
    quantity INTEGER NOT NULL CHECK (quantity > 0),
    unit_price REAL NOT NULL CHECK (unit_price > 0)
);
CREATE INDEX customers_city ON customers(city);
CREATE INDEX products_category ON products(category);
CREATE INDEX orders_customer ON orders(customer_id);
CREATE INDEX orders_date ON orders(order_date);
CREATE INDEX lines_order ON order_lines(order_id);
CREATE INDEX lines_product ON order_lines(product_id);
"""


def partition(values: tuple[str, ...], rng: np.random.Generator, heldout: float) -> dict[str, list[str]]:
    """Split `values` into train / validation / test: `heldout` of them held out (at least one each to validation and
    test), validation getting half of the held-out ones (rounded down). Each list keeps the values' own order."""
    n_hold = max(2, int(round(len(values) * heldout)))
    if n_hold >= len(values):
        raise ValueError(f"heldout_fraction={heldout} leaves no training values among {len(values)}")
    order = rng.permutation(len(values))
    rank = {int(idx): r for r, idx in enumerate(order)}
    n_val = n_hold // 2
    split_of = {v: "validation" if rank[i] < n_val else "test" if rank[i] < n_hold else "train"
                for i, v in enumerate(values)}
    return {s: [v for v in values if split_of[v] == s] for s in SPLITS}


def _day(offset: int) -> str:
    return (FIRST_DAY + dt.timedelta(days=int(offset))).isoformat()


def generate(seed: int, n_customers: int, n_products: int, n_orders: int, heldout_fraction: float) -> dict:
    """All rows of the world and the held-out partition: {"rows": {table: [tuple, ...]}, "partition": {...}}."""
    rng = np.random.default_rng([seed, 11])
    names = [f"{f} {last}" for f in FIRST_NAMES for last in LAST_NAMES]
    if n_customers > len(names):
        raise ValueError(f"n_customers={n_customers} exceeds the {len(names)} distinct customer names")
    products_pool = [(f"{a} {n}", c) for c in CATEGORIES for n in CATEGORY_NOUNS[c] for a in ADJECTIVES]
    most = len(CATEGORIES) * min(len(n) for n in CATEGORY_NOUNS.values()) * len(ADJECTIVES)
    if n_products > most:
        raise ValueError(f"n_products={n_products} exceeds the {most} distinct product names")
    part = {dim: partition(values, rng, heldout_fraction) for dim, values in HELDOUT_DIMENSIONS.items()}

    customers = []
    picked = [int(i) for i in rng.choice(len(names), size=n_customers, replace=False)]
    cities = rng.integers(len(CITIES), size=n_customers)
    segments = rng.choice(len(SEGMENTS), size=n_customers, p=(0.7, 0.22, 0.08))
    signups = rng.integers(0, N_DAYS, size=n_customers)
    for i in range(n_customers):
        city = CITIES[int(cities[i])]
        customers.append((i + 1, names[picked[i]], city, CITY_COUNTRY[city], SEGMENTS[int(segments[i])],
                          _day(signups[i] - 365)))

    # every category gets products: a round-robin over categories, a random name within each
    by_cat = {c: [p for p in products_pool if p[1] == c] for c in CATEGORIES}
    for c in CATEGORIES:
        by_cat[c] = [by_cat[c][int(j)] for j in rng.permutation(len(by_cat[c]))]
    products = []
    for i in range(n_products):
        cat = CATEGORIES[i % len(CATEGORIES)]
        name, _ = by_cat[cat][i // len(CATEGORIES)]
        price = round(float(CATEGORY_PRICE[cat] * rng.lognormal(0.0, 0.55)), 2)
        products.append((i + 1, name, cat, max(price, 1.0), int(rng.integers(0, 501))))

    cust_w = rng.gamma(1.2, size=n_customers)
    cust_w /= cust_w.sum()
    prod_w = rng.gamma(0.7, size=n_products)
    prod_w /= prod_w.sum()
    buyers = rng.choice(n_customers, size=n_orders, p=cust_w)
    days = np.sort(rng.integers(0, N_DAYS, size=n_orders))
    statuses = rng.choice(len(STATUSES), size=n_orders, p=STATUS_P)
    channels = rng.choice(len(CHANNELS), size=n_orders, p=CHANNEL_P)
    orders, lines = [], []
    for k in range(n_orders):
        n_lines = 1 + int(rng.binomial(3, 0.4))
        chosen = rng.choice(n_products, size=n_lines, replace=False, p=prod_w)
        total = 0.0
        for j in chosen:
            qty = min(9, int(rng.geometric(0.55)))
            discount = (0.0, 0.0, 0.0, 0.1, 0.2)[int(rng.integers(5))]
            unit = round(products[int(j)][3] * (1 - discount), 2)
            lines.append((len(lines) + 1, k + 1, int(j) + 1, qty, unit))
            total += qty * unit
        orders.append((k + 1, int(buyers[k]) + 1, _day(days[k]), STATUSES[int(statuses[k])],
                       CHANNELS[int(channels[k])], round(total, 2)))
    rows = {"customers": customers, "products": products, "orders": orders, "order_lines": lines}
    return {"rows": rows, "partition": part}


def write(world: dict, out_dir: Path, meta: dict) -> list[Path]:
    """Write `world.sqlite` (rows in id order, one transaction) and `world.json` (partition and `meta`)."""
    db_path, meta_path = out_dir / DB_NAME, out_dir / META_NAME
    if db_path.exists():
        db_path.unlink()
    conn = sqlite3.connect(db_path)
    try:
        conn.executescript(SCHEMA)
        for table in TABLES:
            rows = world["rows"][table]
            conn.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' * len(rows[0]))})", rows)
        conn.commit()
    finally:
        conn.close()
    counts = {t: len(world["rows"][t]) for t in TABLES}
    doc = {"format_version": FORMAT_VERSION, "partition": world["partition"], "counts": counts, **meta}
    meta_path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return [db_path, meta_path]


def read_meta(world_dir: Path) -> dict:
    """The metadata of a written world; FileNotFoundError / ValueError naming what is wrong."""
    world_dir = Path(world_dir)
    missing = [str(world_dir / n) for n in (DB_NAME, META_NAME) if not (world_dir / n).is_file()]
    if missing:
        raise FileNotFoundError(f"SQL world files missing: {', '.join(missing)} (run `agentrl build-env` first)")
    path = world_dir / META_NAME
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION or "partition" not in meta:
        raise ValueError(f"{path}: not an SQL world description (format_version {FORMAT_VERSION} with a partition)")
    return meta


def connect_ro(db_path: Path) -> sqlite3.Connection:
    """A read-only connection to the world file (URI ``mode=ro``), usable from any thread."""
    uri = Path(db_path).resolve().as_uri() + "?mode=ro"
    return sqlite3.connect(uri, uri=True, check_same_thread=False)


def read_schema(db_path: Path) -> dict[str, dict]:
    """{table: {"columns": [(name, type), ...], "rows": n}} of every table the world must have; ValueError otherwise."""
    conn = connect_ro(db_path)
    try:
        out = {}
        for table in TABLES:
            cols = [(r[1], r[2]) for r in conn.execute(f"PRAGMA table_info({table})")]
            if not cols:
                raise ValueError(f"{db_path}: table {table!r} is missing (tables must be {', '.join(TABLES)})")
            out[table] = {"columns": cols, "rows": conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]}
        return out
    except sqlite3.DatabaseError as exc:
        raise ValueError(f"{db_path}: not a valid SQL world database ({exc})") from None
    finally:
        conn.close()


def describe_texts(schema: dict[str, dict]) -> dict[str, str]:
    """What ``describe_table`` shows of each table: ``orders: order_id INTEGER, ... (6000 rows)``."""
    return {t: f"{t}: {', '.join(f'{c} {ty}' for c, ty in schema[t]['columns'])} ({schema[t]['rows']} rows)"
            for t in TABLES}


def write_corpus(out_dir: Path, schema: dict[str, dict]) -> Path:
    """``corpus.jsonl``: one document per table, its description (schema words for the tokenizer and pre-training;
    no row values, so no held-out value enters training text through it)."""
    path = out_dir / CORPUS_NAME
    docs = [{"doc_id": f"table-{t}", "title": t, "text": text} for t, text in describe_texts(schema).items()]
    path.write_text("".join(json.dumps(d, sort_keys=True) + "\n" for d in docs))
    return path
