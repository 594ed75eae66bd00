"""Training variants compared by replayed tau: the same steps under each variant and seed.

    python data/toy.py                                  # once: the toy world (heldout_data included)
    python bench/variants.py                            # objectives: 6 variants x 3 seeds, 200 steps
    python bench/variants.py --variants drafters --seeds 0,1
    python bench/variants.py --steps 60 --eval-every 20 --variants default,tree [key.sub=value ...]
    python bench/variants.py --world micro --jobs 2     # no toy world: a random target's own greedy text
    python bench/variants.py --world smollm2 --steps 60 --seeds 0,1 --variants default,dpace
                                                        # the real world (python data/smollm2.py first)

Variants are named overrides of configs/toy.yaml: distillation, position weights and the optimiser
(`default`, `target-kl`, `target-ce`, `dpace`, `tree`, `muon`), the drafter variants (`dflash2`,
`sliding`, `dflash2-sliding`; `anchor-window`, a first layer sliding over 2 positions, the real
world's default since it left the floor there, `all-full`, every layer full, its A/B there, and
`block-window`, a first layer sliding over 17 positions so that every slot of a 16-block reads p-1),
the objectives aimed at acceptance (`tv`, `first-failure`, `expected-chain`, `expected-tree`), the
recipe differences of vLLM's speculators one at a time (`any-anchor`,
`no-noise`, `lr-to-0`, `count-norm`) and together (`speculators-recipe`), and a 3x learning rate
(`lr-6e-3`, on the real world);
`--variants objectives|drafters|acceptance|recipe|all` or a comma list. Every run is train.py in one
process (world of one) under FSDP2, so that the Muon variant trains on the same engine as the others;
runs differ only by the variant's overrides and run.seed (drafter initialisation, anchors, feature
noise; the data order stays fixed). Replayed tau (drafter/serving/served.py: serving replayed under teacher
forcing, equal to served tau at T=0 when the eval answers are the target's own) is read from each
run's eval records; on the toy world the eval set is `artifacts/toy/heldout_data`, 512 held-out
prompts with the target's greedy answers (the 32 bench answers of the training config leave a seed
spread larger than the differences between variants). Prints, per variant, the mean and standard
error over seeds of tau_dflash, tau_ddtree@B and the held-out slot accuracy (acc) at the last eval,
then each variant minus the default paired by seed, and writes OUT/summary.json and
OUT/tau_vs_steps.png (mean +- standard error against steps).

`--world smollm2` trains on the SmolLM2-135M-Instruct world (configs/smollm2.yaml): the replayed tau
of the training eval is on the held-out chat bench, and each run's final drafter is replayed on the
HumanEval code bench too (`--also-eval`, columns `bench_code_data:tau_*`).

`--features DIR` (a store of the config's data.path, data/features.py) trains every run from that one
store (data.features), without the target's forward, so that the variants are compared on the same
features; `--eval-features DIR` is the store of its data.eval_path (data.eval_features) and
`--also-eval-features DIR` that of --also-eval, which the final replays then read. The distillation
variants (`target-kl`, `target-ce`, `tv`) need a store of the target's labels (`--target-labels full`).

`--world micro` builds, in OUT/micro, a 4-layer Qwen3 target trained for 150 steps on sequences
x_t = (x_{t-1} + x_{t-2}) mod 64, its greedy continuations of fresh prompts (192 train, 64 eval rows)
and a config for them: a world in a minute or two, for machines where the toy world's target
training is too slow. Its numbers say less than the toy world's.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SLIDING = ["drafter.layer_types=[sliding_attention,sliding_attention]", "drafter.sliding_window=32"]
# the first layer sliding over 2 positions: the anchor's slot reads the context's last position alone
ANCHOR_WINDOW = ["drafter.layer_types=[sliding_attention,full_attention]", "drafter.sliding_window=2"]
# the first layer sliding over a block and one: every slot, the last included, reads p-1 and the anchor there
BLOCK_WINDOW = ["drafter.layer_types=[sliding_attention,full_attention]", "drafter.sliding_window=17"]
DFLASH2 = ["drafter.arch=dflash2", "drafter.selector_rank=32"]  # rank 256 would outweigh the toy drafter
VARIANTS = {
    "default": [],
    "target-kl": ["objective.labels=target", "objective.loss=kl"],
    "target-ce": ["objective.labels=target", "objective.loss=ce"],
    "dpace": ["objective.position_weights=dpace"],
    "tree": ["objective.position_weights=tree"],
    "muon": ["optim.name=muon"],
    "dflash2": DFLASH2,
    "sliding": SLIDING,  # the toy contexts are ~100-170 tokens: a 32-position window cuts most of them
    "dflash2-sliding": DFLASH2 + SLIDING,
    "anchor-window": ANCHOR_WINDOW,
    "block-window": BLOCK_WINDOW,
    "all-full": ["drafter.layer_types=null", "drafter.sliding_window=null"],  # the real world's default before it
    "tv": ["objective.labels=target", "objective.loss=tv"],
    "first-failure": ["objective.truncate=first_failure"],
    "expected-chain": ["objective.loss=expected_chain"],
    "expected-tree": ["objective.loss=expected_tree"],
    "any-anchor": ["objective.anchor_candidates=supervised"],
    "no-noise": ["noise.end=0"],
    "lr-to-0": ["optim.min_lr_ratio=0"],
    "count-norm": ["objective.normalize=count"],
    "lr-6e-3": ["optim.lr=6e-3"],
    "speculators-recipe": ["objective.anchor_candidates=supervised", "noise.end=0", "optim.min_lr_ratio=0",
                           "objective.normalize=count"],
}
GROUPS = {"objectives": ["default", "target-kl", "target-ce", "dpace", "tree", "muon"],
          "drafters": ["default", "dflash2", "sliding", "dflash2-sliding", "anchor-window"],
          "acceptance": ["default", "tv", "first-failure", "expected-chain", "expected-tree"],
          "recipe": ["default", "any-anchor", "no-noise", "lr-to-0", "count-norm", "speculators-recipe"]}
GROUPS["all"] = list(VARIANTS)
TOY_EVAL = ["data.eval_path=artifacts/toy/heldout_data", "train.eval_batches=1000"]
MICRO_TARGET = {"vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128}
MICRO_MODULUS = 64  # micro-world tokens are 0..63: x_t = (x_{t-1} + x_{t-2}) mod 64


def micro_sequences(count: int, length: int, gen) -> "torch.Tensor":
    """Fibonacci-like sequences mod 64 from random first two tokens: each token depends on the two
    before it, so a block's later slots are predictable only through the earlier ones."""
    import torch
    seqs = torch.randint(0, MICRO_MODULUS, (count, 2), generator=gen)
    while seqs.shape[1] < length:
        seqs = torch.cat([seqs, (seqs[:, -1:] + seqs[:, -2:-1]) % MICRO_MODULUS], 1)
    return seqs


def build_micro_target(directory: Path, steps: int = 150) -> None:
    """A 4-layer Qwen3 trained briefly on the micro sequences, with a tokenizer so that train.py
    loads it like any target (the token ids, not the text, are what matters here)."""
    import torch

    from drafter.synthesis.toy_tokenizer import build_tokenizer
    from drafter.target_model.model import random_qwen3

    target = random_qwen3(**MICRO_TARGET).train().requires_grad_(True)
    optimizer = torch.optim.AdamW(target.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(99)
    for _ in range(steps):
        ids = micro_sequences(32, 64, gen)
        loss = target(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"micro target: {steps} steps, last loss {loss.item():.3f}", flush=True)
    target.save_pretrained(directory)
    build_tokenizer(["micro world " * 20, "x = (a + b) % 64"] * 4, MICRO_TARGET["vocab_size"]).save_pretrained(directory)


def build_micro_world(directory: Path, train_rows: int = 192, eval_rows: int = 64, prompt_len: int = 8,
                      new_tokens: int = 56) -> Path:
    """The micro target's greedy continuations of fresh prompts, prepared (loss on the continuation),
    and a config for them; returns the config's path."""
    import datasets
    import torch
    import yaml

    from drafter.target_model.model import load_target

    if not (directory / "target" / "config.json").exists():
        build_micro_target(directory / "target")
    target = load_target(str(directory / "target"), "cpu", torch.float32)
    gen = torch.Generator().manual_seed(1234)
    for name, count in (("train_data", train_rows), ("eval_data", eval_rows)):
        if (directory / name).exists():
            continue
        ids = micro_sequences(count, prompt_len, gen)
        with torch.no_grad():
            for _ in range(new_tokens):  # greedy, the whole batch at once
                ids = torch.cat([ids, target(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
        rows = {"input_ids": ids.tolist(), "loss_mask": [[0] * prompt_len + [1] * new_tokens] * count,
                "length": [ids.shape[1]] * count}
        datasets.Dataset.from_dict(rows).save_to_disk(str(directory / name))
        settings = {"chat_template_kwargs": {"enable_thinking": False}}
        (directory / name / "stats.json").write_text(json.dumps({"settings": settings}))
    cfg = {"target": {"path": str(directory / "target")},
           "drafter": {"num_layers": 1, "block_size": 8},
           "objective": {"num_anchors": 16, "anchors_per_batch": 96, "gamma": 10, "ddtree_budget": 16},
           "optim": {"lr": 1e-2, "warmup_ratio": 0.05, "min_lr_ratio": 0.05},
           "noise": {"end": 0.01, "warmup_steps": 10},
           "data": {"path": str(directory / "train_data"), "eval_path": str(directory / "eval_data"),
                    "max_length": 128, "num_buckets": 1, "tokens_per_batch": 512, "num_workers": 0},
           "train": {"epochs": 100, "eval_batches": 100, "tau_budgets": [16], "threads_per_rank": 1},
           "wandb": {"enabled": False}}
    path = directory / "micro.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def eval_records(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "eval"]


def run_variant(cfg: Path, out: Path, variant: str, seed: int, args, overrides: list[str]) -> list[dict]:
    """One training run; its eval records. A run that finished with the same command before (its
    command.json, written once it ended) is reused, so that a group of variants can be added to an
    earlier comparison without training its shared runs again."""
    run = out / variant / f"seed{seed}"
    command = [sys.executable, str(REPO / "train.py"), "--cfg", str(cfg), f"run.out_dir={run}",
               f"run.seed={seed}", f"train.max_steps={args.steps}", f"train.eval_every={args.eval_every}",
               f"train.save_every={args.steps}", "train.generate_every=0", "train.engine=fsdp",
               "train.resume=never", "train.log_every=10", f"train.threads_per_rank={args.threads}",
               *VARIANTS[variant], *overrides]
    done = run / "command.json"
    if done.exists() and json.loads(done.read_text()) == command[1:]:
        return eval_records(run)
    done.unlink(missing_ok=True)
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        how = f"killed by signal {-result.returncode}" if result.returncode < 0 else f"exit code {result.returncode}"
        sys.exit(f"{variant} seed {seed} failed ({how}; a rerun reuses the runs that finished):\n"
                 f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    done.write_text(json.dumps(command[1:]))
    return eval_records(run)


REPLAY_LOCK = threading.Lock()  # transformers' loading is not thread-safe (its meta-device context is global)


def replayed_on(run: Path, data_path: str, threads: int, store: str | None = None) -> dict[str, float]:
    """Replayed tau (tau_dflash, tau_ddtree@B at the run's tau_budgets) of a run's final drafter on the
    prepared set at `data_path`, computed as the training eval computes it (drafter/serving/served.py),
    its features from the feature store `store` when given; cached in the run directory. One at a time:
    the runs' jobs are threads of this process."""
    cached = run / f"replayed_{Path(data_path).name}.json"
    with REPLAY_LOCK:
        if not cached.exists():
            cached.write_text(json.dumps(replay(run, data_path, threads, store)))
    return json.loads(cached.read_text())


def replay(run: Path, data_path: str, threads: int, store: str | None) -> dict[str, float]:
    import datasets
    import torch
    from omegaconf import OmegaConf

    from drafter.pipeline.feature_store import FeatureStore, load_stored_head
    from drafter.pipeline.feature_store_format import store_refusal
    from drafter.pipeline.loader import collate
    from drafter.metric_sums import finalize_metrics
    from drafter.models import load_drafter
    from drafter.models.blocks import DraftingSetup, FeatureBatch
    from drafter.serving.served import replayed_tau
    from drafter.target_model.model import compute_dtype, context_features, load_target
    from drafter.target_model.tensor_parallel import feature_code_version

    torch.set_num_threads(threads)
    config = OmegaConf.load(run / "checkpoints" / "latest" / "config.yaml")
    dtype = compute_dtype(config.target.dtype, torch.device("cpu"))  # the run's, as its own eval computed
    drafter = load_drafter(run / "checkpoints" / "latest" / "drafter", dtype=dtype).eval()
    stored = FeatureStore(store) if store else None
    # the run's own rules for a store of its eval set: its target, the set's rows, the drafter's layers, the dtype
    as_eval = OmegaConf.merge(config, {"data": {"eval_path": data_path, "features_missing": "error"}})
    if stored is not None and (refusal := store_refusal(stored, as_eval, drafter.target_layer_ids, dtype,
                                                        feature_code_version(), "data.eval_path")):
        sys.exit(f"error: --also-eval-features {store}: {refusal}")
    target = (load_stored_head(store, "cpu", dtype) if stored is not None
              else load_target(config.target.path, "cpu", dtype))
    rows = datasets.load_from_disk(data_path)
    summed = {}
    with torch.no_grad():
        for first in range(0, len(rows), 8):
            batch = collate(rows.select(range(first, min(first + 8, len(rows)))), bucket=0)
            features = (stored.features(batch["input_ids"], batch["lengths"], dtype) if stored is not None
                        else context_features(target, batch["input_ids"], drafter.target_layer_ids))
            for k, v in replayed_tau(DraftingSetup(drafter, target, "dense", budgets=tuple(config.train.tau_budgets)),
                                     FeatureBatch(batch["input_ids"], batch["loss_mask"], features)).items():
                summed[k] = summed.get(k, 0) + v.double()
    return finalize_metrics(summed)


def mean_and_se(values: list[float]) -> tuple[float, float]:
    values = np.asarray(values, dtype=float)
    se = values.std(ddof=1) / math.sqrt(len(values)) if len(values) > 1 else math.nan
    return float(values.mean()), float(se)


def summarise(evals: dict[str, dict[int, list[dict]]], metrics: list[str]) -> dict:
    """variant -> metric -> {"steps": [...], "mean": [...], "se": [...]} over seeds, per eval step."""
    summary = {}
    for variant, per_seed in evals.items():
        summary[variant] = {}
        for metric in metrics:  # the --also-eval replays are in the last record only
            steps = sorted({r["step"] for records in per_seed.values() for r in records if metric in r})
            at = {s: [r[metric] for records in per_seed.values() for r in records if r["step"] == s and metric in r]
                  for s in steps}
            pairs = [mean_and_se(at[s]) for s in steps]
            summary[variant][metric] = {"steps": steps, "mean": [m for m, _ in pairs], "se": [e for _, e in pairs],
                                        "last": at[steps[-1]]}
    return summary


def print_paired_differences(summary: dict, variants: list[str], metrics: list[str]) -> None:
    """Each variant minus the default at the last eval, seed by seed (a seed fixes the drafter's start,
    the anchors and the noise for every variant, so the pairs share that spread): mean +- standard error."""
    print("\nminus the default, paired by seed (mean +- standard error):")
    print("| variant | " + " | ".join(metrics) + " |")
    print("|---|" + "---:|" * len(metrics))
    for variant in variants:
        if variant == "default":
            continue
        cells = []
        for metric in metrics:
            mine, base = summary[variant][metric]["last"], summary["default"][metric]["last"]
            mean, se = mean_and_se([a - b for a, b in zip(mine, base)])
            cells.append(f"{mean:+.3f} +- {se:.3f}")
        print(f"| {variant} | " + " | ".join(cells) + " |")


def plot(summary: dict, metrics: list[str], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(6 * len(metrics), 4))
    for ax, metric in zip(np.atleast_1d(axes), metrics):
        for variant, by_metric in summary.items():
            curve = by_metric[metric]
            mean, se = np.array(curve["mean"]), np.nan_to_num(np.array(curve["se"]))
            ax.plot(curve["steps"], mean, marker="o", label=variant)
            ax.fill_between(curve["steps"], mean - se, mean + se, alpha=0.2)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("held-out slot accuracy" if metric == "acc" else f"replayed {metric}")
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", choices=["toy", "smollm2", "micro"], default="toy")
    parser.add_argument("--cfg", default=None, help="default: configs/toy.yaml (toy), configs/smollm2.yaml "
                                                    "(smollm2), OUT/micro/micro.yaml (micro)")
    parser.add_argument("--also-eval", default=None,
                        help="a second prepared held-out set: each run's final drafter is replayed on it too "
                             "(default on smollm2: artifacts/smollm2/bench_code_data, the code bench)")
    parser.add_argument("--features", default=None, help="a feature store of data.path every run trains from")
    parser.add_argument("--eval-features", default=None, help="with --features: the store of data.eval_path")
    parser.add_argument("--also-eval-features", default=None, help="the store of --also-eval the replays read")
    parser.add_argument("--variants", default="objectives",
                        help="objectives | drafters | acceptance | recipe | all | a comma list")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--out", default="runs/variants")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time, each one process")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: cores / jobs)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value for every run")
    args = parser.parse_args()
    for flag, needs in (("eval_features", "features"), ("also_eval_features", "also_eval")):
        if getattr(args, flag) and not getattr(args, needs):  # else every run, or the replay, would ignore it
            parser.error(f"--{flag.replace('_', '-')} is read only with --{needs.replace('_', '-')}")
    out = Path(args.out).resolve()
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    variants = GROUPS.get(args.variants, args.variants.split(","))
    seeds = [int(s) for s in args.seeds.split(",")]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        sys.exit(f"--variants: unknown {unknown}; choose from {', '.join(GROUPS)} or {', '.join(VARIANTS)}")
    overrides = list(args.overrides)
    if args.cfg:
        cfg = Path(args.cfg).resolve()
    elif args.world == "micro":
        cfg = build_micro_world(out / "micro")
    elif args.world == "smollm2":
        cfg = REPO / "configs" / "smollm2.yaml"
        if not (REPO / "artifacts" / "smollm2" / "bench_chat_data").exists():
            sys.exit("no SmolLM2 world: run `python data/smollm2.py` first")
        args.also_eval = args.also_eval or str(REPO / "artifacts" / "smollm2" / "bench_code_data")
        overrides = ["train.eval_batches=1000"] + overrides  # the whole chat bench, not the demo's 4 batches
    else:
        cfg = REPO / "configs" / "toy.yaml"
        if not (REPO / "artifacts" / "toy" / "heldout_data").exists():
            sys.exit("no toy world with its held-out set: run `python data/toy.py` first (or pass --world micro)")
        overrides = TOY_EVAL + overrides

    overrides += [f"data.{key}={Path(value).resolve()}" for key, value in
                  (("features", args.features), ("eval_features", args.eval_features)) if value]

    def one(job):
        variant, seed = job
        records = run_variant(cfg, out, variant, seed, args, overrides)
        if args.also_eval:
            records[-1].update({f"{Path(args.also_eval).name}:{k}": v for k, v in
                                replayed_on(out / variant / f"seed{seed}", args.also_eval, args.threads,
                                            args.also_eval_features).items()})
        print(f"  {variant:10s} seed {seed}: step {records[-1]['step']} tau_dflash {records[-1]['tau_dflash']:.3f}",
              flush=True)
        return records

    jobs = [(variant, seed) for seed in seeds for variant in variants]  # seed-major: a cut-short run has whole seeds
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        done = dict(zip(jobs, pool.map(one, jobs)))
    evals = {variant: {seed: done[variant, seed] for seed in seeds} for variant in variants}
    last = evals[variants[0]][seeds[0]][-1]
    metrics = ["tau_dflash"] + sorted(k for k in last if k.startswith("tau_ddtree@"))
    metrics += sorted(k for k in last if ":tau_" in k) + ["acc"]
    summary = summarise(evals, metrics)
    (out / "summary.json").write_text(json.dumps({"config": str(cfg), "steps": args.steps, "seeds": seeds,
                                                  "overrides": overrides, "summary": summary}, indent=1))
    plot(summary, metrics, out / "tau_vs_steps.png")
    responses = evals[variants[0]][seeds[0]][-1].get("eval_responses")
    print(f"\nreplayed tau at step {args.steps}, mean +- standard error over {len(seeds)} seeds "
          f"({responses} eval responses; {cfg}):")
    print("| variant | " + " | ".join(metrics) + " |")
    print("|---|" + "---:|" * len(metrics))
    for variant in variants:
        cells = [f"{summary[variant][m]['mean'][-1]:.3f} +- {summary[variant][m]['se'][-1]:.3f}" for m in metrics]
        print(f"| {variant} | " + " | ".join(cells) + " |")
    if "default" in variants and len(seeds) > 1:
        print_paired_differences(summary, variants, metrics)
    print(f"\nplots: {out / 'tau_vs_steps.png'}; per-run records: {out}/<variant>/seed<N>/metrics.jsonl")


if __name__ == "__main__":
    main()
