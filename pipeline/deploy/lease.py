"""A lease on one registered model's aliases, shared by every pipeline that writes them, on any repository or host.

The repository lock (:mod:`pipeline.core.lock`) serialises the commands of one repository. Two repositories, or two
machines, that deploy to one MLflow server under one model name are not serialised by it, and MLflow's registry has
no compare-and-set on an alias: each alias move is a blind write. Every command that moves ``challenger`` or
``champion`` or writes the champion history (deploy, promote, rollback, `agentrl registry check --repair`) therefore
holds this lease while it re-reads the aliases, compares and writes: for a few requests, never while it judges.

The lease is a ticket lock (Lamport's bakery, with the server as the ticket dispenser) kept in the registry itself:

- the tickets are the versions of a second registered model, ``<name>.lease``, which holds no model (each version's
  source is ``lease:/ticket``). The server numbers versions one after another and never gives a number twice, not even
  after a deletion (MLflow deletes a version by marking it), so taking a ticket is an atomic operation on the server;
- a taker creates its ticket, with its holder (command, pid, thread, host, start time) as tags, and holds the lease
  once every lower ticket is gone: released (deleted), expired, left by a process of this host that no longer exists,
  or left by this very thread (whose earlier release failed: a thread never waits on two tickets at once);
- a ticket expires ``ttl_s`` after its last renewal, measured in the server's clock: a renewal rewrites the ticket's
  description, and the server stamps ``last_updated_timestamp``. A taker reads the server's time from its own
  ticket's stamp plus its own monotonic clock since that request was sent, so no two hosts' clocks are compared;
- a waiter renews its ticket while it waits; the holder renews before a write once a third of the lease has passed
  and refuses to write (:class:`LeaseLost`) once less than a quarter of it is left. That quarter is the margin for a
  request's latency: another host may count the ticket expired up to one request's latency early.

Limits (written where a reader of a failure will look; docs/reliability.md): a holder that stops for longer than the
remaining lease between its check and its write (a stopped VM, a request stuck in retries) can write after another
holder took over; a writer that does not take the lease (the MLflow UI, a script with its own ``MlflowClient``) is
not held back at all. `agentrl registry check` finds what either leaves behind.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, field

from pipeline.core.errors import AgentRLError
from pipeline.core.lock import pid_alive

LEASE_SUFFIX = ".lease"
TICKET_SOURCE = "lease:/ticket"  # a source the server accepts and that nothing ever loads
# Publishing is a handful of requests, but one of them may ride out a tracking server's outage in the HTTP client's
# retries (pipeline.core.tracking: 5 retries with back-off, about a minute or more): the lease outlasts that, with
# room. A holder killed on another host blocks the others for at most this long; one of this host, not at all.
TTL_S = 300.0


class LeaseLost(AgentRLError):
    """The holder took so long that its lease may have expired: it writes nothing more."""


class LeaseBusy(AgentRLError):
    """The lease stayed held by another live holder for longer than the taker waits."""


class ChampionMoved(AgentRLError):
    """The champion is no longer the version a decision was judged against: another pipeline promoted one since."""

    def __init__(self, name: str, version: str, judged: str | None, current: str | None):
        self.version, self.judged, self.current = version, judged, current
        was, now = version_label(judged), version_label(current)
        super().__init__(f"the champion of {name!r} moved from {was} to {now} while v{version} was judged against "
                         f"{was} (another pipeline promoted it); v{version} stays registered with gate.decision "
                         f"superseded: judge it against the new champion with `agentrl promote --version {version}`")

    def judge_again_line(self) -> str:
        was, now = version_label(self.judged), version_label(self.current)
        return (f"the champion moved from {was} to {now} (another pipeline) while v{self.version} was judged: "
                f"judging v{self.version} again against {now}")


def version_label(version: str | None) -> str:
    return f"v{version}" if version else "none"


def lease_name(name: str) -> str:
    return f"{name}{LEASE_SUFFIX}"


@dataclass
class Ticket:
    """One lease ticket as read from the registry: its number, holder tags and last renewal (server milliseconds)."""

    number: int
    holder: dict
    renewed_ms: int

    @classmethod
    def of(cls, mv) -> "Ticket":
        return cls(int(mv.version), dict(mv.tags), int(mv.last_updated_timestamp or mv.creation_timestamp or 0))

    def describe(self) -> str:
        h = self.holder
        return (f"ticket {self.number} of `agentrl {h.get('command', '?')}` (pid {h.get('pid', '?')} on "
                f"{h.get('host', '?')}, since {h.get('started', '?')})")

    def gone(self, server_now_ms: float, ttl_s: float, host: str) -> str | None:
        """Why this ticket no longer holds anything (expired, or its process of this host has exited), else None."""
        if server_now_ms - self.renewed_ms > ttl_s * 1000:
            return f"expired {(server_now_ms - self.renewed_ms) / 1000 - ttl_s:.0f} s ago"
        pid = self.holder.get("pid", "")
        if self.holder.get("host") == host and pid.isdigit() and not pid_alive(int(pid)):
            return f"its process {pid} on this host has exited"
        return None


@dataclass
class RegistryLease:
    """The lease on the aliases of registered model `name` (see the module docstring); a context manager."""

    client: object
    name: str
    command: str
    ttl_s: float = TTL_S
    wait_s: float | None = None  # default: two leases, enough for a live holder to finish or a dead one to expire
    poll_s: float = 0.2
    ticket: int | None = None
    _renewed_at: float = 0.0  # local monotonic time at which the last renewal (or the ticket) was sent
    _server_ms: float = 0.0  # the server's stamp of that request
    _held: bool = field(default=False, repr=False)

    def __enter__(self) -> "RegistryLease":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # ---------------------------------------------------------------------------------------------------- taking
    def acquire(self) -> None:
        self._ensure_model()
        sent = time.monotonic()
        mv = self.client.create_model_version(
            lease_name(self.name), TICKET_SOURCE, description="waiting", await_creation_for=0,
            tags={"command": self.command, "pid": str(os.getpid()), "thread": str(threading.get_ident()),
                  "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        self.ticket, self._renewed_at, self._server_ms = int(mv.version), sent, float(mv.last_updated_timestamp)
        deadline = sent + (self.wait_s if self.wait_s is not None else 2 * self.ttl_s)
        try:
            while True:
                blocker = self.blocker()
                if blocker is None:
                    self._held = True
                    return
                if time.monotonic() > deadline:
                    raise LeaseBusy(f"the registry lease of {self.name!r} is held by {blocker.describe()} for longer "
                                    f"than this command waits ({deadline - sent:.0f} s); try again when it has "
                                    f"finished (`agentrl registry check` lists the lease tickets)")
                if time.monotonic() - self._renewed_at > self.ttl_s / 3:
                    self.renew()
                time.sleep(self.poll_s)
        except BaseException:
            self.release()
            raise

    def tickets(self) -> list[Ticket]:
        """Every live ticket, lowest first."""
        found = self.client.search_model_versions(f"name='{lease_name(self.name)}'")
        return sorted((Ticket.of(mv) for mv in found), key=lambda t: t.number)

    def server_now_ms(self) -> float:
        return self._server_ms + (time.monotonic() - self._renewed_at) * 1000

    def blocker(self) -> Ticket | None:
        """The lowest ticket before ours that still holds, or None (ours is then the holder)."""
        host, now = socket.gethostname(), self.server_now_ms()
        mine = {"host": host, "pid": str(os.getpid()), "thread": str(threading.get_ident())}
        for t in self.tickets():
            if t.number >= (self.ticket or 0):
                break
            if t.gone(now, self.ttl_s, host) is None and {k: t.holder.get(k) for k in mine} != mine:
                return t
        return None

    def renew(self) -> None:
        sent = time.monotonic()
        mv = self.client.update_model_version(lease_name(self.name), str(self.ticket),
                                              description="held" if self._held else "waiting")
        self._renewed_at, self._server_ms = sent, float(mv.last_updated_timestamp)

    def check(self) -> None:
        """Call before each write made under the lease: renews it after a third of the lease, and raises
        :class:`LeaseLost` once less than a quarter is left (the write might land after another holder's)."""
        if not self._held:
            raise LeaseLost(f"the registry lease of {self.name!r} is not held")
        elapsed = time.monotonic() - self._renewed_at
        if elapsed > self.ttl_s * 0.75:
            self._held = False
            raise LeaseLost(f"the registry lease of {self.name!r} ran out ({elapsed:.1f} s since it was last renewed, "
                            f"lease {self.ttl_s:g} s): nothing more was written, so that no other pipeline's "
                            f"alias move is overwritten")
        if elapsed > self.ttl_s / 3:
            self.renew()

    def release(self) -> None:
        """Delete our ticket; a failure leaves it to expire (``ttl_s``) or to `agentrl registry check --repair`."""
        self._held = False
        if self.ticket is None:
            return
        try:
            self.client.delete_model_version(lease_name(self.name), str(self.ticket))
        except Exception:  # noqa: BLE001 - the store is gone: the ticket expires by itself
            pass
        self.ticket = None

    def _ensure_model(self) -> None:
        try:
            self.client.create_registered_model(
                lease_name(self.name), description=f"the lease on the aliases of {self.name!r} "
                                                    f"(pipeline.deploy.lease): one version per taker, no model")
        except Exception as exc:  # MLflow's own exception; only pipeline.deploy.registry imports MLflow
            if "ALREADY_EXISTS" not in str(getattr(exc, "error_code", "")) and "already exists" not in str(exc):
                raise


def stale_tickets(client, name: str, now_ms: float, ttl_s: float = TTL_S) -> list[tuple[Ticket, str]]:
    """Tickets of `name`'s lease that hold nothing any more at server time `now_ms`, with why (for `agentrl registry
    check`: :meth:`RegistryLease.server_now_ms` under the lease; a read-only listing passes this host's clock)."""
    host = socket.gethostname()
    found = [Ticket.of(mv) for mv in client.search_model_versions(f"name='{lease_name(name)}'")]
    return [(t, why) for t in sorted(found, key=lambda t: t.number) if (why := t.gone(now_ms, ttl_s, host)) is not None]


__all__ = ["ChampionMoved", "LEASE_SUFFIX", "LeaseBusy", "LeaseLost", "RegistryLease", "TTL_S", "Ticket", "lease_name",
           "stale_tickets", "version_label"]
