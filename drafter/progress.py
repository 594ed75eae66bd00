"""The progress bar of the long jobs (data/regenerate.py, eval/ddtree_accept.py): tqdm on stderr with
the count, rate and ETA. It is redrawn at most once a second on a terminal and once every 30 s into a
log file, so that logs stay short; `enabled=False` (the ranks that do not report) draws nothing."""
import sys

from tqdm import tqdm

TERMINAL_INTERVAL, LOG_INTERVAL = 1.0, 30.0  # seconds between redraws


def progress_bar(*, total: int, desc: str, unit: str, enabled: bool = True) -> tqdm:
    """A bar over `total` `unit`s; call .update(n) as they finish and .close() at the end."""
    terminal = sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not enabled,
                mininterval=TERMINAL_INTERVAL if terminal else LOG_INTERVAL, dynamic_ncols=terminal)
