"""The DFlash drafter: Qwen3-style layers that draft a block of tokens conditioned on target features.

Data flow (one forward):
    target features [b, n, K*H] --fc--> hidden_norm --> ctx [b, n, H]   (shared by every layer)
    block embeddings [b, Q, H] (the target's embedding of [anchor, MASK, ...])
    every layer: queries from the block; keys/values = that layer's k/v projections of [ctx || block]
    (KV injection); the context never passes through an MLP.
    final norm --> the target's LM head (frozen, not ours) --> logits.

Variants (DESIGN.md contract 11, config `drafter.*`): a layer is `full_attention` or
`sliding_attention` (`layer_types`, `sliding_window`), causal inside the block or not (`causal`);
`LayerAttention` says which keys each layer's block queries see, exactly as `dflash` 0.1.0 reads
the exported config.

The same `forward` serves training (all anchors' blocks of a sequence at once, ctx = the whole
sequence, a block mask) and inference (one block, ctx = new context positions appended to a
`DraftCache`, no mask). Weight names and config follow the public `dflash` format, so
`save_pretrained` output loads in `dflash.model.DFlashDraftModel`, SGLang and vLLM.
"""
import functools
from dataclasses import dataclass

import torch
import torch.fx.experimental._config as symbolic_shapes_config
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP, Qwen3PreTrainedModel, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half)

from drafter.target import check_feature_layers, default_target_layer_ids

# Copied from the target config into the drafter's: the drafter has the target's widths.
_TARGET_WIDTH_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                      "intermediate_size", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                      "hidden_act", "rope_parameters", "attention_bias")


LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class DrafterVariant:
    """What tells the drafter variants apart (config keys `drafter.*`, README "Drafter variants").

    layer_types: one of LAYER_TYPES per draft layer (None: all full_attention).
    sliding_window: the window of the sliding layers, in positions, the query's own included.
    causal: None is the public default (sliding layers causal inside the block, full layers
        bidirectional); True / False makes every layer causal / bidirectional (`is_causal`).
    """
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    causal: bool | None = None

    def problems(self, num_layers: int) -> list[str]:
        """What is wrong with this variant for a drafter of `num_layers` layers, each naming its key."""
        problems = []
        types = self.layer_types
        if types is not None and len(types) != num_layers:
            problems.append(f"layer_types has {len(types)} entries for {num_layers} draft layers "
                            "(one per layer)")
        if types is not None and not set(types) <= set(LAYER_TYPES):
            problems.append(f"layer_types {list(types)}: each entry must be one of {', '.join(LAYER_TYPES)}")
        sliding = types is not None and "sliding_attention" in types
        if sliding and self.sliding_window is None:
            problems.append("sliding_window must be set for sliding_attention layers")
        if self.sliding_window is not None and self.sliding_window < 1:
            problems.append(f"sliding_window={self.sliding_window} must be >= 1 (the query itself)")
        if self.sliding_window is not None and not sliding:
            problems.append(f"sliding_window={self.sliding_window} is set but no layer_types entry is "
                            "sliding_attention")
        return problems

    def config_fields(self, num_layers: int) -> dict:
        """The Qwen3Config fields that `dflash` 0.1.0 reads for this variant."""
        types = list(self.layer_types or ["full_attention"] * num_layers)
        sliding = "sliding_attention" in types
        fields = {"layer_types": types, "use_sliding_window": sliding,
                  "sliding_window": self.sliding_window if sliding else None}
        if self.causal is not None:
            fields["is_causal"] = bool(self.causal)
        return fields


def drafter_variant(drafter_section) -> DrafterVariant:
    """The DrafterVariant of the config's `drafter` section (drafter.config.DrafterConfig)."""
    types = drafter_section.layer_types
    return DrafterVariant(layer_types=None if types is None else tuple(types),
                          sliding_window=drafter_section.sliding_window, causal=drafter_section.causal)


def drafter_config(target_config, *, num_layers: int, block_size: int, mask_token_id: int,
                   target_layer_ids: list[int] | None = None,
                   variant: DrafterVariant = DrafterVariant(), **record) -> Qwen3Config:
    """A drafter config for any HF causal-LM target config.

    `record` lands in `dflash_config` (e.g. target_path, chat_template_kwargs) so that a checkpoint can
    be evaluated without flags.
    """
    problems = variant.problems(num_layers)
    if problems:
        raise ValueError("; ".join(problems))
    text_config = target_config.get_text_config()
    num_target_layers = text_config.num_hidden_layers
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(num_target_layers, num_layers)
    target_layer_ids = [int(i) for i in target_layer_ids]
    check_feature_layers(target_layer_ids, num_target_layers)
    if not 0 <= mask_token_id < text_config.vocab_size:
        raise ValueError(f"mask_token_id {mask_token_id} has no row in the target's embedding "
                         f"(vocab_size {text_config.vocab_size})")
    widths = {k: getattr(text_config, k) for k in _TARGET_WIDTH_KEYS if hasattr(text_config, k)}
    widths.setdefault("head_dim", text_config.hidden_size // text_config.num_attention_heads)
    return Qwen3Config(
        **widths, num_hidden_layers=num_layers, num_target_layers=num_target_layers,
        block_size=block_size, tie_word_embeddings=False, **variant.config_fields(num_layers),
        architectures=["DFlashDraftModel"],
        dflash_config={"target_layer_ids": target_layer_ids, "mask_token_id": int(mask_token_id),
                       **record})


def resolve_mask_token_id(tokenizer, target_vocab_size: int) -> int:
    """The tokenizer's mask token; if it has none, add `<|MASK|>` (it must fit the target's vocab rows)."""
    if tokenizer.mask_token_id is None:
        tokenizer.add_special_tokens({"mask_token": "<|MASK|>"})
    if tokenizer.mask_token_id >= target_vocab_size:
        raise ValueError(f"mask token id {tokenizer.mask_token_id} >= target vocab size "
                         f"{target_vocab_size}: the frozen target has no embedding row for it")
    return tokenizer.mask_token_id


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, n, d]; cos/sin [b, n, d]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


@dataclass(frozen=True)
class LayerAttention:
    """Which keys a draft layer's block queries see beyond the DFlash rule (the context before the
    anchor, the own block): a key `offset` = query position - key position before the query is
    dropped if the layer is causal and the key is later (offset < 0), or if the layer slides and
    the key is `window` or more positions away (offset >= window; and, when not causal, offset <=
    -window). Block positions count in the window, as `dflash` 0.1.0 counts them."""
    window: int | None = None
    causal: bool = False

    @property
    def restricts(self) -> bool:
        return self.causal or self.window is not None

    def restrict(self, visible: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        """`visible` (bool) and what this layer lets a query see of a key `offset` positions back."""
        if self.causal:
            visible = visible & (offset >= 0)
        if self.window is not None:
            visible = visible & (offset < self.window)
            if not self.causal:
                visible = visible & (offset > -self.window)
        return visible

    def inference_mask(self, ctx_len: int, block_len: int, device) -> torch.Tensor | None:
        """Bool [1, 1, block_len, ctx_len + block_len] over keys [context 0..ctx_len-1 || block] for
        one block at positions ctx_len.., or None where every key is visible."""
        if not self.restricts:
            return None
        query = ctx_len + torch.arange(block_len, device=device)[:, None]
        offset = query - torch.arange(ctx_len + block_len, device=device)[None]
        return self.restrict(torch.ones_like(offset, dtype=torch.bool), offset)[None, None]


def layer_attention(config: Qwen3Config) -> list[LayerAttention]:
    """Each draft layer's LayerAttention, read from the config as `dflash` 0.1.0 reads it: a
    `sliding_attention` layer slides over `sliding_window` positions and is causal, a
    `full_attention` layer neither, unless `is_causal` (every layer) says otherwise."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    is_causal = getattr(config, "is_causal", None)
    attention = []
    for layer_type in types:
        sliding = layer_type == "sliding_attention"
        attention.append(LayerAttention(config.sliding_window if sliding else None,
                                        sliding if is_causal is None else bool(is_causal)))
    return attention


class DraftCache:
    """Per-layer K/V of the context only: block entries are never stored, so no crop is needed.
    Sliding layers keep their whole context too (their masks drop what lies outside the window)."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    @property
    def length(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Append new context K/V for `layer`; return all context K/V of that layer so far."""
        if layer == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        return self.keys[layer], self.values[layer]


@dataclass(frozen=True)
class FlexMask:
    """A flex_attention BlockMask and the kernel that runs it: compiled (a fused kernel; the GPU path)
    or eager (materialises the full score matrix; CPU tests and debugging)."""
    block_mask: BlockMask
    compiled: bool


def compile_dynamic(fn):
    """torch.compile(fn) with every size symbolic from the first call, so that a new padded length
    or anchor count reuses the compiled code. Duck sizing is off: with it a first batch whose size
    equals a head count shares that constant's symbol and is compiled in as a constant."""
    compiled = torch.compile(fn, dynamic=True)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with symbolic_shapes_config.patch(use_duck_shape=False):
            return compiled(*args, **kwargs)

    return call


def compiled_graph_count() -> int:
    """Graphs torch.compile has compiled in this process so far, all functions together."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


_compiled_flex_attention = compile_dynamic(flex_attention)


def attend(q, k, v, mask):
    """q [b, h, Q, d]; k, v [b, hkv, K, d]; mask: None (all visible), bool [b, 1, Q, K], or a FlexMask."""
    if isinstance(mask, FlexMask):
        flex = _compiled_flex_attention if mask.compiled else flex_attention
        return flex(q, k, v, block_mask=mask.block_mask, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _heads(self, x, heads):
        return x.view(*x.shape[:2], heads, self.head_dim).transpose(1, 2)

    def _keys_values(self, x, rope):
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), *rope)
        return k, self._heads(self.v_proj(x), self.num_kv_heads)

    def forward(self, block, ctx, block_rope, ctx_rope, mask, cache=None, layer_idx=0):
        q = apply_rope(self.q_norm(self._heads(self.q_proj(block), self.num_heads)), *block_rope)
        k_ctx, v_ctx = self._keys_values(ctx, ctx_rope)
        if cache is not None:
            k_ctx, v_ctx = cache.extend(layer_idx, k_ctx, v_ctx)
        k_blk, v_blk = self._keys_values(block, block_rope)
        k, v = torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2)
        out = attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(*block.shape[:2], -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, ctx, block_rope, ctx_rope, mask, cache=None, layer_idx=0):
        x = x + self.self_attn(self.input_layernorm(x), ctx, block_rope, ctx_rope, mask, cache,
                               layer_idx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(Qwen3PreTrainedModel):
    config_class = Qwen3Config
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        num_features = len(config.dflash_config["target_layer_ids"])
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(num_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layer_attention = layer_attention(config)
        self.post_init()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.dflash_config["target_layer_ids"]

    @property
    def mask_token_id(self) -> int:
        return self.config.dflash_config["mask_token_id"]

    def forward(self, block_embeds, block_positions, features, ctx_positions, masks, cache=None):
        """Final-normed block states [b, Q, H].

        block_embeds [b, Q, H], block_positions [b, Q]; target features [b, n, K*H] of the context
        positions ctx_positions [b, n], fused here (fc, hidden_norm) into the states every layer
        projects to K/V. Keys are ordered [context (cache first, if any) || block]; `masks` maps each
        of `self.layer_attention` to the mask (see `attend`) its layers use over keys in that order.
        Everything runs inside forward, so sharding wrappers (ZeRO-3, FSDP2) gather every weight
        through the module's own hooks.
        """
        ctx = self.hidden_norm(self.fc(features))
        block_rope = self.rotary_emb(block_embeds, block_positions)
        ctx_rope = self.rotary_emb(ctx, ctx_positions)
        x = block_embeds
        for i, (layer, attention) in enumerate(zip(self.layers, self.layer_attention)):
            x = layer(x, ctx, block_rope, ctx_rope, masks[attention], cache, i)
        return self.norm(x)

    @torch.no_grad()
    def draft_logits(self, target, ctx_features, block_ids, cache: DraftCache) -> torch.Tensor:
        """Inference: fp32 logits [b, B-1, V] for block positions 1..B-1.

        ctx_features [b, n, K*H] are the new context positions cache.length .. cache.length+n-1 (they
        are appended to `cache`); block_ids [b, B] = [anchor, MASK, ...] sit right after them.
        """
        start = cache.length
        n, block_len = ctx_features.shape[1], block_ids.shape[1]
        positions = torch.arange(start, start + n + block_len, device=block_ids.device)[None]
        positions = positions.expand(block_ids.shape[0], -1)
        block_embeds = target.get_input_embeddings()(block_ids).to(self.dtype)
        masks = {a: a.inference_mask(start + n, block_len, block_ids.device) for a in set(self.layer_attention)}
        hidden = self(block_embeds, positions[:, n:], ctx_features.to(self.dtype), positions[:, :n], masks, cache)
        return target.get_output_embeddings()(hidden[:, 1:].to(target.dtype)).float()


def drafter_from_state_dict(config: Qwen3Config, state_dict: dict[str, torch.Tensor]) -> DFlashDraftModel:
    """A plain (unsharded) drafter on the CPU holding `state_dict`, built without a random init first."""
    with torch.device("meta"):
        drafter = DFlashDraftModel(config)
    drafter.to_empty(device="cpu")
    drafter.load_state_dict(state_dict)
    drafter.rotary_emb = Qwen3RotaryEmbedding(config)  # its buffers are not in state dicts
    return drafter
