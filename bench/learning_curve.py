"""The learning curve: held-out slot accuracy and replayed tau against what the drafter has trained on.

    python bench/learning_curve.py runs/smollm2                       # -> runs/smollm2/curve.{png,json}
    python bench/learning_curve.py runs/a_s0 runs/a_s1 runs/b_s0 runs/b_s1 --out runs/ab   # overlay

Each run's eval records (metrics.jsonl, kind "eval") give, at every eval step, the held-out accuracy of
block slots 1, 2, 4, 8 and 15 (`replay_acc_pos`: every anchor of the replayed responses; runs from
before it: `acc_pos`, the few random anchors of the eval's training step) and the replayed tau (`tau_dflash`, `tau_ddtree@B` for the
run's train.tau_budgets: 8 and 32 in the shipped configs), against two x axes, log scale: the supervised (answer) tokens of the training
batches and the blocks trained so far, all ranks together (train.py counts both into the trainer
state, so they carry across a resume).

The floor is drawn in: bench/floor.py's two predictors that read no target feature, the commonest
answer token (unigram) and the commonest token k after the anchor token (anchor), fitted on the run's
training set and scored on its held-out set.

Runs of one recipe (the same config but for run.seed, data.seed, run.name and run.out_dir) are one group: its
mean over seeds is drawn as a line, the seeds' range as a band. Runs evaluated on different held-out
rows are never drawn together: the script names them and stops. A run without eval records, or whose
records predate the trained-on counts, is named too. One run: curve.png and curve.json go into its own
directory; several: into --out. The figure names the command, the machine and the seeds.

`--break-even tau_ddtree@8=2.39,tau_dflash=2.71` extrapolates: for each group and each named tau, a
least-squares line tau = a + b log10(x) through the group's mean points (x: supervised tokens, and
blocks trained) says at what x the tau would reach its break-even (eval/ddtree_accept.py measures
it), with a range from the slope plus and minus its standard error. A fit of a curve that has barely
started is a guess; the report says on how many points it stands.
"""
import argparse
import json
import math
import os
import platform
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floor import slot_floors  # noqa: E402

from drafter.training.tracking import read_metrics  # noqa: E402

SLOTS = (1, 2, 4, 8, 15)  # and the block's last slot, where the block is shorter
X_AXES = {"supervised_tokens": "supervised tokens seen", "blocks_trained": "blocks trained"}
PER_RUN_KEYS = ("run.seed", "run.name", "run.out_dir", "data.seed")  # what may differ between seeds of one recipe


class CurveError(ValueError):
    """Runs that cannot be drawn (as asked) together, named with the reason."""


def recipe_key(cfg) -> str:
    """The run's config without the keys that differ between seeds of one recipe."""
    container = OmegaConf.to_container(cfg, resolve=True)
    for key in PER_RUN_KEYS:
        section, name = key.split(".", 1)
        container[section] = {k: v for k, v in container.get(section, {}).items() if k != name}
    return json.dumps(container, sort_keys=True, default=str)


def read_run(run_dir: Path, acc_key: str | None = None) -> dict:
    """A run's config and eval points: {dir, cfg, seed, held_out_set, acc_key, points: [...]}; a
    CurveError names a run this cannot draw. The slot accuracy is `acc_key`'s, by default
    replay_acc_pos where every eval has it, else acc_pos (a run resumed across the change has both
    kinds: one measure for the whole curve)."""
    metrics, config = run_dir / "metrics.jsonl", run_dir / "config.yaml"
    if not metrics.is_file() or not config.is_file():
        raise CurveError(f"{run_dir}: not a train.py run directory (it holds no metrics.jsonl and config.yaml)")
    records, problems = read_metrics(metrics)
    for problem in problems:
        print(f"note: {problem}", file=sys.stderr)
    evals = [r for r in records.get("eval", []) if "acc_pos" in r]
    if not evals:
        raise CurveError(f"{run_dir}: no eval records in metrics.jsonl (train.eval_every never reached?)")
    uncounted = [r["step"] for r in evals if not all(k in r for k in (*X_AXES, "held_out_set"))]
    if uncounted:
        raise CurveError(f"{run_dir}: the evals at steps {uncounted} hold no trained-on counts (a run from "
                         "before train.py logged supervised_tokens, blocks_trained and held_out_set)")
    sets = sorted({r["held_out_set"] for r in evals})
    if len(sets) > 1:
        raise CurveError(f"{run_dir}: its evals ran on different held-out sets ({', '.join(sets)})")
    cfg = OmegaConf.load(config)
    # every anchor of the replay; runs from before it: the eval step's random draw of a few
    acc_key = acc_key or ("replay_acc_pos" if all("replay_acc_pos" in r for r in evals) else "acc_pos")
    points = []
    for r in evals:
        acc = r[acc_key]
        points.append({"step": r["step"], **{x: r[x] for x in X_AXES},
                       "acc": {s: acc[s - 1] for s in curve_slots(len(acc) + 1)},
                       "tau": {k: v for k, v in r.items() if k.startswith("tau_") and isinstance(v, (int, float))}})
    return {"dir": str(run_dir), "cfg": cfg, "seed": cfg.run.seed, "held_out_set": sets[0], "acc_key": acc_key,
            "points": points}


def curve_slots(block_size: int) -> list[int]:
    """The slots drawn: SLOTS inside the block, and its last slot."""
    return sorted({s for s in SLOTS if s < block_size} | {block_size - 1})


def tau_names(groups) -> list[str]:
    """tau_dflash first, then tau_ddtree@B by budget: every replayed tau the runs logged."""
    names = {k for g in groups for run in g["runs"] for p in run["points"] for k in p["tau"]}
    return sorted(names, key=lambda k: (k != "tau_dflash", int(k.rpartition("@")[2]) if "@" in k else 0))


def check_comparable(runs: list[dict]) -> str:
    """The held-out set every run was evaluated on; a CurveError naming the runs where they differ."""
    sets = {}
    for run in runs:
        sets.setdefault(run["held_out_set"], []).append(run["dir"])
    if len(sets) > 1:
        listed = "; ".join(f"{key}: {', '.join(dirs)}" for key, dirs in sets.items())
        raise CurveError(f"these runs were evaluated on different held-out sets, so their curves do not "
                         f"compare; draw them apart ({listed})")
    return next(iter(sets))


def recipe_difference(cfg, base) -> str:
    """The config keys (section.key=value) where `cfg`'s recipe differs from `base`'s, at most three."""
    flat = lambda c: {f"{section}.{k}": v for section, values in json.loads(recipe_key(c)).items()  # noqa: E731
                      if isinstance(values, dict) for k, v in values.items()}
    mine, theirs = flat(cfg), flat(base)
    keys = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    text = ", ".join(f"{k}={json.dumps(mine.get(k), separators=(',', ':'))}" for k in keys[:3])
    return text + (f" (+{len(keys) - 3} more)" if len(keys) > 3 else "")


def group_runs(runs: list[dict]) -> list[dict]:
    """Runs of one recipe together, labelled by their run name, or where names repeat by what sets the
    recipe apart from the first group's."""
    groups = {}
    for run in runs:
        groups.setdefault(recipe_key(run["cfg"]), []).append(run)
    names = [members[0]["cfg"].run.name or Path(members[0]["dir"]).name for members in groups.values()]
    base = next(iter(groups.values()))[0]["cfg"]
    labelled = []
    for i, members in enumerate(groups.values()):
        name = names[i]
        if names.count(name) > 1:
            name = name if i == 0 else recipe_difference(members[0]["cfg"], base)
        labelled.append({"label": name if len(groups) == 1 else f"{i}: {name}", "runs": members,
                         "seeds": [m["seed"] for m in members]})
    return labelled


def group_series(group: dict, x_axis: str, value) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x, mean, low, high) over the group's seeds at the eval steps they all reached; `value` reads a
    point's y (NaN where the point has none)."""
    by_step = [{p["step"]: p for p in run["points"]} for run in group["runs"]]
    steps = sorted(set.intersection(*(set(s) for s in by_step)))
    x = np.array([np.mean([run[s][x_axis] for run in by_step]) for s in steps], dtype=float)
    ys = np.array([[value(run[s]) for run in by_step] for s in steps], dtype=float).reshape(len(steps), -1)
    return x, ys.mean(1), ys.min(1), ys.max(1)


def extrapolate(x: np.ndarray, y: np.ndarray, goal: float) -> dict:
    """Where y = a + b log10(x), fitted by least squares to the finite points, reaches `goal`: the x
    (`needed`) and its range (`low`, `high`) at slopes b + and - its standard error, the line pivoting
    on the points' centroid. None where the (bounded) slope does not rise, with the reason."""
    keep = np.isfinite(x) & np.isfinite(y) & (x > 0)
    lx, y = np.log10(x[keep]), y[keep]
    fit = {"points": int(len(y)), "goal": goal}
    if len(y) < 3:
        return {**fit, "needed": None, "why": "fewer than 3 points"}
    slope, intercept = np.polyfit(lx, y, 1)
    spread = ((lx - lx.mean()) ** 2).sum()
    residual = y - (intercept + slope * lx)
    slope_se = float(np.sqrt((residual ** 2).sum() / (len(y) - 2) / spread)) if spread > 0 else math.inf

    def reached_at(b: float) -> float | None:
        return float(10 ** (lx.mean() + (goal - y.mean()) / b)) if b > 0 else None

    fit.update(slope_per_decade=float(slope), slope_se=slope_se, needed=reached_at(slope),
               low=reached_at(slope + slope_se), high=reached_at(slope - slope_se))
    if fit["needed"] is None:
        fit["why"] = "the fitted line does not rise"
    return fit


def extrapolations(groups: list[dict], break_even: dict[str, float]) -> list[dict]:
    """`extrapolate` for every group, x axis and tau named in `break_even` (tau name -> goal)."""
    found = []
    for group in groups:
        for x_axis in X_AXES:
            for tau, goal in break_even.items():
                x, mean, _, _ = group_series(group, x_axis, lambda p, k=tau: p["tau"].get(k, math.nan))
                found.append({"group": group["label"], "x": x_axis, "tau": tau, **extrapolate(x, mean, goal)})
    return found


def extrapolation_line(fit: dict) -> str:
    head = f"{fit['group']}: {fit['tau']} reaches {fit['goal']} at {fit['x']}"
    if fit["needed"] is None:
        return f"{head}: no estimate ({fit['why']}, {fit['points']} points)"
    bounds = [f"{b:.3g}" if b is not None else "never" for b in (fit["low"], fit["high"])]
    return (f"{head} ~{fit['needed']:.3g} (slope {fit['slope_per_decade']:.3f} +- {fit['slope_se']:.3f} a decade: "
            f"{bounds[0]} to {bounds[1]}; {fit['points']} points)")


def parse_break_even(text: str | None) -> dict[str, float]:
    """'tau_ddtree@8=2.39,tau_dflash=2.71' -> {name: goal}; a SystemExit naming a malformed entry."""
    goals = {}
    for entry in filter(None, (text or "").split(",")):
        name, _, value = entry.partition("=")
        try:
            goals[name.strip()] = float(value)
        except ValueError:
            sys.exit(f"error: --break-even entry {entry!r} is not NAME=TAU (e.g. tau_ddtree@8=2.39)")
        if not name.strip().startswith("tau_"):
            sys.exit(f"error: --break-even entry {entry!r}: the name is a replayed tau (tau_dflash, tau_ddtree@B)")
    return goals


def floors_for(cfg) -> list[dict] | None:
    """bench/floor.py's per-slot predictors on the run's own training and held-out rows (None when the
    data cannot be read here, e.g. a run made on another machine)."""
    from drafter.pipeline.datasets import DataError, load_datasets
    from drafter.training.memory_plan import target_model_config

    try:
        vocab = target_model_config(cfg.target.path, cfg.target.random).get_text_config().vocab_size
        train, held_out = load_datasets(cfg.data, vocab, cfg.target.chat_template_kwargs)
        return slot_floors(train, held_out, cfg.drafter.block_size)
    except (DataError, OSError, ValueError) as error:
        print(f"note: no floor lines ({error})", file=sys.stderr)
        return None


def draw(groups: list[dict], floors: list[dict] | None, caption: str, path: Path):
    slots = curve_slots(groups[0]["runs"][0]["cfg"].drafter.block_size)
    columns = [*(f"slot {s}" for s in slots), "replayed tau"]
    fig, axes = plt.subplots(len(X_AXES), len(columns), figsize=(4 * len(columns), 3.4 * len(X_AXES)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, (x_axis, x_label) in enumerate(X_AXES.items()):
        for col, slot in enumerate(slots):
            ax = axes[row, col]
            for g, group in enumerate(groups):
                x, mean, low, high = group_series(group, x_axis, lambda p, s=slot: p["acc"].get(s, math.nan))
                ax.plot(x, mean, marker=".", color=colors[g % len(colors)], label=group["label"])
                if len(group["runs"]) > 1:
                    ax.fill_between(x, low, high, color=colors[g % len(colors)], alpha=0.2)
            if floors and slot <= len(floors):
                ax.axhline(floors[slot - 1]["unigram"], color="gray", ls=":", label="unigram")
                ax.axhline(floors[slot - 1]["anchor"], color="black", ls="--", label="anchor token")
            ax.set(xscale="log", title=f"held-out acc, slot {slot}", xlabel=x_label)
        ax = axes[row, -1]
        for g, group in enumerate(groups):
            for tau, style in zip(tau_names(groups), ("-", "--", ":", "-.") * 4):
                x, mean, low, high = group_series(group, x_axis, lambda p, k=tau: p["tau"].get(k, math.nan))
                if np.isnan(mean).all():
                    continue
                ax.plot(x, mean, ls=style, marker=".", color=colors[g % len(colors)], label=f"{group['label']} {tau}")
                if len(group["runs"]) > 1:
                    ax.fill_between(x, low, high, color=colors[g % len(colors)], alpha=0.15)
        ax.set(xscale="log", title="replayed tau", xlabel=x_label)
    axes[0, 0].legend(fontsize=7)
    axes[0, -1].legend(fontsize=7)
    fig.suptitle(caption, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="train.py run directories")
    parser.add_argument("--out", type=Path, help="where the overlay of several runs goes (one run: its own dir)")
    parser.add_argument("--no-floor", action="store_true", help="skip the floor lines (they read the run's data)")
    parser.add_argument("--break-even", help="NAME=TAU,...: extrapolate where each replayed tau reaches TAU")
    args = parser.parse_args(argv)
    break_even = parse_break_even(args.break_even)
    if len(args.runs) > 1 and args.out is None:
        parser.error("several runs: say where their overlay goes with --out")
    try:
        runs = [read_run(run) for run in args.runs]
        if older := [r["dir"] for r in runs if r["acc_key"] == "acc_pos"]:
            if len(older) < len(runs):  # drawn together, the runs' slot accuracies must be one measure
                print(f"note: {', '.join(older)} predate replay_acc_pos: every run's slot accuracy is the eval "
                      "step's acc_pos", file=sys.stderr)
                runs = [read_run(run, "acc_pos") for run in args.runs]
        held_out_set = check_comparable(runs)
    except CurveError as error:
        sys.exit(f"error: {error}")
    out = args.out or args.runs[0]
    out.mkdir(parents=True, exist_ok=True)
    groups = group_runs(runs)
    floors = None if args.no_floor else floors_for(runs[0]["cfg"])
    command = "python " + " ".join([sys.argv[0], *map(str, argv if argv is not None else sys.argv[1:])])
    machine = f"{platform.node()}: {os.cpu_count()} CPUs, {platform.machine()}, {platform.system()}"
    seeds = "; ".join(f"{g['label']}: seeds {g['seeds']}" for g in groups)
    draw(groups, floors, f"{command}\n{machine} | held-out set {held_out_set} | {seeds}", out / "curve.png")
    report = {"command": command, "machine": machine, "held_out_set": held_out_set, "floors": floors,
              "groups": [{"label": g["label"], "seeds": g["seeds"],
                          "runs": [{"dir": r["dir"], "seed": r["seed"], "points": r["points"]} for r in g["runs"]]}
                         for g in groups]}
    if break_even:
        logged = set(tau_names(groups))
        if missing := sorted(set(break_even) - logged):
            sys.exit(f"error: --break-even names {', '.join(missing)}, which no run logged ({', '.join(sorted(logged))})")
        report["extrapolations"] = extrapolations(groups, break_even)
        for fit in report["extrapolations"]:
            print(extrapolation_line(fit))
    (out / "curve.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {out / 'curve.png'} and {out / 'curve.json'}: {len(runs)} runs in {len(groups)} groups")
    return report


if __name__ == "__main__":
    main()
