"""train.py with faults injected from FAULT_* environment variables (tests only):

    FAULT_NAN_STEPS=3,4     training micro steps (1-based, counted per rank) whose loss becomes NaN
    FAULT_NAN_RANKS=1       ranks that inject them (default: every rank)
    FAULT_STALE_LISTING=1   ranks that see no checkpoints when listing run.out_dir (a stale NFS cache)
"""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import drafter.training.checkpoint  # noqa: E402
import train  # noqa: E402


def rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def ranks(name: str) -> set[int] | None:
    value = os.environ.get(name)
    return None if value is None else {int(r) for r in value.split(",")}


nan_steps = {int(s) for s in os.environ.get("FAULT_NAN_STEPS", "").split(",") if s}
if nan_steps and (ranks("FAULT_NAN_RANKS") is None or rank() in ranks("FAULT_NAN_RANKS")):
    calls, real_step = [0], train.training_step

    def faulty_step(*args, **kwargs):
        loss, metrics = real_step(*args, **kwargs)
        if torch.is_grad_enabled():  # a training micro step, not eval
            calls[0] += 1
            if calls[0] in nan_steps:
                loss = loss * float("nan")
        return loss, metrics

    train.training_step = faulty_step

stale = ranks("FAULT_STALE_LISTING")
if stale and rank() in stale:
    drafter.training.checkpoint.complete_checkpoints = lambda root: []

sys.exit(train.main(sys.argv[1:]))
