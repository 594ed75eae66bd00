"""An evaluation's figures (eval/ddtree_accept.py's report): per benchmark and method, tau, its histogram,
acceptance by depth, time per token and per stage, the lossless verdict against `ar` (each prompt's
first divergence, classed by `lossless.py`), speedups over `ar` and over `hf` (transformers' own greedy
generate), the best method, the public loop's comparison; in words as a markdown table and drawn as two
plots. Definitions: docs/design.md, "tau"."""
import statistics
from dataclasses import asdict
from pathlib import Path

from drafter.serving.decode import STAGES, Method
from drafter.serving.lossless import BF16_TIE_TOLERANCE, first_divergence, lossless_verdict
from drafter.serving.public_loop import PublicAgreement

HF = "hf"  # transformers' own greedy generate: a baseline row of the report, not a method of ours


def best_method(methods: dict[str, dict]) -> str | None:
    """The speculative method with the highest measured speedup over `ar`, among those not found lossy
    (lossless yes or ties-only; every one above temperature 0); None where none was timed."""
    speedups = {name: s["speedup"] for name, s in methods.items()
                if name not in ("ar", HF) and s["speedup"] is not None and s["lossless"] != "no"}
    return max(speedups, key=speedups.get, default=None)


def divergences_from(records: list[dict], reference: list[dict], tolerance: float):
    """(record, FirstDivergence) for the first divergence from `ar` of each prompt that has one. A prompt
    diverges once: its later turns follow the method's own earlier answers, so they are not compared
    after that."""
    found, diverged = [], set()
    for record, ref in zip(records, reference):
        if record["source"] in diverged:
            continue
        divergence = first_divergence(record["output_ids"], ref["output_ids"], ref["margins"], tolerance)
        if divergence is not None:
            diverged.add(record["source"])
            found.append((record, divergence))
    return found


def summarize(records: list[dict], reference: list[dict], greedy: bool, save_samples: bool,
              tie_tolerance: float = BF16_TIE_TOLERANCE) -> dict:
    """Figures of one method on one benchmark; `reference` holds `ar`'s records in the same order.

    tau: mean over responses of each response's mean tokens per step (tau_pooled: over all steps);
    tau_histogram[i]: steps that committed i + 1 tokens; acceptance_by_depth[d - 1]: fraction of
    steps that accepted at least d drafted tokens. Temperature 0 only: `divergences`, each prompt's
    first token that differs from `ar`'s (position, both tokens, the target's top-1 minus top-2
    logit at `ar`'s step, tie: below `tie_tolerance`); `lossless` "yes", "ties-only" or "no";
    divergence_rate the fraction of prompts that diverge.
    """
    replayed = any(r.get("replayed") for r in records)
    greedy = greedy and not replayed  # a replay follows ar's tokens by construction
    steps = [length for r in records for length in r["acceptance_lengths"]]
    per_response = [sum(r["acceptance_lengths"]) / len(r["acceptance_lengths"])
                    for r in records if r["acceptance_lengths"]]
    longest = max(steps, default=1)
    output_tokens = sum(len(r["output_ids"]) for r in records)
    decode_seconds = None if replayed else sum(r["decode_seconds"] for r in records)
    divergences = divergences_from(records, reference, tie_tolerance) if greedy else []
    prompts = len({r["source"] for r in records})
    summary = {
        "tau": sum(per_response) / len(per_response) if per_response else None,
        "tau_pooled": sum(steps) / len(steps) if steps else None,
        "tau_histogram": [steps.count(k) for k in range(1, longest + 1)],
        "acceptance_by_depth": [sum(s > d for s in steps) / len(steps) if steps else None
                                for d in range(1, longest)],
        "time_per_output_token": decode_seconds / output_tokens if output_tokens and not replayed else None,
        "stage_ms_per_step": {stage: 1e3 * sum(r["stage_seconds"].get(stage, 0.0) for r in records)
                              / max(len(steps), 1)
                              for stage in STAGES if any(stage in r["stage_seconds"] for r in records)},
        "lossless": lossless_verdict([d for _, d in divergences]) if greedy else None,
        "divergence_rate": len(divergences) / prompts if greedy and prompts else None,
        "divergences": [{"source": r["source"], "turn": r["turn"], **asdict(d)} for r, d in divergences]
        if greedy else None,
        "replayed": replayed,
        "responses": len(records),
        "output_tokens": output_tokens,
        "steps": len(steps),
    }
    if not replayed:
        summary["speedup_per_response"] = per_response_speedup(records, reference)
    if save_samples:
        summary["samples"] = [{key: r[key] for key in ("source", "turn", "prompt_ids", "output_ids",
                                                       "acceptance_lengths", "margins", "decode_seconds")}
                              for r in records]
    return summary


def per_response_speedup(records: list[dict], reference: list[dict]) -> dict | None:
    """The spread behind the pooled speedup: each response's time per token against `ar`'s on the same
    prompt (median, quartiles, min and max over the responses); None where `ar` was not timed."""
    ratios = sorted((ref["decode_seconds"] / len(ref["output_ids"])) / (r["decode_seconds"] / len(r["output_ids"]))
                    for r, ref in zip(records, reference)
                    if r["output_ids"] and ref["output_ids"] and r["decode_seconds"] and ref["decode_seconds"])
    if not ratios:
        return None
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return {"median": statistics.median(ratios), "q1": quartiles[0], "q3": quartiles[2],
            "min": ratios[0], "max": ratios[-1], "responses": len(ratios)}


def summarize_public(checked: list[tuple[str, PublicAgreement]]) -> dict:
    """The public loop against ours on one benchmark's checked prompts (--check-public): how many decode
    identically step for step, each loop's tau (mean over the prompts), the verdict (yes: all identical;
    ties-only: every first difference a tie; no), the largest score gap where they drafted alike, and
    every prompt's comparison."""
    agreements = [a for _, a in checked]
    differences = [a.difference for a in agreements]
    return {"prompts": len(agreements), "identical": sum(a.identical for a in agreements),
            "tau": sum(a.ours_tau for a in agreements) / len(agreements),
            "public_tau": sum(a.public_tau for a in agreements) / len(agreements),
            "verdict": lossless_verdict(differences),
            "score_gap": max(a.score_gap for a in agreements),
            "per_prompt": [{"source": source, **asdict(a)} for source, a in checked]}


def markdown_table(results: dict) -> str:
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    lines = ["| bench | method | tau | tau pooled | ms/token | speedup | vs hf | break-even tau | lossless | "
             + " | ".join(f"{s} ms/step" for s in STAGES) + " |",
             "|---|---|---:|---:|---:|---:|---:|---:|:---:|" + "---:|" * len(STAGES)]
    for bench, entry in results["benchmarks"].items():
        for method, s in entry["methods"].items():
            tpot = s["time_per_output_token"]
            lossless = "replayed" if s.get("replayed") else s["lossless"] or "-"
            if s["divergence_rate"]:
                lossless += f" ({s['divergence_rate']:.0%} differ)"
            stages = " | ".join(fmt(s["stage_ms_per_step"].get(st), ".2f") for st in STAGES)
            lines.append(f"| {bench} | {method} | {fmt(s['tau'], '.2f')} | {fmt(s['tau_pooled'], '.2f')} "
                         f"| {fmt(tpot and tpot * 1e3, '.2f')} | {fmt(s['speedup'], '.2f')} "
                         f"| {fmt(s.get('speedup_over_hf'), '.2f')} "
                         f"| {fmt(s['break_even_tau'], '.2f')} | {lossless} | {stages} |")
    config = results["config"]
    lines.append(f"\nspeed: {config.get('regime')}, {config['dtype']}"
                 + (f", CPU capability {config['cpu_capability']}" if config.get("cpu_capability") else ""))
    if config.get("hf_note"):
        lines.append(f"\n{config['hf_note']}")
    for bench, entry in results["benchmarks"].items():
        lines.append(speed_line(bench, entry))
    if results["config"].get("tree_verify_refusal"):
        rows = "dflash and ddtree" if results["config"].get("verify_refusal") else "ddtree"
        lines.append(f"\n{results['config']['tree_verify_refusal']}: the {rows} rows are the exact tau on "
                     "ar's greedy text, replayed under teacher forcing (no timing)")
    for bench, entry in results["benchmarks"].items():
        if entry.get("near_tie_share") is not None:
            lines.append(f"\n{bench}: {entry['near_tie_share']:.1%} of ar's steps have a top-2 logit margin "
                         f"below the tie tolerance ({results['config']['tie_tolerance']}): the chance "
                         "that a bug's divergence passes for a tie")
        if "public_check" in entry:
            lines.append(public_check_line(bench, entry["public_check"]))
    return "\n".join(lines)


def speed_line(bench: str, entry: dict) -> str:
    """The best method against `ar`, and `ar` against transformers' own generate, in words."""
    methods, best = entry["methods"], entry.get("best_method")
    line = f"\n{bench}: best method " + (f"{best}, {methods[best]['speedup']:.2f}x ar" if best else "none timed")
    if best and (spread := methods[best].get("speedup_per_response")):
        line += (f" (per response: median {spread['median']:.2f}x, quartiles {spread['q1']:.2f}-{spread['q3']:.2f}, "
                 f"range {spread['min']:.2f}-{spread['max']:.2f})")
    if best and methods[best]["speedup"] < 1:
        line += " (plain decoding is faster)"
    if entry.get("ar_over_hf") is not None:
        hf = methods[HF]
        line += (f"; hf (transformers generate) {hf['time_per_output_token'] * 1e3:.2f} ms/token, our ar takes "
                 f"{entry['ar_over_hf']:.2f}x its time per token, tokens as ar's: {hf['lossless']}")
    return line


def public_check_line(bench: str, check: dict) -> str:
    """--check-public in words: agreement, both taus, verdict and each first difference."""
    line = (f"\n{bench}: the public dflash 0.1.0 loop on {check['prompts']} prompts: {check['identical']} "
            f"identical step for step, tau {check['tau']:.2f} ours vs {check['public_tau']:.2f} public, "
            f"verdict {check['verdict']}")
    for row in check["per_prompt"]:
        d = row["difference"]
        if d is not None:
            margin = "-" if d["margin"] is None else f"{d['margin']:.3g}"
            line += (f"\n  {row['source']} step {d['step']}: {d['kind']} at {d['position']}, "
                     f"{'tie' if d['tie'] else 'semantic'} (margin {margin}; "
                     f"ours {d['ours']}, public {d['theirs']})")
    return line


def save_plots(results: dict, out: Path) -> list[Path]:
    """The tau histogram per benchmark and method, and tau and speedup against the tree budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    benches = results["benchmarks"]
    fig, axes = plt.subplots(1, len(benches), figsize=(5 * len(benches), 3.5), squeeze=False)
    for ax, (bench, entry) in zip(axes[0], benches.items()):
        for method, s in entry["methods"].items():
            if method not in ("ar", HF) and s["steps"]:
                fractions = [c / s["steps"] for c in s["tau_histogram"]]
                ax.plot(range(1, len(fractions) + 1), fractions, marker="o", label=method)
        ax.set(title=bench, xlabel="tokens committed per step (tau)", ylabel="fraction of steps")
        ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
        ax.legend(fontsize=7)
    histogram = out.with_name(out.stem + "_tau_hist.png")
    fig.tight_layout()
    fig.savefig(histogram, dpi=120)
    plt.close(fig)

    fig, (tau_ax, speed_ax) = plt.subplots(1, 2, figsize=(10, 3.5))
    for bench, entry in benches.items():
        methods = {Method.parse(m): s for m, s in entry["methods"].items() if m != HF}
        tree = {m.budget: s for m, s in methods.items() if m.is_tree}
        budgets = sorted(tree)
        for ax, key in ((tau_ax, "tau"), (speed_ax, "speedup")):
            points = [(b, tree[b][key]) for b in budgets if tree[b][key] is not None]  # replayed: no timing
            if not points:
                continue
            line = ax.plot(*zip(*points), marker="o", label=f"{bench} ddtree")
            dflash = entry["methods"]["dflash"][key]
            if dflash is not None:
                ax.axhline(dflash, linestyle="--", color=line[0].get_color(), label=f"{bench} dflash")
    for ax, label in ((tau_ax, "tau (tokens per verify)"), (speed_ax, "speedup over ar")):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ticker.ScalarFormatter())
        ax.set(xlabel="tree budget", ylabel=label)
        if ax.get_legend_handles_labels()[0]:  # replayed rows have no speedup to plot
            ax.legend(fontsize=7)
    budget_plot = out.with_name(out.stem + "_budget.png")
    fig.tight_layout()
    fig.savefig(budget_plot, dpi=120)
    plt.close(fig)
    return [histogram, budget_plot]
