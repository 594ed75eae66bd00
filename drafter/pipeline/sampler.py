"""Length-bucketed, token-budget batching with a distributed, resumable epoch plan.

One epoch is planned up front, as a pure function of (seed, epoch):

1. Every sample goes to the length bucket whose range (previous bound, bound] holds it. Samples
   longer than the top bound are skipped (counted in `stats`), never truncated or over-padded.
2. Within a bucket, samples are shuffled, cut into windows of about `sort_window` batches' worth of
   tokens, sorted by length inside each window, and packed greedily: a batch takes samples while
   n_samples * padded_longest <= tokens_per_batch (one sample over the budget goes alone). Batches
   therefore cost about the same whatever their bucket, and padding stays small.
3. Each bucket's batches are shuffled and grouped world_size at a time into steps: at a step every
   rank gets a batch of the same bucket. So that every rank has the same number of steps, each
   bucket drops its (count mod world_size) batches with the fewest samples for this epoch
   (counted in `stats`; a new shuffle decides next epoch); nothing is ever repeated.
4. The steps of all buckets are interleaved (`interleave_buckets`) so every bucket is spread in
   proportion over the whole epoch, all buckets end together, and no bucket runs more than
   `max_run` steps in a row.
5. The epoch's last (steps mod steps_multiple) steps are cut (counted in `stats`), so that it
   holds whole optimizer steps of `steps_multiple` micro-steps (gradient accumulation).

A sample longer than tokens_per_batch goes alone in its batch, over the budget; `stats` counts
them and `plan_notes` warns about them. `plan_notes` lists every sample a plan leaves out, by cause.

Resuming at (epoch, step) replays the same plan from that step; drafter/pipeline/loader.py loads and
collates the planned batches.
"""

import math
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Sequence

import numpy as np

PAD_MULTIPLE = 8  # batches are padded to a multiple of 8 tokens (capped at the top bucket bound)
SORT_WINDOW = 32  # batches' worth of tokens sorted together: larger -> less padding, less mixing

_EPOCH_STREAM = 0  # the seed's stream for epoch plans; splits.py's hold-out draws on stream 1


def _rng(seed: int, *stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=stream))


def padded_length(length, multiple: int = PAD_MULTIPLE, cap: int | None = None):
    """Length a batch whose longest sample is `length` is padded to: rounded up to `multiple`,
    but never beyond max(length, cap). Works on ints and integer arrays."""
    rounded = -(-length // multiple) * multiple
    return rounded if cap is None else np.minimum(rounded, np.maximum(length, cap))


def _validate_lengths(lengths) -> np.ndarray:
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or not (lengths.size == 0 or np.issubdtype(lengths.dtype, np.integer)):
        raise ValueError(f"lengths must be a 1-D integer array, got shape {lengths.shape} dtype {lengths.dtype}")
    bad = np.flatnonzero(lengths < 1)
    if bad.size:
        raise ValueError(f"lengths[{bad[0]}] = {lengths[bad[0]]}: every sample needs at least one token "
                         f"({bad.size} such rows)")
    return lengths.astype(np.int64)


def make_buckets(lengths, num_buckets: int = 6, max_length: int = 8192, boundaries=None) -> np.ndarray:
    """Upper bounds (inclusive, strictly increasing, last == max_length) of the length buckets.

    Explicit `boundaries` are used as given (max_length is appended if they stop below it).
    Otherwise the bounds are quantiles of the token distribution of `lengths` (samples up to
    max_length), so each bucket holds about the same number of tokens and hence of batches;
    they are rounded up to a multiple of PAD_MULTIPLE and duplicates merged, so heavily tied
    data can give fewer than `num_buckets` buckets.
    """
    if boundaries is not None:
        bounds = np.asarray(list(boundaries), dtype=np.int64)
        if bounds.ndim != 1 or bounds.size == 0 or bounds[0] < 1 or np.any(np.diff(bounds) <= 0):
            raise ValueError(f"bucket boundaries must be increasing positive integers, got {list(boundaries)}")
        if bounds[-1] > max_length:
            raise ValueError(f"bucket boundary {bounds[-1]} exceeds max_length {max_length}")
        return bounds if bounds[-1] == max_length else np.append(bounds, max_length)
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
    kept = np.sort(_validate_lengths(lengths))
    kept = kept[kept <= max_length]
    if kept.size == 0:
        return np.array([max_length], dtype=np.int64)
    cumulative_tokens = np.cumsum(kept)
    targets = cumulative_tokens[-1] * np.arange(1, num_buckets) / num_buckets
    quantiles = kept[np.searchsorted(cumulative_tokens, targets)]
    inner = np.minimum(padded_length(quantiles), max_length)
    return np.unique(np.append(inner, max_length)).astype(np.int64)


def min_feasible_run(steps_per_bucket: Sequence[int]) -> int:
    """Smallest cap on same-bucket runs that can hold for these step counts: a bucket with c of
    n steps needs its runs separated by the other n - c steps, so runs of ceil(c / (n - c + 1))."""
    total = sum(steps_per_bucket)
    return max((math.ceil(c / (total - c + 1)) for c in steps_per_bucket if c), default=1)


def _run_cap_holds(remaining: list[int], last: int, run: int, run_cap: int) -> bool:
    """Whether the `remaining` steps per bucket can still be ordered with runs <= run_cap when
    bucket `last` has just run `run` steps. Exact: `last` can add run_cap - run steps to its run
    and then runs of run_cap between the others; any other bucket runs of run_cap around them."""
    steps_left = sum(remaining)
    for bucket, count in enumerate(remaining):
        others = steps_left - count
        limit = (run_cap - run) + run_cap * others if bucket == last else run_cap * (others + 1)
        if count > limit:
            return False
    return True


def interleave_buckets(steps_per_bucket: Sequence[int], max_run: int,
                       rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """Order the steps of all buckets over one epoch. Returns (bucket id per step, run cap used).

    The order is built backwards from the epoch's end. Counting steps from the end, bucket k's
    j-th of c steps is due at a time drawn uniformly in ((j-1)/c, j/c] of the epoch, and its
    very last step in the final step slot; the earliest due step is placed next. This keeps every
    bucket within a few steps of its proportional share everywhere and puts every bucket's last
    step in the final few steps. A step that would break the run cap, or leave the rest
    impossible to order under it, yields to the next due one. If one bucket holds so many steps
    that max_run cannot hold (more than about max_run / (max_run + 1) of them), the cap is
    relaxed to the smallest feasible one, which is returned.
    """
    counts = [int(c) for c in steps_per_bucket]
    total = sum(counts)
    run_cap = max(max_run, min_feasible_run(counts))
    due_from_end = []
    for count in counts:
        due = (np.arange(1, count + 1) - rng.random(count)) * (total / max(count, 1))
        if count:
            due[0] = 1 - rng.random()  # every bucket's last step falls in the final slot
        due_from_end.append(due.tolist())

    remaining = counts[:]
    order = np.empty(total, dtype=np.int64)
    last, run = -1, 0
    for position in range(total - 1, -1, -1):
        candidates = sorted((due_from_end[k][counts[k] - remaining[k]], k) for k in range(len(counts)) if remaining[k])
        for _, bucket in candidates:
            new_run = run + 1 if bucket == last else 1
            remaining[bucket] -= 1
            if new_run <= run_cap and _run_cap_holds(remaining, bucket, new_run, run_cap):
                break
            remaining[bucket] += 1
        else:
            raise AssertionError("interleave_buckets: no bucket keeps the run cap feasible")
        order[position] = bucket
        last, run = bucket, new_run
    return order, run_cap


def longest_run(values: np.ndarray) -> int:
    """Length of the longest run of equal consecutive values (0 for an empty array)."""
    if len(values) == 0:
        return 0
    edges = np.concatenate(([-1], np.flatnonzero(np.diff(values) != 0), [len(values) - 1]))
    return int(np.diff(edges).max())


def _pack_ascending(padded: np.ndarray, tokens_per_batch: int) -> list[int]:
    """Greedy batch sizes for ascending padded lengths: each batch takes samples while
    count * longest <= tokens_per_batch (at least one sample)."""
    sizes = []
    start = 0
    while start < len(padded):
        window = padded[start:start + max(1, tokens_per_batch // int(padded[start]))]
        fits = window * np.arange(1, len(window) + 1) <= tokens_per_batch
        size = max(1, int(np.count_nonzero(fits)))
        sizes.append(size)
        start += size
    return sizes


class PlannedBatch(NamedTuple):
    step: int
    bucket: int
    indices: np.ndarray  # sample indices into the lengths / dataset


@dataclass(frozen=True)
class EpochPlan:
    """Every rank's batches for one epoch. plan[step][rank] -> sample indices."""

    epoch: int
    world_size: int
    step_buckets: np.ndarray  # [steps] bucket id of each step (same on every rank)
    samples: np.ndarray  # sample indices, batch after batch, step-major then rank
    offsets: np.ndarray  # [steps * world_size + 1] batch boundaries in `samples`
    dropped_batches: int  # to even out ranks
    dropped_samples: int
    cut_steps: int  # the last steps, to a multiple of steps_multiple
    cut_samples: int
    run_cap: int  # the max_run that was enforced (relaxed if the requested one was infeasible)

    def __len__(self) -> int:
        return len(self.step_buckets)

    def batch(self, step: int, rank: int) -> np.ndarray:
        slot = step * self.world_size + rank
        return self.samples[self.offsets[slot]:self.offsets[slot + 1]]

    def __getitem__(self, step: int) -> list[np.ndarray]:
        if not 0 <= step < len(self):
            raise IndexError(f"step {step} out of range for an epoch of {len(self)} steps")
        return [self.batch(step, rank) for rank in range(self.world_size)]


class BucketSampler:
    """Plans epochs of same-bucket, token-budget batches for `world_size` ranks (see module doc).

    `lengths[i]` is the token count of dataset row i; `boundaries` the bucket upper bounds
    (make_buckets), the last one the longest sample allowed; `steps_multiple` the gradient
    accumulation (each epoch's step count is a multiple of it). Plans are pure functions of
    (seed, epoch); the last one is cached. len(sampler) is the number of steps of epoch 0: other
    epochs pack slightly differently and can differ by a few steps (len(sampler.epoch_plan(e))).
    """

    # over six: one argument per sampler setting (the data.* keys and the rank's place), most defaulted
    def __init__(self, lengths, boundaries, tokens_per_batch: int, world_size: int = 1, rank: int = 0,
                 seed: int = 0, max_run: int = 3, sort_window: int = SORT_WINDOW, steps_multiple: int = 1):
        if min(tokens_per_batch, max_run, sort_window, steps_multiple) < 1:
            raise ValueError("tokens_per_batch, max_run, sort_window and steps_multiple must be >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.lengths = _validate_lengths(lengths)
        self.boundaries = make_buckets(self.lengths, max_length=int(boundaries[-1]), boundaries=boundaries)
        self.max_length = int(self.boundaries[-1])
        self.tokens_per_batch = int(tokens_per_batch)
        self.world_size = int(world_size)
        self.rank = int(rank)
        self.seed = int(seed)
        self.max_run = int(max_run)
        self.sort_window = int(sort_window)
        self.steps_multiple = int(steps_multiple)
        self.padded = padded_length(self.lengths, cap=self.max_length)
        self.sample_buckets = np.searchsorted(self.boundaries, self.lengths, side="left")
        self.skipped = np.flatnonzero(self.sample_buckets == self.num_buckets)
        self.over_budget = np.flatnonzero((self.sample_buckets < self.num_buckets)
                                          & (self.padded > self.tokens_per_batch))
        self._cached_plan: EpochPlan | None = None

    @property
    def num_buckets(self) -> int:
        return len(self.boundaries)

    def __len__(self) -> int:
        return len(self.epoch_plan(0))

    def _pack_bucket(self, members: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Shuffled members reordered by length within sort windows, and their batch sizes."""
        padded = self.padded[members]
        window = np.cumsum(padded) // (self.sort_window * self.tokens_per_batch)
        order = np.argsort(window * (self.max_length + 1) + padded, kind="stable")
        members, padded, window = members[order], padded[order], window[order]
        window_starts = np.flatnonzero(np.diff(window, prepend=-1))
        window_ends = np.append(window_starts[1:], len(members))
        sizes = []
        for start, end in zip(window_starts, window_ends):
            sizes.extend(_pack_ascending(padded[start:end], self.tokens_per_batch))
        return members, np.asarray(sizes, dtype=np.int64)

    def epoch_plan(self, epoch: int) -> EpochPlan:
        """The full plan of `epoch` for all ranks; deterministic in (seed, epoch)."""
        if self._cached_plan is not None and self._cached_plan.epoch == epoch:
            return self._cached_plan
        rng = _rng(self.seed, _EPOCH_STREAM, epoch)
        shuffled = rng.permutation(np.flatnonzero(self.sample_buckets < self.num_buckets))
        by_bucket = shuffled[np.argsort(self.sample_buckets[shuffled], kind="stable")]
        bucket_sizes = np.bincount(self.sample_buckets[by_bucket], minlength=self.num_buckets)

        packed, batch_sizes, bucket_step_batches = [], [], []
        dropped_batches = dropped_samples = num_batches = 0
        for members in np.split(by_bucket, np.cumsum(bucket_sizes)[:-1]):
            members, sizes = self._pack_bucket(members)
            shuffled_batches = rng.permutation(len(sizes))
            by_size = shuffled_batches[np.argsort(sizes[shuffled_batches], kind="stable")]
            dropped = by_size[:len(sizes) % self.world_size]  # the smallest; equal sizes at random
            kept = shuffled_batches[~np.isin(shuffled_batches, dropped)]
            dropped_batches += len(dropped)
            dropped_samples += int(sizes[dropped].sum())
            bucket_step_batches.append(num_batches + kept.reshape(-1, self.world_size))
            packed.append(members)
            batch_sizes.append(sizes)
            num_batches += len(sizes)
        packed, batch_sizes = np.concatenate(packed), np.concatenate(batch_sizes)
        batch_starts = np.cumsum(batch_sizes) - batch_sizes

        steps_per_bucket = [len(batches) for batches in bucket_step_batches]
        step_buckets, run_cap = interleave_buckets(steps_per_bucket, self.max_run, rng)
        step_batches = np.empty((len(step_buckets), self.world_size), dtype=np.int64)
        for bucket, batches in enumerate(bucket_step_batches):
            step_batches[step_buckets == bucket] = batches
        usable = len(step_buckets) - len(step_buckets) % self.steps_multiple
        cut_samples = int(batch_sizes[step_batches[usable:]].sum())
        cut_steps = len(step_buckets) - usable
        step_buckets, step_batches = step_buckets[:usable], step_batches[:usable]

        slots = step_batches.reshape(-1)
        sizes = batch_sizes[slots]
        offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        samples = packed[np.repeat(batch_starts[slots] - offsets[:-1], sizes) + np.arange(offsets[-1])]
        for array in (step_buckets, samples, offsets):
            array.flags.writeable = False  # plans are cached and shared: nobody may edit one
        self._cached_plan = EpochPlan(epoch, self.world_size, step_buckets, samples, offsets,
                                      dropped_batches, dropped_samples, cut_steps, cut_samples, run_cap)
        return self._cached_plan

    def batches_for_rank(self, epoch: int, start_step: int = 0) -> Iterator[PlannedBatch]:
        """This rank's batches of `epoch` from `start_step` on: resuming at (epoch, step)."""
        plan = self.epoch_plan(epoch)
        for step in range(start_step, len(plan)):
            yield PlannedBatch(step, int(plan.step_buckets[step]), plan.batch(step, self.rank))

    def stats(self, epoch: int = 0) -> dict:
        """Plan statistics for logging: per-bucket counts and share of batches, sequence lengths,
        padding efficiency (real tokens / computed tokens, padding included), every sample left
        out by cause (skipped too long, dropped to even out ranks, cut for accumulation) and the
        samples longer than the token budget."""
        plan = self.epoch_plan(epoch)
        lengths = self.lengths[plan.samples]
        starts = plan.offsets[:-1]
        sizes = np.diff(plan.offsets)
        empty = len(lengths) == 0  # reduceat cannot take an empty array
        batch_tokens = np.add.reduceat(lengths, starts) if not empty else sizes
        batch_width = np.maximum.reduceat(self.padded[plan.samples], starts) if not empty else sizes
        batch_buckets = np.repeat(plan.step_buckets, self.world_size)
        buckets = []
        for bucket, hi in enumerate(self.boundaries):
            in_bucket = batch_buckets == bucket
            buckets.append({
                "lo": int(self.boundaries[bucket - 1]) + 1 if bucket else 1,
                "hi": int(hi),
                "samples": int(sizes[in_bucket].sum()),
                "batches": int(in_bucket.sum()),
                "batch_pct": 100.0 * int(in_bucket.sum()) / max(len(batch_buckets), 1),
                "tokens": int(batch_tokens[in_bucket].sum()),
                "computed_tokens": int((sizes * batch_width)[in_bucket].sum()),
            })
        computed = int((sizes * batch_width).sum())
        return {
            "epoch": epoch,
            "num_steps": len(plan),
            "world_size": self.world_size,
            "num_batches": len(batch_buckets),
            "tokens_per_batch": self.tokens_per_batch,
            "samples": len(self.lengths),
            "samples_planned": len(plan.samples),
            "max_length": self.max_length,
            "skipped_too_long": len(self.skipped),
            "dropped_samples": plan.dropped_samples,
            "dropped_batches": plan.dropped_batches,
            "steps_multiple": self.steps_multiple,
            "cut_steps": plan.cut_steps,
            "cut_samples": plan.cut_samples,
            "over_budget": len(self.over_budget),
            "over_budget_longest": int(self.lengths[self.over_budget].max()) if len(self.over_budget) else 0,
            "pad_efficiency": float(lengths.sum() / computed) if computed else 1.0,
            "length_min": int(lengths.min()) if not empty else 0,
            "length_mean": float(lengths.mean()) if not empty else 0.0,
            "length_max": int(lengths.max()) if not empty else 0,
            "max_run": self.max_run,
            "run_cap": plan.run_cap,
            "max_same_bucket_run": longest_run(plan.step_buckets),
            "buckets": buckets,
        }


def bucket_table(stats: dict) -> list[str]:
    """The bucket table of `BucketSampler.stats()`: range, samples, batches, % of batches, tokens and
    padding efficiency per bucket (data/plan.py and train.py print it)."""
    lines = [f"{'bucket':>6} {'range':>13} {'samples':>11} {'batches':>9} {'% batches':>9} {'tokens':>15} {'pad eff':>7}"]
    for bucket, row in enumerate(stats["buckets"]):
        efficiency = row["tokens"] / row["computed_tokens"] if row["computed_tokens"] else 1.0
        lines.append(f"{bucket:>6} {row['lo']:>6}-{row['hi']:<6} {row['samples']:>11,} {row['batches']:>9,} "
                     f"{row['batch_pct']:>8.1f}% {row['tokens']:>15,} {efficiency:>7.3f}")
    return lines


def plan_notes(stats: dict) -> list[str]:
    """Lines naming every sample a plan leaves out, by cause, and a warning for samples over the
    token budget (data/plan.py and train.py print them once, under the bucket table)."""
    lines = [
        f"skipped (too long)     {stats['skipped_too_long']:,} samples over max_length {stats['max_length']:,} tokens",
        f"dropped (ranks)        {stats['dropped_samples']:,} samples in {stats['dropped_batches']:,} batches "
        f"(each bucket's batch count cut to a multiple of the world size, {stats['world_size']})",
        f"cut (accumulation)     {stats['cut_samples']:,} samples in the last {stats['cut_steps']:,} steps "
        f"(the epoch cut to a multiple of grad_accum, {stats['steps_multiple']})",
    ]
    if stats["over_budget"]:
        lines.append(f"warning: {stats['over_budget']:,} samples are longer than tokens_per_batch "
                     f"({stats['tokens_per_batch']:,}; the longest {stats['over_budget_longest']:,}): each goes "
                     "alone in a batch over the token budget; raise tokens_per_batch or lower max_length")
    return lines


def held_out_share(lengths, max_length: int, tokens_per_batch: int, world_size: int, rank: int,
                   seed: int) -> tuple[np.ndarray, BucketSampler]:
    """This rank's share of the held-out rows (every world_size-th) and a one-bucket plan over it.
    Unlike training plans nothing is dropped to even out ranks: evaluation runs no collective per
    batch, so every row is evaluated once (one bucket: small splits would lose batches to remainders)."""
    rows = np.arange(rank, len(lengths), world_size)
    return rows, BucketSampler(np.asarray(lengths)[rows], [max_length], tokens_per_batch, seed=seed)


def sampler_from_config(lengths, data_cfg, world_size: int = 1, rank: int = 0,
                        steps_multiple: int = 1) -> BucketSampler:
    """A BucketSampler for the training lengths under the `data:` config section; `steps_multiple`
    is the gradient accumulation (optim.grad_accum)."""
    boundaries = make_buckets(lengths, data_cfg["num_buckets"], data_cfg["max_length"],
                              data_cfg["bucket_boundaries"])
    return BucketSampler(lengths, boundaries, data_cfg["tokens_per_batch"], world_size, rank,
                         data_cfg["seed"], data_cfg["max_run"], steps_multiple=steps_multiple)
