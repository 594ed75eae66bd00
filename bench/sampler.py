"""Bucket sampler vs naive batching: padding efficiency and plan build time on the same lengths.

    python bench/sampler.py [--samples 1000000] [--world-size 8] [--tokens-per-batch 16384]

Lengths: lognormal with median 800, clipped to [16, 8192] (a long tail up to the cap).
Naive (as SpecForge): shuffle, then batches of a fixed sample count padded to their longest. Two
counts are shown: the largest whose worst case fits the same token budget (tokens_per_batch //
8192, the fair memory match), and the bucketed plan's mean samples per batch (same number of
batches, but a worst case far over the budget). Goals: padding efficiency >= 0.95 and an epoch
plan in under 5 s; the exit status is 1 if either is missed.
"""

import argparse
import sys
import time

import numpy as np

from drafter.pipeline.sampler import BucketSampler, make_buckets

MAX_LENGTH = 8192
GOAL_PAD_EFFICIENCY = 0.95
GOAL_PLAN_SECONDS = 5.0


def long_tailed_lengths(num_samples: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(800), 0.8, num_samples)), 16, MAX_LENGTH).astype(np.int64)


def naive_batches(lengths: np.ndarray, batch_size: int, seed: int = 0) -> dict:
    """Random fixed-count batches padded to their longest (the last partial batch dropped)."""
    start = time.perf_counter()
    shuffled = lengths[np.random.default_rng(seed).permutation(len(lengths))]
    batches = shuffled[:len(shuffled) // batch_size * batch_size].reshape(-1, batch_size)
    computed = batches.max(axis=1) * batch_size
    seconds = time.perf_counter() - start
    return {"pad_efficiency": batches.sum() / computed.sum(), "batches": len(batches),
            "real_per_batch": batches.sum() / len(batches), "max_computed": int(computed.max()), "seconds": seconds}


def bucketed_batches(lengths: np.ndarray, tokens_per_batch: int, world_size: int) -> dict:
    start = time.perf_counter()
    boundaries = make_buckets(lengths, num_buckets=6, max_length=MAX_LENGTH)
    sampler = BucketSampler(lengths, boundaries, tokens_per_batch, world_size=world_size, seed=0)
    plan = sampler.epoch_plan(0)
    seconds = time.perf_counter() - start
    stats = sampler.stats(0)
    sizes = np.diff(plan.offsets)
    widths = np.maximum.reduceat(sampler.padded[plan.samples], plan.offsets[:-1])
    return {"pad_efficiency": stats["pad_efficiency"], "batches": stats["num_batches"],
            "real_per_batch": lengths[plan.samples].sum() / stats["num_batches"],
            "max_computed": int((sizes * widths).max()), "seconds": seconds,
            "mean_samples": stats["samples_planned"] / stats["num_batches"], "stats": stats}


def row(name: str, result: dict) -> str:
    return (f"{name:<34} {result['pad_efficiency']:>8.4f} {result['real_per_batch']:>10,.0f} "
            f"{result['max_computed']:>10,} {result['batches']:>9,} {result['seconds']:>8.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--tokens-per-batch", type=int, default=16384)
    args = parser.parse_args(argv)

    lengths = long_tailed_lengths(args.samples)
    print(f"{len(lengths):,} lengths: median {np.median(lengths):.0f}, mean {lengths.mean():.0f}, "
          f"p99 {np.percentile(lengths, 99):.0f}, max {lengths.max()} ({np.sum(lengths == MAX_LENGTH):,} at the cap); "
          f"budget {args.tokens_per_batch:,} tokens per batch")

    bucketed = {world_size: bucketed_batches(lengths, args.tokens_per_batch, world_size)
                for world_size in sorted({1, args.world_size})}
    same_budget = max(1, args.tokens_per_batch // MAX_LENGTH)
    same_batches = round(bucketed[args.world_size]["mean_samples"])
    naive_budget = naive_batches(lengths, same_budget)
    naive_count = naive_batches(lengths, same_batches)

    print(f"\n{'':<34} {'pad eff':>8} {'real/batch':>10} {'max comp':>10} {'batches':>9} {'build s':>8}")
    for world_size, result in bucketed.items():
        print(row(f"bucketed, world size {world_size}", result))
    print(row(f"naive, {same_budget} per batch (same budget)", naive_budget))
    print(row(f"naive, {same_batches} per batch (same steps)", naive_count))

    ours = bucketed[args.world_size]
    stats = ours["stats"]
    print(f"\nbucketed plan: {stats['num_steps']:,} steps x {args.world_size} ranks, longest same-bucket run "
          f"{stats['max_same_bucket_run']}, dropped {stats['dropped_samples']} samples (remainders)")
    print(f"ratio vs naive at the same budget: padding efficiency x{ours['pad_efficiency'] / naive_budget['pad_efficiency']:.2f}, "
          f"real tokens per batch x{ours['real_per_batch'] / naive_budget['real_per_batch']:.2f}, "
          f"batches per epoch x{ours['batches'] / naive_budget['batches']:.3f}")
    print(f"ratio vs naive with as many batches: padding efficiency "
          f"x{ours['pad_efficiency'] / naive_count['pad_efficiency']:.2f}, worst batch "
          f"{naive_count['max_computed'] / args.tokens_per_batch:.1f}x the budget for naive vs "
          f"{ours['max_computed'] / args.tokens_per_batch:.2f}x")

    slowest = max(result["seconds"] for result in bucketed.values())
    efficiency_ok = all(result["pad_efficiency"] >= GOAL_PAD_EFFICIENCY for result in bucketed.values())
    print(f"\ngoal padding efficiency >= {GOAL_PAD_EFFICIENCY}: {'met' if efficiency_ok else 'MISSED'}; "
          f"goal epoch plan < {GOAL_PLAN_SECONDS} s: {'met' if slowest < GOAL_PLAN_SECONDS else 'MISSED'} "
          f"(slowest {slowest:.2f} s)")
    return 0 if efficiency_ok and slowest < GOAL_PLAN_SECONDS else 1


if __name__ == "__main__":
    sys.exit(main())
