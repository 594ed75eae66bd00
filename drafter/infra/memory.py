"""Memory sizes as a user reads them, and the error of a plan that cannot fit the device: shared by
the training run's memory plan (drafter/training/memory_plan.py) and the memory of a DDTree verify as
a batch of paths (drafter/serving/path_memory.py)."""
from drafter.errors import UserError

GiB = 2**30


def size_text(size: int) -> str:
    return f"{size / GiB:.2f} GiB" if size >= GiB / 100 else f"{size / 2**20:.2f} MiB"


class MemoryPlanError(UserError, RuntimeError):
    pass
