"""The DFlash drafter: Qwen3-style layers that draft a block of tokens conditioned on target features.

Data flow (one forward):
    target features [b, n, K*H] --fc--> hidden_norm --> ctx [b, n, H]   (shared by every layer)
    block embeddings [b, Q, H] (the target's embedding of [anchor, MASK, ...])
    every layer: queries from the block; keys/values = that layer's k/v projections of [ctx || block]
    (KV injection); the context never passes through an MLP.
    final norm --> the target's LM head (frozen, not ours) --> logits.

Variants (docs/design.md contract 11, config `drafter.*`): a layer is `full_attention` or
`sliding_attention` (`layer_types`, `sliding_window`), causal inside the block or not (`causal`);
`LayerAttention` says which keys each layer's block queries see, exactly as `dflash` 0.1.0 reads
the exported config. `DFlash2DraftModel` (`arch: dflash2`) adds a `DynamicBlockConv` around every
sublayer and a `CandidateSelector` whose chain (`draft_chain`) is the single path it drafts.

The same `forward` serves training (all anchors' blocks of a sequence at once, ctx = the whole
sequence, a block mask) and inference (one block, ctx = new context positions appended to a
`DraftCache`; a mask only for sliding and causal layers). Weight names and config follow the public
`dflash` format, so `save_pretrained` output loads in `dflash.model.DFlashDraftModel`, SGLang and vLLM.
"""
import functools
from dataclasses import dataclass

import torch
import torch.fx.experimental._config as symbolic_shapes_config
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import Qwen3Config
from transformers import initialization as init
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP, Qwen3PreTrainedModel, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half)

from drafter.ddtree import DraftTree, build_conditional_tree, build_tree
from drafter.draft_config import check_drafter_config


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


class DynamicBlockConv(nn.Module):
    """DFlash2's grouped dynamic depthwise convolution around one sublayer (attention or MLP): a
    causal convolution along the block before the sublayer and one after it. Tap o of channel c at
    slot t weighs slot t - o (zero before the block's first slot) by base_kernel[i, o, c] plus an
    offset shared by c's group of `group_size` channels, predicted from the sublayer's input at t
    (one projection predicts the offsets of both convolutions). Starts as the identity."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def reset_to_identity(self):
        identity = torch.zeros_like(self.base_kernel)
        identity[:, 0] = 1.0
        init.copy_(self.base_kernel, identity)
        init.zeros_(self.kernel_projection.weight)

    def _convolve(self, x, base, offsets, block_len: int):
        """x [b, Q, H], base [kernel, H], offsets [b, Q, kernel, groups] -> [b, Q, H], block by block."""
        b, length, hidden = x.shape
        shape = (b, length // block_len, block_len, self.groups, self.group_size)
        blocks, offsets = x.view(shape), offsets.view(*shape[:3], self.kernel_size, self.groups, 1)
        base = base.view(self.kernel_size, self.groups, self.group_size).to(x.dtype)
        out = torch.zeros_like(blocks)
        for tap in range(self.kernel_size):
            earlier = F.pad(blocks, (0, 0, 0, 0, tap, 0))[:, :, :block_len]  # slot t - tap
            out = out + (base[tap] + offsets[:, :, :, tap]) * earlier
        return out.view(b, length, hidden)

    def forward(self, x, sublayer, block_len: int):
        offsets = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        before = self._convolve(x, self.base_kernel[0], offsets[..., 0, :, :], block_len)
        return self._convolve(sublayer(before), self.base_kernel[1], offsets[..., 1, :, :], block_len)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention_conv: DynamicBlockConv | None = None  # DFlash2 sets both
        self.mlp_conv: DynamicBlockConv | None = None

    @staticmethod
    def _through(conv, sublayer, x, block_len):
        return sublayer(x) if conv is None else conv(x, sublayer, block_len)

    def forward(self, x, inputs: LayerInputs, mask, layer_idx: int):
        attention = lambda h: self.self_attn(h, inputs, mask, layer_idx)  # noqa: E731
        x = x + self._through(self.attention_conv, attention, self.input_layernorm(x), inputs.block_len)
        return x + self._through(self.mlp_conv, self.mlp, self.post_attention_layernorm(x), inputs.block_len)


class DFlashDraftModel(Qwen3PreTrainedModel):
    config_class = Qwen3Config
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config):
        check_drafter_config(config)
        super().__init__(config)
        num_features = len(config.dflash_config["target_layer_ids"])
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(num_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layer_attention = layer_attention(config)
        self._add_variant_modules(config)
        self.post_init()

    def _add_variant_modules(self, config: Qwen3Config):
        """Nothing for DFlash; DFlash2DraftModel adds its convolutions and selector."""

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

    def forward(self, block_embeds, block_positions, features, ctx_positions, masks, cache=None):
        """Final-normed block states [b, A, L, H] of A blocks of L slots each.

        block_embeds [b, A, L, H], block_positions [b, A, L]; target features [b, n, K*H] of the
        context positions ctx_positions [b, n], fused here (fc, hidden_norm) into the states every
        layer projects to K/V. Keys are ordered [context (cache first, if any) || blocks]; `masks`
        maps each of `self.layer_attention` to the mask (see `attend`) its layers use over keys in
        that order, queries being the blocks' slots back to back. Everything runs inside forward,
        so sharding wrappers (ZeRO-3, FSDP2) gather every weight through the module's own hooks.
        """
        b, num_blocks, block_len, width = block_embeds.shape
        x = block_embeds.reshape(b, num_blocks * block_len, width)
        ctx = self.hidden_norm(self.fc(features))
        inputs = LayerInputs(ctx, self.rotary_emb(x, block_positions.reshape(b, -1)),
                             self.rotary_emb(ctx, ctx_positions), cache, block_len)
        for i, (layer, attention) in enumerate(zip(self.layers, self.layer_attention)):
            x = layer(x, inputs, masks[attention], i)
        return self.norm(x).view(b, num_blocks, block_len, width)

    @torch.no_grad()
    def draft_hidden(self, target, ctx_features, block_ids, cache: DraftCache) -> torch.Tensor:
        """Inference: the final-normed states [b, B, H] of one block.

        ctx_features [b, n, K*H] are the new context positions cache.length .. cache.length+n-1 (they
        are appended to `cache`); block_ids [b, B] = [anchor, MASK, ...] sit right after them.
        """
        start = cache.length
        n, block_len = ctx_features.shape[1], block_ids.shape[1]
        positions = torch.arange(start, start + n + block_len, device=block_ids.device)[None]
        positions = positions.expand(block_ids.shape[0], -1)
        block_embeds = self.embed_block(target, block_ids)
        # each layer's keys: its cached context (a suffix of the positions before `start`), the new
        # context and the block; the mask depends on distances only, so it is built over those keys
        masks = {a: a.inference_mask(a.cached_context(start) + n, block_len, block_ids.device)
                 for a in set(self.layer_attention)}
        hidden = self(block_embeds[:, None], positions[:, None, n:], ctx_features.to(self.dtype),
                      positions[:, :n], masks, cache)
        cache.crop(start + n, self.layer_attention)
        return hidden[:, 0]

    @torch.no_grad()
    def draft_states(self, target, ctx_features, block_ids, cache: DraftCache):
        """Inference: (states [b, B-1, H], fp32 logits [b, B-1, V]) of block positions 1..B-1
        (arguments: `draft_hidden`), what `block_trees` builds a tree from."""
        hidden = self.draft_hidden(target, ctx_features, block_ids, cache)[:, 1:]
        return hidden, target.get_output_embeddings()(hidden.to(target.dtype)).float()

    @torch.no_grad()
    def draft_logits(self, target, ctx_features, block_ids, cache: DraftCache) -> torch.Tensor:
        """Inference: fp32 logits [b, B-1, V] for block positions 1..B-1 (arguments: `draft_hidden`)."""
        return self.draft_states(target, ctx_features, block_ids, cache)[1]

    @torch.no_grad()
    def draft_chain(self, target, ctx_features, block_ids, cache: DraftCache) -> torch.Tensor:
        """Inference: the single path [b, B-1] DFlash verifies: the argmax of every slot's logits
        (arguments: `draft_hidden`)."""
        return self.draft_logits(target, ctx_features, block_ids, cache).argmax(-1)

    def chain_picks(self, hidden, logits, predecessors) -> torch.Tensor:
        """The token the drafted path takes at each slot [...] given the token before it
        (`predecessors` [...]; unused by DFlash) from the slot's state and logits [..., V]."""
        return logits.argmax(-1)

    def chain_top(self, hidden, logits, predecessors, k: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores, tokens) [..., k]: the k best tokens of the drafted path at each slot by the score
        `chain_picks` takes the argmax of (DFlash: the logits), best first."""
        return logits.topk(k, dim=-1)

    @property
    def chain_candidates(self) -> int | None:
        """How many of a slot's most likely tokens the drafted path chooses among: None (all) for DFlash."""
        return None

    def block_trees(self, hidden, logits, roots, budget: int, backend: str = "auto") -> DraftTree:
        """The best-`budget` DDTree of each block [n] from its slots' states [n, B-1, H] and logits
        [n, B-1, V] after the anchor tokens `roots` [n]: for DFlash, from the slots' marginals."""
        return build_tree(logits, budget, backend)


class CandidateSelector(nn.Module):
    """DFlash2's low-rank candidate selector: at each block slot it re-scores the drafter's top-K
    tokens by how well each follows the token drafted before it, given the slot's state:
    score(candidate) = logit(candidate) + <P[previous] * W h, S[candidate]>, P and S [V, rank]
    codebooks, W [rank, H]. The chain walked from the anchor takes each slot's best-scored token.
    The codebooks are plain parameters, so they are saved under the names `dflash` 0.1.0 maps."""

    def __init__(self, config: Qwen3Config, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

    def reset_parameters(self, std: float):
        init.normal_(self.predecessor_codebook, mean=0.0, std=std)
        init.normal_(self.successor_codebook, mean=0.0, std=std)

    def forward(self, hidden, predecessors, candidates) -> torch.Tensor:
        """Pair scores [..., K] of candidates [..., K] after predecessors [...], states hidden [..., H]."""
        query = F.embedding(predecessors, self.predecessor_codebook) * self.hidden_projection(hidden)
        keys = F.embedding(candidates, self.successor_codebook)
        return (keys * query[..., None, :].to(keys.dtype)).sum(-1)

    def candidates(self, logits) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, token ids) [..., K] of the top-K tokens, most likely first."""
        return logits.topk(self.top_k, dim=-1)

    def scores(self, hidden, logits, predecessors) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores, candidates) [..., K] of every slot given its predecessor: logit + pair score."""
        unary, candidates = self.candidates(logits)
        return unary + self(hidden, predecessors, candidates).to(unary.dtype), candidates

    def pick(self, hidden, logits, predecessors) -> torch.Tensor:
        """The best-scored candidate [...] of every slot given its predecessor."""
        scores, candidates = self.scores(hidden, logits, predecessors)
        return candidates.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]

    def conditional_logprobs(self, hidden, logits, roots):
        """The selector's K-way distributions over blocks [n] of L slots (states [n, L, H], logits
        [n, L, V]): the candidates [n, L, K]; at slot 1 after the anchor `roots` [n], [n, K]; at each
        later slot after each candidate of the slot before, [n, L-1, K (before), K]."""
        unary, candidates = self.candidates(logits)
        first = unary[:, 0] + self(hidden[:, 0], roots, candidates[:, 0]).to(unary.dtype)
        query = (F.embedding(candidates[:, :-1], self.predecessor_codebook)
                 * self.hidden_projection(hidden[:, 1:])[:, :, None, :])          # [n, L-1, K, r]
        keys = F.embedding(candidates[:, 1:], self.successor_codebook)             # [n, L-1, K, r]
        later = unary[:, 1:, None, :] + torch.einsum("ndpr,ndcr->ndpc", query, keys).to(unary.dtype)
        return candidates, first.log_softmax(-1), later.log_softmax(-1)


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash with a DynamicBlockConv around every attention and MLP sublayer and a
    CandidateSelector over the block's slots (`dflash.model.DFlash2DraftModel`'s structure)."""
    _no_split_modules = ["DFlashDecoderLayer", "CandidateSelector"]

    def _add_variant_modules(self, config: Qwen3Config):
        settings = config.dflash_config
        for layer in self.layers:
            for name in ("attention_conv", "mlp_conv"):
                setattr(layer, name, DynamicBlockConv(config.hidden_size, settings["conv_kernel_size"],
                                                      settings["conv_group_size"]))
        self.candidate_selector = CandidateSelector(config, settings["selector_rank"],
                                                    settings["selector_top_k"])

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, DynamicBlockConv):
            module.reset_to_identity()
        elif isinstance(module, CandidateSelector):
            module.reset_parameters(self.config.initializer_range)

    def chain_picks(self, hidden, logits, predecessors) -> torch.Tensor:
        return self.candidate_selector.pick(hidden, logits, predecessors)

    def chain_top(self, hidden, logits, predecessors, k: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
        """DFlash2: by the selector's scores after each slot's predecessor."""
        scores, candidates = self.candidate_selector.scores(hidden, logits, predecessors)
        top, index = scores.topk(k, dim=-1)
        return top, candidates.gather(-1, index)

    @property
    def chain_candidates(self) -> int | None:
        """DFlash2: the selector's top-K."""
        return self.candidate_selector.top_k

    def block_trees(self, hidden, logits, roots, budget: int, backend: str = "auto") -> DraftTree:
        """DFlash2: the tree of the selector's scores, each node's children scored after its own token
        (`ddtree.build_conditional_tree`). On the toy world it accepts far deeper than the marginals'
        tree of the same drafter (bench/selector_tree.py: replayed tau 7.57 against 4.22 at B=32)."""
        candidates, first, later = self.candidate_selector.conditional_logprobs(hidden, logits, roots)
        return build_conditional_tree(first, later, candidates, budget)

    @torch.no_grad()
    def draft_chain(self, target, ctx_features, block_ids, cache: DraftCache) -> torch.Tensor:
        """Inference: the selector's chain [b, B-1], walked from the anchor one slot at a time, each
        slot's predecessor the token picked before it."""
        hidden = self.draft_hidden(target, ctx_features, block_ids, cache)[:, 1:]
        logits = target.get_output_embeddings()(hidden.to(target.dtype)).float()
        previous, chain = block_ids[:, 0], []
        for slot in range(hidden.shape[1]):
            previous = self.chain_picks(hidden[:, slot], logits[:, slot], previous)
            chain.append(previous)
        return torch.stack(chain, dim=1)


ARCHITECTURES = {"dflash": DFlashDraftModel, "dflash2": DFlash2DraftModel}


def drafter_class(config: Qwen3Config) -> type[DFlashDraftModel]:
    """The class a drafter config is for, by its `architectures` (as the serving stacks pick it)."""
    return DFlash2DraftModel if "DFlash2DraftModel" in (config.architectures or []) else DFlashDraftModel


def load_drafter(directory, **kwargs) -> DFlashDraftModel:
    """An exported drafter directory, DFlash or DFlash2 (`from_pretrained` kwargs pass through)."""
    return drafter_class(Qwen3Config.from_pretrained(directory)).from_pretrained(directory, **kwargs)


def drafter_from_state_dict(config: Qwen3Config, state_dict: dict[str, torch.Tensor]) -> DFlashDraftModel:
    """A plain (unsharded) drafter on the CPU holding `state_dict`, built without a random init first."""
    with torch.device("meta"):
        drafter = drafter_class(config)(config)
    drafter.to_empty(device="cpu")
    drafter.load_state_dict(state_dict)
    drafter.rotary_emb = Qwen3RotaryEmbedding(config)  # its buffers are not in state dicts
    return drafter
