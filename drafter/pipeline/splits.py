"""The held-out split of a prepared dataset: whole groups of rows (one source document's) held out,
seeded, so that no document straddles train and eval."""
import numpy as np

HOLDOUT_STREAM = 1  # the seed's stream for the split; sampler.py's epoch plans draw on stream 0


def split_holdout(groups, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) row indices, each sorted. `groups` holds one label per row; whole groups are
    held out: in a seeded random order, each group that brings the held-out count closer to
    round(eval_fraction * rows) is taken. Rows of one source document never straddle the split."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    _, row_group, sizes = np.unique(np.asarray(groups), return_inverse=True, return_counts=True)
    target = int(round(len(row_group) * eval_fraction))
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(HOLDOUT_STREAM,)))
    held, count = [], 0
    for group in rng.permutation(len(sizes)):
        if count >= target:
            break
        if abs(count + sizes[group] - target) < target - count:
            held.append(group)
            count += int(sizes[group])
    is_held = np.isin(row_group, held)
    return np.flatnonzero(~is_held), np.flatnonzero(is_held)
