"""The RL phase end to end on tiny configurations: one learning step, DeepSpeed with 2 CPU ranks, kill and resume,
and bad input (a contradicting DeepSpeed config, a checkpoint of another model)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.envs.config import EnvConfig
from pipeline.build_env.config import BuildEnvConfig
from pipeline.core.errors import AgentRLError
from pipeline.envs.shop import ShopWorld

REPO = Path(__file__).resolve().parents[1]


def read_tasks(path: str | Path) -> list:
    """The tasks of a task file of the project's shop world (``data/env``), read as the phases read them."""
    from pipeline.envs.taskfile import load_task_file

    world = ShopWorld.load(Path(path).parents[1] / "env")
    try:
        return load_task_file(path, world, validate=False)
    finally:
        world.close()


def signatures(world) -> list[str]:
    """The tool signatures the prompt lists, from the environment."""
    return [s.signature() for s in world.tools()]
TRAIN_YAML = """
env:
  max_steps: 3
rollout:
  max_new_tokens: 10
  batch_size: 8
train:
  algorithm: {algorithm}
  updates: {updates}
  tasks_per_update: 2
  group_size: 2
  num_ranks: {ranks}
  checkpoint_every: 2
  eval_every: 2
  eval_tasks: 4
  test_tasks: 4
  lr: 0.01
  deepspeed_config: {repo}/configs/deepspeed_zero{stage}.json
"""


def make_project(root: Path, seed: int = 0, algorithm: str = "rloo", updates: int = 4, ranks: int = 1,
                 stage: int = 2, d_model: int = 32) -> Path:
    from pipeline.build_env.main import build
    from pipeline.policy.config import ModelConfig
    from pipeline.policy.model import build_policy, save_policy
    from pipeline.policy.tokenizer import corpus_texts, train_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    cfg = BuildEnvConfig(options={"n_products": 40, "n_suppliers": 10},
                         tasks_per_split={"train": 24, "validation": 8, "test": 8})
    build(cfg, EnvConfig(), root / "data", root / "metrics" / "build_env.json")
    world = ShopWorld.load(root / "data" / "env")
    sigs = signatures(world)
    world.close()
    tok = train_tokenizer(corpus_texts(root / "data", sigs), vocab_size=400)
    torch.manual_seed(seed)
    model = build_policy(ModelConfig(d_model=d_model, n_layers=1, n_heads=2, d_ff=64, max_positions=512, seed=seed), tok)
    save_policy(model, tok, root / "models" / "adapted", {"note": "tiny random test policy"})
    (root / "params.yaml").write_text(TRAIN_YAML.format(algorithm=algorithm, updates=updates, ranks=ranks, stage=stage,
                                                        repo=REPO))
    return root


def trained_reference() -> Path:
    """`make_project`'s default project after one uninterrupted, untracked `agentrl train`: the reference that a killed
    and resumed run (here) and a run that lost its tracking server (tests/test_outages.py) must equal. Built once per
    test run (tests/shared_builds.py); read only: a test that runs in it copies it first."""
    from shared_builds import built_once

    from pipeline.train.distributed import child_env

    def build(folder: Path) -> None:
        proj = make_project(folder / "project")
        env = child_env({"PYTHONUNBUFFERED": "1", "AGENTRL_TRACKING": "off", "PYTHONWARNINGS": "ignore"})
        out = subprocess.run([str(Path(sys.executable).parent / "agentrl"), "train"], cwd=proj, env=env,
                             capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    return built_once("train-reference", build)[0] / "project"


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return make_project(tmp_path_factory.mktemp("rl"))


@pytest.fixture()
def in_project(project, monkeypatch):
    monkeypatch.chdir(project)
    return project


def _worker(project: Path, *args: str, env_extra: dict | None = None, ranks: int = 1):
    from pipeline.train.distributed import child_env

    env = child_env({"PYTHONUNBUFFERED": "1", **(env_extra or {})})
    if ranks > 1:
        from pipeline.train.main import launcher_command
        from pipeline.train.distributed import free_port

        cmd = launcher_command("params.yaml", ranks, free_port(), list(args))
    else:
        cmd = [sys.executable, "-m", "pipeline.train.worker", "--params", "params.yaml", *args]
    return subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=900)


def test_one_update_changes_the_policy_and_logs_diagnostics(in_project):
    from pipeline.policy.model import load_policy
    from pipeline.train.worker import run_worker

    before = {k: v.clone() for k, v in load_policy("models/adapted")[0].state_dict().items()}
    result = run_worker("params.yaml", ckpt="ckpt-one", out="models/policy-one", stop_after=1)
    h = result["history"][0]
    for key in ("policy/entropy", "policy/advantage_var", "rollout/reward_spread", "losses/grad_norm",
                "losses/clipfrac", "losses/approx_kl", "rollout/zero_variance_group_share", "tools/entropy",
                "diag/params_without_grad", "charts/episodes_per_s", "charts/sampled_tokens_per_s",
                "offpolicy/is_weight_mean", "sys/rollout_s", "sys/learn_s"):
        assert key in h, key
    assert h["policy/entropy"] > 0 and np.isfinite(h["losses/grad_norm"])
    # the linear warm-up (train.lr_warmup_steps, default 10): the first step runs at lr/11 (train.lr is 0.01 here)
    assert h["train/lr"] == pytest.approx(0.01 / 11)


def _params_with(name: str, **train_keys) -> str:
    """A copy of the project's params.yaml with `train_keys` set in its `train` section (the file's last)."""
    text = Path("params.yaml").read_text()
    for key, value in train_keys.items():
        text = re.sub(rf"^  {key}: .*$", "", text, flags=re.M) + f"  {key}: {value}\n"
    Path(name).write_text(text)
    return name


def test_incoming_tasks_join_the_pool_and_are_counted_in_train_json_and_mlflow(in_project, capsys):
    import os

    from mlflow.tracking import MlflowClient

    from pipeline.core.config import load_section
    from pipeline.envs.shop.tasks import generate_tasks
    from pipeline.envs.taskfile import write_tasks
    from pipeline.policy.config import RolloutConfig
    from pipeline.train.config import TrainConfig
    from pipeline.train.worker import run_key, run_worker

    runtime = ShopWorld.load(Path("data/env"))
    world = runtime.world
    seen = {t.question for t in read_tasks("data/tasks/train.jsonl")}
    fresh = [t for t in generate_tasks(world, "train", 20, {1: 0.25, 2: 0.25, 3: 0.25, 4: 0.25}, seed=99,
                                       solver=lambda plan, allowed: runtime.solve(plan, allowed))
             if t.question not in seen][:2]
    runtime.close()
    held_out = read_tasks("data/tasks/validation.jsonl")[0]  # names validation entities: never trained on
    write_tasks([*fresh, held_out], Path("incoming-worker/batch.jsonl"))
    Path("incoming-worker/README.md").write_text("not tasks\n")
    params = _params_with("params-incoming.yaml", updates=2, incoming_tasks="incoming-worker")

    result = run_worker(params, ckpt="ckpt-incoming", out="models/policy-incoming",
                        metrics_path="metrics/train-incoming.json", curve_path="metrics/train-incoming.csv")
    expected = {"dir": "incoming-worker", "files": 1, "read": 3, "tasks": 2, "dropped_heldout_entities": 1,
                "dropped_heldout_templates": 0, "dropped_duplicates": 0, "dropped_unverifiable": 0}
    assert result["completed"] and result["incoming"] == expected
    written = json.loads(Path("metrics/train-incoming.json").read_text())
    assert written["incoming"] == expected
    # the learnability report of the RL policy's test episodes: in train.json, in MLflow, printed last
    learn, rl = written["learnability"], written["test"]["rl"]["overall"]
    assert learn["episodes"] == rl["n"] and learn["success"] == rl["success_rate"]
    assert learn["actions"]["n"] == round(rl["mean_tool_calls"] * rl["n"])
    assert "train: learnability of the RL policy" in capsys.readouterr().out.split("seen-wording headroom")[-1]
    run = MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).search_runs(
        [MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_experiment_by_name("agentrl").experiment_id],
        filter_string="attributes.run_name = 'train'", order_by=["attributes.start_time DESC"], max_results=1)[0]
    assert run.data.metrics["incoming/tasks"] == 2 and run.data.metrics["incoming/dropped_heldout_entities"] == 1
    assert run.data.metrics["learnability/episodes"] == rl["n"]
    assert "learnability.json" in [a.path for a in MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).list_artifacts(
        run.info.run_id)]
    assert run.data.tags["incoming.dir"] == "incoming-worker"
    # the checkpoints are keyed by the incoming tasks too: a new batch starts a fresh run instead of resuming this one
    (folder,) = Path("ckpt-incoming").iterdir()
    cfgs = (load_section(EnvConfig, "env", params), load_section(RolloutConfig, "rollout", params),
            load_section(TrainConfig, "train", params))
    assert folder.name != run_key("models/adapted", *cfgs, 1)


def test_a_schema_breaking_incoming_file_stops_the_stage_before_anything_is_written(in_project):
    from pipeline.train.main import main as train_main
    from pipeline.train.worker import run_worker

    Path("incoming-bad").mkdir()
    Path("incoming-bad/bad.jsonl").write_text('{"task_id": "x"}\n')
    single = _params_with("params-bad.yaml", incoming_tasks="incoming-bad")
    with pytest.raises(AgentRLError, match=r"incoming task file incoming-bad/bad.jsonl breaks the task schema.*"
                                           r"bad.jsonl:1: missing keys"):
        run_worker(single, ckpt="ckpt-bad", out="models/policy-bad", metrics_path="metrics/train-bad.json")
    assert not any(Path(p).exists() for p in ("ckpt-bad", "models/policy-bad", "metrics/train-bad.json"))
    # several ranks: refused before the DeepSpeed launcher starts any
    ranks = _params_with("params-bad-ranks.yaml", incoming_tasks="incoming-bad", num_ranks=2)
    with pytest.raises(AgentRLError, match="incoming-bad/bad.jsonl"):
        train_main(ranks)


def test_deepspeed_config_that_contradicts_the_params_is_refused(tmp_path):
    from pipeline.train.distributed import resolve_ds_config

    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"gradient_clipping": 5.0, "zero_optimization": {"stage": 2}}))
    with pytest.raises(AgentRLError, match="gradient_clipping=5.0"):
        resolve_ds_config(bad, micro_batch=4, grad_accum=1, world_size=2, max_grad_norm=1.0, device="cpu")
    bad.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(AgentRLError, match="stage 3"):
        resolve_ds_config(bad, micro_batch=4, grad_accum=1, world_size=2, max_grad_norm=1.0, device="cpu")
    bad.write_text(json.dumps({"optimizer": {"type": "Adam"}}))
    with pytest.raises(AgentRLError, match="optimizer"):
        resolve_ds_config(bad, micro_batch=4, grad_accum=1, world_size=2, max_grad_norm=1.0, device="cpu")
    good = resolve_ds_config(REPO / "configs/deepspeed_zero1.json", micro_batch=4, grad_accum=1, world_size=2,
                             max_grad_norm=1.0, device="cpu")
    assert good["train_batch_size"] == 8 and good["bf16"] == {"enabled": False}


@pytest.mark.slow
def test_two_deepspeed_ranks_train_and_report(project):
    out = _worker(project, ranks=2)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    metrics = json.loads((project / "metrics/train.json").read_text())
    assert metrics["world_size"] == 2 and metrics["updates"] == 4
    assert set(metrics["test"]) == {"sft", "rl"} and "level_1_success" in metrics["delta_rl_minus_sft"]
    # the tiny test split's first 4 tasks are all in training wordings: no held-out wording, no headroom figure
    assert "template_unseen" not in metrics["test"]["sft"] and metrics["seen_wording_headroom"] is None
    assert (project / "models/policy/config.json").is_file()
    assert (project / "metrics/train_curve.csv").read_text().count("\n") == 5
    (latest,) = (project / "checkpoints/train").glob("*/latest")
    assert latest.read_text().strip() == "update-4"


@pytest.mark.slow
def test_a_rank_builds_no_shared_memory_op_and_leaves_nothing_in_dev_shm():
    """DeepSpeed's CPU backend would build a C++ op and name one 66 MB /dev/shm buffer per rank, never removed, for its
    inference all-reduce; `init_dist` makes it skip the op (pipeline.train.distributed.SHM_OP). In a child process with
    the launcher's LOCAL_SIZE (without it the backend maps no buffer either way): the backend holds no op, no buffer
    of the group is in /dev/shm, and both all-reduces still work. Before the change the buffer existed here."""
    code = """
import os
os.environ["LOCAL_SIZE"] = "1"
from pathlib import Path
import torch
import pipeline.train.distributed as D
from deepspeed import comm
from deepspeed.comm import comm as backend
D.init_dist()
buffers = sorted(p.name for p in Path("/dev/shm").glob(
    f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ['MASTER_ADDR']}_{os.environ['MASTER_PORT']}_*"))
t, u = torch.arange(4.0), torch.ones(2)
comm.inference_all_reduce(t)
comm.all_reduce(u)
print("RESULT", backend.cdb.shm_comm_op, buffers, t.tolist(), u.tolist())
"""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "RESULT None [] [0.0, 1.0, 2.0, 3.0] [1.0, 1.0]" in out.stdout, out.stdout[-3000:]
    assert "deepspeed_shm_comm_op built successfully" not in out.stdout + out.stderr


@pytest.mark.slow
def test_a_killed_run_resumes_from_its_checkpoint_as_if_it_had_not_stopped(tmp_path):
    ref = trained_reference()  # the same run without interruption
    # The same run killed (SIGKILL, by the worker's fault-injection flag) in the middle of update 3: after its rollouts,
    # before it learns, with the checkpoint of update 2 on disk. (Waiting for the checkpoint and killing from here
    # raced: the tiny run can finish before the signal arrives.)
    proj = make_project(tmp_path / "killed")
    out = _worker(proj, "--kill-at-update", "3")
    assert out.returncode == -signal.SIGKILL, out.stdout[-3000:] + out.stderr[-3000:]
    (latest,) = (proj / "checkpoints/train").glob("*/latest")
    assert latest.read_text().strip() == "update-2"
    assert not (proj / "metrics/train.json").exists()
    out = _worker(proj)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "resumed from" in out.stdout
    a = json.loads((ref / "metrics/train.json").read_text())
    b = json.loads((proj / "metrics/train.json").read_text())
    assert a["evals"] == b["evals"] and a["test"] == b["test"]
    curve = lambda p: [line.split(",")[:5] for line in (p / "metrics/train_curve.csv").read_text().splitlines()]  # noqa: E731
    assert curve(ref) == curve(proj)
    # the published policy is the same bytes (nothing run-specific is saved with it): DVC hashes both alike
    files = lambda p: {f.relative_to(p).as_posix(): f.read_bytes() for f in sorted(p.rglob("*")) if f.is_file()}  # noqa: E731
    assert files(ref / "models/policy") == files(proj / "models/policy")


@pytest.mark.slow
def test_a_finished_run_started_again_restores_its_policy_without_training(tmp_path, monkeypatch, capsys):
    from pipeline.policy.model import load_policy
    from pipeline.train.worker import run_worker

    proj = make_project(tmp_path / "p", updates=2)
    monkeypatch.chdir(proj)
    first = run_worker("params.yaml")
    assert first["completed"] and (proj / "models/policy/policy.json").is_file()
    weights = {k: v.clone() for k, v in load_policy("models/policy")[0].state_dict().items()}
    (ckpt,) = (proj / "checkpoints/train").iterdir()
    assert (ckpt / "best" / "policy.json").is_file()
    # DVC deletes a stage's outputs before it reruns the stage (dvc repro -f): the policy must come back from the
    # finished run's checkpoint folder, without a single update of training.
    import shutil

    shutil.rmtree(proj / "models/policy")
    capsys.readouterr()
    again = run_worker("params.yaml")
    assert "resumed from" in capsys.readouterr().out
    assert again["completed"] and again["history"] == first["history"] and again["evals"] == first["evals"]
    restored = load_policy("models/policy")[0].state_dict()
    assert all(torch.equal(weights[k], restored[k]) for k in weights)


def test_the_checkpoint_key_changes_with_the_code(tmp_path, monkeypatch):
    from pipeline.core.config import load_section
    from pipeline.envs.config import EnvConfig as E
    from pipeline.policy.config import RolloutConfig
    from pipeline.train import worker
    from pipeline.train.config import TrainConfig

    proj = make_project(tmp_path / "p", updates=2)
    monkeypatch.chdir(proj)
    args = ("models/adapted", load_section(E, "env"), load_section(RolloutConfig, "rollout"),
            load_section(TrainConfig, "train"), 1)
    key = worker.run_key(*args)
    assert worker.run_key(*args) == key
    monkeypatch.setattr(worker, "source_digest", lambda: "edited trainer")
    assert worker.run_key(*args) != key


def test_the_checkpoint_key_hashes_the_train_stage_code_that_dvc_yaml_lists():
    """source_digest covers exactly the train stage's code deps in dvc.yaml, so the two cannot drift apart."""
    import yaml

    from pipeline.train import worker
    root = Path(__file__).resolve().parents[1]
    deps = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]["train"]["deps"]
    assert sorted(d for d in deps if d.startswith("pipeline/")) == sorted(worker.TRAIN_SOURCES)
    assert all((root / src).exists() for src in worker.TRAIN_SOURCES)


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_refused(tmp_path, monkeypatch):
    from pipeline.train.worker import run_worker

    proj = make_project(tmp_path / "a", updates=2)
    monkeypatch.chdir(proj)
    run_worker("params.yaml", stop_after=2)
    other = make_project(tmp_path / "b", updates=2, d_model=48)
    monkeypatch.chdir(other)
    from pipeline.core.config import load_section
    from pipeline.envs.config import EnvConfig as E
    from pipeline.policy.config import RolloutConfig
    from pipeline.train.config import TrainConfig
    from pipeline.train.worker import run_key

    # A fresh run of another model never picks up these checkpoints (its folder is keyed by model and params) ...
    key = run_key("models/adapted", load_section(E, "env"), load_section(RolloutConfig, "rollout"),
                  load_section(TrainConfig, "train"), 1)
    (theirs,) = (proj / "checkpoints/train").iterdir()
    assert key != theirs.name
    # ... and checkpoints copied into its folder by hand are refused with a clear error, not resumed into a
    # corrupted policy.
    import shutil

    shutil.copytree(theirs, other / "checkpoints/train" / key)
    with pytest.raises(AgentRLError, match="another model"):
        run_worker("params.yaml")


def test_asynchronous_rollouts_record_staleness_and_importance_weights(in_project):
    from pipeline.train.worker import run_worker

    params = Path("params.yaml").read_text().replace("  algorithm: rloo", "  algorithm: rloo\n  async_rollouts: true\n"
                                                     "  max_staleness: 1\n  rollout_workers: 2")
    Path("params-async.yaml").write_text(params)
    result = run_worker("params-async.yaml", ckpt="ckpt-async", out="models/policy-async", stop_after=3)
    staleness = [h["offpolicy/staleness"] for h in result["history"]]
    assert staleness == [0, 1, 1]  # the first batch comes from the initial snapshot; later ones lag one version
    assert all("offpolicy/is_weight_mean" in h for h in result["history"])
    assert all(h["sys/idle_s"] >= 0 for h in result["history"])


def test_ppo_with_kl_turn_credit_reward_norm_and_adaptive_entropy_trains_in_the_loop(in_project, monkeypatch):
    """The off-by-default capabilities of docs/design.md, switched on together inside a real run of the loop:
    PPO (value loss, explained variance), KL to the adapted reference (0 at the first update, where the policy is
    the reference; above 0 once it moved), per-turn credit (its metric), reward normalisation (the second update's
    scores are no longer the raw returns) and the adaptive entropy coefficient (λ rises while the entropy is below
    the target)."""
    from pipeline.train import advantages
    from pipeline.train.worker import run_worker

    seen = []
    real = advantages.episode_scores

    def spy(records, state):
        scores = real(records, state)
        seen.append((torch.tensor([r["return"] for r in records], dtype=torch.float32), scores))
        return scores

    monkeypatch.setattr(advantages, "episode_scores", spy)
    params = _params_with("params-capabilities.yaml", algorithm="ppo", kl_coef=0.1, turn_credit="true", gamma=0.9,
                          reward_norm_window=8, entropy_coef=0.01, entropy_target=50.0)
    h = run_worker(params, ckpt="ckpt-capabilities", out="models/policy-capabilities", stop_after=2)["history"]
    assert len(h) == 2 and all(np.isfinite(x["losses/grad_norm"]) for x in h)
    assert all("losses/value_loss" in x and "losses/explained_variance" in x for x in h)
    assert h[0]["losses/kl_ref"] == pytest.approx(0.0, abs=1e-4) and h[1]["losses/kl_ref"] > 1e-6
    assert all(x["turn_credit/turns_per_episode"] >= 1 for x in h)
    assert torch.equal(*seen[0]) and not torch.allclose(*seen[1])  # normalised from the second update on
    assert 0.01 < h[0]["policy/entropy_coef"] < h[1]["policy/entropy_coef"] <= 0.1


def test_grpo_with_turn_credit_trains_in_the_loop(in_project):
    """`algorithm: grpo` with per-turn credit inside a real run: the group baseline at turn level logs its spread
    and the learner takes finite steps on advantages that vary."""
    from pipeline.train.worker import run_worker

    params = _params_with("params-grpo.yaml", algorithm="grpo", turn_credit="true", gamma=0.9)
    h = run_worker(params, ckpt="ckpt-grpo", out="models/policy-grpo", stop_after=2)["history"]
    assert len(h) == 2 and all(np.isfinite(x["losses/grad_norm"]) for x in h)
    assert all("turn_credit/adv_spread_within_episode" in x for x in h)
    assert any(x["policy/advantage_var"] > 0 for x in h)
    assert "losses/value_loss" not in h[0]  # no value head


def test_the_test_comparison_reports_tool_calls_per_solved_task_per_level():
    """The overall tool calls per solved task mix levels: a policy that solves more 4-call level-4 tasks raises it
    even when every level's solved tasks take no more calls, so `deltas` reports each level too."""
    from pipeline.train.worker import deltas

    def summary(per_level: dict) -> dict:  # (success rate, calls per solved task, solved) per level
        solved = sum(s for _, _, s in per_level.values())
        return {"overall": {"success_rate": solved / (10 * len(per_level)),
                            "mean_tool_calls_solved": sum(c * s for _, c, s in per_level.values()) / solved,
                            "safety_violations": 0},
                "per_level": {lv: {"success_rate": r, "mean_tool_calls_solved": c} for lv, (r, c, _) in
                              per_level.items()}}

    sft = summary({"1": (0.9, 2.0, 9), "4": (0.1, 4.5, 1)})
    rl = summary({"1": (0.9, 2.0, 9), "4": (0.8, 4.0, 8)})
    d = deltas(sft, rl)
    assert d["tool_calls_per_solved_task"] > 0  # overall: more calls ...
    assert d["level_1_tool_calls_per_solved_task"] == 0 and d["level_4_tool_calls_per_solved_task"] == -0.5
    assert d["level_4_success"] == pytest.approx(0.7)
    assert d["tool_calls_per_success"] is None  # these summaries lack the figure: no delta, no error
    sft["per_level"]["4"]["tool_calls_per_success"], rl["per_level"]["4"]["tool_calls_per_success"] = 45.0, 5.0
    sft["overall"]["tool_calls_per_success"], rl["overall"]["tool_calls_per_success"] = 6.0, 4.5
    d = deltas(sft, rl)
    assert d["level_4_tool_calls_per_success"] == -40.0 and d["tool_calls_per_success"] == -1.5
    assert d["level_1_tool_calls_per_success"] is None
    assert "template_seen_success" not in d  # only when the summaries split by wording
    sft["template_seen"], sft["template_unseen"] = {"success_rate": 0.5}, {"success_rate": 0.0}
    rl["template_seen"], rl["template_unseen"] = {"success_rate": 0.75}, {"success_rate": 0.05}
    d = deltas(sft, rl)
    assert d["template_seen_success"] == pytest.approx(0.25) and d["template_unseen_success"] == pytest.approx(0.05)


def test_seen_wording_headroom_counts_the_seen_tasks_sft_failed():
    """Level 1: 8 seen tasks (SFT solves 6) and 2 in the held-out wording: RL can add 2 of 10 without the held-out
    wording. Level 4: 4 seen (SFT solves 1), 1 held-out: 3 of 5. Overall 5 of 15. No held-out wording: None."""
    from pipeline.train.worker import seen_wording_headroom

    sft = {"per_level": {"1": {"n": 10, "success_rate": 0.6}, "4": {"n": 5, "success_rate": 0.2}},
           "per_level_template_seen": {"1": {"n": 8, "success_rate": 0.75}, "4": {"n": 4, "success_rate": 0.25}}}
    head = seen_wording_headroom(sft)
    assert head == pytest.approx({"level_1": 0.2, "level_4": 0.6, "overall": 5 / 15})
    sft["per_level_template_seen"].pop("4")  # a level whose tasks are all in the held-out wording: no room at all
    assert seen_wording_headroom(sft)["level_4"] == 0.0
    assert seen_wording_headroom({"per_level": sft["per_level"]}) is None


def test_the_test_evaluation_splits_each_level_by_wording(in_project):
    """`evaluate_greedy` on a split with held-out-wording tasks reports each level's seen-wording figures, which the
    headroom reads: the tiny random policy solves nothing, so a level's headroom is its seen share."""
    import dataclasses

    from pipeline.core.config import load_section
    from pipeline.policy.config import RolloutConfig
    from pipeline.policy.model import load_policy
    from pipeline.policy.rollout import RolloutEngine
    from pipeline.train.distributed import Dist
    from pipeline.train.validation import evaluate_greedy
    from pipeline.train.worker import seen_wording_headroom

    tasks = read_tasks("data/tasks/test.jsonl")
    tasks = [dataclasses.replace(t, template_seen=False) if i in (1, 5) else t for i, t in enumerate(tasks)]
    model, tok, _ = load_policy("models/adapted")
    engine = RolloutEngine(model, tok, ShopWorld.load(Path("data/env")), load_section(EnvConfig, "env"),
                           load_section(RolloutConfig, "rollout"))
    summary = evaluate_greedy(engine, tasks, Dist(), seed=20_000)
    seen = summary["per_level_template_seen"]
    assert sum(s["n"] for s in seen.values()) == summary["template_seen"]["n"] == len(tasks) - 2
    head = seen_wording_headroom(summary)
    assert summary["overall"]["success_rate"] == 0 and head["overall"] == pytest.approx(6 / 8)
    for lv, stats in summary["per_level"].items():
        assert head[f"level_{lv}"] == pytest.approx(seen.get(lv, {"n": 0})["n"] / stats["n"])
    plain = evaluate_greedy(engine, [t for t in tasks if t.template_seen], Dist(), seed=20_000)
    assert "per_level_template_seen" not in plain and seen_wording_headroom(plain) is None


def test_train_config_refuses_impossible_combinations():
    from pipeline.core.config import ConfigError, parse_section
    from pipeline.train.config import TrainConfig

    with pytest.raises(ConfigError, match="group_size must be at least 2"):
        parse_section(TrainConfig, {"algorithm": "grpo", "group_size": 1}, "params.yaml:train")
    with pytest.raises(ConfigError, match="multiple of num_ranks"):
        parse_section(TrainConfig, {"tasks_per_update": 3, "num_ranks": 2}, "params.yaml:train")
    with pytest.raises(ConfigError, match="max_staleness must be at least"):
        parse_section(TrainConfig, {"async_rollouts": True, "sync_every": 2, "max_staleness": 1}, "params.yaml:train")
    with pytest.raises(ConfigError, match="did you mean 'clip_eps'"):
        parse_section(TrainConfig, {"clip_epsilon": 0.1}, "params.yaml:train")
    for pruned in ("bc_entity_augmentation", "rollout_entity_augmentation", "efficiency_weight"):
        with pytest.raises(ConfigError, match=pruned):  # experiments that were measured and removed
            parse_section(TrainConfig, {pruned: 0.5}, "params.yaml:train")


def _sgd_learner(cfg, dist, with_value: bool):
    """The adapted policy (plus a value head for PPO) in a DeepSpeed engine with plain SGD at lr 1, so one step moves
    every weight by exactly minus its (clipped) gradient: steps of different code paths compare weight by weight."""
    from pipeline.policy.model import load_policy
    from pipeline.train.actor import ActorCritic
    from pipeline.train.distributed import make_engine, resolve_ds_config

    actor = ActorCritic(load_policy("models/adapted")[0], with_value=with_value)
    actor.train()
    ds = resolve_ds_config(cfg.deepspeed_config, micro_batch=1, grad_accum=cfg.micro_batches, world_size=1,
                           max_grad_norm=cfg.max_grad_norm, device="cpu")
    ds["zero_allow_untested_optimizer"] = True  # SGD: the step is the (clipped) gradient itself, comparable
    opt = torch.optim.SGD([p for p in actor.parameters() if p.requires_grad], lr=1.0)
    return actor, make_engine(actor, opt, ds, dist)


def _learn_step(cfg, engine, records: list[dict], tok, dist, demos: list | None = None) -> dict:
    """One `pipeline.train.learner.learn` update of `engine` on `records`, in fp32 (exact sums; bf16 would differ by
    padding), from a fresh sampling state."""
    from pipeline.policy.tokenizer import PAD, marker_ids
    from pipeline.train import learner
    from pipeline.train.sampling import make_learner_state

    fp32 = lambda dtype, device: contextlib.nullcontext()  # noqa: E731
    ctx = learner.Learner(cfg, engine, None, marker_ids(tok)[PAD], 1.0, dist, fp32, demos, np.random.default_rng(0))
    return learner.learn(ctx, records, make_learner_state(cfg), 0)


@pytest.mark.parametrize("algorithm,loss_agg", [("rloo", "token-mean"), ("ppo", "token-mean"),
                                                ("rloo", "seq-mean-token-mean")])
def test_the_learner_takes_the_same_step_in_one_forward_or_in_length_chunks(in_project, algorithm, loss_agg):
    """`_learn` itself, on one batch of real rollouts: the accumulated step over length-sorted chunks
    (`train.micro_batches`) and, for group baselines, the one-forward on-policy step against the separate π_old
    forward, all move every weight the same way as one forward of the whole batch."""
    from pipeline.core.config import load_section
    from pipeline.policy.config import RolloutConfig
    from pipeline.policy.model import load_policy
    from pipeline.policy.rollout import RolloutEngine
    from pipeline.train import core_algos as A
    from pipeline.train import learner
    from pipeline.train.config import TrainConfig
    from pipeline.train.distributed import init_dist

    dist = init_dist()
    model, tok, _ = load_policy("models/adapted")
    tasks = read_tasks("data/tasks/train.jsonl")[:3]
    engine_r = RolloutEngine(model, tok, ShopWorld.load(Path("data/env")), load_section(EnvConfig, "env"),
                             load_section(RolloutConfig, "rollout"))
    records = engine_r.run([t for t in tasks for _ in range(4)], list(range(12)), greedy=False)
    for i, r in enumerate(records):  # random weights never succeed: give every group reward variance
        r["return"], r["group"] = float((i * 7) % 5) / 4, i // 4
    assert len({len(r["token_ids"]) for r in records}) > 1  # rows of different lengths, so chunks pad differently

    def step(micro_batches: int, force_two_forwards: bool = False, nan_chunk: int | None = None,
             agg: str = loss_agg) -> dict:
        cfg = load_section(TrainConfig, "train").model_copy(update={
            "algorithm": algorithm, "group_size": 4, "tasks_per_update": 3, "micro_batches": micro_batches,
            "loss_agg": agg,
            "lr_warmup_steps": 0, "entropy_coef": 0.01, "entropy_target": None})
        patch = pytest.MonkeyPatch()
        if force_two_forwards:
            patch.setattr(learner, "one_forward", lambda cfg: False)
        if nan_chunk is not None:  # the policy loss of one chunk turns NaN (on this, the only rank)
            calls, real = [], A.ppo_policy_loss

            def poisoned(*args, **kwargs):
                loss, mets = real(*args, **kwargs)
                calls.append(1)
                return (loss * float("nan") if len(calls) == nan_chunk + 1 else loss), mets
            patch.setattr(A, "ppo_policy_loss", poisoned)
        torch.manual_seed(0)  # the same value head for every variant
        actor, engine = _sgd_learner(cfg, dist, with_value=algorithm == "ppo")
        before = {k: v.detach().clone() for k, v in actor.named_parameters()}
        mets = _learn_step(cfg, engine, [dict(r) for r in records], tok, dist)
        patch.undo()
        assert mets["train/skipped_steps_nonfinite"] == (nan_chunk is not None)
        return {k: v.detach() - before[k] for k, v in actor.named_parameters()}

    whole = step(1)
    assert sum(float(d.abs().sum()) for d in whole.values()) > 0
    variants = [step(3)] + ([step(1, force_two_forwards=True)] if algorithm != "ppo" else [])
    for other in variants:
        for k in whole:
            assert torch.allclose(whole[k], other[k], atol=1e-7, rtol=1e-4), k
    if loss_agg != "token-mean":  # the aggregation is not a no-op: episodes of different lengths weigh differently
        other = step(1, agg="token-mean")
        assert any(not torch.allclose(whole[k], other[k], atol=1e-7, rtol=1e-4) for k in whole)
    # A NaN loss in the second of 3 chunks: the step is counted as skipped and no weight moves at all.
    assert all(not d.any() for d in step(3, nan_chunk=1).values())


def _sampled_records(n_tasks: int, group: int) -> tuple:
    """The adapted policy's tokenizer and `group` sampled episodes of each of the first `n_tasks` training tasks."""
    from pipeline.core.config import load_section
    from pipeline.policy.config import RolloutConfig
    from pipeline.policy.model import load_policy
    from pipeline.policy.rollout import RolloutEngine

    model, tok, _ = load_policy("models/adapted")
    tasks = read_tasks("data/tasks/train.jsonl")[:n_tasks]
    engine = RolloutEngine(model, tok, ShopWorld.load(Path("data/env")), load_section(EnvConfig, "env"),
                           load_section(RolloutConfig, "rollout"))
    return tok, engine.run([t for t in tasks for _ in range(group)], list(range(n_tasks * group)), greedy=False)


@pytest.mark.parametrize("algorithm", ["rloo", "ppo"])
def test_turn_credit_reads_the_environments_step_rewards_and_trains(in_project, algorithm):
    """`train.turn_credit`: rollout records carry one environment reward per sampled action, summing to the return;
    the per-turn advantages of the first turn are the episode-level ones; the learner takes a finite step with it
    and logs its metrics; records whose rewards do not match their actions are refused."""
    from pipeline.core.config import load_section
    from pipeline.train import core_algos as A
    from pipeline.train.credit import turn_rewards
    from pipeline.train.batch import group_ids_of
    from pipeline.train.config import TrainConfig
    from pipeline.train.distributed import init_dist
    from pipeline.train.estimators import rloo

    dist = init_dist()
    tok, records = _sampled_records(2, 4)
    for r in records:
        assert len(r["step_rewards"]) == int(A.turn_ids(torch.tensor(r["action_mask"])).max()) + 1 == len(r["steps"])
        assert sum(r["step_rewards"]) == pytest.approx(r["return"], abs=1e-9)
    for i, r in enumerate(records):  # random weights never succeed: a reward on the last turn, varying in the group
        r["step_rewards"] = [0.0] * (len(r["step_rewards"]) - 1) + [float((i * 7) % 5) / 4]
        r["return"], r["group"] = r["step_rewards"][-1], i // 4
    rewards, tmask = turn_rewards(records)
    assert tmask.sum(1).tolist() == [len(r["steps"]) for r in records]
    adv, _ = rloo(A.discounted_returns(rewards, 1.0), tmask, group_ids_of(records))
    episode_adv, _ = rloo(torch.tensor([[r["return"]] for r in records]), torch.ones(len(records), 1),
                          group_ids_of(records))
    assert torch.allclose(adv[:, 0], episode_adv[:, 0])
    cfg = load_section(TrainConfig, "train").model_copy(update={
        "algorithm": algorithm, "group_size": 4, "tasks_per_update": 2, "turn_credit": True, "gamma": 0.9,
        "lr_warmup_steps": 0})
    torch.manual_seed(0)
    actor, engine = _sgd_learner(cfg, dist, with_value=algorithm == "ppo")
    before = {k: v.detach().clone() for k, v in actor.named_parameters()}
    mets = _learn_step(cfg, engine, [dict(r) for r in records], tok, dist)
    assert mets["train/skipped_steps_nonfinite"] == 0 and mets["turn_credit/turns_per_episode"] >= 1
    assert np.isfinite(mets["losses/grad_norm"]) and mets["policy/advantage_var"] > 0
    assert sum(float((v.detach() - before[k]).abs().sum()) for k, v in actor.named_parameters()) > 0
    broken = [dict(r) for r in records]
    broken[3]["step_rewards"] = broken[3]["step_rewards"] + [0.0]
    with pytest.raises(AgentRLError, match="step rewards for"):
        turn_rewards(broken)


def test_ppo_pays_a_folded_episode_once_and_runs_gae_across_its_rows(in_project, monkeypatch):
    """An episode the environment folded (``segments``: several token rows, see pipeline.policy.rollout) goes through
    `_learn` with `algorithm: ppo`: GAE gets one reward per episode, on the last action of its last row, sees every
    row of the episode under one episode index, and the step is finite and moves the weights."""
    from pipeline.core.config import load_section
    from pipeline.train import core_algos as A
    from pipeline.train.config import TrainConfig
    from pipeline.train.distributed import init_dist

    dist = init_dist()
    tok, records = _sampled_records(2, 4)
    for i, r in enumerate(records):
        r["return"], r["group"] = float((i * 7) % 5) / 4 + 0.25, i // 4  # non-zero: a reward is visible where paid
    # fold episode 0 after its first action: a second row starts at the first observation token after it
    mask = records[0]["action_mask"]
    first_action_end = next(k for k in range(1, len(mask)) if mask[k - 1] and not mask[k])
    assert any(mask[first_action_end:]), "the episode needs an action after the fold"
    records[0]["segments"] = [0, first_action_end]
    seen = {}
    real = A.compute_gae_over_segments

    def spy(rewards, values, mask, episode, gamma, lam):
        seen.update(rewards=rewards.clone(), episode=episode.clone())
        return real(rewards, values, mask, episode, gamma, lam)

    cfg = load_section(TrainConfig, "train").model_copy(update={
        "algorithm": "ppo", "group_size": 4, "tasks_per_update": 2, "lr_warmup_steps": 0, "epochs": 1,
        "reward_norm_window": 0, "turn_credit": False})  # scores are then the returns themselves
    torch.manual_seed(0)
    actor, engine = _sgd_learner(cfg, dist, with_value=True)
    before = {k: v.detach().clone() for k, v in actor.named_parameters()}
    monkeypatch.setattr(A, "compute_gae_over_segments", spy)
    mets = _learn_step(cfg, engine, [dict(r) for r in records], tok, dist)
    rewards, episode = seen["rewards"], seen["episode"]
    assert len(episode) == len(records) + 1 and int((episode == 0).sum()) == 2  # episode 0 is two rows
    # rewards: exactly one non-zero token per episode, on its last row's last action token, equal to the return
    scores = torch.tensor([r["return"] for r in records])
    per_episode = torch.zeros(len(records)).index_add_(0, episode, rewards.sum(1))
    assert torch.allclose(per_episode, scores)
    assert int((rewards != 0).sum()) == len(records)
    assert float(rewards[(episode == 0) & ~A.last_rows(episode)].abs().sum()) == 0.0  # the first row is not paid
    assert mets["train/skipped_steps_nonfinite"] == 0 and np.isfinite(mets["losses/grad_norm"])
    assert sum(float((v.detach() - before[k]).abs().sum()) for k, v in actor.named_parameters()) > 0


def test_behaviour_cloning_trains_on_demonstrations_even_when_no_group_carries_signal(in_project):
    """`train.bc_coef`: the behaviour-cloning term reads demonstrations, so the learner forwards none of the
    zero-variance rollouts for it (one dummy row keeps the collective step) and still takes a step on the
    demonstrations' loss when every group's returns are equal; with `bc_coef` 0 the same batch moves nothing."""
    from pipeline.core.config import load_section
    from pipeline.policy.demos import demo_examples, load_demos, prompt_signatures
    from pipeline.train.config import TrainConfig
    from pipeline.train.distributed import init_dist

    dist = init_dist()
    tok, records = _sampled_records(2, 4)
    for i, r in enumerate(records):  # every group's returns equal: no RL signal anywhere
        r["return"], r["group"] = 0.5, i // 4
    train_tasks = read_tasks("data/tasks/train.jsonl")
    questions = {t.task_id: t.question for t in train_tasks}
    world = ShopWorld.load(Path("data/env"))
    sigs = prompt_signatures(world, train_tasks)
    world.close()
    demos = demo_examples(tok, [d for d in load_demos(Path("data/demos/train.jsonl")) if d["success"]], questions, 6,
                          signatures=sigs)

    def step(bc_coef: float) -> tuple[dict, float]:
        cfg = load_section(TrainConfig, "train").model_copy(update={
            "group_size": 4, "tasks_per_update": 2, "micro_batches": 2, "lr_warmup_steps": 0, "entropy_coef": 0.0,
            "entropy_target": None, "bc_coef": bc_coef, "bc_batch": 4})
        actor, engine = _sgd_learner(cfg, dist, with_value=False)
        before = {k: v.detach().clone() for k, v in actor.named_parameters()}
        mets = _learn_step(cfg, engine, [dict(r) for r in records], tok, dist, demos=demos)
        assert mets["rollout/zero_variance_group_share"] == 1.0 and mets["train/rows_forwarded"] == 1
        moved = sum(float((v.detach() - before[k]).abs().sum()) for k, v in actor.named_parameters())
        return mets, moved

    mets, moved = step(0.5)
    assert mets["losses/bc"] > 0 and moved > 0
    assert step(0.0)[1] == 0.0


def test_rl_rollouts_and_the_learner_use_the_train_temperature_and_the_test_comparison_does_not(in_project,
                                                                                                  monkeypatch):
    """`train.rollout_temperature` replaces `rollout.temperature` for what `train()` samples and learns from (one
    distribution, softmax(logits / T), on both sides of the importance ratio); the greedy SFT-against-RL comparison
    reads the `rollout` section as it is. null keeps `rollout.temperature`."""
    from pipeline.train import loop, worker
    seen = {}

    def fake_train(cfg, env_cfg, rollout_cfg, **kw):
        seen["train"] = rollout_cfg.temperature
        raise SystemExit("stop here")

    monkeypatch.setattr(loop, "train", fake_train)
    for value, expected in (("0.5", 0.5), ("null", 1.0)):
        with pytest.raises(SystemExit, match="stop here"):
            worker.run_worker(_params_with("params-temp.yaml", rollout_temperature=value, bc_coef=0.0),
                              ckpt="ckpt-temp", out="models/policy-temp")
        assert seen["train"] == expected


def test_a_demonstrated_episode_has_the_token_layout_of_sft_and_of_sampled_episodes(in_project):
    """`RolloutEngine.demonstrate`: the scripted expert's episodes, recorded as sampled ones are, are token for token
    the SFT text of the same steps (:func:`pipeline.policy.demos.encode_segment`, whose layout test_adapt checks
    against the environment's contexts), segment by segment, also where a short history window folds the context;
    they solve their tasks, and the learner's collate reads them like sampled records."""
    from pipeline.core.config import load_section
    from pipeline.envs.shop.expert import ExpertPolicy
    from pipeline.policy.config import RolloutConfig
    from pipeline.policy.model import load_policy
    from pipeline.policy.rollout import RolloutEngine
    from pipeline.policy.demos import demo_segments, encode_segment
    from pipeline.train.batch import collate_records
    model, tok, _ = load_policy("models/adapted")
    tasks = read_tasks("data/tasks/train.jsonl")
    tasks = [t for t in tasks if len(t.plan) >= 3][:4] + [t for t in tasks if len(t.plan) == 2][:1]
    runtime = ShopWorld.load(Path("data/env"))
    try:
        for window in (6, 1):
            env_cfg = load_section(EnvConfig, "env").model_copy(update={"history_window": window, "max_steps": 8})
            engine = RolloutEngine(model, tok, runtime, env_cfg, load_section(RolloutConfig, "rollout"))
            records = engine.demonstrate(tasks, list(range(len(tasks))), ExpertPolicy, policy_version=3)
            folded = 0
            for task, rec in zip(tasks, records):
                assert rec["success"] and rec["demonstrated"] and rec["policy_version"] == 3
                assert rec["n_calls"] == len(task.plan) and len(rec["steps"]) == len(task.plan)
                segs = demo_segments(task.question, rec["steps"], window, signatures(runtime))
                folded += len(segs) > 1
                ids, mask, starts = [], [], []
                for prompt, pairs in segs:
                    ex = encode_segment(tok, prompt, pairs)
                    starts.append(len(ids))
                    ids, mask = ids + ex.input_ids, mask + ex.loss_mask
                assert rec["token_ids"] == ids and rec["action_mask"] == mask and rec["segments"] == starts
                assert len(rec["logprobs"]) == len(ids) and not any(rec["logprobs"])
                assert sum(rec["step_rewards"]) == pytest.approx(rec["return"])
            assert folded == (len(tasks) - 1 if window == 1 else 0)  # window 1 folds every plan of 3+ steps
            batch = collate_records(records, 0)
            assert batch.n_rows == sum(len(r["segments"]) for r in records)
            assert int(batch.mask.sum()) == sum(sum(r["action_mask"]) for r in records)
    finally:
        runtime.close()


def test_expert_guidance_replaces_one_episode_of_each_failed_group_and_gives_it_a_signal(in_project):
    """`train.guide_failed_groups`: in groups whose episodes all fail (the tiny random policy fails everything), the
    last episode becomes the expert's demonstration of the same task and seed; a group with a success is left as it
    is. Without guidance such a batch carries no signal (every group zero-variance, nothing moves); with it the
    learner trains on the guided groups, the demonstration's tokens at importance weight 1, and its step moves the
    policy's log-probability of the demonstrated actions up."""
    from pipeline.core.config import load_section
    from pipeline.policy.config import RolloutConfig
    from pipeline.policy.model import load_policy
    from pipeline.policy.rollout import RolloutEngine
    from pipeline.policy.scoring import sequence_logprobs
    from pipeline.train.guidance import guide_failed_groups
    from pipeline.train.config import TrainConfig
    from pipeline.train.distributed import init_dist

    dist = init_dist()
    tok, records = _sampled_records(3, 4)
    assert not any(r["success"] for r in records)
    for i, r in enumerate(records):
        r["group"] = i // 4
    records[0] = {**records[0], "success": True, "return": 1.0}  # group 0 has a success: not guided
    tasks = {t.task_id: t for t in read_tasks("data/tasks/train.jsonl")}
    runtime = ShopWorld.load(Path("data/env"))
    model = load_policy("models/adapted")[0]
    engine = RolloutEngine(model, tok, runtime, load_section(EnvConfig, "env"), load_section(RolloutConfig, "rollout"))
    guided, counts = guide_failed_groups(records, tasks, engine, version=5)
    assert counts == {"groups": 3, "guided": 2, "expert_failed": 0}
    assert guided[:4] == records[:4] and guided[4:7] == records[4:7] and guided[8:11] == records[8:11]
    for i in (7, 11):
        demo = guided[i]
        assert demo["demonstrated"] and demo["success"] and demo["group"] == records[i]["group"]
        assert demo["task_id"] == records[i]["task_id"] and demo["seed"] == records[i]["seed"]
        assert demo["policy_version"] == 5

    cfg = load_section(TrainConfig, "train").model_copy(update={
        "group_size": 4, "tasks_per_update": 3, "micro_batches": 2, "lr_warmup_steps": 0, "entropy_coef": 0.0,
        "entropy_target": None, "bc_coef": 0.0, "guide_failed_groups": True})

    def step(batch_records: list[dict]) -> tuple[dict, float, dict]:
        actor, ds_engine = _sgd_learner(cfg, dist, with_value=False)
        before = {k: v.detach().clone() for k, v in actor.named_parameters()}
        lp = lambda: float(sequence_logprobs(actor.policy, guided[7]["token_ids"], guided[7]["action_mask"],  # noqa: E731
                                             segments=guided[7]["segments"]).sum())
        with torch.no_grad():
            lp0 = lp()
        mets = _learn_step(cfg, ds_engine, [dict(r) for r in batch_records], tok, dist)
        moved = sum(float((v.detach() - before[k]).abs().sum()) for k, v in actor.named_parameters())
        with torch.no_grad():
            return mets, moved, {"before": lp0, "after": lp()}

    failed = [dict(r, success=False) for r in records]
    for r in failed:  # every group zero-variance
        r["return"] = 0.0
    mets, moved, _ = step(failed)
    assert mets["rollout/zero_variance_group_share"] == 1.0 and moved == 0.0
    guided_failed, counts = guide_failed_groups(failed, tasks, engine, version=0)
    assert counts["guided"] == 3
    mets, moved, lp = step(guided_failed)
    assert mets["rollout/zero_variance_group_share"] == 0.0 and moved > 0
    # on-policy rows have ratio 1 in a one-forward step, and so do the demonstrations (not π_θ / 1)
    assert mets["offpolicy/is_weight_mean"] == pytest.approx(1.0, abs=1e-3) and np.isfinite(mets["losses/grad_norm"])
    assert lp["after"] > lp["before"]  # the demonstrated actions became more likely
    # PPO reads a guided batch too: its separate π_old forward gives the demonstrations the same weight 1
    ppo = cfg.model_copy(update={"algorithm": "ppo"})
    actor, ds_engine = _sgd_learner(ppo, dist, with_value=True)
    mets = _learn_step(ppo, ds_engine, [dict(r) for r in guided_failed], tok, dist)
    assert mets["offpolicy/is_weight_mean"] == pytest.approx(1.0, abs=1e-3) and np.isfinite(mets["losses/grad_norm"])
    runtime.close()
