"""Plots of a training run, from its metrics.jsonl (and eval/ddtree_accept.py's eval.json if present).

    python eval/plot_run.py runs/toy            # -> runs/toy/plots/*.png

Against optimizer steps:
  loss.png             training and held-out loss
  anchor_metrics.png   the random-anchor metrics (anchor_streak, anchor_top4/8_streak, anchor_ddtree@B),
                       training batches and held-out split
  tau.png              the held-out random-anchor figures next to the replayed tau (tau_dflash,
                       tau_ddtree@B) and the generated tau (gen_tau_*): what the drafter serves
  per_bucket_loss.png  training loss per length bucket
  budget_sweep.png     eval.json's served tau per tree budget and benchmark, with the run's last
                       replayed and generated tau at their budgets (only when eval.json exists)

A figure the run holds no data for is left out (a run from before these metrics, a run without eval
records). A truncated last line (a run killed mid-write) is ignored; any other unreadable line is
skipped and reported. Names from before the renaming (streak, ddtree_streak4/8, ddtree_accept@B) are
read as their new ones. Where a step was logged twice (a resumed run re-logs the steps after its
checkpoint), the later record counts.
"""
import argparse
import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from drafter.training.tracking import read_metrics  # noqa: E402

def number(value) -> float:
    """A plottable float: NaN for anything that is not a finite or infinite number."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def by_budget(key: str):
    name, _, budget = key.partition("@")
    return name, int(budget) if budget.isdigit() else -1


def plot_keys(ax, records: dict[str, list[dict]], kinds, wanted) -> int:
    """One line per (kind, key) with wanted(key); returns how many were drawn."""
    drawn = 0
    for kind in kinds:
        rows = records.get(kind, [])
        for key in sorted({k for row in rows for k in row if wanted(k)}, key=by_budget):
            points = [(row["step"], number(row[key])) for row in rows if key in row]
            ax.plot(*zip(*points), marker=".", label=f"{kind}: {key}")
            drawn += 1
    return drawn


def step_figure(records, title: str, ylabel: str, *selections):
    """Lines for each (kinds, wanted) selection; None when nothing was drawn."""
    fig, ax = plt.subplots(figsize=(7, 4))
    if not sum(plot_keys(ax, records, kinds, wanted) for kinds, wanted in selections):
        plt.close(fig)
        return None
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def per_bucket_figure(records):
    rows = [row for row in records.get("train", []) if isinstance(row.get("per_bucket"), dict)
            and isinstance(row["per_bucket"].get("loss"), list)]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for bucket in range(max(len(row["per_bucket"]["loss"]) for row in rows)):
        losses = [row["per_bucket"]["loss"] for row in rows]
        ax.plot([row["step"] for row in rows], [number(l[bucket]) if bucket < len(l) else math.nan
                                                for l in losses], marker=".", label=f"bucket {bucket}")
    ax.set(title="training loss per length bucket", xlabel="step", ylabel="loss")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def last_value(records, key: str):
    """(step, value) of the last record of any kind holding a number under `key`, else None."""
    found = [(row["step"], number(row[key])) for rows in records.values() for row in rows
             if key in row and not math.isnan(number(row[key]))]
    return max(found) if found else None


def served_tau(methods: dict, method: str) -> float:
    entry = methods.get(method)
    return number(entry.get("tau")) if isinstance(entry, dict) else math.nan


def budget_figure(report, records):
    """Served tau against the tree budget per benchmark (dflash dashed), and the run's last replayed
    (x) and generated (+) tau at their budgets."""
    benchmarks = report.get("benchmarks") if isinstance(report, dict) else None
    if not isinstance(benchmarks, dict) or not benchmarks:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for bench, entry in benchmarks.items():
        methods = entry.get("methods") if isinstance(entry, dict) else None
        methods = methods if isinstance(methods, dict) else {}
        budgets = sorted(b for m in methods if m.startswith("ddtree@") and (b := by_budget(m)[1]) > 0)
        line, = ax.plot(budgets, [served_tau(methods, f"ddtree@{b}") for b in budgets], marker="o",
                        label=f"{bench}: ddtree (eval.json)")
        dflash = served_tau(methods, "dflash")
        if not math.isnan(dflash):
            ax.axhline(dflash, linestyle="--", color=line.get_color(), label=f"{bench}: dflash (eval.json)")
    for prefix, marker, what in (("tau_ddtree@", "x", "replayed"), ("gen_tau_ddtree@", "+", "generated")):
        keys = {k for rows in records.values() for row in rows for k in row if k.startswith(prefix)}
        points = [(by_budget(k)[1], last_value(records, k)) for k in sorted(keys, key=by_budget)]
        points = [(budget, found) for budget, found in points if found]
        if points:
            ax.scatter([budget for budget, _ in points], [value for _, (_, value) in points], marker=marker,
                       s=60, color="black", label=f"{what} during training (step {points[-1][1][0]})")
    ax.set_xscale("log", base=2)
    ax.set(title="served tau against the tree budget", xlabel="tree budget", ylabel="tau (tokens per verify)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def figures(records: dict[str, list[dict]], report: dict | None) -> dict[str, "plt.Figure"]:
    """{file stem: figure} for every figure the data allows."""
    def is_tau(key):
        return key.startswith(("tau_", "gen_tau_"))

    has_tau = any(is_tau(k) for rows in records.values() for row in rows for k in row)
    made = {
        "loss": step_figure(records, "loss", "loss", (("train", "eval"), lambda k: k == "loss")),
        "anchor_metrics": step_figure(records, "random-anchor metrics (not tau)", "tokens per block",
                                      (("train", "eval"), lambda k: k.startswith("anchor_"))),
        "tau": step_figure(records, "random-anchor figures (held-out) vs replayed and generated tau",
                           "tokens per verify", (sorted(records), is_tau),
                           (("eval",), lambda k: k == "anchor_streak" or k.startswith("anchor_ddtree@")))
        if has_tau else None,
        "per_bucket_loss": per_bucket_figure(records),
        "budget_sweep": budget_figure(report, records) if report is not None else None,
    }
    return {name: fig for name, fig in made.items() if fig is not None}


def main(argv=None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", help="a run directory holding metrics.jsonl (e.g. runs/toy)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        sys.exit(f"{metrics}: no such file (is {run_dir} a run directory?)")
    records, problems = read_metrics(metrics)
    report = None
    if (run_dir / "eval.json").is_file():
        try:
            report = json.loads((run_dir / "eval.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            problems.append(f"{run_dir / 'eval.json'}: not valid JSON ({error}), no budget sweep")
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    for name, fig in figures(records, report).items():
        written.append(out_dir / f"{name}.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"wrote {', '.join(map(str, written))}" if written else f"{metrics}: nothing to plot")
    return written


if __name__ == "__main__":
    main()
