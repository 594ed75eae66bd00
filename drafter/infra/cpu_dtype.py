"""Whether this CPU runs bf16 matmuls fast: what `dtype: auto` picks on a CPU (drafter/target_model/model.py).

CPUs with AVX-512 BF16 or AMX run a bf16 matmul faster than an fp32 one; the rest (AVX2 only, e.g. AMD
EPYC before Zen 4) emulate bf16 and run it tens of times slower. The instruction set torch reports
(`torch.backends.cpu.get_cpu_capability()`) does not say which on its own ("AVX512" covers both), so a
short probe decides: one 512x512 @ 512x512 matmul in fp32 and in bf16 at the current thread count, each
timed by torch.utils.benchmark for about BUDGET_S, once per process (well under a second; an emulated
bf16 matmul is called twice, a warm-up and a timed call). The capability is reported with the verdict.

DRAFTER_CPU_BF16=fast|slow skips the probe: the tests set it, so that `auto` is the same on every CPU.
In a process group of several ranks, rank 0 probes and every rank takes its verdict (a collective on
the first call), so that no two ranks pick different dtypes.
"""
import os
import sys
from dataclasses import dataclass
from functools import cache

import torch
import torch.distributed as dist

from drafter.errors import ConfigError
from drafter.infra.collectives import comm_device
from drafter.infra.timing import best_time

OVERRIDE = "DRAFTER_CPU_BF16"  # fast | slow: the verdict without the probe
SIZE = 512  # the probe's square matmul: large enough for the kernels' steady state, small enough to be quick
BUDGET_S = 0.15  # seconds of timed calls per dtype after the warm-up; the fastest block counts
# bf16 is picked only when its matmul runs at least this much faster than fp32's: a smaller gain lies
# within the probe's timing noise on a shared machine, and shrinks end to end (the norms, softmax and
# casts around the matmuls gain less), so it would not pay for bf16's rounding of the features.
BF16_FAST_SPEEDUP = 1.2


@dataclass(frozen=True)
class Bf16Speed:
    """The verdict: `fast` when bf16 pays on this CPU; `ratio` is bf16's matmul time over fp32's (None
    when DRAFTER_CPU_BF16 decided); `capability` is torch's name for the CPU's instruction set; `reason`
    says the verdict in one line."""
    fast: bool
    ratio: float | None
    capability: str
    reason: str


def capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


def bf16_speed() -> Bf16Speed:
    """This CPU's verdict: DRAFTER_CPU_BF16's, else the probe's (run once per process)."""
    override = os.environ.get(OVERRIDE, "").strip().lower()
    if override:
        if override not in ("fast", "slow"):
            raise ConfigError(f"{OVERRIDE}={os.environ[OVERRIDE]}: use fast or slow (or unset it to measure)")
        fast = override == "fast"
        return Bf16Speed(fast, None, capability(), f"{'bf16' if fast else 'fp32'}: {OVERRIDE}={override}")
    return probed()


@cache
def probed() -> Bf16Speed:
    """The probe's verdict; in a group of several ranks, rank 0's (every rank must call it first together)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        ratio = torch.tensor([measure_ratio() if dist.get_rank() == 0 else 0.0], dtype=torch.float64,
                             device=comm_device())
        dist.broadcast(ratio, src=0)
        return verdict(float(ratio.item()), capability(), torch.get_num_threads())
    return verdict(measure_ratio(), capability(), torch.get_num_threads())


def verdict(ratio: float, cap: str, threads: int) -> Bf16Speed:
    """The verdict of a measured `ratio`, bf16's time over fp32's."""
    fast = ratio * BF16_FAST_SPEEDUP <= 1.0
    where = f"this CPU ({cap}) ran a {SIZE}x{SIZE} matmul"
    threads_note = f" ({threads} thread{'s' if threads != 1 else ''})"
    if fast:
        return Bf16Speed(True, ratio, cap, f"bf16: {where} {times(1 / ratio)} faster in bf16 than fp32{threads_note}")
    if ratio < 1.0:
        return Bf16Speed(False, ratio, cap, f"fp32: {where} only {times(1 / ratio)} faster in bf16 than fp32, under "
                                            f"the {BF16_FAST_SPEEDUP}x bf16 needs{threads_note}")
    return Bf16Speed(False, ratio, cap, f"fp32: {where} {times(ratio)} slower in bf16 than fp32{threads_note}")


def times(factor: float) -> str:
    return f"{factor:.1f}x" if factor < 10 else f"{factor:.0f}x"


def measure_ratio() -> float:
    """bf16's best matmul time over fp32's, on inputs of a private generator (the global RNG is left as
    it was, so a run with the probe draws what one without it does)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(SIZE, SIZE, generator=generator)
    b = torch.randn(SIZE, SIZE, generator=generator)
    with torch.no_grad():
        fp32 = best_time(lambda: a @ b, BUDGET_S)
        a16, b16 = a.bfloat16(), b.bfloat16()
        bf16 = best_time(lambda: a16 @ b16, BUDGET_S)
    return max(bf16, 1e-9) / max(fp32, 1e-9)


_said: set[str] = set()


def say_once(line: str) -> None:
    """`line` on stderr, once per process, and on rank 0 only where a process group is formed."""
    if line in _said or (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        return
    _said.add(line)
    print(line, file=sys.stderr, flush=True)


def slow_bf16_warning(name: str, speed: Bf16Speed) -> str:
    """The one-line warning for an explicit bf16 (`name` as the user wrote it) where bf16 is slow."""
    measured = (f"bf16 matmuls ran {times(speed.ratio)} slower than fp32 here" if speed.ratio and speed.ratio >= 1
                else f"bf16 matmuls ran under {BF16_FAST_SPEEDUP}x faster than fp32 here" if speed.ratio
                else f"{OVERRIDE}=slow says bf16 is slow here")
    return f"warning: dtype {name} on this CPU ({speed.capability}): {measured}; dtype auto would pick fp32"

