"""The chosen attention kernel checked against dense SDPA on the run's own first batch.

torch 2.13 has no flex_attention backward on the CPU, so no CI runs the compiled flex path's
backward: a run's first step on a GPU is its first test. Before that step, the drafter's loss and
gradients under the chosen kernel are compared with the dense path on one row of this rank's first
batch, on a plain copy of the drafter (the engine's own state and gradients are not touched). Every
rank compares; the worst rank decides for all. A mismatch stops the run in one line naming the
largest difference, or, with objective.attention=auto, trains on dense and says so in the log and
in W&B.
"""
import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist

from drafter.errors import UserError
from drafter.models.blocks import DraftingSetup, FeatureBatch
from drafter.training.objective import training_step

# relative L2 error of the loss and of every gradient, kernel against dense (bench/gpu_check.py's too)
ATTENTION_TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-5}


class AttentionMismatch(UserError):
    """The chosen kernel's loss or gradients differ from dense beyond the tolerance."""


@dataclass(frozen=True)
class KernelComparison:
    kernel: str
    loss_rel_error: float
    grads_rel_error: float          # over all of the drafter's gradients at once
    worst_parameter: str            # the parameter whose gradient differs most (a diagnostic)
    worst_parameter_rel_error: float
    tolerance: float
    error: str | None = None        # the kernel raised this instead of giving a loss and gradients

    @property
    def passed(self) -> bool:
        """Loss and gradients within the tolerance (a NaN is not); a single parameter's error is reported,
        not judged: a norm's tiny gradient can differ more in relative terms with no harm."""
        return self.error is None and all(math.isfinite(e) and e <= self.tolerance
                                          for e in (self.loss_rel_error, self.grads_rel_error))

    @property
    def badness(self) -> float:
        """How far from passing, for choosing the worst rank (non-finite and errors: inf)."""
        errors = (self.loss_rel_error, self.grads_rel_error)
        return math.inf if self.error or not all(map(math.isfinite, errors)) else max(errors)

    def line(self) -> str:
        if self.error:
            return f"{self.kernel} failed on the first batch: {self.error}"
        return (f"{self.kernel} against dense on the first batch: loss rel {self.loss_rel_error:.2g}, gradients "
                f"rel {self.grads_rel_error:.2g}, largest {self.worst_parameter} rel "
                f"{self.worst_parameter_rel_error:.2g} (tolerance {self.tolerance:g})")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def compare_with_dense(setup: DraftingSetup, batch: FeatureBatch, objective, tolerance: float) -> KernelComparison:
    """Loss and gradients of one training step under the setup's attention kernel and under dense, with
    the same anchors."""
    drafter, kernel = setup.drafter, setup.attention
    names, params = zip(*[(n, p) for n, p in drafter.named_parameters() if p.requires_grad])

    def loss_and_grads(attention):
        with torch.enable_grad():
            loss, _ = training_step(replace(setup, attention=attention), batch, objective,
                                    torch.Generator().manual_seed(0))
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        return loss.detach(), [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]

    try:  # a kernel that cannot compile or run on this GPU fails the check as one that differs does
        loss, grads = loss_and_grads(kernel)
    except Exception as error:  # noqa: BLE001 (torch.compile, Triton and CUDA raise many kinds)
        first = next((line for line in str(error).splitlines() if line.strip()), "")
        return KernelComparison(kernel, math.inf, math.inf, "-", math.inf, tolerance,
                                f"{type(error).__name__}: {first.strip()}")
    dense_loss, dense_grads = loss_and_grads("dense")
    per_parameter = [relative_error(g, d) for g, d in zip(grads, dense_grads)]
    worst = max(range(len(names)), key=lambda i: per_parameter[i] if math.isfinite(per_parameter[i]) else math.inf)
    flat = lambda tensors: torch.cat([t.float().reshape(-1) for t in tensors])  # noqa: E731
    return KernelComparison(kernel, relative_error(loss, dense_loss), relative_error(flat(grads), flat(dense_grads)),
                            names[worst], per_parameter[worst], tolerance)


def worst_over_ranks(comparison: KernelComparison) -> KernelComparison:
    """The comparison of the rank that differs most (this one's without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return comparison
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, asdict(comparison))
    return max((KernelComparison(**c) for c in gathered), key=lambda c: c.badness)


def attention_verdict(setting: str, comparison: KernelComparison) -> tuple[str, str]:
    """(the kernel to train with, the line to log): the chosen kernel where it matches dense; dense,
    with a warning, where it does not and objective.attention is auto; else AttentionMismatch."""
    if comparison.passed:
        return comparison.kernel, f"attention check: {comparison.line()}: ok"
    if setting == "auto":
        return "dense", (f"warning: attention check failed: {comparison.line()}; objective.attention=auto "
                         "trains on dense instead (slower, exact; it materialises the attention scores, which "
                         "long rows may not fit)")
    raise AttentionMismatch(f"objective.attention={setting}: {comparison.line()}; set objective.attention=dense, "
                            "or auto to fall back to it")
