"""The target's cache during speculative decoding, for every family transformers builds one for.

The cache is the target's own `DynamicCache(config=...)` (a layer class per layer type: full and
sliding-window attention, MLA, short-conv and recurrent mixers) with past recording switched on, as
the public `dflash_generate` does: a sliding-window or conv layer then keeps the positions a
rejected draft needs until the next rollback trims it back to its window. On top of it:

  rollback(length)  every attention and conv layer back to `length` positions;
  recurrent state   (Gated DeltaNet, Mamba) cannot be cut back: `snapshot()` clones it before a
                    verify, and after a partial acceptance `decode.py` restores it and advances
                    the target over the accepted tokens again (timed as its own stage);
  trees             `tree_attention_mask` gives each attention layer type the tree mask over the
                    keys that layer holds (a sliding layer: the last window - 1 positions, each node
                    seeing only positions within its window); `compact` keeps the accepted path's
                    rows. A tree cannot pass through a conv or recurrent layer as one flat sequence
                    (each branch must continue its parent's state), so `tree_refusal` names such a
                    target before any work.
A cache layer of a kind not listed here stops decoding by name (`TargetError`), and so does a family
whose forward over several new tokens does not continue its cached state (Jamba's Mamba restarts its
scan there: `continuation_refusal` probes it once per target), since every verify is such a forward.
"""
import weakref

import torch
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, DynamicLayer, LinearAttentionCacheLayerMixin

from drafter.target import TargetError, model_type


def is_state_layer(layer) -> bool:
    """A conv or recurrent mixer's cache layer (no per-position keys)."""
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def is_attention_layer(layer) -> bool:
    return isinstance(layer, DynamicLayer) and not is_state_layer(layer)


class TargetCache:
    """One decode's cache of the target (module docstring)."""

    def __init__(self, target):
        self.cache = DynamicCache(config=target.config)
        self.cache.activate_past_recording()
        self.config = target.config.get_text_config()
        unknown = {type(layer).__name__ for layer in self.cache.layers
                   if not (is_state_layer(layer) or is_attention_layer(layer) or isinstance(layer, DummyLayer))}
        if unknown:
            raise TargetError(f"target {model_type(target)}: cache layers {sorted(unknown)} cannot be rolled "
                              "back after a rejected draft")
        self.layer_types = getattr(self.config, "layer_types", None)

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def rollback(self, length: int) -> None:
        """Drop every position from `length` on (attention keys, conv history); a sliding or conv
        layer is trimmed back to what its next forward needs. Recurrent states are not touched."""
        remove = self.length - length
        if remove < 0:
            raise ValueError(f"cannot roll the cache of {self.length} positions forward to {length}")
        self.cache.crop(-remove)

    def snapshot(self) -> list[tuple[dict, int, torch.Tensor]] | None:
        """Copies of every recurrent state, or None when the target has none."""
        saved = [(layer.recurrent_states, index, state.clone())
                 for layer in self.cache.layers if is_state_layer(layer)
                 for index, state in layer.recurrent_states.items()
                 if layer.is_recurrent_states_initialized[index]]
        return saved or None

    @staticmethod
    def restore(snapshot) -> None:
        for states, index, saved in snapshot:
            states[index].copy_(saved)

    # ------------------------------------------------------------------ trees

    def tree_refusal(self) -> str | None:
        """Why a flat tree verify would be wrong for this target, or None."""
        kinds = sorted({kind for kind in (self.layer_types or []) if kind in ("chunked_attention",)})
        if kinds:
            return f"its {', '.join(kinds)} layers have no tree mask here"
        if any(is_state_layer(layer) for layer in self.cache.layers):
            return ("its conv / recurrent layers (Gated DeltaNet, Mamba, short conv) would run the tree as one "
                    "flat sequence, while each branch must continue its parent's state")
        return None

    def _attention_layers(self) -> dict[str, object]:
        """One cache layer per attention layer type: {type: layer} keyed by config.layer_types, or
        {"all": layer} when the config has one kind (or no layer_types)."""
        kinds = {}
        for index, layer in enumerate(self.cache.layers):
            if is_attention_layer(layer):
                kind = self.layer_types[index] if self.layer_types else "all"
                kinds.setdefault(kind, layer)
        if len({getattr(layer, "sliding_window", None) for layer in kinds.values()}) == 1:
            return {"all": next(iter(kinds.values()))}
        return kinds

    def tree_attention_mask(self, visible: torch.Tensor, depths: torch.Tensor, start: int, dtype: torch.dtype):
        """Additive masks for a verify forward of the rows of `visible` [q, q] (a row sees itself and
        its ancestors) at positions start + depths [q]: one tensor [1, 1, q, keys] when every
        attention layer holds the same keys, else {layer type: tensor}, which the families with
        several layer types accept as their own mask mapping."""
        masks = {kind: self._layer_mask(layer, visible, depths, start, dtype)
                 for kind, layer in self._attention_layers().items()}
        return masks["all"] if "all" in masks else masks

    @staticmethod
    def _layer_mask(layer, visible, depths, start, dtype):
        q = visible.shape[0]
        window = getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) else None
        past = min(start, window - 1) if window else start  # the positions this layer's forward sees
        past_positions = torch.arange(start - past, start, device=depths.device)
        row_positions = start + depths
        seen_past = torch.ones((q, past), dtype=torch.bool, device=depths.device)
        seen_tree = visible.clone()
        if window:
            seen_past &= past_positions[None] > row_positions[:, None] - window
            seen_tree &= depths[None] > depths[:, None] - window
        seen = torch.cat([seen_past, seen_tree], dim=1)
        mask = torch.zeros(seen.shape, dtype=dtype, device=depths.device)
        return mask.masked_fill_(~seen, torch.finfo(dtype).min)[None, None]

    def compact(self, tree_rows: int, keep_rows: torch.Tensor) -> None:
        """After a verify forward of `tree_rows` rows: keep, in each attention layer, its past and
        then the rows `keep_rows` (in that order); drop the other tree rows."""
        for layer in self.cache.layers:
            if not is_attention_layer(layer) or layer.keys is None or layer.keys.numel() == 0:
                continue
            past = layer.keys.shape[-2] - tree_rows
            for name in ("keys", "values"):
                states = getattr(layer, name)
                kept = states[..., past:, :].index_select(-2, keep_rows)
                setattr(layer, name, torch.cat([states[..., :past, :], kept], dim=-2))
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length += len(keep_rows) - tree_rows


_CONTINUATION = weakref.WeakKeyDictionary()  # target -> refusal message or None


@torch.no_grad()
def continuation_refusal(target, tolerance: float = 0.1) -> str | None:
    """Why speculative decoding cannot run on `target`, or None: its forward over 4 new tokens on a
    cache of 6 must give the logits of one forward over all 10 (within `tolerance` of the logits'
    spread, far above bf16 noise and far below a state that restarted). Probed once per target on a
    fixed pseudo-random sequence; no global RNG is touched."""
    if target not in _CONTINUATION:
        vocab = target.config.get_text_config().vocab_size
        ids = torch.randint(0, vocab, (1, 10), generator=torch.Generator().manual_seed(0)).to(target.device)
        whole = target(ids).logits[0, 6:].float()
        cache = TargetCache(target)
        target(ids[:, :6], past_key_values=cache.cache, use_cache=True)
        steps = target(ids[:, 6:], position_ids=torch.arange(6, 10, device=ids.device)[None],
                       past_key_values=cache.cache, use_cache=True).logits[0].float()
        error = float((steps - whole).abs().max() / whole.std().clamp_min(1e-6))
        _CONTINUATION[target] = None if error <= tolerance else (
            f"target {model_type(target)}: its forward over several new tokens on a cache does not continue "
            f"the cached state (logits off by {error:.2f} of their spread on a probe), and every verify is such "
            "a forward; dflash and ddtree cannot run on it (ar can)")
    return _CONTINUATION[target]
