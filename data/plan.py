"""Show how a prepared dataset will be batched under a config and world size, before any GPU is spent.

    python data/plan.py --lengths L.npy --cfg configs/v3.yaml --world-size 8 [--json plan.json] [key.sub=value ...]
    python data/plan.py --dataset DIR --cfg configs/v3.yaml --world-size 8
    python data/plan.py --cfg configs/v3.yaml --world-size 8            # the dataset at data.path
    python data/plan.py --cfg configs/v3.yaml --world-size 8 --gpu-memory 80GB --memory-only target.tp_size=2

Lengths come from a `.npy` array, a text file with one integer per line, or the `length` column of
a dataset saved with save_to_disk (and its `group` column, when there is one). When data.eval_path is
null the eval rows are held out first, exactly as training does (whole groups; rows without groups
are one group each). The epoch is cut to a multiple of optim.grad_accum, as training does. Prints
the bucket table, padding efficiency, the longest same-bucket run, every sample left out by cause,
a warning for samples over the token budget and a picture of the bucket sequence over the epoch;
--json writes the statistics and, for every global step, the bucket id of each rank.

--gpu-memory prints the per-GPU memory plan training prints at start-up (drafter/training/memory_plan.py: the
target at target.tp_size, the drafter's state under the engine, activations) and, when it does not
fit, the changes that would; --memory-only skips the dataset.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from drafter.config import CONFIG_FILE_ERRORS, Config, ConfigError, config_error_reason
from drafter.pipeline.sampler import BucketSampler, bucket_table, plan_notes, sampler_from_config
from drafter.pipeline.splits import split_holdout
from drafter.infra.deepspeed_engine import deepspeed_config
from drafter.infra.memory import GiB
from drafter.infra.repo_paths import find_in_repo
from drafter.training.memory_plan import fitting_changes, plan_inputs, plan_memory, target_model_config

SHADES = " .:-=+*#%@"  # share of a column's steps in a bucket, from none to all


def read_lengths_file(path: str) -> np.ndarray:
    """Sample lengths from a .npy array or a text file of one integer per line."""
    if path.endswith(".npy"):
        lengths = np.load(path)
        if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer):
            raise ValueError(f"{path}: expected a 1-D integer array, got shape {lengths.shape} dtype {lengths.dtype}")
        return lengths
    lengths = []
    with open(path) as lines:
        for line_number, line in enumerate(lines, start=1):
            try:
                lengths.append(int(line))
            except ValueError:
                raise ValueError(f"{path}, line {line_number}: {line.strip()!r} is not an integer length") from None
    return np.asarray(lengths, dtype=np.int64)


def read_dataset(path: str) -> tuple[np.ndarray, np.ndarray | None]:
    """The `length` column of a prepared dataset saved with save_to_disk, and its `group` column
    (None when it has none)."""
    from datasets import Dataset, load_from_disk

    dataset = load_from_disk(path)
    if not isinstance(dataset, Dataset):
        raise ValueError(f"{path}: expected a single Dataset, found a {type(dataset).__name__}")
    if "length" not in dataset.column_names:
        raise ValueError(f"{path}: no 'length' column (columns: {dataset.column_names})")
    groups = np.asarray(dataset["group"], dtype=object) if "group" in dataset.column_names else None
    return np.asarray(dataset.with_format("numpy")["length"]), groups


def bucket_picture(step_buckets: np.ndarray, num_buckets: int, width: int = 100) -> list[str]:
    """One text row per bucket; each column covers an equal span of steps and its shade is the
    share of those steps that come from the bucket."""
    columns = np.array_split(step_buckets, min(width, max(len(step_buckets), 1)))
    rows = []
    for bucket in range(num_buckets):
        shares = [np.mean(column == bucket) if len(column) else 0.0 for column in columns]
        shades = [SHADES[0] if share == 0 else SHADES[1 + int(share * (len(SHADES) - 2.001))] for share in shares]
        rows.append(f"{bucket:>6} |{''.join(shades)}|")
    return rows


def format_report(stats: dict, sampler: BucketSampler, step_buckets: np.ndarray, held_out: int) -> str:
    lines = [
        f"{stats['samples']:,} samples ({held_out:,} held out for eval), world size {stats['world_size']}, "
        f"{stats['tokens_per_batch']:,} tokens per batch per rank (padding counted), epoch {stats['epoch']}",
        "",
        *bucket_table(stats),
    ]
    lines += [
        "",
        f"steps per epoch        {stats['num_steps']:,} micro-steps (one batch per rank each, every rank in the same "
        f"bucket), {stats['num_steps'] // stats['steps_multiple']:,} optimizer steps",
        f"padding efficiency     {stats['pad_efficiency']:.4f} (real tokens / computed tokens)",
        f"sequence length        min {stats['length_min']}, mean {stats['length_mean']:.1f}, max {stats['length_max']}",
        f"longest same-bucket run {stats['max_same_bucket_run']} (cap {stats['run_cap']}"
        + (f", relaxed from {stats['max_run']}: one bucket holds too many steps" if stats["run_cap"] > stats["max_run"] else "")
        + ")",
        *plan_notes(stats),
        "",
        f"bucket sequence over the epoch ({len(step_buckets):,} steps, left to right; shade = share of the column's steps):",
        *bucket_picture(step_buckets, sampler.num_buckets),
        "first steps: " + "".join(str(b) if b < 10 else "+" for b in step_buckets[:100].tolist()),
    ]
    return "\n".join(lines)


def parse_bytes(text: str) -> int:
    """"80GB", "141GiB", "80" (GiB) -> bytes; GB counts as GiB, as GPU memory is quoted."""
    number = text.upper().removesuffix("IB").removesuffix("B").removesuffix("G")
    try:
        return int(float(number) * GiB)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give GPU memory as e.g. 80GB") from None


def memory_report(cfg, world_size: int, gpu_bytes: int, gpus_per_node: int) -> tuple[str, dict]:
    """The plan training prints at start-up, on a GPU of `gpu_bytes` (bf16 unless target.dtype=fp32)."""
    cfg = OmegaConf.merge(OmegaConf.structured(Config), cfg)
    dtype_bytes = 4 if cfg.target.dtype in ("fp32", "float32") else 2
    model_config = target_model_config(cfg.target.path, cfg.target.random)
    ds = (deepspeed_config(cfg.train.ds_config, cfg, world_size, dtype_bytes == 2,
                           model_config.get_text_config().hidden_size, on_cpu=False)
          if cfg.train.engine == "deepspeed" else None)
    plan = plan_memory(plan_inputs(cfg, model_config, world_size, ds, dtype_bytes))
    lines = plan.lines(gpu_bytes)
    if plan.total > gpu_bytes:
        changes = fitting_changes(plan.inputs, gpu_bytes, node_ranks=min(world_size, gpus_per_node))
        lines.append("does not fit; changes that fit: " + ("; ".join(changes) or "none alone, combine them"))
    return "\n".join(lines), {"gpu": plan.gpu, "host": plan.host, "total": plan.total, "gpu_memory": gpu_bytes}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--lengths", help=".npy array or text file with one integer length per line")
    source.add_argument("--dataset", help="prepared dataset directory (save_to_disk) with a 'length' column")
    parser.add_argument("--cfg", required=True, help="YAML config with a data: section")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--epoch", type=int, default=0)
    parser.add_argument("--json", help="write the statistics and per-step bucket ids here")
    parser.add_argument("--gpu-memory", type=parse_bytes, help="print the per-GPU memory plan for GPUs of this "
                        "size, e.g. 80GB")
    parser.add_argument("--memory-only", action="store_true", help="only the memory plan (no dataset needed)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="the largest target.tp_size a change may suggest")
    parser.add_argument("overrides", nargs="*", help="OmegaConf dotlist overrides, e.g. data.tokens_per_batch=32768")
    args = parser.parse_args(argv)

    try:
        cfg_path = find_in_repo(args.cfg, "configs", f"--cfg {args.cfg}")
        cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(cfg_path),
                              OmegaConf.from_dotlist(args.overrides))
    except ConfigError as error:
        parser.error(str(error))
    except OSError as error:
        parser.error(f"--cfg {args.cfg}: {error}")
    except CONFIG_FILE_ERRORS as error:
        parser.error(f"--cfg {args.cfg}: {config_error_reason(error)}")
    memory = None
    if args.gpu_memory:
        try:
            text, memory = memory_report(cfg, args.world_size, args.gpu_memory, args.gpus_per_node)
        except ConfigError as error:  # what train.py refuses before anything loads
            parser.error(str(error))
        print(text)
        if args.memory_only:
            return {"memory": memory}
        print()
    elif args.memory_only:
        parser.error("--memory-only needs --gpu-memory")
    data_cfg = cfg.data
    groups = None
    if not (args.lengths or args.dataset or not OmegaConf.is_missing(data_cfg, "path")):
        parser.error("give --lengths or --dataset, or set data.path in the config")
    try:
        if args.lengths:
            lengths = read_lengths_file(args.lengths)
        else:
            lengths, groups = read_dataset(args.dataset or data_cfg.path)
    except (OSError, ValueError) as error:  # no such file or dataset, or one without lengths
        parser.error(str(error))

    held_out = 0
    if data_cfg.eval_path is None:
        train_rows, eval_rows = split_holdout(np.arange(len(lengths)) if groups is None else groups,
                                              data_cfg.eval_fraction, data_cfg.seed)
        lengths, held_out = lengths[train_rows], len(eval_rows)
    grad_accum = OmegaConf.select(cfg, "optim.grad_accum", default=1)
    sampler = sampler_from_config(lengths, data_cfg, args.world_size, steps_multiple=grad_accum)
    stats = sampler.stats(args.epoch)
    epoch_plan = sampler.epoch_plan(args.epoch)
    print(format_report(stats, sampler, epoch_plan.step_buckets, held_out))

    first_samples = epoch_plan.samples[epoch_plan.offsets[:-1]]  # bucket of each rank's actual batch
    rank_buckets = sampler.sample_buckets[first_samples].reshape(len(epoch_plan), args.world_size)
    plan = {**stats, "held_out": held_out, "steps": rank_buckets.tolist(), **({"memory": memory} if memory else {})}
    if args.json:
        Path(args.json).write_text(json.dumps(plan))
        print(f"\nwrote {args.json}")
    return plan


if __name__ == "__main__":
    main(sys.argv[1:])
