"""The DFlash drafter: Qwen3-style layers that draft a block of tokens conditioned on target features.

Data flow (one forward):
    target features [b, n, K*H] --fc--> hidden_norm --> ctx [b, n, H]   (shared by every layer)
    block embeddings [b, Q, H] (the target's embedding of [anchor, MASK, ...])
    every layer: queries from the block; keys/values = that layer's k/v projections of [ctx || block]
    (KV injection); the context never passes through an MLP.
    final norm --> the target's LM head (frozen, not ours) --> logits.

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

_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")  # Qwen3RotaryEmbedding's own


def _config_value(config, key: str, default=None):
    """config.key, or its global value where the config holds the key per layer (Gemma 4)."""
    try:
        value = getattr(config, key, default)
    except Exception:  # transformers: an attribute that differs per layer has no single value
        value = config.to_dict().get(key, default)
    return default if value is None else value


def drafter_attention_shape(text_config) -> dict:
    """The drafter's heads: the target's (query heads, KV heads, head dim) where its attention is
    ordinary multi-head attention; for MLA targets (DeepSeek-V3, Kimi) head dim = the target's value
    head dim, as many query heads as fill the hidden size, and at most 8 KV heads that divide them.
    A per-layer head dim (Gemma 4's global layers) gives way to the config's head_dim."""
    hidden, heads = text_config.hidden_size, text_config.num_attention_heads
    if getattr(text_config, "kv_lora_rank", None):  # multi-head latent attention
        head_dim = getattr(text_config, "v_head_dim", None) or hidden // heads
        heads = max(1, hidden // head_dim)
        kv_heads = max(k for k in range(1, min(8, heads) + 1) if heads % k == 0)
        return {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim}
    kv_heads = _config_value(text_config, "num_key_value_heads", heads)
    head_dim = _config_value(text_config, "head_dim", hidden // heads)
    return {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim}


def drafter_rope(text_config) -> dict:
    """The drafter's rotary: the target's full-attention rotary (one entry of a per-layer-type dict),
    applied to the whole head (partial-rotary and multimodal sections dropped), of a type
    Qwen3RotaryEmbedding computes; otherwise the default rotary at the target's base."""
    rope = dict(getattr(text_config, "rope_parameters", None) or {})
    if "full_attention" in rope and isinstance(rope["full_attention"], dict):
        rope = dict(rope["full_attention"])
    theta = rope.get("rope_theta", getattr(text_config, "rope_theta", 10000.0))
    if rope.get("rope_type", "default") not in _ROPE_TYPES:
        return {"rope_type": "default", "rope_theta": theta}
    for key in ("partial_rotary_factor", "mrope_section", "mrope_interleaved"):
        rope.pop(key, None)
    return {**rope, "rope_type": rope.get("rope_type", "default"), "rope_theta": theta}


def drafter_widths(text_config) -> dict:
    """Everything of the drafter's Qwen3 config that comes from the target: the hidden size (which
    must match: the drafter reads the target's features and calls its embedding and LM head), the
    vocabulary, and the sizes the drafter takes over where the target has them (MLP width: the
    target's dense `intermediate_size`, else 3x hidden; activation, norm eps, attention bias)."""
    from transformers.activations import ACT2FN

    hidden_act = getattr(text_config, "hidden_act", None)
    eps = next((getattr(text_config, k) for k in ("rms_norm_eps", "layer_norm_epsilon", "norm_eps")
                if getattr(text_config, k, None)), 1e-6)
    return {"hidden_size": text_config.hidden_size, "vocab_size": text_config.vocab_size,
            **drafter_attention_shape(text_config),
            "intermediate_size": getattr(text_config, "intermediate_size", None) or 3 * text_config.hidden_size,
            "hidden_act": hidden_act if hidden_act in ACT2FN else "silu", "rms_norm_eps": float(eps),
            "max_position_embeddings": getattr(text_config, "max_position_embeddings", 32768),
            "attention_bias": bool(getattr(text_config, "attention_bias", False)),
            "rope_parameters": drafter_rope(text_config)}


def drafter_config(target_config, *, num_layers: int, block_size: int, mask_token_id: int,
                   target_layer_ids: list[int] | None = None, input_embedding_scale: float = 1.0,
                   **record) -> Qwen3Config:
    """A drafter config for any HF causal-LM target config (`drafter_widths`).

    `input_embedding_scale` is the target's embedding scale (`target.input_embedding_scale`): the
    block is embedded as raw embedding rows times it, at training and serving time alike. The
    drafter's logits are the target's LM head on its states, without the target's final soft-capping
    (tanh keeps the order, so argmax and the tree's top-k are the same; the drafter is trained on
    the uncapped logits). `record` lands in `dflash_config` (e.g. target_path, chat_template_kwargs)
    so that a checkpoint can be evaluated without flags.
    """
    text_config = target_config.get_text_config()
    num_target_layers = text_config.num_hidden_layers
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(num_target_layers, num_layers)
    target_layer_ids = [int(i) for i in target_layer_ids]
    check_feature_layers(target_layer_ids, num_target_layers)
    if not 0 <= mask_token_id < text_config.vocab_size:
        raise ValueError(f"mask_token_id {mask_token_id} has no row in the target's embedding "
                         f"(vocab_size {text_config.vocab_size})")
    return Qwen3Config(
        **drafter_widths(text_config), num_hidden_layers=num_layers, num_target_layers=num_target_layers,
        block_size=block_size, tie_word_embeddings=False, use_sliding_window=False,
        architectures=["DFlashDraftModel"],
        dflash_config={"target_layer_ids": target_layer_ids, "mask_token_id": int(mask_token_id),
                       "input_embedding_scale": float(input_embedding_scale),
                       "target_model_type": getattr(text_config, "model_type", None), **record})


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


class DraftCache:
    """Per-layer K/V of the context only: block entries are never stored, so no crop is needed."""

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

    def embed_block(self, target, block_ids: torch.Tensor) -> torch.Tensor:
        """The block's input states: the target's raw embedding rows times
        dflash_config.input_embedding_scale, as the public loader embeds them, in the drafter's dtype."""
        scale = float(self.config.dflash_config.get("input_embedding_scale", 1.0))
        return (F.embedding(block_ids, target.get_input_embeddings().weight) * scale).to(self.dtype)

    def forward(self, block_embeds, block_positions, features, ctx_positions, mask=None, cache=None):
        """Final-normed block states [b, Q, H].

        block_embeds [b, Q, H], block_positions [b, Q]; target features [b, n, K*H] of the context
        positions ctx_positions [b, n], fused here (fc, hidden_norm) into the states every layer
        projects to K/V. Keys are ordered [context (cache first, if any) || block]; `mask` indexes
        them in that order. Everything runs inside forward, so sharding wrappers (ZeRO-3, FSDP2)
        gather every weight through the module's own hooks.
        """
        ctx = self.hidden_norm(self.fc(features))
        block_rope = self.rotary_emb(block_embeds, block_positions)
        ctx_rope = self.rotary_emb(ctx, ctx_positions)
        x = block_embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, block_rope, ctx_rope, mask, cache, i)
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
        block_embeds = self.embed_block(target, block_ids)
        hidden = self(block_embeds, positions[:, n:], ctx_features.to(self.dtype), positions[:, :n], None, cache)
        return target.get_output_embeddings()(hidden[:, 1:].to(target.dtype)).float()


def drafter_from_state_dict(config: Qwen3Config, state_dict: dict[str, torch.Tensor]) -> DFlashDraftModel:
    """A plain (unsharded) drafter on the CPU holding `state_dict`, built without a random init first."""
    with torch.device("meta"):
        drafter = DFlashDraftModel(config)
    drafter.to_empty(device="cpu")
    drafter.load_state_dict(state_dict)
    drafter.rotary_emb = Qwen3RotaryEmbedding(config)  # its buffers are not in state dicts
    return drafter
