"""Metrics as [sum, count] tensors, so that ranks and micro-batches add up before one division
(`finalize_metrics`): training's block metrics, DFlash2's selector metrics and served tau all count so."""
import math

import torch


def sum_count(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """[sum, count] of `values` over `where`."""
    return torch.stack([(values.float() * where).sum(), where.float().sum()])


def finalize_metrics(summed: dict[str, torch.Tensor]) -> dict[str, float | list[float]]:
    """[sum, count] -> mean (NaN where count is 0); per-position rows -> a list per slot 1..B-1."""
    out = {}
    for name, value in summed.items():
        ratio = value[..., 0] / value[..., 1]
        out[name] = ratio.tolist() if ratio.dim() else (float(ratio) if value[1] > 0 else math.nan)
    return out
