"""Progress and timing of the long jobs.

The progress bar (data/regenerate.py, eval/ddtree_accept.py): tqdm on stderr with the count, rate and
ETA. It is redrawn at most once a second on a terminal and once every 30 s into a log file, so that
logs stay short; `enabled=False` (the ranks that do not report) draws nothing.

The stage timer (the decode loop's draft / verify / commit, the training step's target / drafter /
optimizer): wall time per named stage.
"""
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

from tqdm import tqdm

TERMINAL_INTERVAL, LOG_INTERVAL = 1.0, 30.0  # seconds between redraws


def progress_bar(*, total: int, desc: str, unit: str, enabled: bool = True) -> tqdm:
    """A bar over `total` `unit`s; call .update(n) as they finish and .close() at the end."""
    terminal = sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not enabled,
                mininterval=TERMINAL_INTERVAL if terminal else LOG_INTERVAL, dynamic_ncols=terminal)


class StageTimer:
    """Wall time per stage (`with timer("verify"): ...`), summed in `seconds`. On CUDA the work is
    asynchronous: with `synchronize` the device is synchronised around each stage, so the time is
    the stage's own. `enabled=False` times nothing (where a synchronisation would cost too much)."""

    def __init__(self, device, synchronize: bool = False, enabled: bool = True):
        self.synchronize = synchronize and device.type == "cuda"
        self.enabled = enabled
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, stage: str):
        if not self.enabled:
            yield
            return
        if self.synchronize:
            _cuda_synchronize()
        start = time.perf_counter()
        yield
        if self.synchronize:
            _cuda_synchronize()
        self.seconds[stage] += time.perf_counter() - start


def _cuda_synchronize():
    import torch  # only where a GPU is timed: the server-only jobs of data/regenerate.py never load torch
    torch.cuda.synchronize()
