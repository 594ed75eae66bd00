"""The building blocks both drafter architectures share: which keys a block query sees
(`LayerAttention`, for training masks and serving alike), the draft cache, the attention kernel
choice, and the DFlash decoder layer with KV injection.

    target features [b, n, K*H] --fc--> hidden_norm --> ctx [b, n, H]   (shared by every layer)
    every layer: queries from the block; keys/values = that layer's k/v projections of [ctx || block]
    (KV injection); the context never passes through an MLP.

A layer is `full_attention` or `sliding_attention` (`layer_types`, `sliding_window`), causal inside
the block or not (`causal`); `LayerAttention` says which keys each layer's block queries see, exactly
as `dflash` 0.1.0 reads the exported config (docs/design.md contract 11).
"""
import functools
from dataclasses import dataclass

import torch
import torch.fx.experimental._config as symbolic_shapes_config
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, rotate_half


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, n, d]; cos/sin [b, n, d]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


@dataclass
class VisibleKeys:
    """The keys each block query sees, as two index intervals [b, Q] each into keys ordered
    [context (T) || blocks (A*B)]: [ctx_start, ctx_end) of the context and [block_start, block_end)
    of its own block. Intervals, not an offset rule, so that the compiled flex kernel gets a mask of
    gathers and comparisons only (an offset rule failed to compile in inductor's CPU flex template)."""
    ctx_start: torch.Tensor
    ctx_end: torch.Tensor
    block_start: torch.Tensor
    block_end: torch.Tensor

    @staticmethod
    def _contain(kv, ctx_start, ctx_end, block_start, block_end):
        return ((kv >= ctx_start) & (kv < ctx_end)) | ((kv >= block_start) & (kv < block_end))

    def dense(self, num_keys: int) -> torch.Tensor:
        """Bool [b, 1, Q, num_keys]."""
        kv = torch.arange(num_keys, device=self.ctx_end.device)
        bounds = (self.ctx_start, self.ctx_end, self.block_start, self.block_end)
        return self._contain(kv, *(x[..., None] for x in bounds))[:, None]

    def mask_mod(self):
        """The same mask as a flex_attention mask_mod."""
        # Closure locals, gathered one by one: read through `self` or a generator expression, the
        # mask miscompiled in inductor's CPU flex template (torch 2.13).
        ctx_start, ctx_end, block_start, block_end = self.ctx_start, self.ctx_end, self.block_start, self.block_end

        def mask_mod(batch, head, q, kv):
            return self._contain(kv, ctx_start[batch, q], ctx_end[batch, q], block_start[batch, q],
                                 block_end[batch, q])
        return mask_mod


@dataclass(frozen=True)
class LayerAttention:
    """Which keys a draft layer's block queries see, as `dflash` 0.1.0 reads its config. DFlash: the
    context before the anchor and the whole own block. A sliding layer sees only keys fewer than
    `window` positions before the query (its own position included; block positions count, as the
    public class counts them) and, when not causal, fewer than `window` after it; a causal layer sees
    no later slot of its block."""
    window: int | None = None
    causal: bool = False

    @property
    def restricts(self) -> bool:
        return self.causal or self.window is not None

    def cached_context(self, length: int) -> int:
        """How many of the last `length` context positions a draft cache keeps for this layer once a
        block is drafted: all of them, or for a sliding layer the last window - 1 (the most a later
        query sees before its own position), as the serving caches keep them: dflash 0.1.0's
        DynamicSlidingWindowLayer with past recording, cropped back after each block."""
        return length if self.window is None else min(length, self.window - 1)

    def visible_keys(self, anchors: torch.Tensor, seq_len: int, block_size: int) -> VisibleKeys:
        """For blocks at `anchors` [b, A] over a context of `seq_len` positions (keys [context ||
        A blocks of block_size])."""
        b, num_blocks = anchors.shape
        query = torch.arange(num_blocks * block_size, device=anchors.device)
        slot, block = query % block_size, query // block_size
        anchor = anchors[:, block]
        ctx_start, first, end = torch.zeros_like(anchor), torch.zeros_like(slot), torch.full_like(slot, block_size)
        if self.window is not None:
            ctx_start = (anchor + slot - self.window + 1).clamp(min=0)
            first = (slot - self.window + 1).clamp(min=0)
        if self.causal:
            end = slot + 1
        elif self.window is not None:
            end = (slot + self.window).clamp(max=block_size)
        block_keys = seq_len + block * block_size
        return VisibleKeys(ctx_start, anchor, (block_keys + first).expand(b, -1), (block_keys + end).expand(b, -1))

    def inference_mask(self, ctx_len: int, block_len: int, device) -> torch.Tensor | None:
        """Bool [1, 1, block_len, ctx_len + block_len] over keys [context 0..ctx_len-1 || block] for
        one block at positions ctx_len.., or None where every key is visible."""
        if not self.restricts:
            return None
        anchor = torch.full((1, 1), ctx_len, device=device)
        return self.visible_keys(anchor, ctx_len, block_len).dense(ctx_len + block_len)


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
    """Per-layer K/V of the context only: block entries are never stored. After each block `crop`
    keeps what the next block can see (`LayerAttention.cached_context`): a full layer its whole
    context, a sliding layer its last window - 1 positions. `length` counts every context position
    seen, so positions stay absolute while a sliding layer's keys are a suffix of them."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.length = 0

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Append new context K/V for `layer`; return that layer's kept context K/V and the new."""
        if layer == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        return self.keys[layer], self.values[layer]

    def crop(self, length: int, layer_attention: list[LayerAttention]):
        """The context now ends at `length`: keep each layer's `cached_context` of it."""
        self.length = length
        for i, attention in enumerate(layer_attention):
            drop = self.keys[i].shape[2] - attention.cached_context(length)
            self.keys[i], self.values[i] = self.keys[i][:, :, drop:], self.values[i][:, :, drop:]


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


@dataclass
class LayerInputs:
    """What every draft layer of one forward shares: the fused context states [b, n, H] and rotary
    tables of context and blocks, the cache (inference) and the block length (blocks lie back to
    back along the query axis)."""
    ctx: torch.Tensor
    block_rope: tuple[torch.Tensor, torch.Tensor]
    ctx_rope: tuple[torch.Tensor, torch.Tensor]
    cache: DraftCache | None
    block_len: int


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

    def forward(self, block, inputs: LayerInputs, mask, layer_idx: int):
        q = apply_rope(self.q_norm(self._heads(self.q_proj(block), self.num_heads)), *inputs.block_rope)
        k_ctx, v_ctx = self._keys_values(inputs.ctx, inputs.ctx_rope)
        if inputs.cache is not None:
            k_ctx, v_ctx = inputs.cache.extend(layer_idx, k_ctx, v_ctx)
        k_blk, v_blk = self._keys_values(block, inputs.block_rope)
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
        self.attention_conv: nn.Module | None = None  # DFlash2 sets both (models/dflash2.py)
        self.mlp_conv: nn.Module | None = None

    @staticmethod
    def _through(conv, sublayer, x, block_len):
        return sublayer(x) if conv is None else conv(x, sublayer, block_len)

    def forward(self, x, inputs: LayerInputs, mask, layer_idx: int):
        attention = lambda h: self.self_attn(h, inputs, mask, layer_idx)  # noqa: E731
        x = x + self._through(self.attention_conv, attention, self.input_layernorm(x), inputs.block_len)
        return x + self._through(self.mlp_conv, self.mlp, self.post_attention_layernorm(x), inputs.block_len)
