"""The memory of a DDTree verify as a batch of paths (drafter/serving/path_verify.py, decoding on
hybrid targets): the target's decode cache per batch row, measured on the target, and the worst tree
of a budget; `check_path_batch_fits` refuses a budget that cannot fit, naming the largest that does."""
import math
import weakref
from dataclasses import dataclass

import torch

from drafter.infra.memory import MemoryPlanError, size_text
from drafter.target_model.cache import TargetCache, is_own_layer
from drafter.target_model.model import model_type


@dataclass(frozen=True)
class CacheFootprint:
    """A batch row of the target's decode cache, by layer, measured on the target: bytes that do not
    grow with the positions held (conv and recurrent states, compressor buffers), bytes per position
    held (attention keys and values), and the window a sliding layer holds at most (None: every position)."""
    fixed: tuple[int, ...]
    per_position: tuple[float, ...]
    windows: tuple[int | None, ...]

    def row_bytes(self, positions: int) -> int:
        return math.ceil(sum(fixed + per * (min(positions, window) if window else positions)
                             for fixed, per, window in zip(self.fixed, self.per_position, self.windows)))


def _layer_bytes(layer) -> int:
    """The bytes of every state tensor a cache layer holds (in its attributes and their dicts), each
    once; 0-d tensors are settings (a sliding window), not state."""
    tensors = {}
    for value in vars(layer).values():
        for tensor in (value.values() if isinstance(value, dict) else [value]):
            if torch.is_tensor(tensor) and tensor.dim() > 0:
                tensors[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
    return sum(tensors.values())


@torch.no_grad()
def cache_footprint(target) -> CacheFootprint:
    """Measured from two short forwards on throwaway caches, of 4 and 6 positions: past the width of a
    conv kernel (3-4 in Qwen3.5, Mamba-2, LFM2), within any sliding window. Exact for transformers'
    cache layer kinds; a model's own layers (DeepSeek-V4's compressors, which emit an entry every
    4 or 128 positions) get a rough estimate from these two points."""
    sizes = []
    for length in (4, 6):
        cache = TargetCache(target)
        cache.forward(torch.zeros((1, length), dtype=torch.long, device=target.device))
        cache.rollback(length)  # a conv layer's recorded history back to its kernel width
        sizes.append([_layer_bytes(layer) for layer in cache.cache.layers])
    per_position = [(long - short) / 2 for short, long in zip(*sizes)]
    # a model's own cache layer (compressors: entries that grow past the window) is counted uncapped
    windows = [layer.sliding_window - 1 if getattr(layer, "is_sliding", False) and not is_own_layer(layer) else None
               for layer in cache.cache.layers]
    return CacheFootprint(tuple(short - 4 * per for short, per in zip(sizes[0], per_position)),
                          tuple(per_position), tuple(windows))


@dataclass(frozen=True)
class PathBatchPlan:
    """The memory of a DDTree verify as a batch of paths (drafter/serving/path_verify.py) at `budget`
    nodes on a cache of `context` positions, for the worst tree of that budget: a tree of B nodes and
    depth d has at most B - d + 1 leaves (rows), so at most B rows (a star) and at most
    max_d (B - d + 1)(d + 1) tokens. The prefix cache and one copy of it per row, each holding the
    context and the row's d + 1 positions, beside the batch forward's logits and one layer's working set.
    Not counted: a conv layer's history growing by the row's tokens during the forward."""
    family: str
    budget: int
    context: int
    rows: int
    tokens: int
    cache_bytes: int
    forward_bytes: int

    @property
    def total(self) -> int:
        return self.cache_bytes + self.forward_bytes

    def line(self) -> str:
        return (f"ddtree@{self.budget} on {self.family} as a batch of paths at {self.context} positions: up to "
                f"{self.rows} rows and {self.tokens} tokens per verify, {size_text(self.cache_bytes)} of cache "
                f"copies + {size_text(self.forward_bytes)} of forward = {size_text(self.total)}")


def path_batch_plan(target, footprint: CacheFootprint, budget: int, block_size: int, context: int) -> PathBatchPlan:
    text = target.config.get_text_config()
    depth_limit = max(1, min(budget, block_size - 1))
    rows = budget
    tokens = max((budget - d + 1) * (d + 1) for d in range(1, depth_limit + 1))
    cache = (rows + 1) * footprint.row_bytes(context + depth_limit + 1)
    width = target.dtype.itemsize
    intermediate = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
    forward = tokens * (text.vocab_size + 4 * text.hidden_size + 3 * intermediate) * width
    return PathBatchPlan(model_type(target), budget, context, rows, tokens, cache, forward)


_FOOTPRINTS = weakref.WeakKeyDictionary()  # target -> CacheFootprint


def check_path_batch_fits(target, budget: int, block_size: int, context: int, free_bytes: int) -> PathBatchPlan:
    """The plan at `budget`; raise MemoryPlanError naming it, and the largest budget that fits, when it
    does not fit `free_bytes`. The target's cache footprint is measured once per target."""
    if target not in _FOOTPRINTS:
        _FOOTPRINTS[target] = cache_footprint(target)
    plan_at = lambda b: path_batch_plan(target, _FOOTPRINTS[target], b, block_size, context)  # noqa: E731
    plan = plan_at(budget)
    if plan.total <= free_bytes:
        return plan
    fitting = next((b for b in range(budget - 1, 0, -1) if plan_at(b).total <= free_bytes), None)
    raise MemoryPlanError(f"{plan.line()}, beyond the {size_text(free_bytes)} free on the device: "
                          + (f"use a budget of at most {fitting}" if fitting else "no budget fits; use dflash"))
