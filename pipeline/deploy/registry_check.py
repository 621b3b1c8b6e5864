"""`agentrl registry check`: list what stopped commands and writers that skip the lease leave in a registered model,
and with ``--repair`` put it right.

What it finds (each a :class:`Finding` with what ``--repair`` does about it):

- ``ungated-champion``: ``champion`` points at a version whose gate did not pass (``gate.decision`` rejected,
  superseded, judging, abandoned or missing: set by hand, or by a writer that skips the gate). Repair: ``champion``
  back to the last version of the history whose decision is ``promoted``, the history cut after it; left as it is
  (and said so) when the history holds none;
- ``unrecorded-champion``: ``champion`` points at a version that passed, but the history does not end with it or its
  ``gate.decision`` is not ``promoted`` yet (a command stopped between those writes). Repair: write them;
- ``half-moved``: ``challenger`` points at a version that passed against the champion that is still in place, and
  ``champion`` never moved to it (a deploy stopped between its two alias moves). Repair: finish the move (champion,
  history, ``promoted``), which is what the stopped deploy was doing and what its rerun does;
- ``orphan``: a version whose ``gate.decision`` is ``passed`` or ``promoted`` but that is not the champion, not in
  the history and was not rolled back (a deploy stopped after creating it, or tags written before the alias moved by
  an older release or another writer). Repair: ``gate.decision=abandoned`` with the reason in
  ``gate.abandoned_reason``; the version and its check tags stay, and `agentrl promote --version N` judges it again;
- ``half-judged``: ``gate.decision=judging``: a hand `agentrl promote` stopped while it wrote the tags one by one.
  Repair: ``abandoned``, as above;
- ``stale-ticket``: a ticket of the registry lease (:mod:`pipeline.deploy.lease`) whose holder is gone. Repair:
  delete it (it blocks nothing, but it is clutter).

Repairs never promote a version the gate did not pass, never delete a model version and never move ``champion``
forward except to finish a move the gate decided against the champion still in place. They run under the lease, on
a fresh read, so they do not race a deploy. A version younger than ``min_age_s`` may belong to a deploy that is still
publishing it: it is listed as such and left alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.core.errors import AgentRLError
from pipeline.deploy.lease import TTL_S, lease_name, stale_tickets
from pipeline.deploy.registry import (ABANDONED, CHALLENGER, CHAMPION, DECISION_TAG, JUDGING, PASSED, PROMOTED,
                                      ModelRegistry)

# a deploy publishes its version within two leases of creating it; `agentrl registry check --min-age` overrides it
MIN_AGE_S = 3 * TTL_S


@dataclass
class Finding:
    kind: str
    subject: str
    detail: str
    repair: str  # what --repair does; "" when it cannot
    fix: Callable[[object], None] | None = None  # called with the lease held

    def describe(self) -> str:
        return f"  {self.kind:<19} {self.subject}: {self.detail}" + (f" -> repair: {self.repair}" if self.repair else
                                                                     " -> not repaired here")


def _abandon(registry: ModelRegistry, version: str, reason: str) -> Callable[[object], None]:
    def fix(lease) -> None:
        lease.check()
        registry.client.set_model_version_tag(registry.name, version, "gate.abandoned_reason", reason)
        registry.client.set_model_version_tag(registry.name, version, DECISION_TAG, ABANDONED)
    return fix


def inspect(registry: ModelRegistry, now_ms: float, min_age_s: float = MIN_AGE_S) -> list[Finding]:
    """Every problem of `registry` at server time `now_ms` (milliseconds), champion first."""
    versions = {str(mv.version): mv for mv in registry.client.search_model_versions(f"name='{registry.name}'")}
    tags = {v: dict(mv.tags) for v, mv in versions.items()}
    decision = {v: t.get(DECISION_TAG) for v, t in tags.items()}
    champion, challenger, history = (registry.alias_version(CHAMPION), registry.alias_version(CHALLENGER),
                                     registry.history())
    found = _champion_findings(registry, champion, history, decision)
    for v in sorted(versions, key=int):
        if v == champion:
            continue
        young = (now_ms - versions[v].creation_timestamp) / 1000 < min_age_s
        if decision[v] == JUDGING:
            young = (now_ms - _epoch_ms(tags[v].get("gate.decided_at"))) / 1000 < min_age_s
            found.append(_young(v, "half-judged") if young else Finding(
                "half-judged", f"v{v}", "gate.decision judging: a hand promote stopped while writing the gate's tags",
                f"gate.decision {ABANDONED}", _abandon(registry, v, "its gate tags were written part-way")))
        elif decision[v] in (PASSED, PROMOTED) and v not in history and "rolled_back_at" not in tags[v]:
            judged = tags[v].get("gate.champion_at_decision", "none")
            if young:
                found.append(_young(v, "orphan"))
            elif v == challenger and decision[v] == PASSED and judged == (champion or "none"):
                found.append(Finding("half-moved", f"v{v}", f"challenger v{v} passed its gate against champion "
                                     f"{_v(champion)}, still in place, but champion never moved to it",
                                     f"champion to v{v}, as its gate decided", _finish(registry, v)))
            else:
                found.append(Finding("orphan", f"v{v}", f"gate.decision {decision[v]} (judged against {_v(judged)}) "
                                     f"but v{v} is not the champion and never was", f"gate.decision {ABANDONED}",
                                     _abandon(registry, v, "its command stopped before champion moved to it")))
    for ticket, why in stale_tickets(registry.client, registry.name, now_ms):
        found.append(Finding("stale-ticket", f"lease ticket {ticket.number}", f"{ticket.describe()}: {why}",
                             "delete it", lambda lease, n=ticket.number: registry.client.delete_model_version(
                                 lease_name(registry.name), str(n))))
    return found


def _champion_findings(registry: ModelRegistry, champion: str | None, history: list[str],
                       decision: dict) -> list[Finding]:
    if champion is None:
        return []
    if decision.get(champion) not in (PASSED, PROMOTED):
        back = next((h for h in reversed(history) if h != champion and decision.get(h) == PROMOTED), None)
        return [Finding("ungated-champion", f"champion v{champion}", f"gate.decision of v{champion} is "
                        f"{decision.get(champion) or 'missing'}: it did not pass the gate",
                        f"champion back to v{back}, the last promoted version of the history" if back else "",
                        _unseat(registry, champion, back, history) if back else None)]
    if history[-1:] != [champion] or decision[champion] != PROMOTED:
        return [Finding("unrecorded-champion", f"champion v{champion}", f"passed its gate, but the history ends with "
                        f"{_v(history[-1] if history else None)} and gate.decision is {decision[champion]}",
                        "write the history and gate.decision promoted",
                        _finish(registry, champion))]
    return []


def _finish(registry: ModelRegistry, version: str) -> Callable[[object], None]:
    def fix(lease) -> None:
        champion, history = registry.alias_version(CHAMPION), registry.history()
        if champion != version:  # half-moved: the compare-and-set a deploy makes
            registry.client.set_registered_model_alias(registry.name, CHALLENGER, version)
        registry._move_champion(version, champion, history[:-1] if history[-1:] == [version] else history, [], lease)
    return fix


def _unseat(registry: ModelRegistry, champion: str, back: str, history: list[str]) -> Callable[[object], None]:
    def fix(lease) -> None:
        lease.check()
        registry._set_history(history[: len(history) - history[::-1].index(back)])
        registry.client.set_registered_model_alias(registry.name, CHAMPION, back)
    return fix


def _epoch_ms(stamp: str | None) -> float:
    """Milliseconds since the epoch of a ``gate.decided_at`` stamp (0 when missing or unreadable)."""
    import calendar

    try:
        return calendar.timegm(time.strptime(stamp or "", "%Y-%m-%dT%H:%M:%SZ")) * 1000.0
    except ValueError:
        return 0.0


def _young(version: str, kind: str) -> Finding:
    return Finding(kind, f"v{version}", "created moments ago: a deploy may still be publishing it", "")


def _v(version: str | None) -> str:
    return f"v{version}" if version and version != "none" else "none"


def check(registry: ModelRegistry, repair: bool = False, min_age_s: float = MIN_AGE_S,
          say: Callable[[str], None] = print) -> list[Finding]:
    """List the problems of `registry` (and with `repair`, repair them under the lease, then list what is left).
    Returns the problems left."""
    registry._require_model()
    aliases = registry.aliases()
    say(f"registry check: {registry.name!r} at {registry.tracking_uri}: champion {_v(aliases[CHAMPION])}, "
        f"challenger {_v(aliases[CHALLENGER])}, history {aliases['history']}")
    if not repair:
        found = inspect(registry, time.time() * 1000, min_age_s)  # this host's clock: a listing writes nothing
    else:
        with registry.lease("registry check --repair") as lease:
            found = inspect(registry, lease.server_now_ms(), min_age_s)
            for f in found:
                if f.fix is not None:
                    f.fix(lease)
                    say(f"  repaired {f.kind} {f.subject}: {f.repair}")
            found = inspect(registry, lease.server_now_ms(), min_age_s)
    for f in found:
        say(f.describe())
    say("registry check: consistent" if not found else f"registry check: {len(found)} problem(s)"
        + ("" if repair else "; `agentrl registry check --repair` repairs those marked 'repair'"))
    return found


def main(params_path: str = "params.yaml", repair: bool = False, min_age_s: float = MIN_AGE_S) -> bool:
    """`agentrl registry check`: whether nothing is left to report (the command exits 0, else 1)."""
    from pipeline.core.config import load_section
    from pipeline.core.tracking import store_errors
    from pipeline.deploy.config import DeployConfig

    if min_age_s < 0:
        raise AgentRLError(f"registry check: --min-age {min_age_s:g} is negative (seconds; 0 repairs every version)")
    cfg = load_section(DeployConfig, "deploy", params_path)
    with store_errors("registry check", "repairs are single writes made under the lease; run it again"):
        left = check(ModelRegistry(cfg.model_name), repair, min_age_s)
    return not left


__all__ = ["Finding", "MIN_AGE_S", "check", "inspect", "main"]
