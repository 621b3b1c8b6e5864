"""One measurement point of bench/scale.py, run in its own process so that its peak memory is its own.

    python bench/scale_points.py SECTION '{"x": ..., ...}'

prints one line ``RESULT {json}``: ``times`` (seconds per measured part), ``work`` (what each part has to process at
this size: rows, bytes, tokens, FLOPs; bench/scale.py fits the slope the work implies from it) and ``peak_mib`` (the
largest resident set of this process or of any child it waited for). Each section's function below builds its
inputs outside the timed parts; imports that cost a constant (Great Expectations, torch, DeepSpeed) are done before
the clock starts, so the curves show the cost that grows with the work.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
if str(REPO / "bench") not in sys.path:
    sys.path.insert(0, str(REPO / "bench"))


def _timed(fn, *args, **kwargs):
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t


def peak_mib() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, kids) / 1024


def _warm_gx() -> None:
    import great_expectations  # noqa: F401  (a constant ~10 s import on this machine; not part of any curve)


# ------------------------------------------------------------------------------------------------------- build_env
def build_env(p: dict) -> dict:
    """The phase `build` on `train` training tasks (validation and test a tenth each) and `products` products;
    its own clock splits generation (world, tasks, demonstrations), validation (every GX suite) and the rest
    (probes, expert/random baselines on every split, checksums, publishing)."""
    from pipeline.build_env.config import BuildEnvConfig
    from pipeline.build_env.main import build
    from pipeline.envs.config import EnvConfig

    _warm_gx()
    train = int(p["train"])
    small = max(1, train // 10)
    cfg = BuildEnvConfig(tasks_per_split={"train": train, "validation": small, "test": small},
                         options={"n_products": int(p["products"]), "n_suppliers": int(p.get("suppliers", 80))})
    with tempfile.TemporaryDirectory() as tmp:
        m = build(cfg, EnvConfig(), Path(tmp) / "data", Path(tmp) / "build_env.json")
    s, c = m["seconds"], m["counts"]
    tasks = c["tasks_train"] + c["tasks_validation"] + c["tasks_test"]
    world_rows = sum(v for k, v in c.items() if not k.startswith("tasks_") and k != "demos")
    return {"times": {"generate": s["generate"], "validate": s["validate"], "total": s["total"]},
            "work": {"generate": world_rows + tasks + c["demos"], "validate": m["validation"]["rows"],
                     "total": world_rows + tasks + c["demos"]},
            "info": {"tasks": tasks, "demos": c["demos"], "validated_rows": m["validation"]["rows"], **c}}


# ----------------------------------------------------------------------------------------------------- check_drift
def check_drift(p: dict) -> dict:
    """`n` current trajectories in the format check_drift reads (`check_drift.current_trajectories`: run_episode
    records as a deployed policy logs them, JSON Lines) against `n` reference episodes (a demonstrations-like file,
    read unchecked as the phase reads data/demos/train.jsonl), both loaded as the phase loads them
    (pipeline.check_drift.main.load_episodes: reading, and for the current file its "trajectories" suite), then the
    behaviour-drift test (trajectory_drift: features and per-feature tests). The records are resampled from expert
    and random episodes played on 200 generated tasks (as bench/drift.py does; 80/20 expert/random for the
    reference, 70/30 current)."""
    from drift import base_episodes, resample

    from pipeline.check_drift.checks import trajectory_drift
    from pipeline.check_drift.config import DriftConfig
    from pipeline.check_drift.main import load_episodes
    from pipeline.envs.config import EnvConfig
    from pipeline.envs.shop import ShopWorld
    from pipeline.envs.shop.world import generate_world

    _warm_gx()
    n = int(p["n"])
    world = ShopWorld(generate_world(0, 400, 80, 0.3))
    _, expert, rand = base_episodes(world, 200, seed=1)
    for r in expert + rand:  # a served policy's log: no rollout token fields
        for k in ("token_ids", "action_mask", "logprobs"):
            r.pop(k, None)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"reference": Path(tmp) / "reference.jsonl", "current": Path(tmp) / "current.jsonl"}
        for (name, path), (share, seed) in zip(paths.items(), ((0.8, 2), (0.7, 3))):
            with path.open("w") as f:
                for r in resample(expert, rand, n, share, seed=seed):
                    f.write(json.dumps(r) + "\n")
        del expert, rand
        size = paths["current"].stat().st_size
        current, t_cur = _timed(load_episodes, paths["current"], "current trajectories", EnvConfig(), world)
        reference, t_ref = _timed(load_episodes, paths["reference"], "demonstrations", EnvConfig(), world, suite=None)
        drift, t_drift = _timed(trajectory_drift, reference, current, DriftConfig())
    world.close()
    return {"times": {"load_current": t_cur, "load_reference": t_ref, "drift_test": t_drift,
                      "total": t_cur + t_ref + t_drift},
            "work": {"load_current": n, "load_reference": n, "drift_test": 2 * n, "total": 2 * n},
            "info": {"file_bytes": size, "drifted": drift.drifted_features}}


# ---------------------------------------------------------------------------------------------------------- rl
RL_YAML = """
env:
  max_steps: {max_steps}
rollout:
  max_new_tokens: {max_new_tokens}
  batch_size: 64
train:
  updates: {updates}
  tasks_per_update: {tasks}
  group_size: {group}
  num_ranks: {ranks}
  checkpoint_every: 1000
  eval_every: 1000
  eval_tasks: 4
  test_tasks: 4
  incoming_tasks: null
  deepspeed_config: {repo}/configs/deepspeed_zero2.json
"""


def rl_project(root: Path) -> None:
    """A small shop project (40 products, 48 training tasks) under `root`/data, shared by every RL point."""
    from pipeline.build_env.config import BuildEnvConfig
    from pipeline.build_env.main import build
    from pipeline.envs.config import EnvConfig

    cfg = BuildEnvConfig(options={"n_products": 40, "n_suppliers": 10},
                         tasks_per_split={"train": 48, "validation": 8, "test": 8})
    build(cfg, EnvConfig(), root / "data", root / "metrics" / "build_env.json")


def rl(p: dict) -> dict:
    """`updates` RL updates (pipeline.train.worker, the stage's own process; the DeepSpeed launcher for 2 ranks) of a
    randomly initialised built-in policy of width `d_model` (4 layers, d_ff = 2.625·d_model as the default's
    672/256) on `tasks` tasks × `group` rollouts per update; rollout and learner seconds per update from the stage's
    own curve (sys_rollout_s, sys_learn_s), the first update left out as warm-up."""
    import torch

    from pipeline.envs.shop import ShopWorld
    from pipeline.policy.config import ModelConfig
    from pipeline.policy.model import build_policy, n_parameters, save_policy
    from pipeline.policy.tokenizer import corpus_texts, train_tokenizer
    from pipeline.train.distributed import child_env, free_port
    from pipeline.train.main import launcher_command

    shared = Path(p["project"])
    d = int(p["d_model"])
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "data").symlink_to(shared / "data", target_is_directory=True)
        world = ShopWorld.load(shared / "data" / "env")
        sigs = [s.signature() for s in world.tools()]
        world.close()
        tok = train_tokenizer(corpus_texts(shared / "data", sigs), vocab_size=512)
        torch.manual_seed(0)
        model = build_policy(ModelConfig(d_model=d, d_ff=int(2.625 * d), max_positions=1024), tok)
        n_params = n_parameters(model)
        save_policy(model, tok, root / "models" / "adapted", {"note": "random policy of bench/scale.py"})
        del model
        (root / "params.yaml").write_text(RL_YAML.format(
            updates=p["updates"], tasks=p["tasks"], group=p["group"], ranks=p["ranks"], repo=REPO,
            max_steps=p.get("max_steps", 4), max_new_tokens=p.get("max_new_tokens", 16)))
        args = ["--out", "out/policy", "--ckpt", "out/ckpt", "--metrics", "out/train.json", "--curve", "out/curve.csv"]
        if int(p["ranks"]) > 1:
            cmd = launcher_command("params.yaml", int(p["ranks"]), free_port(), args)
        else:
            cmd = [sys.executable, "-m", "pipeline.train.worker", "--params", "params.yaml", *args]
        env = child_env({"MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}", "PYTHONUNBUFFERED": "1"})
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"train failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        lines = (root / "out" / "curve.csv").read_text().splitlines()
    head = lines[0].split(",")
    rows = [dict(zip(head, r.split(","))) for r in lines[2:]]  # the first update warms up
    k = max(1, len(rows))
    roll = sum(float(r["sys_rollout_s"]) for r in rows) / k
    learn = sum(float(r["sys_learn_s"]) for r in rows) / k
    tokens = sum(int(r["train_batch_tokens"]) for r in rows) / k
    # the update's work: forward FLOPs ∝ parameters × tokens (the learner's 6·N·T, the rollouts' 2·N per token)
    w = n_params * tokens
    return {"times": {"rollout": roll, "learner": learn, "update": roll + learn},
            "work": {"rollout": w, "learner": w, "update": w},
            "info": {"n_params": n_params, "tokens_per_update": tokens, "updates_timed": len(rows)}}


# ------------------------------------------------------------------------------------------------ orchestration
def _data(folder: Path, mib: int) -> None:
    """`mib` files of 1 MiB of random bytes (incompressible, all distinct: every byte must be hashed)."""
    folder.mkdir(parents=True)
    for i in range(mib):
        (folder / f"part-{i:05d}.bin").write_bytes(os.urandom(1 << 20))


NOOP_STAGE = """stages:
  noop:
    cmd: python -c "open('out.txt', 'w').write('done')"
    deps:
      - data
    outs:
      - out.txt
"""


def orchestration(p: dict) -> dict:
    """Orchestration around a phase that does nothing, on `mib` MiB of data: DVC (`dvc repro` of a no-op stage that
    depends on the data: hashing it; `dvc status` right after, on DVC's state cache; `dvc status` after every file's
    mtime changed: hashing again; `dvc commit -f` of the data as a tracked output via `dvc add`), an MLflow run that
    logs the phase's params and metrics and the data folder as artefacts (pipeline.core.tracking, SQLite store), and a
    Prefect flow run of a task that receives the data's path and does nothing (a temporary local server, as `agentrl
    run` uses; its start-up is left out: the second flow run is timed)."""
    mib = int(p["mib"])
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    times: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _data(root / "data", mib)
        run = lambda *cmd: subprocess.run(cmd, cwd=root, env=env, check=True, capture_output=True, text=True)  # noqa: E731
        run("git", "init", "-q")
        run("dvc", "init", "-q")
        (root / "dvc.yaml").write_text(NOOP_STAGE)
        _, times["dvc_repro"] = _timed(run, "dvc", "repro", "-q")
        _, times["dvc_status"] = _timed(run, "dvc", "status", "-q")
        later = time.time() + 5
        for f in (root / "data").iterdir():
            os.utime(f, (later, later))
        _, times["dvc_status_rehash"] = _timed(run, "dvc", "status", "-q")
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root / 'mlflow.db'}"
        from pipeline.core.tracking import Tracker

        tracker = Tracker()

        def log() -> None:
            with tracker.run("noop", params={"size_mib": mib}) as r:
                r.log_metrics({"noop/seconds": 0.0})
                for f in sorted((root / "data").iterdir()):
                    r.log_artifact(str(f), "data")

        with tracker.run("warm-up", params={}):  # creates the store and the experiment: not part of the curve
            pass
        _, times["mlflow_log"] = _timed(log)
        times["prefect_flow"] = _prefect(root, str(root / "data"))
    per_file = mib << 20
    return {"times": times,
            "work": {"dvc_repro": per_file, "dvc_status": 1, "dvc_status_rehash": per_file, "mlflow_log": per_file,
                     "prefect_flow": 1},
            "info": {"bytes": per_file}}


def _prefect(root: Path, data: str) -> float:
    os.environ["PREFECT_HOME"] = str(root / ".prefect")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect import flow, task

    @task
    def noop_phase(path: str) -> str:
        return path

    @flow(name="noop-phase")
    def noop_flow(path: str) -> str:
        return noop_phase(path)

    noop_flow(data)  # starts the temporary server
    _, t = _timed(noop_flow, data)
    return t


# -------------------------------------------------------------------------------------------- thin wrappers
def sft(p: dict) -> dict:
    """bench/sft_throughput.py's own measurement (its `train_child`: pipeline.adapt.sft.train_lm on the default model)
    at sequence length `seq`, full fine-tuning, eager, fp32, run in this point's process; and its matmul peak,
    measured right after in the same process."""
    import sft_throughput as S
    from pipeline.policy.tokenizer import BOS, EOS, PAD

    class Tokenizer(S._FakeTokenizer):  # the policy now asks its tokenizer for bos/eos as well as pad
        pad_token, bos_token, eos_token = PAD, BOS, EOS

    S._FakeTokenizer = Tokenizer

    class Box:  # train_child reports through a queue's put
        def put(self, value):
            self.value = value

    threads, box = int(p.get("threads", 1)), Box()
    S.train_child(box, "fp32", "full", int(p["steps"]), int(p["batch"]), int(p["seq"]), threads, 1000, 1, False)
    row = box.value
    peak = S.matmul_peak("fp32", threads)["flops"]
    flops = (row["model_flops_per_s"] + row["attn_flops_per_s"]) * row["seconds"]
    return {"times": {"train_steps": row["seconds"]}, "work": {"train_steps": flops},
            "info": {"utilisation": row["model_flops_per_s"] / peak, "tokens_per_s": row["tokens_per_s"],
                     "peak_gflops": peak / 1e9}}


def rollout(p: dict) -> dict:
    """bench/rollout.py's own worker: the rollout engine and the generate-per-turn baseline on `episodes` episodes
    (random weights, or the trained policy `policy` on data/tasks/validation.jsonl)."""
    times, work, info = {}, {}, {}
    for method in ("engine", "generate_turn"):
        cmd = [sys.executable, str(REPO / "bench" / "rollout.py"), "--worker", method, "fp32",
               "--episodes", str(p["episodes"]), "--threads", "1"] + (["--policy", p["policy"]] if p.get("policy") else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=p.get("cwd") or REPO,
                              env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            raise SystemExit(f"bench/rollout.py {method} failed:\n{proc.stderr[-3000:]}")
        r = json.loads(line[len("RESULT "):])
        times[method], work[method] = r["seconds"], r["tokens"]
        info[f"{method}_tokens_per_s"] = r["tokens"] / r["seconds"]
    return {"times": times, "work": work, "info": info}


SECTIONS = {"build_env": build_env, "check_drift": check_drift, "rl": rl, "orchestration": orchestration,
            "sft": sft, "rollout": rollout}


def main() -> None:
    section, params = sys.argv[1], json.loads(sys.argv[2])
    out = SECTIONS[section](params)
    out["peak_mib"] = peak_mib()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
