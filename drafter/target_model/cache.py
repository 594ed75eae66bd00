"""The target's cache during speculative decoding, for every family transformers builds one for.

The cache is the target's own `DynamicCache(config=...)` (a layer class per layer type: full and
sliding-window attention, MLA, short-conv and recurrent mixers) with past recording switched on, as
the public `dflash_generate` does: a sliding-window or conv layer then keeps the positions a
rejected draft needs until the next rollback trims it back to its window. On top of it:

  rollback(length)  every attention and conv layer back to `length` positions;
  recurrent state   (Gated DeltaNet, Mamba) cannot be cut back: `snapshot()` clones it before a
                    verify, and after a partial acceptance `decode.py` restores it and advances
                    the target over the accepted tokens again (timed as its own stage); so does
                    a cache layer class the model defines itself (DeepSeek-V4's compressor
                    caches: a window cut at every forward, pooling buffers, compressed entries),
                    whose state is kept whole;
  trees             on attention-only targets (`tree_form` "mask") `tree_attention_mask` gives each
                    attention layer type the tree mask over the keys that layer holds (a sliding
                    layer: the last window - 1 positions, each node seeing only positions within its
                    window), LFM2's short convs read along the tree (drafter/target_model/tree_conv.py);
                    `compact` keeps the accepted path's rows (keys, conv history). A tree cannot pass
                    through any other conv, or a recurrent or compressor layer, as one flat sequence
                    (each branch must continue its parent's state), nor chunked attention: there
                    (`tree_form` "paths") the tree runs as a batch of its root-to-leaf paths on a
                    per-row copy of the cache (`forks_by_row`; drafter/serving/path_verify.py).
                    `tree_refusal` names a target neither form can verify, before any work.
A cache layer of a kind not listed here stops decoding by name (`TargetError`), and so does a family
whose forward over several new tokens does not continue its cached state (Jamba's Mamba restarts its
scan there: `probe_decoding` probes it once per target), since every verify is such a forward.
"""
import copy
import inspect
import weakref
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, DynamicLayer, LinearAttentionCacheLayerMixin

from drafter.target_model.model import TargetError, model_type
from drafter.target_model.tree_conv import tree_conv_layers


def is_state_layer(layer) -> bool:
    """A conv or recurrent mixer's cache layer (no per-position keys)."""
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def is_own_layer(layer) -> bool:
    """A cache layer class the model defines itself, not one of transformers' `cache_utils` kinds
    (DeepSeek-V4's compressor caches). Its state is more than per-position keys: it is never cut
    back, but saved whole before a verify and restored after a rejected draft. Such a class replaces
    its tensors on update (concatenation) rather than writing into them, so a copy of its attributes
    (dicts one level deep) is a copy of its state."""
    return type(layer).__module__ != DynamicLayer.__module__


def forks_itself(layer) -> bool:
    """Whether a model's own cache layer class defines its own `reorder_cache` (the batch op that
    copies its state per row), rather than inheriting transformers' one for per-position keys."""
    return type(layer).reorder_cache.__module__ == type(layer).__module__


def forks_by_row(cache: DynamicCache, rows: torch.Tensor) -> DynamicCache:
    """A new cache whose batch row i is row `rows[i]` of `cache`, every layer through its class's own
    `reorder_cache`; `cache` is untouched (each layer is a shallow copy, its dicts of states copied,
    and `reorder_cache` replaces every state tensor by a new one)."""
    forked = copy.copy(cache)
    forked.layers = [_layer_copy(layer) for layer in cache.layers]
    forked.reorder_cache(rows)
    return forked


def _layer_copy(layer):
    copied = copy.copy(layer)
    for name, value in vars(layer).items():
        if isinstance(value, dict):
            setattr(copied, name, dict(value))
    return copied


def is_attention_layer(layer) -> bool:
    return isinstance(layer, DynamicLayer) and not is_state_layer(layer) and not is_own_layer(layer)


class TargetCache:
    """One decode's cache of the target (module docstring). Every target forward on it goes through
    `forward`, which counts the positions it holds (a pure recurrent cache has no length to read)."""

    def __init__(self, target):
        self.target = target
        self.cache = DynamicCache(config=target.config)
        self.cache.activate_past_recording()
        self.config = target.config.get_text_config()
        unknown = {type(layer).__name__ for layer in self.cache.layers
                   if not (is_state_layer(layer) or is_attention_layer(layer) or is_own_layer(layer)
                           or isinstance(layer, DummyLayer))}
        if unknown:
            raise TargetError(f"target {model_type(target)}: cache layers {sorted(unknown)} cannot be rolled "
                              "back after a rejected draft")
        self.layer_types = getattr(self.config, "layer_types", None)
        self.length = 0
        # the forward's name for its cache: `past_key_values`, or `cache` in newer families (Dory)
        parameters = inspect.signature(target.forward).parameters
        self.cache_argument = "past_key_values" if "past_key_values" in parameters else "cache"

    def forward(self, input_ids: torch.Tensor, **kwargs):
        """The target over `input_ids` [1, n] at positions length.. (unless `position_ids` say
        otherwise), on this cache."""
        kwargs.setdefault("position_ids", torch.arange(self.length, self.length + input_ids.shape[1],
                                                       device=input_ids.device)[None])
        out = self.target(input_ids, **{self.cache_argument: self.cache}, use_cache=True, **kwargs)
        self.length += input_ids.shape[1]
        return out

    def rollback(self, length: int) -> None:
        """Drop every position from `length` on (attention keys, conv history); a sliding or conv
        layer is trimmed back to what its next forward needs. Recurrent states and the model's own
        cache layers are not touched (`snapshot`)."""
        remove = self.length - length
        if remove < 0:
            raise ValueError(f"cannot roll the cache of {self.length} positions forward to {length}")
        for layer in self.cache.layers:
            if is_own_layer(layer):
                continue
            if is_state_layer(layer) and None in layer.conv_kernel_size.values():
                if remove:  # its conv history cannot be cut (Mamba-2 records no kernel width): refuse
                    raise TargetError(f"target {model_type(self.target)}: a conv state of unknown width "
                                      "cannot be rolled back after a rejected draft")
                continue
            layer.crop(-remove)
        self.length = length

    def snapshot(self) -> tuple[list, list] | None:
        """Copies of every recurrent state and of every own cache layer's state (`is_own_layer`), or
        None when the target has neither."""
        recurrent = [(layer.recurrent_states, index, state.clone())
                     for layer in self.cache.layers if is_state_layer(layer)
                     for index, state in layer.recurrent_states.items()
                     if layer.is_recurrent_states_initialized[index]]
        own = [(layer, {name: dict(value) if isinstance(value, dict) else value
                        for name, value in vars(layer).items()})
               for layer in self.cache.layers if is_own_layer(layer)]
        return (recurrent, own) if recurrent or own else None

    @staticmethod
    def restore(snapshot) -> None:
        recurrent, own = snapshot
        for states, index, saved in recurrent:
            states[index].copy_(saved)
        for layer, attributes in own:
            vars(layer).update(attributes)

    # ------------------------------------------------------------------ trees

    def flat_tree_refusal(self) -> str | None:
        """Why one flat forward under a tree mask would be wrong for this target, or None."""
        kinds = sorted({kind for kind in (self.layer_types or []) if kind in ("chunked_attention",)})
        if kinds:
            return f"its {', '.join(kinds)} layers have no tree mask here"
        over_trees = tree_conv_layers(self.target)  # LFM2's short convs read along a tree's branches
        if any(is_state_layer(layer) and index not in over_trees for index, layer in enumerate(self.cache.layers)):
            return ("its conv / recurrent layers (Gated DeltaNet, Mamba, short conv) would run the tree as one "
                    "flat sequence, while each branch must continue its parent's state")
        own = sorted({type(layer).__name__ for layer in self.cache.layers if is_own_layer(layer)})
        if own:
            return (f"its own cache layers ({', '.join(own)}: state beyond per-position keys, such as compressors "
                    "pooling consecutive positions) would run the tree as one flat sequence, while each branch "
                    "must continue its parent's state")
        return None

    def tree_form(self) -> str:
        """How a DDTree verify runs here: "mask", one flat forward under a tree mask (attention-only
        targets), or "paths", a batch of the tree's root-to-leaf paths (`drafter/serving/path_verify.py`)."""
        return "mask" if self.flat_tree_refusal() is None else "paths"

    def tree_refusal(self) -> str | None:
        """Why neither form can verify a tree exactly on this target, or None: a model's own cache layer
        whose class does not say how to copy its state per batch row (no `reorder_cache` of its own)."""
        if self.tree_form() == "mask":
            return None
        unforkable = sorted({type(layer).__name__ for layer in self.cache.layers
                             if is_own_layer(layer) and not forks_itself(layer)})
        if unforkable:
            return (f"{self.flat_tree_refusal()}; and its own cache layers ({', '.join(unforkable)}) define no "
                    "reorder_cache of their own, so their state cannot be copied per path of the tree")
        return None

    def _attention_layers(self) -> dict[str, object]:
        """One cache layer per attention layer type: {type: layer} keyed by config.layer_types, or
        {"all": layer} when the config has one kind (or no layer_types)."""
        kinds = {}
        # a looped family (Dory) appends copies of its looped layers' caches after one per layer
        for index, layer in enumerate(self.cache.layers[:self.config.num_hidden_layers]):
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

    # what an attention cache layer holds per position, and along which dim (DSA layers: an indexer too)
    _PER_POSITION = (("keys", -2), ("values", -2), ("indexer_keys", 1), ("indexer_position_ids", -1))

    def compact(self, tree_rows: int, keep_rows: torch.Tensor) -> None:
        """After a verify forward of `tree_rows` rows: keep, in each attention layer and each conv
        history, its past and then the rows `keep_rows` (in that order); drop the other tree rows."""
        for layer in self.cache.layers:
            if is_state_layer(layer):  # a conv history computed over the tree (drafter/target_model/tree_conv.py)
                for index, states in layer.conv_states.items():
                    past = states.shape[-1] - tree_rows
                    layer.conv_states[index] = torch.cat(
                        [states[..., :past], states[..., past:].index_select(-1, keep_rows)], dim=-1)
                continue
            if not is_attention_layer(layer):
                continue
            for name, dim in self._PER_POSITION:
                states = getattr(layer, name, None)
                if states is None or states.numel() == 0:
                    continue
                past = states.shape[dim] - tree_rows
                kept = states.narrow(dim, past, tree_rows).index_select(dim, keep_rows)
                setattr(layer, name, torch.cat([states.narrow(dim, 0, past), kept], dim=dim))
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length += len(keep_rows) - tree_rows
        self.length += len(keep_rows) - tree_rows


@dataclass(frozen=True)
class DecodeProbe:
    """What decoding can do on a target: `cannot_decode` / `cannot_verify` say why not, or None."""
    cannot_decode: str | None
    cannot_verify: str | None


_PROBES = weakref.WeakKeyDictionary()  # target -> DecodeProbe


@torch.no_grad()
def probe_decoding(target, tolerance: float = 0.25) -> DecodeProbe:
    """Whether the target decodes exactly on its own cache, as `decode.generate` drives it: after a
    forward over 6 tokens, 4 one-token forwards (ar) and, on a second cache, one forward over the 4
    (every verify is such a forward) must each give the logits of one forward over all 10: their RMS
    difference within `tolerance` of the logits' spread (bf16 noise is far below, a state that
    restarted far above). Probed once per target on a fixed pseudo-random sequence; no global RNG
    is touched."""
    if target in _PROBES:
        return _PROBES[target]
    name = model_type(target)
    vocab = target.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, 10), generator=torch.Generator().manual_seed(0)).to(target.device)
    whole = target(ids).logits[0, 6:].float()

    def off(logits) -> float:
        return float((logits.float() - whole).pow(2).mean().sqrt() / whole.std().clamp_min(1e-6))

    try:
        one_by_one, at_once = TargetCache(target), TargetCache(target)
        one_by_one.forward(ids[:, :6])
        stepped = []
        for position in range(6, 10):
            stepped.append(one_by_one.forward(ids[:, position:position + 1]).logits[0, -1])
            one_by_one.rollback(position + 1)
        at_once.forward(ids[:, :6])
        verify_error, ar_error = off(at_once.forward(ids[:, 6:]).logits[0]), off(torch.stack(stepped))
    except (TargetError, ValueError, RuntimeError, TypeError, NotImplementedError) as error:
        probe = DecodeProbe(f"target {name}: it does not decode on its own DynamicCache ({error})", None)
    else:
        probe = DecodeProbe(
            None if ar_error <= tolerance else (
                f"target {name}: one-token forwards on its own cache with past recording do not give its logits "
                f"(off by {ar_error:.2f} of their spread on a probe); no method can decode it here"),
            None if verify_error <= tolerance else (
                f"target {name}: its forward over several new tokens on a cache does not continue the cached "
                f"state (logits off by {verify_error:.2f} of their spread on a probe), and every verify is such "
                "a forward; dflash and ddtree cannot run on it (ar can)"))
    _PROBES[target] = probe
    return probe
