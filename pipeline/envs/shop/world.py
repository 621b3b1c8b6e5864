"""The generated world the tools act on: products and suppliers in a real SQLite database, and a document corpus.

Everything is drawn from one seeded `numpy.random.Generator`, so a seed gives byte-identical files. Products and
suppliers are split into train / validation / test partitions *here*, before any task exists, so that every task of a
held-out split names only held-out entities (a supplier's flagship product lies in the supplier's own partition).

Deliberately left out: free-text product descriptions beyond one sentence (the corpus exists for the `search` tool, not
for language modelling at scale).
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.core.errors import AgentRLError
from pipeline.core.jsonl import read_jsonl

ADJECTIVES = (
    "Blue", "Red", "Green", "Silver", "Golden", "Quiet", "Rapid", "Compact", "Smart", "Classic", "Bright", "Solid",
    "Tiny", "Grand", "Swift", "Urban", "Rustic", "Modern", "Polar", "Sunny", "Misty", "Amber", "Coral", "Ivory",
    "Cobalt", "Crimson", "Hollow", "Lucky", "Noble", "Prime", "Royal", "Steady", "Wild", "Cosmic", "Velvet", "Arctic",
    "Copper", "Dusty", "Emerald", "Frosty",
)
NOUNS = {
    "lighting": ("Lamp", "Lantern", "Torch", "Bulb"),
    "kitchen": ("Kettle", "Pan", "Mug", "Blender", "Toaster"),
    "tools": ("Hammer", "Drill", "Wrench", "Saw", "Ladder"),
    "outdoor": ("Tent", "Backpack", "Bottle", "Compass"),
    "office": ("Desk", "Chair", "Stapler", "Notebook", "Marker"),
    "audio": ("Speaker", "Radio", "Headset"),
    "garden": ("Hose", "Shovel", "Planter", "Rake"),
}
SUPPLIER_PREFIXES = (
    "Nordic", "Acme", "Summit", "Harbor", "Pioneer", "Atlas", "Vertex", "Beacon", "Cedar", "Falcon", "Granite",
    "Horizon", "Juniper", "Keystone", "Lumen", "Meridian", "Northwind", "Orchid", "Pinnacle", "Quarry", "Riverside",
    "Sterling", "Trident", "Union", "Valley", "Willow", "Zenith", "Aurora", "Bristol", "Crescent",
)
SUPPLIER_SUFFIXES = ("Tools", "Supply", "Goods", "Trading", "Works", "Imports", "Partners", "Outfitters", "Depot", "Co")
CITIES = (
    "Oslo", "Lyon", "Porto", "Graz", "Turin", "Ghent", "Malmo", "Leeds", "Bergen", "Krakow", "Brno", "Cork", "Tartu",
    "Basel", "Delft", "Nantes", "Aarhus", "Bilbao", "Split", "Tampere",
)
SPLIT_NAMES = ("train", "validation", "test")

PRODUCT_FIELDS = ("category", "supplier", "price", "stock", "weight_kg")
SUPPLIER_FIELDS = ("city", "flagship")
NUMERIC_RANGES = {"price": (1, 999), "stock": (0, 500), "weight_kg": (0.1, 50.0)}

SCHEMA = """
CREATE TABLE products (
    product_id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    category TEXT NOT NULL,
    supplier TEXT NOT NULL,
    price INTEGER NOT NULL CHECK (price BETWEEN 1 AND 999),
    stock INTEGER NOT NULL CHECK (stock BETWEEN 0 AND 100000),
    weight_kg REAL NOT NULL CHECK (weight_kg > 0)
);
CREATE TABLE suppliers (
    supplier_id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    city TEXT NOT NULL,
    flagship TEXT NOT NULL REFERENCES products(name)
);
"""


@dataclass(frozen=True)
class World:
    """Rows of the world plus the entity partition (entity name -> split)."""

    products: list[dict]
    suppliers: list[dict]
    corpus: list[dict]
    product_split: dict[str, str] = field(repr=False)
    supplier_split: dict[str, str] = field(repr=False)

    def products_in(self, split: str) -> list[dict]:
        return [p for p in self.products if self.product_split[p["name"]] == split]

    def suppliers_in(self, split: str) -> list[dict]:
        return [s for s in self.suppliers if self.supplier_split[s["name"]] == split]


def draw_numeric(rng: np.random.Generator, n: int) -> dict[str, list]:
    """Draw the numeric attributes of `n` products (also used to redraw them per episode)."""
    lo, hi = NUMERIC_RANGES["weight_kg"]
    return {
        "price": [int(x) for x in rng.integers(1, 1000, size=n)],
        "stock": [int(x) for x in rng.integers(0, 501, size=n)],
        "weight_kg": [round(float(x), 1) for x in rng.uniform(lo, hi, size=n)],
    }


def _partition(names: list[str], rng: np.random.Generator, heldout: float) -> dict[str, str]:
    order = rng.permutation(len(names))
    n_hold = max(2, int(round(len(names) * heldout)))
    n_val = n_hold // 2
    split = {}
    for rank, idx in enumerate(order):
        split[names[idx]] = "validation" if rank < n_val else "test" if rank < n_hold else "train"
    return split


def generate_world(seed: int, n_products: int, n_suppliers: int, heldout_fraction: float) -> World:
    """Generate products, suppliers and the corpus; raise ValueError if the name space is too small."""
    rng = np.random.default_rng([seed, 1])
    pairs = [(adj, noun, cat) for adj in ADJECTIVES for cat, nouns in NOUNS.items() for noun in nouns]
    if n_products > len(pairs):
        raise ValueError(f"n_products={n_products} exceeds the {len(pairs)} distinct product names the generator has")
    sup_names = [f"{p} {s}" for p in SUPPLIER_PREFIXES for s in SUPPLIER_SUFFIXES]
    if n_suppliers > len(sup_names):
        raise ValueError(f"n_suppliers={n_suppliers} exceeds the {len(sup_names)} distinct supplier names")
    chosen = [pairs[i] for i in rng.choice(len(pairs), size=n_products, replace=False)]
    supplier_names = [sup_names[i] for i in rng.choice(len(sup_names), size=n_suppliers, replace=False)]
    numeric = draw_numeric(rng, n_products)
    product_split = _partition([f"{a} {n}" for a, n, _ in chosen], rng, heldout_fraction)
    supplier_split = _partition(supplier_names, rng, heldout_fraction)

    products = []
    for i, (adj, noun, cat) in enumerate(chosen):
        products.append({
            "product_id": i + 1,
            "name": f"{adj} {noun}",
            "category": cat,
            "supplier": supplier_names[int(rng.integers(n_suppliers))],
            "price": numeric["price"][i],
            "stock": numeric["stock"][i],
            "weight_kg": numeric["weight_kg"][i],
        })
    by_split = {s: [p["name"] for p in products if product_split[p["name"]] == s] for s in SPLIT_NAMES}
    suppliers = []
    for j, name in enumerate(supplier_names):
        pool = by_split[supplier_split[name]]
        if not pool:
            raise ValueError(f"no products in split {supplier_split[name]!r}; raise n_products or heldout fraction")
        suppliers.append({
            "supplier_id": j + 1,
            "name": name,
            "city": CITIES[int(rng.integers(len(CITIES)))],
            "flagship": pool[int(rng.integers(len(pool)))],
        })
    corpus = [
        {"doc_id": f"sup-{s['supplier_id']:05d}", "title": s["name"],
         "text": f'"{s["name"]}" is a supplier from {s["city"]}. Its flagship product is "{s["flagship"]}".'}
        for s in suppliers
    ] + [
        {"doc_id": f"prod-{p['product_id']:05d}", "title": p["name"],
         "text": f'"{p["name"]}" is a {p["category"]} product supplied by "{p["supplier"]}".'}
        for p in products
    ]
    return World(products, suppliers, corpus, product_split, supplier_split)


def world_to_sqlite(world: World, conn: sqlite3.Connection) -> None:
    conn.executescript(SCHEMA)
    conn.executemany(
        "INSERT INTO products VALUES (:product_id, :name, :category, :supplier, :price, :stock, :weight_kg)",
        world.products,
    )
    conn.executemany("INSERT INTO suppliers VALUES (:supplier_id, :name, :city, :flagship)", world.suppliers)
    conn.commit()


def write_world(world: World, out_dir: Path) -> dict[str, Path]:
    """Write `world.sqlite`, `corpus.jsonl` and `entities.json` (the split partition) into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    db_path = out_dir / "world.sqlite"
    if db_path.exists():
        db_path.unlink()
    conn = sqlite3.connect(db_path)
    try:
        world_to_sqlite(world, conn)
    finally:
        conn.close()
    corpus_path = out_dir / "corpus.jsonl"
    corpus_path.write_text("".join(json.dumps(d, sort_keys=True) + "\n" for d in world.corpus))
    ent_path = out_dir / "entities.json"
    ent_path.write_text(json.dumps({"products": world.product_split, "suppliers": world.supplier_split},
                                   indent=1, sort_keys=True))
    return {"db": db_path, "corpus": corpus_path, "entities": ent_path}


def load_world(data_dir: Path) -> World:
    """Read a world written by :func:`write_world`; a missing or unreadable file raises FileNotFoundError/ValueError."""
    data_dir = Path(data_dir)
    needed = [data_dir / n for n in ("world.sqlite", "corpus.jsonl", "entities.json")]
    missing = [str(p) for p in needed if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"world files missing: {', '.join(missing)} (run `agentrl build-env` first)")
    conn = sqlite3.connect(f"file:{needed[0]}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        products = [dict(r) for r in conn.execute("SELECT * FROM products ORDER BY product_id")]
        suppliers = [dict(r) for r in conn.execute("SELECT * FROM suppliers ORDER BY supplier_id")]
    except sqlite3.DatabaseError as exc:
        raise ValueError(f"{needed[0]}: not a valid world database ({exc})") from None
    finally:
        conn.close()
    try:
        corpus = read_jsonl(needed[1], "document corpus", allow_empty=True)
    except AgentRLError as exc:  # a corrupt corpus: the ValueError this function promises
        raise ValueError(str(exc)) from None
    ents = json.loads(needed[2].read_text())
    return World(products, suppliers, corpus, ents["products"], ents["suppliers"])
