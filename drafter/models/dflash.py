"""The DFlash drafter: Qwen3-style layers that draft a block of tokens conditioned on target features.

Data flow (one forward):
    target features [b, n, K*H] --fc--> hidden_norm --> ctx [b, n, H]   (shared by every layer)
    block embeddings [b, Q, H] (the target's embedding of [anchor, MASK, ...])
    every layer: queries from the block; keys/values = that layer's k/v projections of [ctx || block]
    (KV injection); the context never passes through an MLP.
    final norm --> the target's LM head (frozen, not ours) --> logits.

The same `forward` serves training (all anchors' blocks of a sequence at once, ctx = the whole
sequence, a block mask) and inference (one block, ctx = new context positions appended to a
`DraftCache`; a mask only for sliding and causal layers). Weight names and config follow the public
`dflash` format, so `save_pretrained` output loads in `dflash.model.DFlashDraftModel`, SGLang and vLLM.
"""
from dataclasses import replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3PreTrainedModel, Qwen3RMSNorm, Qwen3RotaryEmbedding

from drafter.models.checks import check_drafter_config
from drafter.models.draft_vocab import DraftVocab
from drafter.models.layers import DFlashDecoderLayer, DraftCache, LayerInputs, layer_attention
from drafter.tree.ddtree import DraftTree, build_tree


class DFlashDraftModel(Qwen3PreTrainedModel):
    """The DFlash drafter, and the interface every registered architecture keeps (`DraftModel`):
    what training, serving, the engines and the export ask of a drafter, answered here for DFlash
    and overridden by the architectures that differ (drafter/models/dflash2.py)."""
    config_class = Qwen3Config
    _no_split_modules = ["DFlashDecoderLayer"]
    arch: ClassVar[str] = "dflash"                 # its name in the config (`drafter.arch`)
    variant_keys: ClassVar[tuple[str, ...]] = ()  # its own `drafter.*` settings (exported; refused on another arch)
    drafts_marginals: ClassVar[bool] = True      # its chain is the argmax of its slots' marginals
    takes_draft_vocab: ClassVar[bool] = True     # its head may be a draft vocabulary's (draft_vocab.py)

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
        if getattr(config, "draft_vocab_size", None):  # the table, filled by `set_draft_vocab` or the checkpoint
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self._draft_head = (None, None)  # (what it was gathered from, the draft head)
        self.post_init()

    def _add_variant_modules(self, config: Qwen3Config):
        """Nothing for DFlash; DFlash2DraftModel adds its convolutions and selector."""

    @classmethod
    def variant_problems(cls, variant, hidden_size: int, vocab_size: int, block_size: int) -> list[str]:
        """What this architecture's own settings (`variant_keys` of `variant`, a DrafterVariant)
        cannot do with the target's widths and the block size, each naming its key."""
        return []

    @classmethod
    def variant_dflash_config(cls, variant) -> dict:
        """The `dflash_config` entries `dflash` 0.1.0 reads for this architecture's own settings."""
        return {key: getattr(variant, key) for key in cls.variant_keys}

    def shard_units(self) -> list[nn.Module]:
        """The submodules a sharding engine wraps one by one before the root (FSDP2's `fully_shard`):
        every decoder layer, and any module called on its own after the forward."""
        return list(self.layers)

    def auxiliary_loss(self, hidden, blocks, head_weight, chunk_rows: int):
        """(loss, metrics) that this architecture adds to the block loss from the training forward's
        final states `hidden` [b, A, B, H] and the batch's `blocks` (models.blocks.Blocks), or None:
        nothing for DFlash."""
        return None

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.dflash_config["target_layer_ids"]

    @property
    def mask_token_id(self) -> int:
        return self.config.dflash_config["mask_token_id"]

    @property
    def draft_vocab(self) -> DraftVocab | None:
        """The draft vocabulary its LM head is cut to, or None: the target's whole head."""
        return DraftVocab.from_buffers(self.d2t, self.t2d) if hasattr(self, "d2t") else None

    def set_draft_vocab(self, vocab: DraftVocab):
        for name, value in vocab.buffers().items():
            getattr(self, name).copy_(value)

    def head_weight(self, target) -> torch.Tensor:
        """The frozen LM head [V or K, H] its logits come from: the target's, or its draft vocabulary's
        rows of it (gathered once per head and table)."""
        weight = target.get_output_embeddings().weight
        vocab = self.draft_vocab
        if vocab is None:
            return weight
        source = (weight.data_ptr(), weight._version, weight.dtype, self.d2t.data_ptr(), self.d2t._version)
        if self._draft_head[0] != source:
            self._draft_head = (source, vocab.head(weight.detach()))
        return self._draft_head[1]

    def head_logits(self, target, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [..., V or K] of final states `hidden` under `head_weight`."""
        # a fresh copy, not a view: in bf16 on the CPU (torch 2.13) a block's slots 1..B-1 went down a
        # matmul path ~20-50x slower, for a batch of one too (which .contiguous() returns unchanged: its
        # flag ignores the batch stride of a size-1 dimension); the copy is H values a row against V
        hidden = hidden.to(target.dtype, memory_format=torch.contiguous_format, copy=True)
        if self.draft_vocab is None:
            return target.get_output_embeddings()(hidden).float()
        return F.linear(hidden, self.head_weight(target)).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Token ids of its head's rows as the target's ids."""
        vocab = self.draft_vocab
        return draft_ids if vocab is None else vocab.to_target(draft_ids)

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
        # normed after the reshape, so the output is no view: FSDP2 places its pre-backward hook on
        # the root's output, and a view's in-place use would drop it
        return self.norm(x.view(b, num_blocks, block_len, width))

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
    def draft_states(self, target, ctx_features, block_ids, cache: DraftCache, depth: int | None = None):
        """Inference: (states [b, D, H], fp32 logits [b, D, V]) of block positions 1..D, D = `depth`
        (None: all B-1), what `block_trees` builds a tree from (arguments: `draft_hidden`); with a
        draft vocabulary the logits are over its K words [b, D, K] (`head_logits`). The whole
        block is drafted either way; only the LM head, the draft step's largest cost, skips the later
        slots. A tree of N nodes is at most N deep, so ddtree@N asks for min(N, B-1) slots and gets
        the tree all B-1 would give (`tests/test_ddtree.py`)."""
        hidden = self.draft_hidden(target, ctx_features, block_ids, cache)[:, 1:]
        hidden = hidden if depth is None else hidden[:, :depth]
        return hidden, self.head_logits(target, hidden)

    @torch.no_grad()
    def draft_logits(self, target, ctx_features, block_ids, cache: DraftCache) -> torch.Tensor:
        """Inference: fp32 logits [b, B-1, V] over the target's ids for block positions 1..B-1
        (arguments: `draft_hidden`); -inf outside a draft vocabulary."""
        logits = self.draft_states(target, ctx_features, block_ids, cache)[1]
        vocab = self.draft_vocab
        return logits if vocab is None else vocab.full_logits(logits)

    @torch.no_grad()
    def draft_chain(self, target, ctx_features, block_ids, cache: DraftCache) -> torch.Tensor:
        """Inference: the single path [b, B-1] DFlash verifies: the argmax of every slot's logits
        (arguments: `draft_hidden`); with a draft vocabulary, its best draft word at each slot."""
        return self.draft_logits(target, ctx_features, block_ids, cache).argmax(-1)

    def chain_picks(self, hidden, logits, predecessors) -> torch.Tensor:
        """The token (a target id) the drafted path takes at each slot [...] given the token before
        it (`predecessors` [...]; unused by DFlash) from the slot's state and logits [..., V or K]."""
        return self.to_target_ids(logits.argmax(-1))

    def chain_top(self, hidden, logits, predecessors, k: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores, tokens) [..., k]: the k best tokens (target ids) of the drafted path at each slot
        by the score `chain_picks` takes the argmax of (DFlash: the logits), best first."""
        scores, tokens = logits.topk(k, dim=-1)
        return scores, self.to_target_ids(tokens)

    @property
    def chain_candidates(self) -> int | None:
        """How many of a slot's most likely tokens the drafted path chooses among: None (all) for DFlash."""
        return None

    def block_trees(self, hidden, logits, roots, budget: int, backend: str = "auto") -> DraftTree:
        """The best-`budget` DDTree of each block [n] from its slots' states [n, B-1, H] and logits
        [n, B-1, V or K] after the anchor tokens `roots` [n]: for DFlash, from the slots' marginals;
        its tokens are target ids."""
        tree = build_tree(logits, budget, backend)
        return replace(tree, tokens=self.to_target_ids(tree.tokens))
