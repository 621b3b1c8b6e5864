"""A switch of the RL phase on against off, with the same seeds, side by side in one table.

    python bench/switches.py --name replay --seeds 0 1 2 -S train.replay.enabled=true [-S key=value ...]

For each seed it runs the `train` stage twice from the committed adapted policy (`models/adapted`) and data (`data/`):
once with `params.yaml` as it is ("off") and once with the `-S` overrides ("on"), both on a short fixed budget
(`--updates`, validation every `--eval-every` updates on `--eval-tasks` tasks, the final greedy SFT-against-RL
comparison on `--test-tasks` test tasks; one DeepSpeed rank unless `--ranks`). It prints, per seed and on the mean,
the best validation success, the test success of the RL policy (overall, per level, the held-out wording) and the
seconds, "on" next to "off" with the difference, and writes the table as JSON to `--out` when given.

The short budget is the one the default run's own early stopping picked (its best validation came at update 20), so
a switch that helps the default should show within it; a switch whose effect needs a longer run is measured with a
larger `--updates`, and says so.

The "off" runs depend only on `params.yaml`, the seed and the budget (every switch is off by default, so code that
adds a switch leaves them as they were), so they are kept in a cache (`~/.cache/agentrl-bench/switches/`, keyed by
those and by the adapted model's hash; each entry records the hash of the training code it ran) and reused by later
comparisons; `--fresh-baseline` reruns them. Runs write only under a temporary folder; tracking goes
to a throwaway MLflow store there.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "agentrl-bench" / "switches"


def parse_override(text: str) -> tuple[list[str], object]:
    """``section.key.sub=value`` -> (["section", "key", "sub"], YAML value)."""
    if "=" not in text:
        raise SystemExit(f"error: -S {text!r}: expected key=value, e.g. -S train.replay.enabled=true")
    key, value = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(value)


def apply_overrides(params: dict, overrides: list[tuple[list[str], object]]) -> dict:
    out = copy.deepcopy(params)
    for path, value in overrides:
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = value
    return out


def code_hash() -> str:
    """Hash of the code a training run executes (pipeline/ and configs/), so a cached baseline is never reused
    across code that could train differently."""
    h = hashlib.sha256()
    for p in sorted([*(REPO / "pipeline").rglob("*.py"), *(REPO / "configs").rglob("*")]):
        if p.is_file() and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(REPO)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def adapted_hash() -> str:
    h = hashlib.sha256()
    for p in sorted((REPO / "models" / "adapted").rglob("*")):
        if p.is_file() and p.name != "policy.json":
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def budget(args, seed: int) -> dict:
    return {"seed": seed, "updates": args.updates, "eval_every": args.eval_every, "eval_tasks": args.eval_tasks,
            "test_tasks": args.test_tasks, "num_ranks": args.ranks, "checkpoint_every": 10_000,
            "early_stopping_patience": None}


def run_train(params: dict, tmp: Path, name: str) -> dict:
    """One `train` stage run with `params`; returns its figures."""
    d = tmp / name
    d.mkdir(parents=True)
    params = copy.deepcopy(params)
    params["train"]["deepspeed_config"] = str(REPO / params["train"]["deepspeed_config"])
    (d / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    args = ["--params", str(d / "params.yaml"), "--out", str(d / "policy"), "--ckpt", str(d / "ckpt"),
            "--metrics", str(d / "train.json"), "--curve", str(d / "curve.csv")]
    sys.path.insert(0, str(REPO))
    from pipeline.train.distributed import child_env, free_port
    from pipeline.train.main import launcher_command

    ranks = params["train"]["num_ranks"]
    cmd = (launcher_command(str(d / "params.yaml"), ranks, free_port(), args[2:]) if ranks > 1
           else [sys.executable, "-m", "pipeline.train.worker", *args])
    env = child_env({"MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}", "HF_HUB_OFFLINE": "1"})
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"error: run {name} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    m = json.loads((d / "train.json").read_text())
    rl = m["test"]["rl"]
    out = {"best_val": m["best_val_success"], "test": rl["overall"]["success_rate"],
           "test_sft": m["test"]["sft"]["overall"]["success_rate"], "seconds": round(seconds, 1),
           "safety_violations": rl["overall"].get("safety_violations")}
    for lv, s in sorted(rl.get("per_level", {}).items()):
        out[f"test_l{lv}"] = s["success_rate"]
    for split, name in (("template_seen", "test_seen_wordings"), ("template_unseen", "test_heldout_wording")):
        if split in rl:
            out[name] = rl[split]["success_rate"]
    # the last update's figures of every new capability (weights, multipliers, replay share, ...), for the report
    curve = (d / "curve.csv").read_text().splitlines()
    if len(curve) > 1:
        head, last = curve[0].split(","), curve[-1].split(",")
        out["last_update"] = {k: v for k, v in zip(head, last) if v and k.split("_")[0] in
                              {"reward", "replay", "explore", "taskgen", "reward_model", "population", "credit",
                               "sampling", "context", "alarms"}}
    return out


def baseline(params: dict, seed: int, tmp: Path, fresh: bool, key_extra: str) -> dict:
    key = hashlib.sha256(json.dumps([params, key_extra], sort_keys=True, default=str).encode()).hexdigest()[:20]
    path = CACHE / f"{key}.json"
    if path.exists() and not fresh:
        cached = json.loads(path.read_text())
        cached["cached"] = True
        return cached
    out = run_train(params, tmp, f"off-{seed}")
    out["measured_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out["code"] = code_hash()
    CACHE.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    return out


FIGURES = ["best_val", "test", "test_l1", "test_l2", "test_l3", "test_l4", "test_seen_wordings", "test_heldout_wording",
           "test_sft", "safety_violations", "seconds"]


def table(rows: list[tuple[int, dict, dict]]) -> str:
    figs = [f for f in FIGURES if any(f in on or f in off for _, off, on in rows)]
    lines = [f"{'figure':<20}" + "".join(f"  seed {s}: off → on (Δ)        " for s, _, _ in rows) + "  mean off → on (Δ)"]
    for f in figs:
        cells, offs, ons = [], [], []
        for _, off, on in rows:
            a, b = off.get(f), on.get(f)
            if a is None or b is None:
                cells.append(f"  {'n/a':<30}")
                continue
            offs.append(a)
            ons.append(b)
            cells.append(f"  {a:>7.3f} → {b:>7.3f} ({b - a:+.3f})      ")
        mean = (f"  {sum(offs) / len(offs):.3f} → {sum(ons) / len(ons):.3f} "
                f"({(sum(ons) - sum(offs)) / len(offs):+.3f})") if offs else ""
        lines.append(f"{f:<20}" + "".join(cells) + mean)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", required=True, help="name of the switch (for the report)")
    ap.add_argument("-S", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a params.yaml override of the 'on' runs, e.g. train.replay.enabled=true (repeatable)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--updates", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-tasks", type=int, default=200)
    ap.add_argument("--test-tasks", type=int, default=400)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--fresh-baseline", action="store_true", help="rerun the 'off' runs instead of reusing cached ones")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = ap.parse_args()
    if not (REPO / "models" / "adapted").is_dir():
        raise SystemExit("error: models/adapted not found: run `dvc repro adapt` (or `dvc pull`) first")
    overrides = [parse_override(s) for s in args.overrides]
    if not overrides:
        raise SystemExit("error: no -S override given: 'on' would equal 'off'")
    base_params = yaml.safe_load((REPO / "params.yaml").read_text())
    key_extra = adapted_hash()
    rows = []
    with tempfile.TemporaryDirectory(prefix="switches-") as t:
        tmp = Path(t)
        for seed in args.seeds:
            off_params = apply_overrides(base_params, [(["train", k], v) for k, v in budget(args, seed).items()])
            off = baseline(off_params, seed, tmp, args.fresh_baseline, key_extra)
            on = run_train(apply_overrides(off_params, overrides), tmp, f"on-{seed}")
            rows.append((seed, off, on))
            print(f"seed {seed}: off best_val {off['best_val']:.3f} test {off['test']:.3f}"
                  f"{' (cached: ' + off['measured_at'] + ', code ' + off['code'] + ')' if off.get('cached') else ''} | on best_val {on['best_val']:.3f} "
                  f"test {on['test']:.3f} | {on['seconds']:.0f}s", flush=True)
    print(f"\n{args.name}: {' '.join('-S ' + s for s in args.overrides)}; {args.updates} updates, validation on "
          f"{args.eval_tasks} tasks every {args.eval_every}, test {args.test_tasks} tasks, {args.ranks} rank(s)")
    print(table(rows))
    for seed, _, on in rows:
        if on.get("last_update"):
            print(f"seed {seed}, on, last update: {on['last_update']}")
    if args.out:
        args.out.write_text(json.dumps({"name": args.name, "overrides": args.overrides, "updates": args.updates,
                                        "runs": [{"seed": s, "off": off, "on": on} for s, off, on in rows]}, indent=1))


if __name__ == "__main__":
    main()
