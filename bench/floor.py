"""The accuracy floor a drafter must pass to be reading anything: count-based predictors of each block
slot, fitted on the training set and scored on the held-out set, beside a run's held-out slot accuracy.

    python bench/floor.py --train artifacts/smollm2/train_data --eval artifacts/smollm2/bench_chat_data \\
        [--run runs/smollm2] [--block-size 16]

For a block anchored at p (p and p+1 supervised, as training draws anchors), slot k's label is x_{p+k}.
Two predictors that read no target feature:
- unigram: the commonest supervised token of the training set, at every slot;
- anchor: the commonest x_{p+k} after the anchor token x_p in the training set (a skip-k bigram; the
  unigram where the anchor token was never seen).
A drafter whose held-out slot accuracy (`--run`: the last eval of its metrics.jsonl) sits at the
unigram column predicts the answers' commonest token; below the anchor column it has not yet learned
even what the anchor token alone says. Both are counted over every anchor of the held-out rows, the
run's accuracy over every anchor of its replayed responses (`replay_acc_pos`; older runs: the few
anchors its eval's training step drew, `acc_pos`).
"""
import argparse
from pathlib import Path

import datasets
import numpy as np
import torch

from drafter.models.blocks import anchor_candidates
from drafter.training.tracking import read_metrics


def anchor_pairs(dataset, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(x_p, x_{p+k}) over every anchor p (training's rule: `anchor_candidates`) of every row whose slot k
    is supervised."""
    anchors, labels = [], []
    for row in dataset.select_columns(["input_ids", "loss_mask"]).with_format("numpy"):
        ids, mask = row["input_ids"].astype(np.int64), row["loss_mask"].astype(bool)
        n = len(ids) - k
        if n < 1:
            continue
        allowed = anchor_candidates(torch.from_numpy(mask)[None])[0].numpy()
        p = np.flatnonzero(allowed[:n] & mask[k:])
        anchors.append(ids[p])
        labels.append(ids[p + k])
    return (np.concatenate(anchors), np.concatenate(labels)) if anchors else (np.zeros(0, int), np.zeros(0, int))


def commonest_next(anchors: np.ndarray, labels: np.ndarray) -> dict[int, int]:
    """For each anchor token, its commonest label (ties: the smallest token id)."""
    pairs, counts = np.unique(np.stack([anchors, labels], 1), axis=0, return_counts=True)
    order = np.lexsort((pairs[:, 1], -counts, pairs[:, 0]))  # by anchor, then most counted, then id
    pairs = pairs[order]
    first = np.ones(len(pairs), dtype=bool)
    first[1:] = pairs[1:, 0] != pairs[:-1, 0]
    return dict(zip(pairs[first, 0].tolist(), pairs[first, 1].tolist()))


def slot_floors(train, held_out, block_size: int) -> list[dict]:
    """Per slot 1..block_size-1: the unigram and anchor predictors' held-out accuracy and the anchor count."""
    train_pairs = {k: anchor_pairs(train, k) for k in range(1, block_size)}
    every_label = train_pairs[1][1]
    if not len(every_label):
        raise ValueError("the training set has no anchor (no two supervised tokens in a row)")
    values, counts = np.unique(every_label, return_counts=True)
    unigram = int(values[np.argmax(counts)])
    rows = []
    for k in range(1, block_size):
        table = commonest_next(*train_pairs[k])
        anchors, labels = anchor_pairs(held_out, k)
        guess = np.array([table.get(a, unigram) for a in anchors.tolist()], dtype=np.int64)
        rows.append({"slot": k, "anchors": int(len(labels)),
                     "unigram": float((labels == unigram).mean()) if len(labels) else float("nan"),
                     "anchor": float((guess == labels).mean()) if len(labels) else float("nan")})
    return rows


def last_eval_accuracy(run: Path) -> tuple[int, list[float]] | None:
    """(step, held-out accuracy per slot) of the last eval record of a run's metrics.jsonl (lines a
    kill cut short are skipped, as `read_metrics` reads any run's log)."""
    records, _ = read_metrics(run / "metrics.jsonl")
    evals = [r for r in records.get("eval", []) if "acc_pos" in r]
    return (evals[-1]["step"], evals[-1].get("replay_acc_pos", evals[-1]["acc_pos"])) if evals else None


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train", required=True, help="prepared training set (data/prepare.py output)")
    parser.add_argument("--eval", required=True, help="prepared held-out set")
    parser.add_argument("--run", type=Path, help="a training run directory: its last eval's slot accuracy")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    if args.block_size < 2:
        parser.error("--block-size must be >= 2")
    if args.run and not (args.run / "metrics.jsonl").is_file():
        parser.error(f"--run {args.run}: no metrics.jsonl there (a train.py run directory holds one)")
    try:
        train, held_out = (datasets.load_from_disk(path) for path in (args.train, args.eval))
        rows = slot_floors(train, held_out, args.block_size)
    except (OSError, ValueError, KeyError) as error:  # no dataset there, or not a prepared one
        parser.error(f"--train {args.train} / --eval {args.eval}: {error}")
    measured = last_eval_accuracy(args.run) if args.run else None
    if args.run and measured is None:
        parser.error(f"{args.run}/metrics.jsonl holds no eval record with acc_pos")
    header = "| slot | held-out anchors | unigram | anchor |" + (f" run, step {measured[0]} |" if measured else "")
    print(header)
    print("|" + "---:|" * (header.count("|") - 1))
    for row in rows:
        run_cell = f" {measured[1][row['slot'] - 1]:.3f} |" if measured and row["slot"] <= len(measured[1]) else ""
        print(f"| {row['slot']} | {row['anchors']} | {row['unigram']:.3f} | {row['anchor']:.3f} |{run_cell}")
    return rows


if __name__ == "__main__":
    main()
