"""Train/serve consistency on the model that is served (docs/design.md §5.3: replay deployed episodes
in the training environment). The deploy phase runs it on the pyfunc it has just logged in its run (``runs:/<deploy
run>/model``, the artefact the model version will point at), before the gate decides and before the version exists.

What runs, on the first ``deploy.served_check.tasks`` test tasks (task i with seed ``deploy.seed + i``):

1. **The served path, for real**: ``agentrl serve --model-uri runs:/<deploy run>/model`` in a subprocess on a free
   loopback port; each task is one ``POST /solve`` (one at a time: batch size 1, the latency one user sees). The
   response gives each step's action and observation, the per-step rewards, the answer and the outcome.
2. **Replay in the training environment** (the training world ``deploy.world_dir`` and the ``env`` section): each
   recorded action is stepped in order and must give the same observation and reward, and the episode must end
   where and as the served one ended (answer, success, violations, truncation, return).
3. **Prompts and token ids**: the server answers with actions, not prompts, so the serving side's rendering is
   taken from the logged pyfunc loaded in-process from the same URI (``mlflow.pyfunc.load_model``: its packaged
   world, its ``serving.json`` environment settings, its tokenizer and its rollout engine's encoding) by stepping
   the same recorded actions in its own environment; every state's context text and token ids must equal the
   training path's (training world, ``env`` config, the policy folder's tokenizer, the training engine's
   encoding). The in-process pyfunc's replay must also reproduce the HTTP observations, which ties it to the
   server.
4. **Hidden states**: the mean-pooled last hidden state of the served model (the pyfunc's quantised weights) on the
   serving ids, against the fp32 training model on the training ids; the largest per-state MSE must stay within
   ``hidden_mse_bound``. Also reported: the MSE against the training path's own int8 copy (0 when the registered
   weights are the trained ones).
5. **Actions**: at every replayed state the training code path (:meth:`RolloutEngine.complete`, greedy) with the
   served precision's weights made from the policy folder picks an action; the share equal to the served action
   must be at least ``min_action_agreement``. The same with the fp32 weights gives the fp32-vs-int8 agreement
   figure (reported, not gated: quantisation parity is the gate's own check).
6. **Latency**: per action, served over HTTP against the training path's rollout engine in-process with the same
   weights and batch size 1; the in-process episodes are also compared with the served ones (``episodes_identical``).

Why not exact action equality: int8 ``dynamic`` quantises activations per forward with one scale per tensor, so a
state whose context arrived as a whole prompt (here) and one built turn by turn in a KV cache (the server) see
slightly different activations; a near tie between two tokens can then flip. The agreement floor absorbs that and
still fails a different model version, whose agreement is far lower (and whose MSE is far over the bound).

A server that does not start or a request that fails is a failed check (with the reason), not an exception: the
version is registered as challenger and the gate refuses it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.core.errors import AgentRLError

RESULT_NAME = "served_consistency"
SNIPPET = 40


class ServeError(AgentRLError):
    """The served endpoint could not be started or did not answer."""


# --------------------------------------------------------------------------------------------------- the endpoint
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agentrl_command() -> list[str]:
    exe = Path(sys.executable).with_name("agentrl")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "flows.cli"]


class ServedEndpoint:
    """``agentrl serve`` on `model_uri` in a subprocess (its own process group) on a free loopback port.

    ``with ServedEndpoint(...) as ep:`` starts it; :meth:`wait_ready` waits for ``GET /ready``; leaving the block
    stops it (SIGTERM, then SIGKILL after 20 s)."""

    def __init__(self, model_uri: str, serve_cfg, tracking_uri: str | None, workdir: Path):
        self.model_uri, self.serve_cfg, self.tracking_uri, self.workdir = model_uri, serve_cfg, tracking_uri, workdir
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log_path = workdir / "serve.log"

    def __enter__(self) -> "ServedEndpoint":
        import yaml

        params = self.workdir / "params.yaml"
        params.write_text(yaml.safe_dump({"deploy": {"serve": self.serve_cfg.model_dump()}}))
        env = dict(os.environ)
        if self.tracking_uri:
            env["MLFLOW_TRACKING_URI"] = self.tracking_uri
        cmd = _agentrl_command() + ["serve", "--params", str(params), "--model-uri", self.model_uri,
                                    "--host", "127.0.0.1", "--port", str(self.port)]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     process_group=0)  # its own group: stopped with its children
        return self

    def log_tail(self, lines: int = 3) -> str:
        text = self.log_path.read_text(errors="replace").strip().splitlines() if self.log_path.is_file() else []
        return " | ".join(text[-lines:]) or "(no output)"

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until ``GET /ready`` answered 200; :class:`ServeError` when the process exits or time runs out."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise ServeError(f"`agentrl serve` exited with {self.proc.returncode} before it was ready: "
                                 f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/ready", timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                pass
            time.sleep(0.2)
        raise ServeError(f"`agentrl serve` was not ready within {timeout_s:g} s: {self.log_tail()}")

    def solve(self, request: dict, timeout_s: float) -> dict:
        body = json.dumps(request).encode()
        req = urllib.request.Request(f"{self.url}/solve", data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            raise ServeError(f"POST /solve for task {request.get('task_id')!r} answered {exc.code}: "
                             f"{exc.read()[:300].decode(errors='replace')}") from None
        except OSError as exc:
            raise ServeError(f"POST /solve for task {request.get('task_id')!r} failed: {exc}") from None

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


@contextlib.contextmanager
def _tracking_env(tracking_uri: str | None):
    """``MLFLOW_TRACKING_URI`` set to `tracking_uri` for a fluent MLflow call (``mlflow.pyfunc.load_model`` resolves
    ``models:/`` through it), restored afterwards."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    if tracking_uri:
        os.environ["MLFLOW_TRACKING_URI"] = tracking_uri
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = before


# -------------------------------------------------------------------------------------------------------- replay
def replay(runtime, env_cfg, task, seed: int, actions: list[str]) -> dict:
    """Step `actions` (action texts, in order) in a fresh episode of `task` with `seed`: the context before each
    step, each observation and reward, how many actions were taken before the episode ended, and its outcome."""
    from pipeline.envs.runner import AgentEnv

    env = AgentEnv(world=runtime, tasks=[task], config=env_cfg)
    obs, info = env.reset(seed=seed, options={"task": task})
    out = {"contexts": [], "observations": [], "rewards": [], "final": None}
    try:
        for action in actions:
            out["contexts"].append(obs["context"])
            obs, reward, terminated, truncated, info = env.step(action)
            out["observations"].append(info["observation_text"])
            out["rewards"].append(float(reward))
            if terminated or truncated:
                out["final"] = {"answer": info["answer"], "success": bool(info["is_success"]),
                                "n_violations": info["n_violations"], "truncated": bool(truncated),
                                "return": float(info["return"])}
                break
    finally:
        env.close()
    return out


def pooled_hidden(model, ids: list[list[int]]) -> np.ndarray:
    """Mean over each sequence's tokens of the model's last hidden state (after the final norm), one sequence per
    forward (batch 1, as the server runs one request: int8 ``dynamic`` scales activations per forward, so a batch
    would mix neighbours into each other's numbers), float64 (n, hidden). The model's train/eval mode is restored."""
    import torch

    backbone = getattr(model, "base_model", model)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            return np.stack([backbone(input_ids=torch.tensor([x])).last_hidden_state[0].double().mean(0).numpy()
                             for x in ids])
    finally:
        model.train(was_training)


def _first_difference(a, b) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _around(text, pos: int) -> str:
    lo = max(0, pos - SNIPPET)
    return ("..." if lo else "") + repr(text[lo:pos + SNIPPET])


def _compare_episode(i: int, task_id: str, served: dict, train: dict, serving_side: dict) -> list[str]:
    """The first disagreement of a served response, its replay in the training environment and its replay in the
    served pyfunc's environment, as reason strings (empty: all agree)."""
    where = f"task {i} ({task_id})"
    steps = served["trajectory"]
    for name, rep in (("training environment", train), ("served pyfunc's environment", serving_side)):
        for k, s in enumerate(steps):
            if k >= len(rep["observations"]):
                return [f"{where}: the {name} ended the episode after {len(rep['observations'])} of the "
                        f"{len(steps)} served actions"]
            if rep["observations"][k] != s["observation"]:
                pos = _first_difference(rep["observations"][k], s["observation"])
                return [f"{where} step {k}: replayed observation in the {name} differs at character {pos}: "
                        f"served {_around(s['observation'], pos)}, replayed {_around(rep['observations'][k], pos)}"]
            if served.get("step_rewards") is not None and abs(rep["rewards"][k] - served["step_rewards"][k]) > 1e-9:
                return [f"{where} step {k}: replayed reward in the {name} {rep['rewards'][k]:.6g} != served "
                        f"{served['step_rewards'][k]:.6g}"]
        fin = rep["final"]
        if fin is None:
            return [f"{where}: the served episode ended after {len(steps)} actions; in the {name} it goes on"]
        for key in ("answer", "success", "n_violations", "truncated", "return"):
            if served.get(key) is not None and (abs(fin[key] - served[key]) > 1e-9 if key == "return"
                                                else fin[key] != served[key]):
                return [f"{where}: replayed {key} in the {name} {fin[key]!r} != served {served[key]!r}"]
    return []


# ------------------------------------------------------------------------------------------------------ the check
def check_served(model_uri: str, tracking_uri: str | None, cfg, env_cfg, rollout_cfg, tasks: list, model, tokenizer,
                 runtime) -> dict:
    """Run the check (module docstring) for `model_uri` against the training path (`model`: the fp32 policy with
    `tokenizer`, `runtime`: the training world, `env_cfg`, `rollout_cfg`); `cfg` is the DeployConfig. Returns the
    result: ``status`` pass/fail, ``reasons``, and the figures."""
    from pipeline.deploy.pyfunc import load_solver

    sc = cfg.served_check
    tasks = list(tasks[: sc.tasks])
    seeds = [cfg.seed + i for i in range(len(tasks))]
    seconds: dict[str, float] = {}
    base = {"model_uri": model_uri, "tasks": len(tasks), "seed": cfg.seed, "precision": cfg.serve_precision}
    t0 = time.perf_counter()
    solver = None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with ServedEndpoint(model_uri, cfg.serve, tracking_uri, Path(tmp)) as ep:
                with _tracking_env(tracking_uri):
                    solver = load_solver(model_uri)  # in-process, while the server loads the same URI
                seconds["load_in_process"] = time.perf_counter() - t0
                seconds["serve_ready"] = ep.wait_ready(sc.startup_timeout_s) + seconds["load_in_process"]
                served, http_s = [], []
                for task, seed in zip(tasks, seeds):
                    t = time.perf_counter()
                    served.append(ep.solve({**task.to_dict(), "seed": seed}, sc.request_timeout_s))
                    http_s.append(time.perf_counter() - t)
        except AgentRLError as exc:  # ServeError, or a URI the in-process load refuses
            if solver is not None:
                solver.close()
            return {**base, "status": "fail", "passed": False, "reasons": [str(exc)],
                    "seconds": {**seconds, "total": time.perf_counter() - t0}}
    seconds["served_episodes"] = sum(http_s)
    try:
        return compare_paths(served, http_s, solver, tasks, seeds, cfg, env_cfg, rollout_cfg, model, tokenizer,
                             runtime, base, seconds, t0)
    finally:
        solver.close()


def compare_paths(served: list[dict], http_s: list[float], solver, tasks: list, seeds: list[int], cfg, env_cfg,
                  rollout_cfg, model, tokenizer, runtime, base: dict | None = None, seconds: dict | None = None,
                  t0: float | None = None) -> dict:
    """Steps 2-6 of the module docstring on the served responses (`served`, one per task, and the seconds each took,
    `http_s`) and the in-process pyfunc `solver` loaded from the same URI; the result dict of :func:`check_served`."""
    from pipeline.deploy.quantize import make_variant
    from pipeline.policy.rollout import RolloutEngine

    base, seconds, t0 = base or {}, seconds if seconds is not None else {}, t0 or time.perf_counter()
    sc = cfg.served_check
    reasons: list[str] = []
    roll1 = rollout_cfg.model_copy(update={"dtype": "fp32", "batch_size": 1})
    quant = make_variant(model, cfg.serve_precision, cfg.quantization)  # the training code path's served weights

    # the training path's own episodes, in-process, one at a time (latency; identical to the served ones?)
    t = time.perf_counter()
    train_eps = RolloutEngine(quant, tokenizer, runtime, env_cfg, roll1).run(tasks, seeds, greedy=True)
    in_process_s = time.perf_counter() - t

    t = time.perf_counter()
    states = _replay_served(served, tasks, seeds, solver, RolloutEngine(model, tokenizer, runtime, env_cfg, roll1),
                            runtime, env_cfg, reasons)
    seconds["replay"] = time.perf_counter() - t

    t = time.perf_counter()
    hidden_mse = _hidden_mse(model, solver.model, quant, states, sc.hidden_mse_bound, reasons)
    seconds["hidden_states"] = time.perf_counter() - t

    t = time.perf_counter()
    agreement = _action_agreement(model, quant, tokenizer, states, cfg, env_cfg, rollout_cfg, roll1, reasons)
    seconds["actions"] = time.perf_counter() - t

    same = sum([s["action"] for s in r["trajectory"]] == [s["action"] for s in e["steps"]]
               and r["answer"] == e["answer"] for r, e in zip(served, train_eps))
    latency = _latency(served, http_s, train_eps, in_process_s)
    seconds["total"] = time.perf_counter() - t0
    return {
        **base, "status": "fail" if reasons else "pass", "passed": not reasons, "reasons": reasons,
        "states": len(states.actions), "prompts_identical": states.prompts_ok, "tokens_identical": states.tokens_ok,
        "replay_identical": states.replay_ok, "hidden_mse": hidden_mse, "action_agreement": agreement,
        "episodes_identical": same, "served_success": sum(bool(r["success"]) for r in served) / max(len(served), 1),
        "latency": latency,
        "seconds": {k: round(v, 3) for k, v in seconds.items()},
    }


@dataclass
class ReplayedStates:
    """Every state of the served episodes replayed on both sides, in order: the training side's and the serving
    side's context text and token ids, the served action, (task index, step) of each; and whether the replays, the
    prompts and the token ids all agreed."""

    ctx_train: list[str] = field(default_factory=list)
    ctx_serve: list[str] = field(default_factory=list)
    ids_train: list[list[int]] = field(default_factory=list)
    ids_serve: list[list[int]] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    where: list[tuple[int, int]] = field(default_factory=list)
    replay_ok: bool = True
    prompts_ok: bool = True
    tokens_ok: bool = True


def _replay_served(served: list[dict], tasks: list, seeds: list[int], solver, train_engine, runtime, env_cfg,
                   reasons: list[str]) -> ReplayedStates:
    """Steps 2 and 3: replay every served episode in the training environment and in the served pyfunc's own, and
    compare each state's prompt and token ids (each engine's own encoding); the first difference of each kind is
    appended to `reasons`."""
    out = ReplayedStates()
    for i, (task, seed, resp) in enumerate(zip(tasks, seeds, served)):
        acts = [s["action"] for s in resp["trajectory"]]
        tr = replay(runtime, env_cfg, task, seed, acts)
        sv = replay(solver.runtime, solver.env_cfg, task, seed, acts)
        bad = _compare_episode(i, task.task_id, resp, tr, sv)
        if bad and out.replay_ok:
            reasons += bad
        out.replay_ok = out.replay_ok and not bad
        for k, (a, b) in enumerate(zip(tr["contexts"], sv["contexts"])):
            ia, ib = train_engine._prompt_ids(a), solver.engine._prompt_ids(b)  # each engine's own encoding
            if a != b and out.prompts_ok:
                pos = _first_difference(a, b)
                reasons.append(f"task {i} ({task.task_id}) step {k}: prompts differ at character {pos}: training "
                               f"{_around(a, pos)}, serving {_around(b, pos)}")
                out.prompts_ok = False
            if ia != ib and out.tokens_ok:
                pos = _first_difference(ia, ib)
                reasons.append(f"task {i} ({task.task_id}) step {k}: token ids differ at token {pos}: training "
                               f"{ia[max(0, pos - 4):pos + 4]}, serving {ib[max(0, pos - 4):pos + 4]}")
                out.tokens_ok = False
            out.ctx_train.append(a)
            out.ctx_serve.append(b)
            out.ids_train.append(ia)
            out.ids_serve.append(ib)
            out.actions.append(acts[k])
            out.where.append((i, k))
    return out


def _hidden_mse(model, served_model, quant, states: ReplayedStates, bound: float, reasons: list[str]) -> dict:
    """Step 4: hidden states of the served weights against the fp32 training model (and the training path's own
    copy); a largest per-state MSE over `bound` is appended to `reasons`."""
    mse = mse_own = None
    if states.ids_train:
        h_train, h_served, h_own = (pooled_hidden(model, states.ids_train),
                                    pooled_hidden(served_model, states.ids_serve),
                                    pooled_hidden(quant, states.ids_train))
        mse = ((h_served - h_train) ** 2).mean(axis=1)
        mse_own = ((h_served - h_own) ** 2).mean(axis=1)
        if not mse.max() <= bound:
            i, k = states.where[int(np.argmax(mse))]
            reasons.append(f"hidden-state MSE of the served model vs the fp32 training model {mse.max():.3e} > bound "
                           f"{bound:g} (task {i} step {k}; {int((mse > bound).sum())} of {len(mse)} states over it)")
    return {"max": None if mse is None else float(mse.max()), "mean": None if mse is None else float(mse.mean()),
            "bound": bound, "vs_training_path_max": None if mse_own is None else float(mse_own.max())}


def _action_agreement(model, quant, tokenizer, states: ReplayedStates, cfg, env_cfg, rollout_cfg, roll1,
                      reasons: list[str]) -> dict:
    """Step 5: the training code path's greedy action at every replayed state, with the served precision's weights
    (gated: below `min_action_agreement` is appended to `reasons`) and with the fp32 ones (reported)."""
    from pipeline.envs.protocol import sanitize
    from pipeline.policy.rollout import RolloutEngine

    sc, actions = cfg.served_check, states.actions
    norm = lambda text: sanitize(text.strip())[: env_cfg.max_action_chars]  # noqa: E731 - as the environment echoes it
    picks_q = [norm(r["text"]) for r in RolloutEngine(quant, tokenizer, cfg=roll1).complete(states.ctx_train,
                                                                                            greedy=True)]
    roll = rollout_cfg.model_copy(update={"dtype": "fp32"})  # fp32 does not depend on its batch: batched
    picks_f = [norm(r["text"]) for r in RolloutEngine(model, tokenizer, cfg=roll).complete(states.ctx_train,
                                                                                           greedy=True)]
    n = len(actions)
    agree = sum(a == b for a, b in zip(picks_q, actions)) / n if n else None
    agree_fq = sum(a == b for a, b in zip(picks_f, picks_q)) / n if n else None
    agree_fs = sum(a == b for a, b in zip(picks_f, actions)) / n if n else None
    if agree is None:
        reasons.append("the served episodes hold no actions to compare")
    elif agree < sc.min_action_agreement:
        j = next(j for j, (a, b) in enumerate(zip(picks_q, actions)) if a != b)
        i, k = states.where[j]
        reasons.append(f"action agreement of the training path ({cfg.serve_precision}) with the served actions "
                       f"{agree:.3f} < {sc.min_action_agreement} (first at task {i} step {k}: "
                       f"served {actions[j]!r}, training path {picks_q[j]!r})")
    return {"served_vs_training_path": agree, "min": sc.min_action_agreement,
            "fp32_vs_" + cfg.serve_precision: agree_fq, "fp32_vs_served": agree_fs}


def _latency(served: list[dict], http_s: list[float], train_eps: list[dict], in_process_s: float) -> dict:
    """Step 6: milliseconds per action and per episode, served over HTTP and in-process."""
    served_actions = sum(len(r["trajectory"]) for r in served)
    train_actions = sum(r["n_calls"] for r in train_eps)
    lat_http = 1000.0 * sum(http_s) / max(served_actions, 1)
    lat_local = 1000.0 * in_process_s / max(train_actions, 1)
    return {"served_http_ms_per_action": lat_http, "in_process_ms_per_action": lat_local,
            "difference_ms_per_action": lat_http - lat_local, "ratio": lat_http / lat_local if lat_local else None,
            "served_http_ms_per_episode": 1000.0 * sum(http_s) / max(len(served), 1),
            "in_process_ms_per_episode": 1000.0 * in_process_s / max(len(train_eps), 1)}


# ----------------------------------------------------------------------------------------- the deploy phase's call
def served_consistency(cfg, env_cfg, rollout_cfg, tracking_uri: str | None, model_uri: str, run, tasks: list, model,
                       tokenizer, runtime) -> dict:
    """The check on the logged pyfunc `model_uri` (``runs:/<deploy run>/model``, the artefact the version will point
    at), or a ``skipped`` result when ``deploy.served_check.enabled`` is false; logged with the run's gate inputs
    (``gate_inputs/served_consistency.json``, read by the gate, also by ``agentrl promote`` later) and as run metrics.
    It runs before the version exists, so the gate's decision goes into the version's tags with it."""
    from pipeline.deploy.registry import GATE_DIR

    if not cfg.served_check.enabled:
        result = {"status": "skipped", "passed": None, "reasons": [],
                  "reason": "deploy.served_check.enabled is false"}
    else:
        result = check_served(model_uri, tracking_uri, cfg, env_cfg, rollout_cfg, tasks, model, tokenizer, runtime)
    run.log_dict(result, f"{GATE_DIR}/{RESULT_NAME}.json")
    run.log_metrics(flat_metrics(result))
    return result


def flat_metrics(result: dict) -> dict:
    out = {}
    if result.get("passed") is not None:
        out["served/passed"] = float(result["passed"])
    for key, sub in (("hidden_mse", ("max", "vs_training_path_max")),
                     ("action_agreement", tuple((result.get("action_agreement") or {}).keys())),
                     ("latency", ("served_http_ms_per_action", "in_process_ms_per_action"))):
        for k in sub:
            v = (result.get(key) or {}).get(k)
            if isinstance(v, (int, float)) and k != "min":
                out[f"served/{key}/{k}"] = float(v)
    return out


def describe(result: dict) -> str:
    """One or more report lines."""
    if result["status"] == "skipped":
        return f"  served consistency: not run ({result['reason']})"
    if "hidden_mse" not in result:
        return f"  served consistency: FAIL ({'; '.join(result['reasons'])})"
    a, m, lat = result["action_agreement"], result["hidden_mse"], result["latency"]
    same = result["tokens_identical"] and result["prompts_identical"]
    head = (f"  served consistency: {'pass' if result['passed'] else 'FAIL'} on {result['tasks']} tasks, "
            f"{result['states']} states: prompts and token ids {'identical' if same else 'DIFFER'}, "
            f"replay {'identical' if result['replay_identical'] else 'DIFFERS'}, hidden MSE max {m['max']:.2e} "
            f"(bound {m['bound']:g}), actions {a['served_vs_training_path']:.3f} agree "
            f"(fp32 vs {result['precision']} {a['fp32_vs_' + result['precision']]:.3f}), latency/action "
            f"{lat['served_http_ms_per_action']:.1f} ms served vs {lat['in_process_ms_per_action']:.1f} ms in-process")
    return "\n".join([head] + [f"    {r}" for r in result["reasons"]])


__all__ = ["RESULT_NAME", "ServeError", "ServedEndpoint", "check_served", "compare_paths", "describe", "flat_metrics",
           "replay", "served_consistency"]
