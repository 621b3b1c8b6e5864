"""Benchmark: the drift verdict's false-alarm rate on drift-free data and its power on each known shift, per environment.

For each environment (built as `build_env` builds it, default options, the build's level mix, into a temporary
folder) the reference is the built training split. Then, with a new seed each time:

- ``--samples`` drift-free current samples: ``--current`` tasks drawn from the same generator as the split was drawn
  (a uniform subsample of a split-sized draw, :func:`pipeline.check_drift.checks.make_reference_sample`'s
  ``drawn_as``), so reference and current come from one distribution;
- ``--samples`` shifted current samples per known shift of the environment
  (:data:`pipeline.check_drift.checks.DRIFT_KINDS`: ``level_shift`` everywhere, ``value_shift`` where the environment
  has :meth:`value_shifted`);
- optionally (``--batch``) ``--samples`` current samples of ``--current`` tasks drawn on their own, as the validation
  split or an incoming batch is drawn: not the reference's distribution where the generator draws distinct tasks
  from a bounded space (the SQL analyst), printed apart as what the pipeline meets with its validation stand-in.

Each sample gets the whole verdict of the phase (:func:`pipeline.check_drift.main.run_checks`, its seed the sample's
index): the task check, the calibration (``--repeats`` fresh split-sized draws), and the hidden-state MMD test on a
small randomly initialised Llama (``--hidden``, the tasks' reset observations; the cost of the test does not depend
on training, and a random network's hidden states still separate different questions), judged together by the
family rule at ``--alpha``. The behaviour check needs rollouts and is left out (episodes cost far more than the
statistics). Prints per environment the false-alarm rate (goal <= 0.05) and the power per shift (goal >= 0.9), each
with a 95 % Wilson interval, and which checks fired.

    python bench/drift_calibration.py                  # 40 samples per case, reference 4000, current 400, 20 repeats
    python bench/drift_calibration.py --small          # reference 1000, current 200, 2 repeats: 3-10 min per
                                                       # environment on a busy 2-core machine
    python bench/drift_calibration.py --envs shop,sql,calendar --samples 40 --batch
"""

from __future__ import annotations

import argparse
import collections
import math
import tempfile
import time
from pathlib import Path

import torch

from pipeline.check_drift import checks as C
from pipeline.check_drift.config import DriftConfig
from pipeline.envs.config import EnvConfig

GOAL_FALSE_ALARM = 0.05
GOAL_POWER = 0.9
LEVEL_MIX = {1: 0.25, 2: 0.25, 3: 0.25, 4: 0.25}
SEED_BASE = {"same": 10_000, "batch": 20_000, **{k: 30_000 + 1000 * i for i, k in enumerate(sorted(C.DRIFT_KINDS))}}


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a rate k / n."""
    if not n:
        return float("nan"), float("nan")
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def build(name: str, out: Path, n_ref: int, n_cur: int):
    """The environment built as build_env builds it (seed 0, default options); returns (world, options, train)."""
    from pipeline.envs.contract import BuildRequest
    from pipeline.envs.registry import environment_class, open_environment

    out.mkdir(parents=True, exist_ok=True)
    cls = environment_class(name)
    options = cls.Options()
    result = cls.build(out, BuildRequest(0, {"train": n_ref, "validation": n_cur, "test": n_cur}, dict(LEVEL_MIX),
                                         options))
    return open_environment(name, out), options, [t.to_dict() for t in result.tasks["train"]]


def tiny_policy(tasks: list[dict], world):
    """A small random Llama and a tokenizer trained on the reference observations (the hidden-state check's model)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.check_drift.features import observation_contexts, tool_signatures
    from pipeline.check_drift.main import Policy
    from pipeline.policy.tokenizer import marker_ids, train_tokenizer

    contexts = observation_contexts(tasks[:500], None, EnvConfig().history_window, tool_signatures(world))
    tok = train_tokenizer(contexts, vocab_size=400)
    ids = marker_ids(tok)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"], pad_token_id=ids["<pad>"],
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    return Policy(LlamaForCausalLM(config).eval(), tok, "random tiny Llama")


def shifts(world) -> list[str]:
    """The known shifts this environment supports."""
    return [k for k in C.DRIFT_KINDS if k != "value_shift" or world.value_shifted(0) is not None]


def run_case(args, world, options, reference, policy, kind: str) -> tuple[int, int, collections.Counter, float]:
    """(verdicts that failed, samples, checks that failed, seconds) over ``args.samples`` current samples of `kind`."""
    from pipeline.check_drift.main import run_checks

    fired = 0
    by_check: collections.Counter = collections.Counter()
    t = time.perf_counter()
    for k in range(args.samples):
        seed = SEED_BASE[kind] + k
        if kind == "same":
            sample = C.make_reference_sample(world, args.current, seed, LEVEL_MIX, options=options,
                                             drawn_as=len(reference))
        elif kind == "batch":
            sample = C.make_reference_sample(world, args.current, seed, LEVEL_MIX, options=options)
        else:
            sample = C.make_drifted_tasks(world, args.current, kind, seed, LEVEL_MIX, options=options)
        cfg = DriftConfig(alpha=args.alpha, seed=k, false_alarm_repeats=args.repeats,
                          false_alarm_sample_size=args.current, mmd_permutations=args.permutations,
                          max_hidden_samples=args.hidden_samples, consistency_probes=8)
        verdict = run_checks(cfg, EnvConfig(), dict(LEVEL_MIX), options, reference, sample.tasks, world, sample.world,
                             policy, None, [], "none", [], "none")
        fired += int(not verdict["passed"])
        by_check.update(verdict["failed_checks"])
    return fired, args.samples, by_check, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--envs", default="shop,sql", help="comma-separated environment names (shop, sql, calendar)")
    ap.add_argument("--samples", type=int, default=40, help="current samples per case (drift-free, each shift)")
    ap.add_argument("--reference", type=int, default=4000, help="tasks in the reference (training) split")
    ap.add_argument("--current", type=int, default=400, help="tasks per current sample")
    ap.add_argument("--repeats", type=int, default=DriftConfig().false_alarm_repeats,
                    help="calibration repeats per verdict (check_drift.false_alarm_repeats)")
    ap.add_argument("--alpha", type=float, default=DriftConfig().alpha, help="the verdict's family level")
    ap.add_argument("--permutations", type=int, default=DriftConfig().mmd_permutations)
    ap.add_argument("--hidden-samples", type=int, default=200, help="observations per side of the MMD test")
    ap.add_argument("--no-hidden", dest="hidden", action="store_false", help="leave the hidden-state check out")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the hidden-state embedding)")
    ap.add_argument("--batch", action="store_true", help="also current samples drawn on their own (see above)")
    ap.add_argument("--cases", default=None,
                    help="comma-separated cases to run (same, batch, level_shift, value_shift); default: all")
    ap.add_argument("--small", action="store_true",
                    help="reference 1000, current 200, 2 calibration repeats, 100 hidden samples (minutes, not hours)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)  # tiny forward passes: more threads on a shared machine only contend
    if args.small:
        args.reference, args.current, args.repeats, args.hidden_samples = 1000, 200, 2, 100
    print(f"settings: {args.samples} samples per case, reference {args.reference}, current {args.current}, "
          f"calibration repeats {args.repeats}, alpha {args.alpha}, MMD "
          f"{f'{args.hidden_samples} observations, {args.permutations} permutations' if args.hidden else 'off'}")
    for name in args.envs.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            world, options, reference = build(name, Path(tmp) / "env", args.reference, args.current)
            policy = tiny_policy(reference, world) if args.hidden else None
            cases = [c for c in ("same", *(["batch"] if args.batch else []), *shifts(world))
                     if args.cases is None or c in args.cases.split(",")]
            for kind in cases:
                fired, n, by_check, seconds = run_case(args, world, options, reference, policy, kind)
                lo, hi = wilson(fired, n)
                what, goal = (("false-alarm rate", f"goal <= {GOAL_FALSE_ALARM}") if kind == "same" else
                              ("false-alarm rate (batch drawn alone)", "not exchangeable where draws deplete")
                              if kind == "batch" else (f"power on {kind}", f"goal >= {GOAL_POWER}"))
                fired_by = ", ".join(f"{c} {v}" for c, v in sorted(by_check.items())) or "none"
                print(f"{name:9s} {what}: {fired}/{n} = {fired / n:.3f} (95 % {lo:.3f}-{hi:.3f}; {goal}); "
                      f"checks fired: {fired_by}; {seconds:.0f}s")
            world.close()


if __name__ == "__main__":
    main()
