"""DFlash2: DFlash with a dynamic block convolution around every sublayer and a low-rank candidate
selector whose chain, walked from the anchor, is the single path it drafts; and the selector's
training objective. Everything DFlash2 does differently from DFlash lives here."""
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers import initialization as init

from drafter.losses.lm_head import top_logprobs
from drafter.metric_sums import sum_count
from drafter.models.dflash import DFlashDraftModel
from drafter.models.layers import DraftCache
from drafter.tree.ddtree import DraftTree, build_conditional_tree


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
    arch: ClassVar[str] = "dflash2"
    takes_draft_vocab: ClassVar[bool] = False  # its selector scores the target's whole vocabulary
    variant_keys: ClassVar[tuple[str, ...]] = ("conv_kernel_size", "conv_group_size", "selector_rank",
                                               "selector_top_k")
    drafts_marginals: ClassVar[bool] = False  # it drafts its selector chain

    @classmethod
    def variant_problems(cls, variant, hidden_size: int, vocab_size: int, block_size: int) -> list[str]:
        problems = []
        if hidden_size % variant.conv_group_size:
            problems.append(f"conv_group_size={variant.conv_group_size} does not divide the hidden size "
                            f"{hidden_size} (the convolution's channel groups)")
        if variant.selector_top_k > vocab_size:
            problems.append(f"selector_top_k={variant.selector_top_k} exceeds the vocabulary ({vocab_size})")
        if variant.conv_kernel_size > block_size:
            problems.append(f"conv_kernel_size={variant.conv_kernel_size} exceeds block_size={block_size}: "
                            "taps past the block's start see only zeros")
        return problems

    def shard_units(self) -> list[nn.Module]:
        """DFlash2: the selector too (it is called on its own after the forward)."""
        return [*self.layers, self.candidate_selector]

    def auxiliary_loss(self, hidden, blocks, head_weight, chunk_rows: int):
        """DFlash2: the selector's K-way cross entropy over teacher-forced predecessors
        (`selector_loss`), with its chain metrics (`selector_metrics`)."""
        b, num_blocks, block_size, width = hidden.shape
        rows = SelectorRows(hidden[:, :, 1:].reshape(-1, width), blocks.labels[..., :-1].reshape(-1),
                            blocks.labels[..., 1:].reshape(-1), blocks.weights[..., 1:].reshape(-1))
        loss, hit = selector_loss(self.candidate_selector, rows, head_weight, chunk_rows)
        metrics = selector_metrics(hit.view(b, num_blocks, block_size - 1), blocks)
        metrics["selector_loss"] = torch.stack([loss.detach(), loss.new_ones(())])
        return loss, metrics

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


@dataclass
class SelectorRows:
    """One row per block slot 1..B-1: its final state [N, H], the token before it (the anchor or the
    previous label: teacher forcing) [N], its label [N] and loss weight [N]."""
    hidden: torch.Tensor
    predecessors: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor


def selector_loss(selector, rows: SelectorRows, head_weight, chunk_rows: int):
    """(loss, hit [N]): DFlash2's selector objective, sum_r w_r CE_r / sum_r w_r of a K-way cross
    entropy over each row's candidates scored as serving scores them (`CandidateSelector.pick`),
    and whether the selector picks the label from the drafter's real top-K.

    The candidates are the drafter's top-K under the frozen LM head; when the label is not among
    them it replaces the K-th (the gold is inserted at the last rank, as the open trainers do),
    so every row has a target while the set keeps K entries and a static shape, and the selector
    still learns to prefer the gold over the K-1 likeliest others. Such rows count as misses in
    `hit`: serving never sees the gold there. The candidates' log-probabilities (the unary term,
    equal to the logits up to a per-row constant, which the cross entropy ignores) carry no
    gradient: the block loss trains the marginals; this loss trains the selector and, through its
    hidden projection, the drafter's states.
    """
    k = selector.top_k
    unary, candidates, label_logprob = top_logprobs(rows.hidden.detach(), head_weight, k, chunk_rows,
                                                    labels=rows.labels)
    present = (candidates == rows.labels[:, None]).any(-1)
    last = torch.arange(k, device=candidates.device) == k - 1
    insert = ~present[:, None] & last
    candidates = torch.where(insert, rows.labels[:, None], candidates)
    unary = torch.where(insert, label_logprob[:, None], unary)
    gold = (candidates == rows.labels[:, None]).long().argmax(-1)
    scores = unary + selector(rows.hidden, rows.predecessors, candidates).float()
    ce = F.cross_entropy(scores, gold, reduction="none")
    loss = (ce * rows.weights).sum() / rows.weights.sum().clamp_min(1e-12)
    hit = present & (scores.argmax(-1) == gold)
    return loss, hit


def selector_metrics(hit: torch.Tensor, blocks) -> dict[str, torch.Tensor]:
    """DFlash2's teacher-forced chain metrics from `hit` [b, A, B-1] (`selector_loss`).

    selector_acc: P(the selector picks the label | the previous tokens are the text's), over
        supervised slots.
    anchor_selector_streak: 1 (bonus) + the leading slots it picks right, per random anchor: the
        selector chain's `anchor_streak` (while every pick is right the chain's predecessors are the
        text's, so teacher forcing walks the served chain).
    """
    supervised = blocks.weights[..., 1:] > 0
    hit = hit & supervised
    return {"selector_acc": sum_count(hit, supervised),
            "anchor_selector_streak": sum_count(hit.long().cumprod(-1).sum(-1) + 1, blocks.valid)}
