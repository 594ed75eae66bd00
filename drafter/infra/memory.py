"""Memory sizes as a user reads them, and the error of a plan that cannot fit the device: shared by
the training run's memory plan (drafter/training/memory_plan.py) and the memory of a DDTree verify as
a batch of paths (drafter/serving/path_memory.py); a process's peak memory as the benchmarks measure it."""
import resource

import torch

from drafter.errors import UserError

GiB = 2**30


def size_text(size: int) -> str:
    return f"{size / GiB:.2f} GiB" if size >= GiB / 100 else f"{size / 2**20:.2f} MiB"


class MemoryPlanError(UserError, RuntimeError):
    pass


def peak_memory_bytes(device: torch.device) -> int:
    """The peak memory of this process on `device`: CUDA's most allocated there, else the process's
    largest resident set (the CPU's peak, allocator and all)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
