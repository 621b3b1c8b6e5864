"""Long-term memory of the context actions (docs/design.md §3.7): notes an agent ``remember``s in one episode
and ``recall``s in later ones, in SQLite, with access statistics per note as meta-memory.

- **Retrieval**: BM25 (k1 = 1.2, b = 0.75) over the notes' terms (lower-case runs of letters and digits), the query's
  distinct terms each counted once; notes with a score of 0 are never returned; ties go to the alphabetically first
  text (not to the id: notes written by episodes that end in the same decode step of the rollout engine get their ids
  in thread order, and the ranking must not depend on it). :func:`bm25_scores` and :func:`rank` are pure functions.
- **What an episode sees**: only notes written by episodes that ended before it started. An episode's ``remember``
  calls are buffered and written when it ends, and its recalls read notes with an id up to the store's last id at its
  reset (:meth:`MemoryStore.last_id`), so episodes running side by side never see each other's notes and an episode
  is the same whatever its batch neighbours do.
- **Meta-memory** per note: ``reads`` (recalls that returned it), ``hits`` (those whose episode then succeeded: the
  note's utility is hits / reads) and ``last_used`` (Unix time of its last read). They are bookkeeping for reports
  (:meth:`MemoryStore.stats`), deliberately not used in the ranking (a note that is read more would be read more).
- **Where**: ``env.context_actions.memory_path``; empty keeps one in-process store shared by every episode of the
  process (lost at exit), a path is a SQLite file (created, parents included) shared by every process that names it.
  :func:`open_store` keeps one open store per path per process; every access holds the store's lock.

Deliberately left out: vector retrieval (no embedding model is guaranteed to be installed next to the environment) and
forgetting (a store only grows; delete the file to start over).
"""

from __future__ import annotations

import math
import re
import sqlite3
import threading
import time
from pathlib import Path

import numpy as np

BM25_K1, BM25_B = 1.2, 0.75
_TERM = re.compile(r"[a-z0-9]+")
_STORES: dict[str, "MemoryStore"] = {}
_STORES_LOCK = threading.Lock()


def terms(text: str) -> list[str]:
    """
    >>> terms('Height of "Wild Torch" = 320.5')
    ['height', 'of', 'wild', 'torch', '320', '5']
    """
    return _TERM.findall(str(text).lower())


def bm25_scores(query: list[str], docs: list[list[str]], k1: float = BM25_K1, b: float = BM25_B) -> np.ndarray:
    """BM25 score of every document (a list of terms) for the query's distinct terms; idf = ln(1 + (N - n + 0.5) /
    (n + 0.5)) with n the documents holding the term."""
    n_docs = len(docs)
    scores = np.zeros(n_docs, dtype=np.float64)
    if n_docs == 0:
        return scores
    avgdl = max(1e-9, sum(len(d) for d in docs) / n_docs)
    for q in dict.fromkeys(query):
        counts = [d.count(q) for d in docs]
        n_q = sum(c > 0 for c in counts)
        if n_q == 0:
            continue
        idf = math.log(1.0 + (n_docs - n_q + 0.5) / (n_q + 0.5))
        for i, (f, d) in enumerate(zip(counts, docs)):
            if f:
                scores[i] += idf * f * (k1 + 1) / (f + k1 * (1 - b + b * len(d) / avgdl))
    return scores


def rank(query: str, texts: list[str], k: int) -> list[int]:
    """Indices of the at most `k` best texts for `query` with a positive score, best first (ties: text order)."""
    scores = bm25_scores(terms(query), [terms(t) for t in texts])
    order = sorted((i for i in range(len(texts)) if scores[i] > 0), key=lambda i: (-scores[i], texts[i], i))
    return order[:k]


class MemoryStore:
    """One SQLite table of notes with their access statistics (see the module docstring)."""

    def __init__(self, path: str = ""):
        self.path = path
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(path or ":memory:", check_same_thread=False, isolation_level=None)
        self.lock = threading.Lock()
        with self.lock:
            self.conn.execute("CREATE TABLE IF NOT EXISTS notes (id INTEGER PRIMARY KEY, text TEXT NOT NULL, "
                              "source TEXT NOT NULL, reads INTEGER NOT NULL DEFAULT 0, "
                              "hits INTEGER NOT NULL DEFAULT 0, last_used REAL)")

    def last_id(self) -> int:
        with self.lock:
            return int(self.conn.execute("SELECT COALESCE(MAX(id), 0) FROM notes").fetchone()[0])

    def add(self, texts: list[str], source: str) -> list[int]:
        """Write notes (one transaction); returns their ids."""
        with self.lock:
            self.conn.execute("BEGIN IMMEDIATE")
            ids = [int(self.conn.execute("INSERT INTO notes (text, source) VALUES (?, ?)", (t, source)).lastrowid)
                   for t in texts]
            self.conn.execute("COMMIT")
        return ids

    def search(self, query: str, upto_id: int, k: int) -> list[tuple[int, str]]:
        """The best `k` notes with id <= `upto_id` for `query` as (id, text); counts a read on each."""
        with self.lock:
            rows = self.conn.execute("SELECT id, text FROM notes WHERE id <= ? ORDER BY id", (upto_id,)).fetchall()
            found = [rows[i] for i in rank(query, [t for _, t in rows], k)]
            if found:
                self.conn.executemany("UPDATE notes SET reads = reads + 1, last_used = ? WHERE id = ?",
                                      [(time.time(), i) for i, _ in found])
        return [(int(i), t) for i, t in found]

    def credit(self, ids: list[int], success: bool) -> None:
        """An episode that read `ids` ended; a success counts a hit on each (the notes' utility)."""
        if ids and success:
            with self.lock:
                self.conn.executemany("UPDATE notes SET hits = hits + 1 WHERE id = ?", [(i,) for i in ids])

    def notes(self) -> list[dict]:
        """Every note with its statistics, oldest first."""
        with self.lock:
            rows = self.conn.execute("SELECT id, text, source, reads, hits, last_used FROM notes ORDER BY id").fetchall()
        return [dict(zip(("id", "text", "source", "reads", "hits", "last_used"), r)) for r in rows]

    def stats(self) -> dict:
        """Store-wide meta-memory: notes, notes ever read, reads, hits and the utility hits / reads."""
        with self.lock:
            n, used, reads, hits = self.conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(reads > 0), 0), COALESCE(SUM(reads), 0), COALESCE(SUM(hits), 0) "
                "FROM notes").fetchone()
        return {"notes": int(n), "notes_read": int(used), "reads": int(reads), "hits": int(hits),
                "utility": float(hits) / reads if reads else 0.0}

    def close(self) -> None:
        with self.lock:
            self.conn.close()


def open_store(path: str = "") -> MemoryStore:
    """The process's store for `path` (opened once; see the module docstring for the empty path)."""
    key = str(Path(path).resolve()) if path else ""
    with _STORES_LOCK:
        if key not in _STORES:
            _STORES[key] = MemoryStore(key)
        return _STORES[key]
