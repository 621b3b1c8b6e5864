"""Paths of the RL loop that a user meets and the plain runs never take, each driven for real in a tiny run of
:func:`pipeline.train.loop.train`: the collapse alarms (firing on a collapsing series, silent on a healthy one), the
asynchronous pool's stale-batch drop (and a resumed asynchronous run, which must not drop its first batch), a tool
that raises inside training, injected tool failures and latency spikes (counted per update, in metrics/train.json
and MLflow), the KL penalty to the reference and reward normalisation as the loop computes them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from pipeline.train.diagnostics import ALARM_KEYS, COLLAPSE, collapse_alarms, run_health

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    from test_train import make_project

    return make_project(tmp_path_factory.mktemp("paths"))


def write_params(project: Path, name: str, env: dict | None = None, **train) -> Path:
    """A copy of the project's params.yaml with `env` and `train` keys set."""
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["env"].update(env or {})
    params["train"].update(train)
    path = project / name
    path.write_text(yaml.safe_dump(params))
    return path


def run_loop(project: Path, params: Path, ckpt: str, stop_after: int | None = None,
             log: list | None = None) -> dict:
    """`train()` in this process on the project's data (no tracker, no test comparison)."""
    from pipeline.core.config import load_section
    from pipeline.core.tracking import NullRun
    from pipeline.envs.config import EnvConfig
    from pipeline.envs.shop import ShopWorld
    from pipeline.envs.taskfile import load_task_file
    from pipeline.policy.config import RolloutConfig
    from pipeline.train.config import TrainConfig
    from pipeline.train.distributed import init_dist
    from pipeline.train.loop import Hooks, train

    cfg = load_section(TrainConfig, "train", params)
    runtime = ShopWorld.load(project / "data" / "env")
    tasks = project / "data" / "tasks"
    try:
        return train(cfg, load_section(EnvConfig, "env", params), load_section(RolloutConfig, "rollout", params),
                     policy_dir=project / "models" / "adapted",
                     train_tasks=load_task_file(tasks / "train.jsonl", runtime, validate=False),
                     val_tasks=load_task_file(tasks / "validation.jsonl", runtime, validate=False), runtime=runtime,
                     out_dir=project / f"out-{ckpt}", ckpt_dir=project / ckpt, dist=init_dist(), run=NullRun("train"),
                     hooks=Hooks(stop_after=stop_after, log=(log if log is not None else []).append))
    finally:
        runtime.close()


# --------------------------------------------------------------------------------------------- collapse alarms
def test_each_collapse_alarm_fires_when_its_figure_falls_below_its_floor_and_never_on_a_healthy_series():
    """A scripted collapse: entropy, reward spread and advantage variance fall one after the other. Each alarm
    first fires at the update its figure crosses its floor and keeps firing after; a healthy series (every figure
    well above its floor) and a metrics dict without the figures raise none."""
    floor = 0.02
    n = 8
    series = {"policy/entropy": [1.0, 0.8, 0.5, 0.2, 0.05, 0.01, 0.005, 0.001],
              "rollout/reward_spread": [0.4, 0.3, 0.2, 0.1, 0.0, 0.0, 0.0, 0.0],
              "policy/advantage_var": [0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 1e-9, 0.0]}
    fired = {name: [] for name, _ in ALARM_KEYS}
    for u in range(n):
        metrics = {k: float(v[u]) for k, v in series.items()}
        warnings = collapse_alarms(metrics, floor)
        for name, key in ALARM_KEYS:
            if metrics.get(f"alarms/{name}_collapse") == 1.0:
                fired[name].append(u + 1)
                assert any(w.startswith(f"{name} collapsed") for w in warnings)
        assert len(warnings) == sum(f"alarms/{name}_collapse" in metrics for name, _ in ALARM_KEYS)
    assert fired == {"entropy": [6, 7, 8], "reward_spread": [5, 6, 7, 8], "advantage_var": [7, 8]}

    healthy = {"policy/entropy": 0.9, "rollout/reward_spread": 0.3, "policy/advantage_var": 0.2}
    assert collapse_alarms(healthy, floor) == [] and not any(k.startswith("alarms/") for k in healthy)
    at_floor = {"policy/entropy": floor, "rollout/reward_spread": COLLAPSE["reward_spread"],
                "policy/advantage_var": COLLAPSE["advantage_var"]}
    assert collapse_alarms(at_floor, floor) == []  # strictly below the floor
    assert collapse_alarms({}, floor) == []
    history = [{"update": 1, "alarms/entropy_collapse": 1.0}, {"update": 2},
               {"update": 3, "alarms/entropy_collapse": 1.0}]
    assert run_health(history)["alarms"] == {"entropy": [1, 3], "reward_spread": [], "advantage_var": []}


def test_the_entropy_alarm_fires_in_the_loop_logs_the_right_update_and_training_goes_on(project):
    """A real run whose entropy floor is above any entropy the policy can have: every update sets
    ``alarms/entropy_collapse`` and logs a warning naming that update (1-based, as every other line of the loop),
    and training goes on (an alarm warns; it does not stop). The same run with the floor at 0 raises no entropy
    alarm. The tiny random policy never answers right, so its reward spread collapses in both."""
    log: list[str] = []
    params = write_params(project, "params-alarm.yaml", entropy_alarm=1e6)
    h = run_loop(project, params, "ckpt-alarm", 2, log)["history"]
    assert len(h) == 2 and all(x["alarms/entropy_collapse"] == 1.0 for x in h)
    assert all(x["policy/entropy"] > 0 for x in h)
    warnings = [m for m in log if m.startswith("warning:")]
    assert any(m.startswith("warning: update 1: entropy collapsed") for m in warnings), warnings
    assert any(m.startswith("warning: update 2: entropy collapsed") for m in warnings), warnings
    assert not any(m.startswith("warning: update 0:") for m in warnings)
    assert all(x["alarms/reward_spread_collapse"] == 1.0 and x["rollout/reward_spread"] == 0.0 for x in h)

    log = []
    h = run_loop(project, write_params(project, "params-no-alarm.yaml", entropy_alarm=0.0), "ckpt-no-alarm", 1,
                 log)["history"]
    assert "alarms/entropy_collapse" not in h[0] and not any("entropy collapsed" in m for m in log)


# ----------------------------------------------------------------------------------- asynchronous stale batches
def test_a_batch_older_than_max_staleness_is_dropped_counted_and_not_learned(project, monkeypatch):
    """The real asynchronous pool, whose weight sync after update 2 is missed (as a sync that never happened): the
    batch of update 3 is two versions old, beyond ``max_staleness: 1``; it is dropped (no learner step, no loss),
    counted (``offpolicy/dropped_stale_batch``, the run's ``dropped_stale_batches``) and logged, and the next sync
    brings the run back to learning."""
    from pipeline.train import async_pool

    real_sync = async_pool.AsyncRollouts.sync

    def misses_version_1(self, policy, version):
        if version != 1:
            real_sync(self, policy, version)

    monkeypatch.setattr(async_pool.AsyncRollouts, "sync", misses_version_1)
    params = write_params(project, "params-stale.yaml", async_rollouts=True, max_staleness=1, rollout_workers=1,
                          updates=4, eval_every=10)
    log: list[str] = []
    h = run_loop(project, params, "ckpt-stale", log=log)["history"]
    assert [x["offpolicy/staleness"] for x in h] == [0, 1, 2, 1]
    assert [x.get("offpolicy/dropped_stale_batch", 0.0) for x in h] == [0.0, 0.0, 1.0, 0.0]
    assert "losses/total" not in h[2] and all("losses/total" in h[i] for i in (0, 1, 3))
    assert "update 3: dropped a batch 2 versions old (max_staleness=1)" in log
    assert run_health(h)["dropped_stale_batches"] == 1


def test_a_resumed_asynchronous_run_does_not_drop_its_first_batch_as_stale(project):
    """The pool of a resumed run generates with the resumed weights: its first batch is as fresh as the policy,
    not as old as the run (a pool numbering its snapshot from 0 made it `start` versions stale, and dropped it)."""
    params = write_params(project, "params-async-resume.yaml", async_rollouts=True, max_staleness=1,
                          rollout_workers=1, updates=4, eval_every=10, checkpoint_every=2)
    first = run_loop(project, params, "ckpt-async-resume", stop_after=2)["history"]
    log: list[str] = []
    again = run_loop(project, params, "ckpt-async-resume", stop_after=1, log=log)["history"]
    assert any(m.startswith("resumed from") for m in log) and len(first) == 2 and len(again) == 3
    assert again[2]["offpolicy/staleness"] == 0 and "offpolicy/dropped_stale_batch" not in again[2]
    assert "losses/total" in again[2]


# -------------------------------------------------------------------------------------- tool faults in training
def test_a_tool_that_raises_during_training_is_an_error_observation_and_training_goes_on(project, monkeypatch):
    """The shop's `lookup` raising ZeroDivisionError on every other call while the loop trains: the episodes of the
    update (the expert's demonstrations for the policy's failed groups reach the tools) see the failure as an error
    observation, the update counts it (``faults/tool_exceptions``) and learns on."""
    from pipeline.envs.shop import tools
    from pipeline.train import loop as loop_mod

    real, calls = tools.Lookup.execute, []

    def flaky(self, params, ctx):
        calls.append(1)
        if len(calls) % 2:
            raise ZeroDivisionError("float division by zero")
        return real(self, params, ctx)

    guided_batches = []
    real_guide = loop_mod.guide_failed_groups

    def spy(*args, **kwargs):
        out = real_guide(*args, **kwargs)
        guided_batches.append(out[0])
        return out

    monkeypatch.setattr(tools.Lookup, "execute", flaky)
    monkeypatch.setattr(loop_mod, "guide_failed_groups", spy)
    params = write_params(project, "params-raising.yaml", env={"max_steps": 8}, guide_failed_groups=True,
                          eval_every=10)
    h = run_loop(project, params, "ckpt-raising", stop_after=2)["history"]
    assert len(h) == 2 and all(np.isfinite(x["losses/grad_norm"]) for x in h)
    assert sum(x["faults/tool_exceptions"] for x in h) > 0
    observations = [s["observation"] for batch in guided_batches for r in batch if r.get("demonstrated")
                    for s in r["steps"]]
    assert any(o == "<obs>error: lookup failed (ZeroDivisionError)</obs>\n" for o in observations)
    assert sum(x["faults/tool_exceptions"] for x in h) == sum(
        o.endswith("failed (ZeroDivisionError)</obs>\n") for o in observations)


@pytest.mark.slow
def test_a_run_with_20_percent_tool_failures_and_latency_spikes_completes_and_reports_them(project, monkeypatch):
    """`env.tool_failure_rate: 0.2` with latency spikes, in a complete run of the train phase: it finishes, every
    update logs the faults its episodes met, metrics/train.json's ``health`` sums them with the observed failure
    rate (within a binomial bound of 0.2), the learning curve and MLflow carry them, and the episodes the policy
    learned from (the expert's demonstrations for its failed groups: the tiny random policy's own actions never
    reach a tool) saw the injected errors."""
    from mlflow.tracking import MlflowClient

    from pipeline.train.worker import run_worker

    monkeypatch.chdir(project)
    params = write_params(project, "params-faults.yaml",
                          env={"max_steps": 8, "tool_failure_rate": 0.2, "tool_latency_spike_rate": 0.3,
                               "tool_latency_spike_s": 0.001},
                          guide_failed_groups=True, updates=3, tasks_per_update=4, eval_every=3)
    result = run_worker(params.name, ckpt="ckpt-faults", out="models/policy-faults",
                        metrics_path="metrics/train-faults.json", curve_path="metrics/train-faults.csv")
    h = result["history"]
    assert result["completed"] and len(h) == 3
    health = json.loads(Path("metrics/train-faults.json").read_text())["health"]
    faults = health["tool_faults"]
    n, k = faults["tool_calls"], faults["injected_failures"]
    print(f"\n[faults] train run: {k}/{n} tool calls failed (observed {k / n:.3f}, configured 0.2), "
          f"{faults['latency_spikes']} latency spikes (configured 0.3)")
    assert n == sum(x["faults/tool_calls"] for x in h) >= 20
    assert abs(k - 0.2 * n) <= 4 * np.sqrt(n * 0.2 * 0.8) and k > 0, faults
    assert faults["failure_rate"] == pytest.approx(k / n) and faults["latency_spikes"] > 0
    header = Path("metrics/train-faults.csv").read_text().splitlines()[0].split(",")
    assert {"faults_failure_rate", "faults_latency_spikes", "alarms_reward_spread_collapse"} <= set(header)
    # the random policy never answers right: its reward spread collapses at every update, and the run says so
    assert health["alarms"]["reward_spread"] == [1, 2, 3] and health["dropped_stale_batches"] == 0
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    run = client.search_runs([client.get_experiment_by_name("agentrl").experiment_id],
                             filter_string="attributes.run_name = 'train'", order_by=["attributes.start_time DESC"],
                             max_results=1)[0]
    logged = client.get_metric_history(run.info.run_id, "faults/injected_failures")
    assert len(logged) == 3 and sum(m.value for m in logged) == k
    assert [m.value for m in client.get_metric_history(run.info.run_id, "alarms/reward_spread_collapse")] == [1.0] * 3


# ---------------------------------------------------------------------------- KL and reward normalisation
def _weights_after_each_update(monkeypatch) -> list[torch.Tensor]:
    """Spies on the loop's learner call: the policy's flattened weights after every update."""
    from pipeline.train import loop as loop_mod

    real, seen = loop_mod.learn, []

    def spy(learner, records, sampler, u):
        out = real(learner, records, sampler, u)
        seen.append(torch.cat([p.detach().flatten().clone() for p in learner.engine.module.policy.parameters()]))
        return out

    monkeypatch.setattr(loop_mod, "learn", spy)
    return seen


def test_the_kl_penalty_to_the_reference_is_logged_and_changes_the_update(project, monkeypatch):
    """PPO with `kl_coef` 0 and 1 from the same start, seeds and rollouts: the first update is the same (the policy
    is its reference, so the k3 penalty and its gradient are 0), the second differs (the penalty pulls toward the
    reference), and the loop logs a KL above 0 only where the policy has moved."""
    seen = _weights_after_each_update(monkeypatch)
    common = dict(algorithm="ppo", eval_every=10, entropy_coef=0.05, skip_zero_variance_groups=False)
    h0 = run_loop(project, write_params(project, "params-kl0.yaml", kl_coef=0.0, **common), "ckpt-kl0", 2)["history"]
    h1 = run_loop(project, write_params(project, "params-kl1.yaml", kl_coef=1.0, **common), "ckpt-kl1", 2)["history"]
    no_kl, kl = seen[:2], seen[2:]
    assert "losses/kl_ref" not in h0[1] or h0[1]["losses/kl_ref"] == 0.0
    assert h1[0]["losses/kl_ref"] == pytest.approx(0.0, abs=1e-6) and h1[1]["losses/kl_ref"] > 1e-6
    assert torch.allclose(no_kl[0], kl[0], atol=1e-7)
    assert not torch.allclose(no_kl[1], kl[1], atol=1e-6)


def test_reward_normalisation_shifts_and_scales_the_scores_the_loop_learns_from(project, monkeypatch):
    """With `reward_norm_window` = the batch (8 episodes), the scores the advantages start from are the batch's
    returns normalised by the previous window: (R − μ)/(σ + 1e-6) of the last 8 returns learned from (the raw
    returns at the first update, before two are known). The expert's demonstrations give the batches returns that
    differ, so the normalisation is visible."""
    from pipeline.train import advantages

    seen = []
    real = advantages.episode_scores

    def spy(records, state):
        returns = np.array([r["return"] for r in records])
        scores = real(records, state)
        seen.append((returns, scores.numpy().astype(np.float64)))
        return scores

    monkeypatch.setattr(advantages, "episode_scores", spy)
    params = write_params(project, "params-norm.yaml", env={"max_steps": 8}, reward_norm_window=8,
                          guide_failed_groups=True, tasks_per_update=4, eval_every=10)
    run_loop(project, params, "ckpt-norm", 3)
    assert len(seen) == 3 and all(len(r) == 8 for r, _ in seen)
    assert np.allclose(seen[0][1], seen[0][0])  # nothing known yet: the raw returns
    for (prev, _), (returns, scores) in zip(seen, seen[1:]):
        assert prev.std() > 0
        assert np.allclose(scores, (returns - prev.mean()) / (prev.std() + 1e-6), atol=1e-5)
    first_norm = seen[1][1]
    assert not np.allclose(first_norm, seen[1][0])
