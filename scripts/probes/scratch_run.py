"""Run phases of the pipeline in a scratch copy of the repository with changed params, and print what RL did.

The README's Status experiments (session 21's wordings and adapt seeds, session 22's scarce level-3 demonstrations)
were run by hand the way this script runs them (it was written after them): a copy of `params.yaml` (and `configs/`, `dvc.yaml`, `pyproject.toml`, `data/incoming/`) in a
folder of its own, a few params overridden, then `agentrl build-env`, `adapt`, `train` and `evaluate` run there one
after another. Nothing in the repository is written: data, models, metrics, checkpoints and the MLflow store land in
the scratch folder. The phases run on the installed package (`pip install -e .`), so keep the checkout they import
from in place while they run (a removed worktree lost a 45-minute run in session 21).

    python scripts/probes/scratch_run.py /tmp/l3cov12 \\
        -S build_env.demos.level_coverage.3=0.12 -S adapt.gate.min.eval/greedy/success_L3=0

`-S KEY=VALUE` sets a key by its dotted path (VALUE is read as YAML: numbers, true/false, null, lists); every
section is validated against its config model before anything runs, so a mistyped key stops here with the
config's own message. `--data-from DIR` copies another scratch folder's `data/` and skips `build-env` (the same
build params give the same bytes, so it is refused when DIR's `build_env` or `env` section differs from the new one). `--summary` only prints the summary of a finished folder. Two scratch runs side
by side on this 2-core machine oversubscribe it badly (session 22: pre-training ran about 8 times slower), so run
them one after another.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
COPIED = ("configs", "params.yaml", "dvc.yaml", "pyproject.toml", "data/incoming")
PHASES = ("build-env", "adapt", "train", "evaluate")


def set_key(params: dict, dotted: str, value) -> None:
    """Set `dotted` (section.key.sub...) in `params`; a level-keyed mapping (level_coverage, level_mix) takes int
    keys as params.yaml writes them."""
    parts = dotted.split(".")
    node = params
    for i, part in enumerate(parts):
        key = int(part) if part.isdigit() and isinstance(node, dict) and int(part) in node else part
        if i == len(parts) - 1:
            node[key] = value
            return
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]


def validate(params: dict) -> None:
    from params_table import SECTIONS  # noqa: PLC0415 (scripts/ on the path above)

    from pipeline.core.config import ConfigError, parse_section  # noqa: PLC0415

    unknown = sorted(set(params) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"unknown params.yaml section(s) {unknown}; sections: {sorted(SECTIONS)}")
    for name, model in SECTIONS.items():
        try:
            parse_section(model, params.get(name), f"params.yaml:{name}")
        except ConfigError as exc:
            raise SystemExit(str(exc)) from None


def summary(folder: Path) -> str:
    """Test success SFT -> RL overall and per level from metrics/train.json, per family and wording (seen / held-out)
    from metrics/evaluate.json, and the adapt stage's validation figures from metrics/adapt.json."""
    out = []
    adapt = folder / "metrics/adapt.json"
    if adapt.is_file():
        a = json.loads(adapt.read_text())
        levels = " ".join(f"L{lv} {g['greedy_success']:.2f}/{g['sampled_success']:.2f}"
                          for lv, g in a["per_level"].items())
        out.append(f"adapt: validation greedy/sampled {levels}; demonstrations per level "
                   f"{a['sft']['examples_per_level']}; {a['seconds']['total']:.0f} s")
    train = folder / "metrics/train.json"
    if train.is_file():
        t = json.loads(train.read_text())
        sft, rl = t["test"]["sft"], t["test"]["rl"]
        per = ", ".join(f"L{lv} {sft['per_level'][lv]['success_rate']:.3f}->{rl['per_level'][lv]['success_rate']:.3f}"
                        for lv in sft["per_level"])
        out.append(f"train: test SFT {sft['overall']['success_rate']:.3f} -> RL {rl['overall']['success_rate']:.3f}"
                   f" ({per}); safety violations {sft['overall']['safety_violations']} -> "
                   f"{rl['overall']['safety_violations']}; best update {t['best_update']}; {t['seconds']:.0f} s")
    evaluate = folder / "metrics/evaluate.json"
    if evaluate.is_file():
        e = json.loads(evaluate.read_text())
        fams: dict[str, list[str]] = defaultdict(list)
        for policy, flags in sorted(e["flags"].items(), key=lambda kv: kv[0] != "sft"):
            for fam, g in (flags["unseen_templates"].get("per_family") or {}).items():
                cell = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
                fams[fam].append(f"{policy} {cell(g['seen_success'])}/{cell(g['unseen_success'])}")
        out.append("evaluate: test success per family, seen/held-out wording: "
                   + "; ".join(f"{fam} {', '.join(v)}" for fam, v in fams.items()))
    return "\n".join(out) if out else f"{folder}: no metrics yet"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="scratch folder (created; must not exist unless --summary)")
    ap.add_argument("-S", "--set", action="append", default=[], metavar="KEY=VALUE", help="override a param")
    ap.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    ap.add_argument("--data-from", type=Path, help="copy data/ from this scratch folder and skip build-env")
    ap.add_argument("--summary", action="store_true", help="only print the summary of a finished folder")
    args = ap.parse_args(argv)
    if args.summary:
        if not args.folder.is_dir():
            raise SystemExit(f"--summary {args.folder}: no such folder")
        print(summary(args.folder))
        return 0
    if args.folder.exists():
        raise SystemExit(f"{args.folder} exists: pick a new scratch folder (nothing is overwritten)")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"-S {item!r}: expected KEY=VALUE, e.g. -S train.updates=200")
        set_key(params, key, yaml.safe_load(raw))
    validate(params)
    phases = list(args.phases)
    if args.data_from is not None:
        if not (args.data_from / "data/tasks").is_dir() or not (args.data_from / "params.yaml").is_file():
            raise SystemExit(f"--data-from {args.data_from}: no data/tasks or params.yaml there")
        theirs = yaml.safe_load((args.data_from / "params.yaml").read_text()) or {}
        differ = [sec for sec in ("build_env", "env") if theirs.get(sec) != params.get(sec)]
        if differ:
            raise SystemExit(f"--data-from {args.data_from}: its params.yaml differs in {differ}, so its data is not "
                             f"what these params build; drop --data-from or the build_env/env overrides")
        phases = [p for p in phases if p != "build-env"]
    args.folder.mkdir(parents=True)
    for rel in COPIED:
        src, dst = ROOT / rel, args.folder / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)
    if args.data_from is not None:
        for sub in ("env", "tasks", "demos"):
            shutil.copytree(args.data_from / "data" / sub, args.folder / "data" / sub)
    (args.folder / "params.yaml").write_text(
        "# scratch copy of params.yaml; overrides: " + " ".join(args.set) + "\n"
        + yaml.safe_dump(params, sort_keys=False))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    agentrl = Path(sys.executable).with_name("agentrl")
    for phase in phases:
        print(f"== {phase} in {args.folder}", flush=True)
        rc = subprocess.call([str(agentrl), phase], cwd=args.folder, env=env)
        if rc != 0:
            print(f"{phase} failed (exit {rc}); later phases not run", file=sys.stderr)
            print(summary(args.folder))
            return rc
    print(summary(args.folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
