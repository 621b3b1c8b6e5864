"""The MLflow model registry side of deployment: register a policy, run the promotion gate, move aliases, roll back.

Conventions (one registered model, ``deploy.model_name``):

- every deployed policy is a new model version whose run holds ``model/`` (the pyfunc, :mod:`pipeline.deploy.pyfunc`)
  and ``gate_inputs/{adapt,drift,quantization,test_results}.json``: what the gate judges travels with the version, so
  ``agentrl promote --version N`` judges version N on its own evidence, not on whatever ``metrics/`` holds today;
- a new version gets the alias ``challenger``; the gate moves ``champion`` to it when every check passes;
- each check's outcome is a version tag ``gate.<check>`` (``pass``/``fail``) with ``gate.<check>.detail``, plus
  ``gate.decision``, ``gate.champion_at_decision`` and ``gate.decided_at``. ``gate.decision`` is ``passed`` or
  ``rejected`` when the version is created; ``promoted`` only after ``champion`` moved to it; ``superseded`` when
  another pipeline moved the champion first; ``judging`` while a hand `agentrl promote` writes the tags one by one;
  ``abandoned`` when `agentrl registry check --repair` found the command that wrote it stopped part-way;
- every version is tagged ``weights.sha256``, :func:`weights_digest` of the policy folder it packages. A deploy
  whose weights are those of the current ``champion`` or ``challenger`` registers nothing and moves no alias
  (:meth:`ModelRegistry.unchanged`; ``metrics/deploy.json`` then says ``unchanged``): the same weights judged again on
  the evidence of a rerun would only pile up versions (``agentrl promote --version N`` judges an existing challenger
  again). Weights equal to an older version's (neither alias) are registered as a new challenger, which records the
  older ones (:meth:`ModelRegistry.versions_with_weights`): deploying them again is how an old policy comes back;
- the champions in order are the registered-model tag ``agentrl.champion_history`` (a JSON list of versions);
  :func:`rollback` points ``champion`` at the one before and drops the last, tagging it ``rolled_back_at``.

Every input is read and checked before anything is written: a version or alias that does not exist, a registered
model that does not exist, or a version without its gate inputs is an :class:`AgentRLError` and the registry is left
as it was. ``dry_run`` writes nothing at all.

Registration order (a tracking server can stop between any two requests): the deploy run's artefacts first; then the
gate's decision, from reads only (:func:`judge`); then the version, created with every tag (weights digest and
``gate.*``) in one request, so no version exists without its tags; the aliases last (``challenger``, then
``champion``, then the history tag, then ``gate.decision=promoted``: a champion missing from the history still rolls
back to the one before it). Every alias move happens under the registry lease (:mod:`pipeline.deploy.lease`, shared by
every pipeline that writes this model, on any host), and ``champion`` moves only while it still points at the
version the decision was judged against (compare-and-set; :class:`ChampionMoved` otherwise). When
a step after the version's creation fails, :meth:`ModelRegistry.publish` points the aliases it moved back and deletes
the version; what it cannot undo (the server stays down) the error names. MLflow's client retries transient HTTP
failures first (:func:`pipeline.core.tracking.configure_http_retries`).

Every call goes through an explicit ``MlflowClient`` (no fluent API and no module-level state, as in
:mod:`pipeline.core.tracking`).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.deploy.config import DeployGateConfig
from pipeline.deploy.gate import GateDecision, GateInputs, decide, pair_results
from pipeline.deploy.lease import ChampionMoved
from pipeline.core.errors import AgentRLError

CHALLENGER, CHAMPION = "challenger", "champion"
HISTORY_TAG = "agentrl.champion_history"
WEIGHTS_TAG = "weights.sha256"
# gate.decision, in the order a version can go through them: judging (a hand promote is writing the check tags),
# passed or rejected (the decision), promoted (written after champion moved to it), superseded (passed, but another
# pipeline moved the champion first), abandoned (`agentrl registry check --repair`: its command stopped part-way)
DECISION_TAG = "gate.decision"
JUDGING, PASSED, REJECTED, PROMOTED, SUPERSEDED, ABANDONED = ("judging", "passed", "rejected", "promoted",
                                                              "superseded", "abandoned")
GATE_DIR = "gate_inputs"
MODEL_DIR = "model"


def weights_digest(policy_dir: str | Path) -> str:
    """SHA-256 over every file of a saved policy folder (names and bytes, in name order) except ``policy.json``, whose
    lineage (the step, and in policies saved before it became reproducible the save time and commit) can differ
    between two runs that trained the same weights: equal digests mean the same weights, config and tokenizer. A
    missing or empty folder is an AgentRLError."""
    import hashlib

    from pipeline.policy.model import POLICY_JSON

    root = Path(policy_dir)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.relative_to(root).as_posix() != POLICY_JSON)
    if not files:
        raise AgentRLError(f"{root}: no policy files to digest (is it a folder written by save_policy?)")
    h = hashlib.sha256()
    for p in files:
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        with p.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def _not_found(exc) -> bool:
    """Whether an MlflowException says that the model, version or alias asked for does not exist."""
    return "RESOURCE_DOES_NOT_EXIST" in str(getattr(exc, "error_code", "")) or "not found" in str(exc).lower()


class ModelRegistry:
    """One registered model in an MLflow registry (``tracking_uri``: ``$MLFLOW_TRACKING_URI`` or the repo's store)."""

    def __init__(self, name: str, tracking_uri: str | None = None):
        from pipeline.core.tracking import Tracker, mlflow_client, require_tracking

        require_tracking(f"the model registry ({name!r})")

        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # no progress bars in logs
        self.name = name
        self.tracking_uri = tracking_uri or Tracker().tracking_uri
        self.client = mlflow_client(self.tracking_uri, registry_uri=self.tracking_uri)

    # ------------------------------------------------------------------------------------------------------ reading
    def exists(self) -> bool:
        """Whether the registered model exists; a store that does not answer is raised, not taken for a no."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(self.name)
            return True
        except MlflowException as exc:
            if _not_found(exc):
                return False
            raise

    def _require_model(self) -> None:
        if not self.exists():
            raise AgentRLError(f"registered model {self.name!r} does not exist in {self.tracking_uri} (run `agentrl "
                               f"deploy` first)")

    def find_alias(self, alias: str):
        """The model version (MLflow's ``ModelVersion``) `alias` points to; None when the model or the alias does not
        exist. Any other failure (a store that did not answer) is raised, so that a caller can retry it."""
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_model_version_by_alias(self.name, alias)
        except MlflowException as exc:
            if _not_found(exc):
                return None
            raise

    def run_tags(self, run_id: str) -> dict[str, str]:
        """The tags of the tracking run `run_id` (e.g. the run that registered a version)."""
        return dict(self.client.get_run(run_id).data.tags)

    def alias_version(self, alias: str) -> str | None:
        """The version `alias` points to, or None when the alias (or the model) does not exist; a store that does not
        answer is raised (a missing answer taken for "no alias" would let an undo delete a live alias)."""
        mv = self.find_alias(alias)
        return None if mv is None else str(mv.version)

    def resolve(self, version: str | int | None = None, alias: str | None = None) -> str:
        """A version number from `version` or `alias` (default: the challenger); missing ones raise AgentRLError."""
        from mlflow.exceptions import MlflowException

        self._require_model()
        if version is not None and alias is not None:
            raise AgentRLError("give a version or an alias, not both")
        if version is None:
            alias = alias or CHALLENGER
            found = self.alias_version(alias)
            if found is None:
                raise AgentRLError(f"alias {alias!r} of model {self.name!r} points to no version")
            return found
        try:
            return str(self.client.get_model_version(self.name, str(version)).version)
        except MlflowException:
            raise AgentRLError(f"model {self.name!r} has no version {version}") from None

    def tags(self, version: str) -> dict:
        return dict(self.client.get_model_version(self.name, str(version)).tags)

    def history(self) -> list[str]:
        tags = self.client.get_registered_model(self.name).tags if self.exists() else {}
        return json.loads(tags.get(HISTORY_TAG, "[]"))

    def gate_inputs(self, version: str) -> GateInputs:
        """The gate inputs logged with `version`; a missing one is an AgentRLError naming it."""
        mv = self.client.get_model_version(self.name, str(version))
        if not mv.run_id:
            raise AgentRLError(f"version {version} of {self.name!r} has no run, so no gate inputs (metrics)")
        have = {Path(a.path).stem for a in self.client.list_artifacts(mv.run_id, GATE_DIR)}
        missing = [k for k in GateInputs.REQUIRED if k not in have]
        if missing:
            raise AgentRLError(f"version {version} of {self.name!r} is missing gate metrics: "
                               f"{', '.join(f'{GATE_DIR}/{m}.json' for m in missing)}; register it with `agentrl "
                               f"deploy`, which logs them")
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(self.client.download_artifacts(mv.run_id, GATE_DIR, tmp))
            data = {}
            for k in GateInputs.REQUIRED + tuple(k for k in GateInputs.OPTIONAL if k in have):
                try:
                    data[k] = json.loads((local / f"{k}.json").read_text())
                except json.JSONDecodeError as exc:
                    raise AgentRLError(f"version {version}: {GATE_DIR}/{k}.json is not valid JSON ({exc.msg})") from None
        return GateInputs(**data)

    def model_uri(self, version: str) -> str:
        return f"models:/{self.name}/{version}"

    # ------------------------------------------------------------------------------------------------------ writing
    def versions_with_weights(self, digest: str, exclude: str | None = None) -> list[str]:
        """Versions (oldest first) tagged with the weights digest `digest`, `exclude` left out."""
        if not self.exists():
            return []
        found = [str(mv.version) for mv in self.client.search_model_versions(f"name='{self.name}'")  # int in SQLite
                 if mv.tags.get(WEIGHTS_TAG) == digest and str(mv.version) != str(exclude)]
        return sorted(found, key=int)

    def unchanged(self, digest: str) -> tuple[str, str] | None:
        """(alias, version) of the ``champion``, else the ``challenger``, whose ``weights.sha256`` is `digest`; None when
        neither alias points to these weights (or the model does not exist yet)."""
        if not self.exists():
            return None
        for alias in (CHAMPION, CHALLENGER):
            mv = self.find_alias(alias)
            if mv is not None and mv.tags.get(WEIGHTS_TAG) == digest:
                return alias, str(mv.version)
        return None

    def lease(self, command: str):
        """The lease on this model's aliases (:mod:`pipeline.deploy.lease`): every alias move is made under it."""
        from pipeline.deploy.lease import RegistryLease

        return RegistryLease(self.client, self.name, command)

    def finish_publish(self, version: str) -> str | None:
        """Complete the alias moves of a deploy that was killed inside :meth:`publish` (or whose store went away there
        for good): `version` carries a passing ``gate.decision`` decided against the champion that is still in place,
        but ``champion`` does not point to it, or it does and the history or the ``promoted`` tag is missing. Returns
        what was completed, or None when nothing was left to do. Called by a deploy rerun whose weights are
        `version`'s; under the lease, so the comparison with the champion holds when the alias moves."""
        with self.lease("deploy (finishing)") as lease:
            tags = self.tags(version)
            if tags.get(DECISION_TAG) not in (PASSED, PROMOTED):
                return None
            champion, history = self.alias_version(CHAMPION), self.history()
            if champion != version:
                if tags.get("gate.champion_at_decision", "none") != (champion or "none"):
                    return None  # the champion moved since the decision: it no longer holds, promote by hand
                lease.check()
                self.client.set_registered_model_alias(self.name, CHALLENGER, version)
                self._move_champion(version, champion, history, [], lease)
                return f"promoted v{version} to champion, which its recorded gate decision had passed"
            if not history or history[-1] != version or tags.get(DECISION_TAG) != PROMOTED:
                self._move_champion(version, champion, history[:-1] if history[-1:] == [version] else history, [],
                                    lease)
                return f"added v{version} to the champion history"
            return None

    def register(self, run_id: str, model_dir: str | Path, inputs: GateInputs, tags: dict | None = None) -> str:
        """:meth:`log_candidate` then :meth:`create_version`: log the pyfunc and the gate inputs into `run_id` and
        create a model version with all its `tags`."""
        self.log_candidate(run_id, model_dir, inputs)
        return self.create_version(run_id, tags)

    def log_candidate(self, run_id: str, model_dir: str | Path, inputs: GateInputs) -> str:
        """Log the pyfunc folder and the gate inputs into `run_id`; returns the logged model's URI
        (``runs:/<run>/model``), which can be served and checked before any version exists."""
        for k in GateInputs.REQUIRED:
            self.client.log_dict(run_id, getattr(inputs, k), f"{GATE_DIR}/{k}.json")
        self.client.log_artifacts(run_id, str(model_dir), MODEL_DIR)
        return f"runs:/{run_id}/{MODEL_DIR}"

    def create_version(self, run_id: str, tags: dict | None = None) -> str:
        """Create a model version of the pyfunc logged in `run_id` with all its `tags` in one request. No alias moves
        here (:meth:`publish` does that last); a failure after the version exists deletes it again (see
        :meth:`publish`)."""
        from mlflow.exceptions import MlflowException

        if not self.exists():
            try:
                self.client.create_registered_model(self.name, description="agentrl policy: a pyfunc that solves "
                                                                           "tasks with the tools (pipeline.deploy)")
            except MlflowException:
                if not self.exists():  # not a race with another registration
                    raise
        source = f"{self.client.get_run(run_id).info.artifact_uri}/{MODEL_DIR}"
        mv = self.client.create_model_version(self.name, source, run_id=run_id, tags=tags or None)
        version = str(mv.version)
        with self._withdrawn_on_failure(version, {}, moved=[]):
            for _ in range(600):  # a file or SQLite store is READY at once; a remote one may take a moment
                if self.client.get_model_version(self.name, version).status == "READY":
                    break
                time.sleep(0.1)
        return version

    def aliases(self) -> dict[str, str | None]:
        """Where ``challenger`` and ``champion`` point now, and the champion history (key ``history``)."""
        return {CHALLENGER: self.alias_version(CHALLENGER), CHAMPION: self.alias_version(CHAMPION),
                "history": self.history()}

    def publish(self, version: str, decision: GateDecision | None, command: str = "deploy") -> None:
        """The last writes of a deploy, under the lease: ``challenger`` to `version`, and with a passing `decision`
        ``champion`` (only while it is still the version the decision was judged against: a compare-and-set), the
        history, and ``gate.decision=promoted``. When another pipeline moved the champion since the decision,
        `version` stays challenger, is tagged ``gate.decision=superseded`` and :class:`ChampionMoved` is raised. On
        any other failure the aliases moved are pointed back and `version` is deleted (:meth:`_withdrawn_on_failure`)."""
        lease = self.lease(command)
        with self._withdrawn_on_failure(version, {}, []):  # no lease (busy, or no store): the version goes again
            lease.acquire()
        try:
            before = self.aliases()  # read under the lease: what an undo restores, what the champion is now
            moved: list[str] = []
            with self._withdrawn_on_failure(version, before, moved):
                lease.check()
                self.client.set_registered_model_alias(self.name, CHALLENGER, version)
                moved.append(CHALLENGER)
                if decision is None or not decision.passed:
                    return
                if before[CHAMPION] == decision.champion:
                    self._move_champion(version, before[CHAMPION], before["history"], moved, lease)
                    return
            self._supersede(version, decision.champion, before[CHAMPION], lease)
        finally:
            lease.release()

    def promote_version(self, version: str, judged_against: str | None, command: str = "promote") -> None:
        """Under the lease: ``champion`` to `version` if it still points where the gate judged `version` against
        (`judged_against`), then the history and ``gate.decision=promoted``; else :class:`ChampionMoved`."""
        with self.lease(command) as lease:
            champion = self.alias_version(CHAMPION)
            if champion != judged_against:
                self._supersede(version, judged_against, champion, lease)
            self._move_champion(version, champion, self.history(), [], lease)

    def _supersede(self, version: str, judged: str | None, current: str | None, lease) -> None:
        lease.check()
        self.client.set_model_version_tag(self.name, version, DECISION_TAG, SUPERSEDED)
        self.client.set_model_version_tag(self.name, version, "gate.superseded_by", current or "none")
        raise ChampionMoved(self.name, version, judged, current)

    @contextlib.contextmanager
    def _withdrawn_on_failure(self, version: str, before: dict, moved: list[str]):
        """Undo a registration that failed after `version` was created: point the aliases in `moved` back to where
        `before` says, restore the history, delete `version`. A store that does not answer stops the undoing (every
        further request would wait out its retries too); the error then names what is left. A failure of the store
        becomes an AgentRLError (one line); any other exception is re-raised as it is, after the undoing."""
        from pipeline.core.tracking import store_failure

        try:
            yield
        except BaseException as exc:
            left = self._withdraw(version, before, moved)
            why = store_failure(exc)
            if why is None and not isinstance(exc, AgentRLError):
                raise
            state = ("; left in the registry: " + "; ".join(left)) if left else \
                f"; version {version} was deleted again and the aliases are where they were"
            raise AgentRLError(f"registering {self.name!r} version {version} failed: {why or exc}{state}") from exc

    def _withdraw(self, version: str, before: dict, moved: list[str]) -> list[str]:
        steps = [(f"alias {a!r} points to v{version} (was {'v' + before[a] if before[a] else 'unset'})",
                  (lambda a=a: self.client.set_registered_model_alias(self.name, a, before[a]) if before[a] else
                   self.client.delete_registered_model_alias(self.name, a))) for a in reversed(moved)]
        if CHAMPION in moved:
            steps.append((f"tag {HISTORY_TAG} may end in v{version}", lambda: self._set_history(before["history"])))
        steps.append((f"version {version} stays registered, with all its tags",
                      lambda: self.client.delete_model_version(self.name, version)))
        for i, (what, undo) in enumerate(steps):
            try:
                undo()
            except Exception:  # noqa: BLE001 - the store is gone: say what stays, do not wait on it again
                return [w for w, _ in steps[i:]]
        return []

    def _set_history(self, history: list[str]) -> None:
        self.client.set_registered_model_tag(self.name, HISTORY_TAG, json.dumps(history))

    def _move_champion(self, version: str, champion: str | None, history: list[str], moved: list[str],
                       lease=None) -> None:
        """``champion`` to `version`, then the history, then ``gate.decision=promoted`` on `version`: a champion set by
        hand joins the history it was missing from. In this order a failure between two writes leaves a champion that
        :func:`rollback` still rolls back correctly, and no version says ``promoted`` before the alias moved to it
        (`agentrl registry check` finds and finishes a champion whose history or tag is missing)."""
        history = list(history)
        if champion is not None and champion != version and (not history or history[-1] != champion):
            history.append(champion)
        if lease is not None:
            lease.check()
        self.client.set_registered_model_alias(self.name, CHAMPION, version)
        moved.append(CHAMPION)
        self._set_history(history + [version])
        self.client.set_model_version_tag(self.name, version, DECISION_TAG, PROMOTED)

    def record(self, decision: GateDecision, promote: bool) -> None:
        """Write the checks as version tags, one request each: ``gate.decision=judging`` first and the decision
        (``passed``/``rejected``) last, so that tags left half-written by a stopped command say so; then, with
        `promote` and a pass, :meth:`promote_version` (compare-and-set against ``decision.champion``)."""
        v = decision.version
        tags = decision_tags(decision)
        self.client.set_model_version_tag(self.name, v, DECISION_TAG, JUDGING)
        self.client.set_model_version_tag(self.name, v, "gate.decided_at", tags["gate.decided_at"])  # since when
        for key, value in tags.items():
            if key not in (DECISION_TAG, "gate.decided_at"):
                self.client.set_model_version_tag(self.name, v, key, value)
        self.client.set_model_version_tag(self.name, v, DECISION_TAG, tags[DECISION_TAG])
        if promote and decision.passed:
            self.promote_version(v, decision.champion)


def decision_tags(decision: GateDecision) -> dict[str, str]:
    """The version tags that record a gate decision: ``gate.<check>`` and its detail per check, ``gate.decision``
    (``passed`` or ``rejected``: ``promoted`` is written only after ``champion`` moved, by :meth:`ModelRegistry.
    _move_champion`), ``gate.champion_at_decision`` and ``gate.decided_at``."""
    tags: dict[str, str] = {}
    for c in decision.checks:
        tags[f"gate.{c.name}"] = "pass" if c.passed else "fail"
        tags[f"gate.{c.name}.detail"] = c.detail[:4000]
    tags[DECISION_TAG] = PASSED if decision.passed else REJECTED
    tags["gate.champion_at_decision"] = decision.champion or "none"
    tags["gate.decided_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return tags


# ------------------------------------------------------------------------------------------------------- operations
ChampionEvaluator = Callable[[str, list[dict]], list[dict]]


def promote(registry: ModelRegistry, cfg: DeployGateConfig, version: str | int | None = None,
            alias: str | None = None, dry_run: bool = False,
            evaluate_champion: ChampionEvaluator | None = None, attempts: int = 2,
            notify: Callable[[str], None] | None = None, require_live: bool = False) -> GateDecision:
    """Run the gate on a version (default: the challenger) and, unless `dry_run`, record it and promote on a pass.
    With `require_live`, the check ``live`` (:func:`pipeline.deploy.gate.require_live`) must pass first.

    When the challenger's and the champion's stored results share fewer than ``min_paired_tasks`` tasks and
    `evaluate_champion` is given, it is called with (champion version, the challenger's results) and must return the
    champion's results on exactly those tasks and seeds: the paired test then compares the same episodes.

    The champion moves only if it is still the one the decision was judged against (:meth:`ModelRegistry.
    promote_version`). When another pipeline moved it in between, the version is judged again against the new one,
    up to `attempts` decisions in all (`notify` hears one line each time); after the last, :class:`ChampionMoved`."""
    v = registry.resolve(version, alias)
    inputs = registry.gate_inputs(v)  # raises before any write when metrics are missing
    from pipeline.deploy.gate import require_live as live_check  # an AgentRLError, before any write, when not passed

    live = [live_check(registry.tags(v), v)] if require_live else []
    for attempt in range(1, attempts + 1):
        decision = judge(registry, cfg, v, inputs, evaluate_champion)
        decision.checks += live
        if dry_run:
            return decision
        try:
            registry.record(decision, promote=True)
            return decision
        except ChampionMoved as moved:
            if attempt == attempts:
                raise
            if notify is not None:
                notify(f"{registry.name}: {moved.judge_again_line()}")
    raise AssertionError("unreachable")


def judge(registry: ModelRegistry, cfg: DeployGateConfig, version: str, inputs: GateInputs,
          evaluate_champion: ChampionEvaluator | None = None) -> GateDecision:
    """The gate's decision on `inputs` (those of `version`, which need not be registered yet) against the current
    champion; reads the registry, writes nothing."""
    champion = registry.alias_version(CHAMPION)
    if champion == version:
        raise AgentRLError(f"version {version} of {registry.name!r} is already the champion")
    champ_results = None
    if champion is not None:
        try:
            champ_results = registry.gate_inputs(champion).test_results
        except AgentRLError:
            champ_results = None
        shared = len(pair_results(inputs.test_results, champ_results or [])[2])
        if shared < cfg.min_paired_tasks and evaluate_champion is not None:
            champ_results = evaluate_champion(champion, inputs.test_results)
    return decide(version, inputs, champion, champ_results, cfg)


def rollback(registry: ModelRegistry) -> tuple[str, str]:
    """Point `champion` back at the previous champion; returns (from version, to version). Read and written under
    the lease, so a deploy elsewhere cannot promote between the read and the move."""
    registry._require_model()
    with registry.lease("rollback") as lease:
        current = registry.alias_version(CHAMPION)
        if current is None:
            raise AgentRLError(f"model {registry.name!r} has no champion to roll back")
        history = registry.history()
        if history and history[-1] == current:
            history = history[:-1]
        if not history:
            raise AgentRLError(f"model {registry.name!r} has no previous champion (history: champion v{current} only)")
        previous = history[-1]
        # the history first: when the alias move then fails, a second rollback finds the champion off the history's
        # end and moves it to the same previous version (alias first would roll a second step back)
        lease.check()
        registry._set_history(history)
        registry.client.set_registered_model_alias(registry.name, CHAMPION, previous)
        registry.client.set_model_version_tag(registry.name, current, "rolled_back_at",
                                              time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    return current, previous


__all__ = ["CHALLENGER", "CHAMPION", "DECISION_TAG", "HISTORY_TAG", "ChampionMoved", "ModelRegistry",
           "decision_tags", "judge", "promote", "rollback"]
