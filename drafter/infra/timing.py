"""Wall time of a call, measured by torch.utils.benchmark: warmed up, the accelerator (if any)
synchronised around each timed block, at the current torch thread count (Timer's default is one)."""
from collections.abc import Callable

import torch


def best_time(fn: Callable[[], object], min_run_time: float) -> float:
    """Seconds per call of `fn`: the fastest block of Timer.blocked_autorange, which times blocks of
    calls for about `min_run_time` seconds after its warm-up (at least one block: a call slower than
    `min_run_time` is timed once)."""
    from torch.utils import benchmark  # here: importing it takes ~0.2 s, and most processes never time

    timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return min(timer.blocked_autorange(min_run_time=min_run_time).times)
