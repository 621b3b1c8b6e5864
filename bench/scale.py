"""How each phase's cost grows with the size of its work: log-log slopes against the slope the work implies.

    python bench/scale.py [--only NAME ...] [--full] [--json OUT] [--plots DIR] [--policy DIR]

Sections (``--only`` picks some; default: build_env, check_drift, rl, orchestration; ``sft`` and ``rollout`` are thin
wrappers around bench/sft_throughput.py and bench/rollout.py, run when named):

- ``build_env``: the phase's generation (world, tasks, demonstrations), its Great Expectations validation and its
  total, against the number of tasks (train 1k, 4k, 10k; ``--full``: 4k, 40k, 400k; validation and test a tenth
  each) and against the number of products in the world (100, 300, 1200: the most distinct names the shop
  generates; at 500 training tasks);
- ``check_drift``: loading a current trajectory file as the phase does (reading and its "trajectories" suite), a
  reference file of the same size (read unchecked, as the demonstrations are) and the behaviour-drift test, against
  the number of trajectories (10k, 31.6k, 100k; ``--full`` up to 1M);
- ``rl``: rollout and learner seconds per RL update (pipeline.train.worker) against the group size, the tasks per
  update, the policy's width (d_model 256, 512, 1024) and the DeepSpeed ranks (1, 2);
- ``orchestration``: DVC (repro, status, status after a touch), MLflow (a run logging the data) and a Prefect flow
  run around a phase that does nothing, against the data size (16, 64, 256 MiB; ``--full`` up to 1 GiB);
- ``sft``: SFT seconds for a fixed number of steps against the sequence length (bench/sft_throughput.py's child);
- ``rollout``: the rollout engine and generate/turn against the number of episodes (bench/rollout.py's worker).

Every point runs in its own process (bench/scale_points.py), so its peak RSS is its own. For each series and part,
the slope of log(seconds) on log(size) is fitted, and so is the slope of log(work) on log(size), where the work is
what the part must process at that size (rows, bytes, parameters × tokens, FLOPs: scale_points.py says which). The
verdict: ``DEFECT`` when the time's slope exceeds the work's by 0.2 or more while the largest point takes at least
0.5 s (below that, fixed costs and noise dominate); ``sublinear`` when it is 0.2 or more below (fixed costs not yet
amortised); else ``as work``. For the ranks series the implied slope is one rank's share of the work (-1), and the
verdict says whether 2 ranks sped the update up (``speed-up``), did not, or slowed it (a defect only with free
cores). The machine is shared: the load average is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
POINTS = REPO / "bench" / "scale_points.py"
MARGIN = 0.2  # slope excess that counts as worse than the work (a 10× larger input costing ≥ 1.6× more than it should)
MIN_SECONDS = 0.5  # below this at the largest point, a slope says more about fixed costs and noise than about growth


def series(section: str, full: bool, policy: str | None) -> list[tuple[str, str, list[tuple[float, dict]]]]:
    """(series name, what x is, [(x, point parameters)]) of a section."""
    if section == "build_env":
        trains = [4000, 40_000, 400_000] if full else [1000, 4000, 10_000]
        return [("build_env/tasks", "tasks (all splits)", [(t * 1.2, {"train": t, "products": 400}) for t in trains]),
                ("build_env/products", "products", [(n, {"train": 500, "products": n}) for n in (100, 300, 1200)])]
    if section == "check_drift":
        ns = [10_000, 31_623, 100_000, 316_228, 1_000_000] if full else [10_000, 31_623, 100_000]
        return [("check_drift/trajectories", "trajectories", [(n, {"n": n}) for n in ns])]
    if section == "rl":
        base = {"tasks": 2, "group": 2, "d_model": 256, "ranks": 1, "updates": 3}
        big = [2, 4, 8, 16] if full else [2, 4, 8]
        return [("rl/group", "group size", [(g, {**base, "group": g}) for g in big]),
                ("rl/tasks", "tasks per update", [(t, {**base, "tasks": t}) for t in big]),
                ("rl/width", "d_model", [(d, {**base, "d_model": d}) for d in (256, 512, 1024)]),
                ("rl/ranks", "DeepSpeed ranks", [(r, {**base, "tasks": 4, "group": 4, "ranks": r}) for r in (1, 2)])]
    if section == "orchestration":
        sizes = [16, 64, 256, 1024] if full else [16, 64, 256]
        return [("orchestration/data", "data MiB", [(m, {"mib": m}) for m in sizes])]
    if section == "sft":
        seqs = [64, 128, 256, 512] if full else [64, 128, 256]
        return [("sft/seq", "sequence length", [(s, {"seq": s, "steps": 3, "batch": 8}) for s in seqs])]
    if section == "rollout":
        eps = [16, 32, 64, 128] if full else [16, 32, 64]
        extra = {"policy": policy} if policy else {}
        return [("rollout/episodes", "episodes", [(e, {"episodes": e, **extra}) for e in eps])]
    raise ValueError(section)


DEFAULT = ("build_env", "check_drift", "rl", "orchestration")
ALL = (*DEFAULT, "sft", "rollout")


def run_point(section: str, params: dict, env: dict) -> dict:
    proc = subprocess.run([sys.executable, str(POINTS), section, json.dumps(params)], capture_output=True, text=True,
                          env=env, cwd=REPO)
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{section} {params} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(line[len("RESULT "):])


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log y on log x (None with fewer than two usable points)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx, my = sum(p[0] for p in pts) / len(pts), sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx else None


def verdict(fit: float | None, implied: float | None, largest: float, parallel: bool = False) -> str:
    """See the module docstring. A `parallel` series (x: ranks sharing one update) compares the time with the same
    total work: slower counts as a defect only where each rank had a free core (load below cores − ranks)."""
    if fit is None or implied is None:
        return "n/a"
    if parallel:
        if fit <= -MARGIN:
            return "speed-up"
        if fit < MARGIN:
            return "no speed-up"
        free = (os.cpu_count() or 1) - os.getloadavg()[0]
        return "DEFECT" if free >= 2 else f"slower (cores busy: {free:.1f} free)"
    if fit >= implied + MARGIN:
        return "DEFECT" if largest >= MIN_SECONDS else "noise (fast)"
    if fit <= implied - MARGIN:
        return "sublinear"
    return "as work"


def analyse(name: str, xlabel: str, points: list[tuple[float, dict]]) -> list[dict]:
    """One row per part of the series: sizes, seconds, peak RSS, fitted and implied slopes, verdict. For ranks, the
    implied slope is that of one rank's share of the work (-1: ideal parallel scaling)."""
    xs = [x for x, _ in points]
    rows = []
    for part in points[0][1]["times"]:
        ts = [r["times"][part] for _, r in points]
        ws = [r["work"].get(part) for _, r in points]
        fit = slope(xs, ts)
        implied = slope(xs, ws) if all(w is not None for w in ws) else None
        rows.append({"series": name, "x_label": xlabel, "part": part, "x": xs, "seconds": ts,
                     "peak_mib": [r["peak_mib"] for _, r in points], "work": ws, "slope": fit,
                     "implied_slope": implied, "verdict": verdict(fit, implied, max(ts), name == "rl/ranks"),
                     "info": [r.get("info", {}) for _, r in points]})
    return rows


def fmt_size(x: float) -> str:
    return f"{x / 1e6:g}M" if x >= 1e6 else f"{x / 1e3:g}k" if x >= 1e4 else f"{x:g}"


def print_rows(rows: list[dict]) -> None:
    print(f"{'series':26s} {'part':18s} {'sizes':>22s} {'seconds':>28s} {'peak MiB':>18s} {'slope':>6s} "
          f"{'work':>6s}  verdict")
    for r in rows:
        f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        print(f"{r['series']:26s} {r['part']:18s} {' '.join(fmt_size(x) for x in r['x']):>22s} "
              f"{' '.join(f'{t:.3g}' for t in r['seconds']):>28s} "
              f"{' '.join(f'{m:.0f}' for m in r['peak_mib']):>18s} {f(r['slope']):>6s} {f(r['implied_slope']):>6s}  "
              f"{r['verdict']}")


def plot(rows: list[dict], path: Path, title: str, labels: dict[str, str] | None = None, memory: bool = False) -> None:
    """Log-log plot, one panel per series: each part's points and fitted line, slopes in the legend; with `memory`,
    one more panel per series: the points' peak RSS, one curve per run (before and after a fix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(dict.fromkeys(r["series"] for r in rows))
    panels = len(names) * (2 if memory else 1)
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 3.6), squeeze=False)
    if memory:
        for ax, name in zip(axes[0][len(names):], names):
            runs = {r.get("run", ""): r for r in rows if r["series"] == name}  # peak RSS is per point, not per part
            for run, r in runs.items():
                ax.loglog(r["x"], r["peak_mib"], "o-", ms=4, label=f"{(labels or {}).get(run, run)}peak RSS")
            ax.set_title(f"{name}: peak RSS", fontsize=9)
            ax.set_xlabel(r["x_label"], fontsize=8)
            ax.set_ylabel("MiB", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.legend(fontsize=6)
    for ax, name in zip(axes[0], names):
        for r in (r for r in rows if r["series"] == name):
            x, t = np.array(r["x"], float), np.array(r["seconds"], float)
            keep = t > 0
            lbl = (labels or {}).get(r.get("run", ""), "")
            (line,) = ax.loglog(x[keep], t[keep], "o", ms=4)
            if r["slope"] is not None and keep.sum() >= 2:
                b = np.mean(np.log(t[keep])) - r["slope"] * np.mean(np.log(x[keep]))
                imp = "-" if r["implied_slope"] is None else f"{r['implied_slope']:.2f}"
                ax.loglog(x[keep], np.exp(b) * x[keep] ** r["slope"], "-", color=line.get_color(),
                          label=f"{lbl}{r['part']}: slope {r['slope']:.2f} (work {imp})")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(rows[[r["series"] for r in rows].index(name)]["x_label"], fontsize=8)
        ax.set_ylabel("seconds", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def compare(before: list[dict], after: list[dict], plots: Path) -> None:
    """Rows of the same series and part before and after a fix: seconds side by side, the ratio, both slopes; one
    plot per section with both curves."""
    old = {(r["series"], r["part"]): r for r in before}
    both = []
    print("\nbefore -> after (same sizes; ratio = before / after)")
    for r in after:
        b = old.get((r["series"], r["part"]))
        if b is None or b["x"] != r["x"]:
            continue
        ratios = " ".join(f"{bt / at:.2f}x" if at > 0 else "-" for bt, at in zip(b["seconds"], r["seconds"]))
        print(f"  {r['series']} {r['part']}: slope {b['slope']:.2f} -> {r['slope']:.2f} (work {r['implied_slope']:.2f}); "
              f"seconds {' '.join(f'{t:.3g}' for t in b['seconds'])} -> {' '.join(f'{t:.3g}' for t in r['seconds'])}; "
              f"{ratios}; peak MiB {' '.join(f'{m:.0f}' for m in b['peak_mib'])} -> "
              f"{' '.join(f'{m:.0f}' for m in r['peak_mib'])}")
        both += [{**b, "run": "before"}, {**r, "run": "after"}]
    for section in dict.fromkeys(r["series"].split("/")[0] for r in both):
        rows = [r for r in both if r["series"].startswith(section + "/")]
        plot(rows, plots / f"scale_{section}_fix.png", f"{section}: before and after the fix (log-log)",
             {"before": "before ", "after": "after "}, memory=True)


def run_section(section: str, full: bool, policy: str | None, env: dict, extra: dict | None = None,
                pick: str | None = None) -> list[dict]:
    """Every point of every series of `section` whose name contains `pick` (each in its own process), analysed."""
    rows = []
    for name, xlabel, pts in series(section, full, policy):
        if pick and pick not in name:
            continue
        results = []
        for x, params in pts:
            t = time.perf_counter()
            res = run_point(section, {**params, **(extra or {})}, env)
            print(f"  {name} {fmt_size(x)}: " + ", ".join(f"{k} {v:.3g}s" for k, v in res["times"].items()) +
                  f"; peak {res['peak_mib']:.0f} MiB ({time.perf_counter() - t:.0f}s wall, load "
                  f"{os.getloadavg()[0]:.1f})", flush=True)
            results.append((x, res))
        rows += analyse(name, xlabel, results)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=ALL, default=None, help="sections to run (default: "
                    + ", ".join(DEFAULT) + ")")
    ap.add_argument("--full", action="store_true", help="the large sizes too (hours on a 2-core machine)")
    ap.add_argument("--series", default=None, help="only the series whose name contains this (e.g. rl/width)")
    ap.add_argument("--json", default=None, help="also write every row to this JSON file")
    ap.add_argument("--plots", default=str(REPO / "docs" / "img"), help="folder of the scale_<section>.png plots")
    ap.add_argument("--before", default=None, help="a --json file written by this script on the code before a fix: "
                    "its rows and this run's go into one plot per section, scale_<section>_fix.png, with the ratios")
    ap.add_argument("--policy", default=None, help="rollout section: a trained policy folder (run from a project "
                                                   "root that has data/)")
    args = ap.parse_args(argv)
    before = None
    if args.before:  # read before any section runs: a bad file must not cost a measurement
        try:
            before = json.loads(Path(args.before).read_text())["rows"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            ap.exit(2, f"error: --before {args.before}: not a --json file of this script ({exc})\n")
    if args.policy and not (Path(args.policy) / "config.json").is_file():
        ap.exit(2, f"error: --policy {args.policy}: not a policy folder (no config.json)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    for k, v in {"MLFLOW_DISABLE_TELEMETRY": "true", "GX_ANALYTICS_ENABLED": "false", "DVC_NO_ANALYTICS": "1",
                 "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1"}.items():
        env.setdefault(k, v)
    load0 = os.getloadavg()
    print(f"bench/scale.py: {os.cpu_count()} CPUs, load average at start {load0[0]:.2f} {load0[1]:.2f} "
          f"{load0[2]:.2f}", flush=True)
    rows: list[dict] = []
    tmp = None
    for section in args.only or DEFAULT:
        if section == "rl":
            tmp = tempfile.TemporaryDirectory()  # the small project every RL point trains on
            subprocess.run([sys.executable, "-c", f"from scale_points import rl_project; from pathlib import Path; "
                            f"rl_project(Path({tmp.name!r}))"], cwd=REPO / "bench", env=env, check=True,
                           capture_output=True)
            series_rows = run_section(section, args.full, args.policy, env, {"project": tmp.name}, args.series)
        else:
            series_rows = run_section(section, args.full, args.policy, env, None, args.series)
        if not series_rows:
            continue
        plot(series_rows, Path(args.plots) / f"scale_{section}.png", f"{section}: seconds against size (log-log)")
        rows += series_rows
    if tmp is not None:
        tmp.cleanup()
    print()
    print_rows(rows)
    load1 = os.getloadavg()
    print(f"load average at end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} (2-core machine: above 2 the points "
          f"shared the cores)")
    if before is not None:
        compare(before, rows, Path(args.plots))
    if args.json:
        Path(args.json).write_text(json.dumps({"load_start": load0, "load_end": load1, "rows": rows}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
