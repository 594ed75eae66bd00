"""The weight layout a CPU serves fastest: each linear's weight stored row-major (as loaded) or column-major.

`F.linear(x, W)` multiplies by W transposed. On some CPUs the BLAS kernel for a few rows of x runs much
faster when W's transpose is the contiguous one: on an AVX-512 Xeon (torch 2.13, fp32, one thread) a
[9, 576] x [576, 2304] product, the shape of a 9-node tree verify, took 0.33 ms column-major against
0.60 row-major, and the 49,152-word LM head at 9 rows 20 ms against 30; under AVX2 kernels the two
layouts tie. So a short probe on the model's own largest decoder weight decides, once per process, dtype and
thread count: column-major is served only where it is at least COLUMN_GAIN faster at `VERIFY_ROWS` rows and at
most ONE_ROW_SLACK slower at one row (timing noise), so plain decoding (`ar`, `generate`) loses nothing measurable.

Serving only: values are unchanged (a copy transposed twice), every module keeps its parameters (tied
weights stay one tensor), and training never calls this. DRAFTER_CPU_WEIGHT_LAYOUT=row|column skips the
probe; the tests set row.
"""
import os
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from drafter.errors import ConfigError
from drafter.infra.timing import best_time

OVERRIDE = "DRAFTER_CPU_WEIGHT_LAYOUT"  # row | column: the layout without the probe
VERIFY_ROWS = 9  # a DDTree verify of 8 nodes and its root
COLUMN_GAIN = 1.15  # a smaller gain lies within the probe's noise on a shared machine
ONE_ROW_SLACK = 1.05  # column-major may cost one-row products at most this much
PROBE_S = 0.05  # timing per (layout, rows): 4 cases, well under a second


@dataclass(frozen=True)
class Layout:
    """The verdict: `column` when column-major weights are served; `reason` says why, in one line."""
    column: bool
    reason: str


def serving_layout(model: nn.Module, dtype: torch.dtype) -> Layout:
    """The layout to serve `model` in on the CPU: DRAFTER_CPU_WEIGHT_LAYOUT's, else the probe's on the
    model's largest decoder weight (its input and output embeddings are not probed)."""
    override = os.environ.get(OVERRIDE, "").strip().lower()
    if override:
        if override not in ("row", "column"):
            raise ConfigError(f"{OVERRIDE}={os.environ[OVERRIDE]}: use row or column (or unset it to measure)")
        return Layout(override == "column", f"weights {override}-major: {OVERRIDE}={override}")
    weight = probe_weight(model)
    if weight is None:
        return Layout(False, "weights row-major: no linear layer to probe")
    return probed(tuple(weight.shape), dtype, torch.get_num_threads())


def probe_weight(model: nn.Module) -> torch.Tensor | None:
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is not None:
        embeddings.add(id(output.weight))
    linears = [m.weight for m in model.modules() if isinstance(m, nn.Linear) and id(m.weight) not in embeddings]
    return max(linears, key=torch.Tensor.numel, default=None)


@cache
def probed(shape: tuple[int, int], dtype: torch.dtype, threads: int) -> Layout:
    """The probe's verdict for a weight of `shape` and `dtype` at `threads` (the current thread count)."""
    generator = torch.Generator().manual_seed(0)
    row = torch.randn(shape, generator=generator).to(dtype)
    column = row.t().contiguous().t()
    times = {}
    with torch.no_grad():
        for rows in (1, VERIFY_ROWS):
            x = torch.randn(rows, shape[1], generator=generator).to(dtype)
            for name, weight in (("row", row), ("column", column)):
                times[name, rows] = linear_seconds(x, weight)
    gain = times["row", VERIFY_ROWS] / times["column", VERIFY_ROWS]
    one_row = times["column", 1] / times["row", 1]
    column_wins = gain >= COLUMN_GAIN and one_row <= ONE_ROW_SLACK
    what = (f"a {VERIFY_ROWS}-row product by a {shape[0]}x{shape[1]} {str(dtype).removeprefix('torch.')} weight ran "
            f"{gain:.2f}x faster column-major, one row {1 / one_row:.2f}x")
    return Layout(column_wins, f"weights {'column' if column_wins else 'row'}-major: {what}")


def linear_seconds(x: torch.Tensor, weight: torch.Tensor) -> float:
    return best_time(lambda: F.linear(x, weight), PROBE_S)


def serve_column_major_(model: nn.Module) -> int:
    """Stores every linear weight of `model` column-major in place (same values, same parameters, tied
    ones stay tied); returns how many it changed."""
    changed = 0
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.weight.is_contiguous() and module.weight.dim() == 2:
                module.weight.data = module.weight.data.t().contiguous().t()
                changed += 1
    return changed
