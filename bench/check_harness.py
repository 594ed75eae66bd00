"""The harness of bench/gpu_check.py's checks: a log line with the time since the start, a check's
failure (CheckFailed, require), its time budget (CheckTimeout, time_budget) and the loop that runs
every check whatever the others did (run_check, run_checks); plus what the in-process checks
(bench/gpu_check.py) and the preflight's run checks (bench/preflight_runs.py) both build models and
batches with (build_on, make_batch).

In-process checks are stopped by SIGALRM, which Python handles between bytecodes: a hang inside one
C call is caught only by the subprocess checks, whose own budgets kill their process tree.
"""
import signal
import time
import traceback
from contextlib import contextmanager, nullcontext

import torch

START = time.perf_counter()  # log's clock, reset by bench/gpu_check.py's main


def log(message: str):
    print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - START:6.1f}s] {message}", flush=True)


class CheckFailed(Exception):
    pass


def require(condition: bool, message: str):
    if not condition:
        raise CheckFailed(message)


@contextmanager
def build_on(device: torch.device, dtype: torch.dtype):
    """Modules built inside get their weights created (and initialised) directly on `device` in
    `dtype`: the 8B target is never materialised in fp32 on the CPU."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)  # later float tensors (anchor scores, weights) stay fp32


def make_batch(vocab_size: int, batch: int, seq_len: int, prompt: int, device: torch.device, seed: int = 0):
    """Random tokens; loss mask on after the prompt."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (batch, seq_len), generator=gen).to(device)
    loss_mask = torch.ones(batch, seq_len, dtype=torch.long, device=device)
    loss_mask[:, :prompt] = 0
    return input_ids, loss_mask


class CheckTimeout(Exception):
    pass


@contextmanager
def time_budget(seconds: int):
    """CheckTimeout in the main thread once `seconds` have passed (SIGALRM; only between bytecodes,
    so not inside a hung C call). Outside the main thread: no budget."""
    def expire(signum, frame):
        raise CheckTimeout(f"timeout after {seconds} s (hang?)")
    try:
        previous = signal.signal(signal.SIGALRM, expire)
    except ValueError:  # not the main thread
        yield
        return
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_check(name: str, function, *args, budget_s: int | None = None) -> tuple[str, dict]:
    log(f"{name} ..." + (f" (budget {budget_s} s)" if budget_s else ""))
    try:
        with time_budget(budget_s) if budget_s else nullcontext():
            figures = function(*args)
        status = "pass"
    except (CheckFailed, CheckTimeout) as failure:
        status, figures = f"FAIL: {failure}", {}
    except Exception as error:  # e.g. out of memory: reported, and the other checks still run
        traceback.print_exc()
        status, figures = f"FAIL: {type(error).__name__}: {error}", {}
    log(f"{name}: {status}")
    return status, figures


def run_checks(checks: list[tuple], budgets: dict[str, int], report: dict) -> None:
    """Each (name, function, *args) under its budget; every check runs whatever the others did."""
    for name, function, *check_args in checks:
        status, figures = run_check(name, function, *check_args, budget_s=budgets.get(name))
        report["checks"][name] = status
        report[name] = figures
