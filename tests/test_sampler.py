"""Length-bucket sampler: buckets, packing, interleaving, distributed split, resume, stats,
collate, the DataLoader path and data/plan.py."""

import functools
import itertools
import json
import math
import time

import numpy as np
import pytest
import torch

from data import plan as plan_cli
from drafter.pipeline.loader import collate, make_loader
from drafter.pipeline.sampler import (BucketSampler, _run_cap_holds, held_out_share, interleave_buckets, longest_run,
                                      make_buckets, min_feasible_run, padded_length, plan_notes)
from drafter.pipeline.splits import split_holdout

MAX_LENGTH = 2048
TOKENS_PER_BATCH = 2048
NUM_SAMPLES = 12000
TOO_LONG = 7  # samples over MAX_LENGTH mixed into every distribution


def lengths_of(distribution: str, seed: int) -> tuple[np.ndarray, list[int] | None]:
    """Sample lengths (a few over MAX_LENGTH) and explicit boundaries (None: automatic)."""
    rng = np.random.default_rng(seed)
    n = NUM_SAMPLES - TOO_LONG
    if distribution == "lognormal":
        lengths, boundaries = rng.lognormal(np.log(300), 0.8, n), None
    elif distribution == "uniform":
        lengths, boundaries = rng.uniform(1, MAX_LENGTH, n), None
    elif distribution == "bimodal":
        lengths, boundaries = np.where(rng.random(n) < 0.5, rng.normal(100, 20, n), rng.normal(1500, 200, n)), None
    else:  # long tail under fixed short buckets: the top bucket gets about 70% of all batches
        lengths, boundaries = rng.lognormal(np.log(60), 1.5, n), [32, 64, 128, 256, MAX_LENGTH]
    lengths = np.clip(np.round(lengths), 1, MAX_LENGTH).astype(np.int64)
    lengths = np.concatenate([lengths, rng.integers(MAX_LENGTH + 1, 3 * MAX_LENGTH, TOO_LONG)])
    return rng.permutation(lengths), boundaries


@functools.lru_cache(maxsize=None)
def sampler_for(distribution: str, world_size: int, seed: int, rank: int = 0) -> BucketSampler:
    lengths, boundaries = lengths_of(distribution, seed)
    bounds = make_buckets(lengths, num_buckets=6, max_length=MAX_LENGTH, boundaries=boundaries)
    return BucketSampler(lengths, bounds, TOKENS_PER_BATCH, world_size=world_size, rank=rank, seed=seed)


DISTRIBUTIONS = ["lognormal", "uniform", "bimodal", "dominant"]
CASES = list(itertools.product(DISTRIBUTIONS, [1, 2, 8], [0, 1]))


def in_bucket(sampler: BucketSampler, batch: np.ndarray, bucket: int) -> bool:
    lo = sampler.boundaries[bucket - 1] if bucket else 0
    return bool(np.all((sampler.lengths[batch] > lo) & (sampler.lengths[batch] <= sampler.boundaries[bucket])))


# ---- buckets -------------------------------------------------------------------------------

def test_auto_buckets_are_token_quantiles():
    lengths, _ = lengths_of("lognormal", 0)
    bounds = make_buckets(lengths, num_buckets=6, max_length=MAX_LENGTH)
    assert len(bounds) == 6 and bounds[-1] == MAX_LENGTH
    assert np.all(np.diff(bounds) > 0) and np.all(bounds[:-1] % 8 == 0)
    kept = lengths[lengths <= MAX_LENGTH]
    shares = np.bincount(np.searchsorted(bounds, kept), weights=kept) / kept.sum()
    assert np.all(np.abs(shares - 1 / 6) < 0.03), shares


def test_explicit_buckets_and_bad_input():
    assert make_buckets([5], boundaries=[512, 1024], max_length=4096).tolist() == [512, 1024, 4096]
    assert make_buckets([5], boundaries=[512, 4096], max_length=4096).tolist() == [512, 4096]
    for bad in ([1024, 512], [512, 512], [0, 512], [512, 8192]):
        with pytest.raises(ValueError, match="bound"):
            make_buckets([5], boundaries=bad, max_length=4096)
    with pytest.raises(ValueError, match=r"lengths\[2\] = 0"):
        make_buckets([5, 7, 0, -1], max_length=4096)
    with pytest.raises(ValueError, match="integer"):
        make_buckets([5.5, 7.0], max_length=4096)


def test_tied_lengths_merge_buckets():
    assert make_buckets(np.full(100, 100), num_buckets=6, max_length=4096).tolist() == [104, 4096]


# ---- interleaving --------------------------------------------------------------------------

def _orderable(remaining: tuple, last: int, run: int, cap: int) -> bool:
    """Exhaustive search: can these counts be ordered with runs <= cap, given the current run?"""
    if sum(remaining) == 0:
        return True
    for bucket, count in enumerate(remaining):
        new_run = run + 1 if bucket == last else 1
        if count and new_run <= cap:
            rest = remaining[:bucket] + (count - 1,) + remaining[bucket + 1:]
            if _orderable(rest, bucket, new_run, cap):
                return True
    return False


def test_run_cap_feasibility_is_exact():
    for num_buckets, cap in itertools.product((1, 2, 3), (1, 2, 3)):
        for remaining in itertools.product(range(5), repeat=num_buckets):
            for last in range(num_buckets):
                for run in range(1, cap + 1):
                    assert _run_cap_holds(list(remaining), last, run, cap) == _orderable(remaining, last, run, cap)


def _max_share_deviation(order: np.ndarray, counts) -> float:
    """Largest gap, over buckets and steps, between steps taken and the proportional share."""
    progress = np.arange(1, len(order) + 1) / len(order)
    return max(np.abs(np.cumsum(order == k) - count * progress).max() for k, count in enumerate(counts))


@pytest.mark.parametrize("seed", range(8))
def test_interleave_random_counts(seed):
    rng = np.random.default_rng(seed)
    for trial in range(40):
        counts = rng.integers(0, 150, rng.integers(1, 8))
        if trial % 2:  # one bucket with 50% to 90% of all steps: sometimes over the 75% cap limit
            counts[0] = int(counts[1:].sum() * rng.uniform(1, 9))
        if counts.sum() == 0:
            continue
        order, cap = interleave_buckets(counts, 3, np.random.default_rng(trial))
        assert np.bincount(order, minlength=len(counts)).tolist() == counts.tolist()
        assert cap == max(3, min_feasible_run(counts)) and longest_run(order) <= cap
        if cap > 3:  # relaxed only where needed: one step less is impossible
            assert counts.max() > (cap - 1) * (counts.sum() - counts.max() + 1)
        assert _max_share_deviation(order, counts) <= (cap + len(counts)) / 2
        total = len(order)
        tail = max(math.ceil(0.05 * total), len(counts) if cap == 3 else len(counts) + cap)
        for bucket in np.flatnonzero(counts):
            assert np.flatnonzero(order == bucket)[-1] >= total - tail


# ---- the epoch plan ------------------------------------------------------------------------

@pytest.mark.parametrize("distribution,world_size,seed", CASES)
def test_plan_properties(distribution, world_size, seed):
    sampler = sampler_for(distribution, world_size, seed)
    plan = sampler.epoch_plan(0)
    num_steps = len(plan)
    assert num_steps >= 100 and len(sampler) == num_steps

    for step in range(num_steps):
        batches = plan[step]
        assert len(batches) == world_size and all(len(batch) for batch in batches)
        step_bucket = int(plan.step_buckets[step])
        for batch in batches:  # same bucket on every rank, token budget with padding counted
            assert in_bucket(sampler, batch, step_bucket)
            width = padded_length(sampler.lengths[batch].max(), cap=MAX_LENGTH)
            assert len(batch) * width <= TOKENS_PER_BATCH or len(batch) == 1

    assert len(np.unique(plan.samples)) == len(plan.samples)  # no sample twice across ranks and steps
    assert not np.isin(sampler.skipped, plan.samples).any() and len(sampler.skipped) == TOO_LONG
    assert len(plan.samples) + plan.dropped_samples + TOO_LONG == NUM_SAMPLES
    assert plan.dropped_batches < world_size * sampler.num_buckets

    assert plan.run_cap == 3 and longest_run(plan.step_buckets) <= 3
    for bucket in np.unique(plan.step_buckets):  # every bucket ends in the last 5% of the epoch
        assert np.flatnonzero(plan.step_buckets == bucket)[-1] >= num_steps - math.ceil(0.05 * num_steps)


def test_dominant_bucket_holds_the_cap():
    shares = [b["batch_pct"] for b in sampler_for("dominant", 8, 0).stats(0)["buckets"]]
    assert max(shares) > 60  # the case the cap is hardest for, yet still feasible (< 75%)


def test_infeasible_cap_is_relaxed_and_reported():
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(1500, 2049, 3000), rng.integers(1, 33, 400)])
    sampler = BucketSampler(lengths, [32, MAX_LENGTH], TOKENS_PER_BATCH, world_size=2, seed=0)
    stats = sampler.stats(0)
    long_steps, short_steps = [sum(sampler.epoch_plan(0).step_buckets == k) for k in (1, 0)]
    assert stats["run_cap"] == math.ceil(long_steps / (short_steps + 1)) > 3
    assert stats["max_same_bucket_run"] <= stats["run_cap"]


def test_single_sample_over_budget_goes_alone():
    lengths = np.array([100, 3000, 100, 2500, 100, 50])
    sampler = BucketSampler(lengths, [128, 4096], tokens_per_batch=2048, seed=0)
    batches = sorted(sorted(sampler.epoch_plan(0)[step][0].tolist()) for step in range(len(sampler)))
    assert batches == [[0, 2, 4, 5], [1], [3]]


def test_plans_are_deterministic_and_change_per_epoch():
    lengths, _ = lengths_of("lognormal", 0)
    bounds = make_buckets(lengths, 6, MAX_LENGTH)
    first, second = (BucketSampler(lengths, bounds, TOKENS_PER_BATCH, world_size=2, seed=0) for _ in range(2))
    for epoch in (0, 3):
        a, b = first.epoch_plan(epoch), second.epoch_plan(epoch)
        assert np.array_equal(a.samples, b.samples) and np.array_equal(a.offsets, b.offsets)
        assert np.array_equal(a.step_buckets, b.step_buckets)
    epoch0, epoch1 = first.epoch_plan(0), first.epoch_plan(1)
    assert not np.array_equal(epoch0.step_buckets[:50], epoch1.step_buckets[:50])
    assert np.mean(epoch0.samples[:1000] == epoch1.samples[:1000]) < 0.01
    other_seed = BucketSampler(lengths, bounds, TOKENS_PER_BATCH, world_size=2, seed=1).epoch_plan(0)
    assert np.mean(other_seed.samples[:1000] == epoch0.samples[:1000]) < 0.01


@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_resume_replays_the_tail(world_size):
    lengths, _ = lengths_of("lognormal", 1)
    bounds = make_buckets(lengths, 6, MAX_LENGTH)
    for rank in sorted({0, world_size - 1}):
        full = list(BucketSampler(lengths, bounds, TOKENS_PER_BATCH, world_size, rank, seed=5).batches_for_rank(2))
        for start in (0, 1, len(full) // 2, len(full) - 1, len(full)):
            restarted = BucketSampler(lengths, bounds, TOKENS_PER_BATCH, world_size, rank, seed=5)
            restarted.stats(epoch=0)  # a fresh process that planned another epoch first
            tail = list(restarted.batches_for_rank(2, start_step=start))
            assert len(tail) == len(full) - start
            for got, want in zip(tail, full[start:]):
                assert got.step == want.step and got.bucket == want.bucket
                assert np.array_equal(got.indices, want.indices)


def test_ranks_see_disjoint_slices_of_one_plan():
    world_size = 8
    per_rank = [list(sampler_for("uniform", world_size, 0, rank).batches_for_rank(0)) for rank in range(world_size)]
    assert len({len(batches) for batches in per_rank}) == 1
    for step_batches in zip(*per_rank):
        assert len({batch.bucket for batch in step_batches}) == 1
    seen = np.concatenate([batch.indices for batches in per_rank for batch in batches])
    assert len(np.unique(seen)) == len(seen) == len(sampler_for("uniform", world_size, 0).epoch_plan(0).samples)


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_stats_match_the_plan(distribution):
    sampler = sampler_for(distribution, 2, 0)
    stats, plan = sampler.stats(0), sampler.epoch_plan(0)
    planned = sampler.lengths[plan.samples]
    assert stats["num_steps"] == len(plan) and stats["num_batches"] == 2 * len(plan)
    assert (stats["length_min"], stats["length_max"]) == (planned.min(), planned.max())
    assert stats["length_mean"] == pytest.approx(planned.mean())
    assert stats["skipped_too_long"] == TOO_LONG and stats["dropped_samples"] == plan.dropped_samples
    assert stats["max_same_bucket_run"] == longest_run(plan.step_buckets)

    real = computed = 0
    batches_per_bucket = np.zeros(sampler.num_buckets, dtype=int)
    for step in range(len(plan)):
        for batch in plan[step]:
            real += sampler.lengths[batch].sum()
            computed += len(batch) * padded_length(sampler.lengths[batch].max(), cap=MAX_LENGTH)
            batches_per_bucket[plan.step_buckets[step]] += 1
    assert stats["pad_efficiency"] == pytest.approx(real / computed)
    assert stats["pad_efficiency"] > 0.95
    rows = stats["buckets"]
    assert [row["batches"] for row in rows] == batches_per_bucket.tolist()
    assert sum(row["batch_pct"] for row in rows) == pytest.approx(100)
    assert sum(row["samples"] for row in rows) == len(plan.samples)
    assert sum(row["tokens"] for row in rows) == real
    assert [row["hi"] for row in rows] == sampler.boundaries.tolist()
    assert all(rows[k]["lo"] == rows[k - 1]["hi"] + 1 for k in range(1, len(rows)))


def test_split_holdout_of_single_rows():
    rows = np.arange(1000)
    train, held = split_holdout(rows, 0.05, seed=3)
    assert len(held) == 50 and len(train) == 950
    assert np.array_equal(np.sort(np.concatenate([train, held])), rows)
    assert np.array_equal(held, split_holdout(rows, 0.05, seed=3)[1])
    assert not np.array_equal(held, split_holdout(rows, 0.05, seed=4)[1])
    assert len(split_holdout(rows, 0.0, seed=3)[1]) == 0


@pytest.mark.parametrize("seed", range(5))
def test_split_holdout_holds_out_whole_groups(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 40, 300)  # documents of 1..39 rows, rows of a document scattered
    groups = rng.permutation(np.repeat([f"lib/file{i}.py" for i in range(len(sizes))], sizes))
    train, held = split_holdout(groups, 0.05, seed)
    assert np.array_equal(np.sort(np.concatenate([train, held])), np.arange(len(groups)))
    assert not set(groups[train]) & set(groups[held])
    target = 0.05 * len(groups)
    assert abs(len(held) - target) <= sizes.max() / 2
    assert np.array_equal(held, split_holdout(groups, 0.05, seed)[1])
    assert not np.array_equal(held, split_holdout(groups, 0.05, seed + 1)[1])


@pytest.mark.parametrize("seed", range(5))
def test_split_holdout_skips_groups_that_overshoot(seed):
    groups = np.concatenate([np.repeat(np.arange(50), 30), 1000 + np.arange(30)])  # 50 of 30 rows, 30 single rows
    _, held = split_holdout(groups, 0.01, seed)  # 15 rows: a group of 30 would land as far away as none
    assert len(held) == 15 and (groups[held] >= 1000).all()


# ---- collate and the DataLoader path -------------------------------------------------------

def test_collate_pads_right_with_masks():
    rows = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
            {"input_ids": np.arange(1, 12), "loss_mask": np.ones(11, dtype=np.int64)}]
    batch = collate(rows, bucket=4)
    assert batch["bucket"] == 4 and batch["lengths"].tolist() == [3, 11]
    assert batch["input_ids"].shape == batch["loss_mask"].shape == batch["attention_mask"].shape == (2, 16)
    assert batch["input_ids"][0].tolist() == [5, 6, 7] + [0] * 13
    assert batch["input_ids"][1, :11].tolist() == list(range(1, 12))
    assert batch["loss_mask"][0].tolist() == [0, 1, 1] + [0] * 13
    assert batch["loss_mask"][1].sum() == 11 and batch["attention_mask"].sum(1).tolist() == [3, 11]
    assert all(t.dtype == torch.long for t in (batch["input_ids"], batch["loss_mask"], batch["attention_mask"]))
    assert collate(rows, bucket=0, max_length=13)["input_ids"].shape[1] == 13  # rounding stops at max_length
    with pytest.raises(ValueError, match="row 1"):
        collate([rows[0], {"input_ids": [1, 2], "loss_mask": [1]}], bucket=0)


def token_rows(lengths: np.ndarray) -> list[dict]:
    """Rows whose tokens all equal their row index, so batches reveal which rows they hold."""
    return [{"input_ids": [i] * int(n), "loss_mask": [1] * int(n)} for i, n in enumerate(lengths)]


def small_sampler(world_size: int, rank: int) -> BucketSampler:
    lengths = np.random.default_rng(0).integers(1, 300, 600)
    return BucketSampler(lengths, make_buckets(lengths, 3, 512), 1024, world_size, rank, seed=0)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_yields_the_plan_from_start_step(num_workers):
    sampler = small_sampler(world_size=2, rank=1)
    rows = token_rows(sampler.lengths)
    start = 7
    expected = list(sampler.batches_for_rank(1, start))
    with make_loader(rows, sampler, epoch=1, start_step=start, num_workers=num_workers, prefetch_factor=2) as loader:
        batches = list(loader)
    assert len(batches) == len(expected) > 0
    for batch, want in zip(batches, expected):
        assert batch["step"] == want.step and batch["bucket"] == want.bucket
        assert batch["input_ids"][:, 0].tolist() == want.indices.tolist()
        assert batch["lengths"].tolist() == sampler.lengths[want.indices].tolist()
        assert batch["input_ids"].shape[1] == padded_length(sampler.lengths[want.indices].max(), cap=512)


def test_loader_queue_depth_fills_and_drains():
    sampler = small_sampler(world_size=1, rank=0)
    loader = make_loader(token_rows(sampler.lengths), sampler, epoch=0, num_workers=0, prefetch_factor=3)
    deadline = time.monotonic() + 10
    while loader.queue_depth() < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loader.queue_depth() == 3  # full: nothing consumed yet
    total = len(loader)
    consumed = sum(1 for _ in loader)
    assert consumed == total == len(sampler) and loader.queue_depth() == 0 and len(loader) == 0
    loader.close()


def test_loader_reports_bad_rows_and_stops_early():
    sampler = small_sampler(world_size=1, rank=0)
    rows = token_rows(sampler.lengths)
    first = next(sampler.batches_for_rank(0)).indices[0]
    rows[first] = {"input_ids": [1], "loss_mask": [1]}
    with pytest.raises(ValueError, match=f"dataset row {first}"):
        list(make_loader(rows, sampler, epoch=0, num_workers=0))
    loader = make_loader(token_rows(sampler.lengths), sampler, epoch=0, num_workers=0, prefetch_factor=2)
    next(loader)
    loader.close()
    assert list(loader) == []


# ---- data/plan.py --------------------------------------------------------------------------

def check_plan_json(path, world_size: int) -> dict:
    plan = json.loads(path.read_text())
    assert {"buckets", "pad_efficiency", "max_same_bucket_run", "steps"} <= plan.keys()
    assert all({"lo", "hi", "samples", "batches"} <= row.keys() for row in plan["buckets"])
    assert len(plan["steps"]) == plan["num_steps"] > 0
    assert all(len(step) == world_size and len(set(step)) == 1 for step in plan["steps"])
    assert sum(row["batches"] for row in plan["buckets"]) == world_size * len(plan["steps"])
    assert sum(row["samples"] for row in plan["buckets"]) == plan["samples_planned"]
    counts = np.bincount([step[0] for step in plan["steps"]], minlength=len(plan["buckets"]))
    assert counts.tolist() == [row["batches"] // world_size for row in plan["buckets"]]
    assert longest_run(np.array([step[0] for step in plan["steps"]])) == plan["max_same_bucket_run"] <= 3
    return plan


def test_plan_cli_on_npy_and_text(tmp_path, capsys):
    lengths, _ = lengths_of("lognormal", 0)
    lengths = np.clip(lengths * 4, 1, 8192)  # the v3 config's 8192-token range
    np.save(tmp_path / "lengths.npy", lengths)
    (tmp_path / "lengths.txt").write_text("\n".join(map(str, lengths.tolist())) + "\n")
    for name, world_size in (("lengths.npy", 8), ("lengths.txt", 2)):
        out = tmp_path / f"{name}.json"
        plan_cli.main(["--lengths", str(tmp_path / name), "--cfg", "configs/v3.yaml",
                       "--world-size", str(world_size), "--json", str(out)])
        plan = check_plan_json(out, world_size)
        assert plan["held_out"] == round(0.01 * NUM_SAMPLES) and plan["samples"] == NUM_SAMPLES - plan["held_out"]
        assert "padding efficiency" in capsys.readouterr().out


def test_plan_cli_overrides_and_bad_line(tmp_path, capsys):
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(map(str, range(1, 3001))) + "\n")
    out = tmp_path / "plan.json"
    plan_cli.main(["--lengths", str(path), "--cfg", "configs/v3.yaml", "--world-size", "2", "--json", str(out),
                   "data.tokens_per_batch=4096", "data.bucket_boundaries=[500,1000,2000]", "data.eval_fraction=0"])
    plan = check_plan_json(out, 2)
    assert plan["tokens_per_batch"] == 4096 and plan["held_out"] == 0
    assert [row["hi"] for row in plan["buckets"]] == [500, 1000, 2000, 8192]
    path.write_text("12\n40\nabc\n7\n")
    with pytest.raises(SystemExit):  # one line naming the file and line, no traceback
        plan_cli.main(["--lengths", str(path), "--cfg", "configs/v3.yaml"])
    assert "lengths.txt, line 3: 'abc' is not an integer length" in capsys.readouterr().err


def test_plan_cli_on_a_prepared_dataset(tmp_path, capsys):
    from datasets import Dataset

    lengths = np.random.default_rng(0).integers(1, 4000, 3000)
    Dataset.from_dict({"length": lengths}).save_to_disk(str(tmp_path / "prepared"))
    out = tmp_path / "plan.json"
    plan_cli.main(["--dataset", str(tmp_path / "prepared"), "--cfg", "configs/v3.yaml", "--world-size", "2",
                   "--json", str(out), "data.eval_fraction=0"])
    plan = check_plan_json(out, 2)
    assert plan["samples"] == 3000
    Dataset.from_dict({"n": lengths}).save_to_disk(str(tmp_path / "unprepared"))
    with pytest.raises(SystemExit):  # one line naming the dataset, no traceback
        plan_cli.main(["--dataset", str(tmp_path / "unprepared"), "--cfg", "configs/v3.yaml"])
    assert "unprepared: no 'length' column" in capsys.readouterr().err


# ---- losses made visible: accumulation cut, rank drops, skips, over-budget samples -----------

@pytest.mark.parametrize("steps_multiple", [3, 8])
def test_steps_multiple_cuts_the_epoch_tail_and_counts_it(steps_multiple):
    lengths, _ = lengths_of("lognormal", 2)
    bounds = make_buckets(lengths, 6, MAX_LENGTH)
    whole = BucketSampler(lengths, bounds, TOKENS_PER_BATCH, world_size=2, seed=0).epoch_plan(1)
    sampler = BucketSampler(lengths, bounds, TOKENS_PER_BATCH, world_size=2, seed=0, steps_multiple=steps_multiple)
    plan, stats = sampler.epoch_plan(1), sampler.stats(1)
    assert len(plan) == len(whole) - len(whole) % steps_multiple and len(plan) % steps_multiple == 0
    assert np.array_equal(plan.step_buckets, whole.step_buckets[:len(plan)])
    assert np.array_equal(plan.samples, whole.samples[:len(plan.samples)])
    assert plan.cut_steps == len(whole) - len(plan) > 0
    assert plan.cut_samples == len(whole.samples) - len(plan.samples)
    assert (stats["cut_steps"], stats["cut_samples"], stats["steps_multiple"]) == (
        plan.cut_steps, plan.cut_samples, steps_multiple)
    accounted = stats["samples_planned"] + stats["skipped_too_long"] + stats["dropped_samples"] + stats["cut_samples"]
    assert accounted == len(lengths)
    with pytest.raises(ValueError, match="steps_multiple"):
        BucketSampler(lengths, bounds, TOKENS_PER_BATCH, steps_multiple=0)


def test_plan_notes_name_every_loss_and_warn_once_about_over_budget_samples():
    lengths = np.concatenate([np.full(300, 100), [1500, 1800, 1800], [5000]])  # 3 over 1024, 1 over 2048
    sampler = BucketSampler(lengths, [128, 2048], tokens_per_batch=1024, world_size=2, seed=0, steps_multiple=4)
    stats = sampler.stats(0)
    assert stats["over_budget"] == 3 and stats["over_budget_longest"] == 1800
    notes = plan_notes(stats)
    assert [line.split()[0] for line in notes] == ["skipped", "dropped", "cut", "warning:"]
    assert "1 samples over max_length 2,048" in notes[0]
    assert f"{stats['dropped_samples']} samples in {stats['dropped_batches']} batches" in notes[1]
    assert f"{stats['cut_samples']} samples in the last {stats['cut_steps']} steps" in notes[2]
    assert "3 samples are longer than tokens_per_batch (1,024; the longest 1,800)" in notes[3]
    quiet = BucketSampler(np.full(300, 100), [128, 2048], tokens_per_batch=1024).stats(0)
    assert quiet["over_budget"] == 0 and not any("warning" in line for line in plan_notes(quiet))


def test_plan_cli_cuts_to_grad_accum_and_holds_out_whole_groups(tmp_path, capsys):
    from datasets import Dataset

    rng = np.random.default_rng(0)
    groups = np.repeat([f"file{i}.py" for i in range(60)], 70)  # 60 documents of 70 rows
    Dataset.from_dict({"length": rng.integers(1, 6000, len(groups)), "group": groups}).save_to_disk(
        str(tmp_path / "prepared"))
    out = tmp_path / "plan.json"
    plan_cli.main(["--dataset", str(tmp_path / "prepared"), "--cfg", "configs/v3.yaml", "--world-size", "2",
                   "--json", str(out), "optim.grad_accum=4", "data.eval_fraction=0.04",
                   "data.tokens_per_batch=4096"])
    plan = json.loads(out.read_text())
    assert plan["num_steps"] % 4 == 0 and plan["steps_multiple"] == 4
    assert plan["held_out"] == 140  # 2 documents (168 rows were asked for; 3 documents are 210)
    assert plan["samples_planned"] + plan["dropped_samples"] + plan["cut_samples"] + plan["skipped_too_long"] \
        == plan["samples"] == len(groups) - plan["held_out"]
    report = capsys.readouterr().out
    assert f"cut (accumulation)     {plan['cut_samples']} samples" in report
    assert report.count("warning:") == 1 and "longer than tokens_per_batch (4,096" in report


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_held_out_row_is_evaluated_once_over_the_ranks(world_size):
    """Training plans drop batches to even out ranks; the held-out plans must not (a small eval split
    would lose a large share of its rows)."""
    lengths = np.random.default_rng(world_size).integers(20, 300, size=37)
    lengths[5] = 900  # too long for max_length: the one row left out
    seen = []
    for rank in range(world_size):
        rows, sampler = held_out_share(lengths, 512, 1024, world_size, rank, seed=0)
        plan = sampler.epoch_plan(0)
        seen += rows[plan.samples].tolist()
    assert sorted(seen) == [i for i in range(37) if i != 5]
