"""The frozen LM head over many rows of drafter states, one chunk of rows at a time, so that the full
rows x vocabulary logits of neither the drafter nor the target ever exist at once.

`ChunkedLMHeadLoss` is the one loss kernel every objective runs: each chunk's logits, each row's label
rank and the drafter's argmax (metrics, the first-failure cut), the drafter's log-probabilities, the
row's divergence to its label (drafter/losses/divergences.py: CE, KL or CE + TV, against the data
token or the target's distribution) and that divergence's gradient w.r.t. the hidden state, all in the
forward pass. With fixed row weights (the default objective) the weights are folded into the
gradient chunk by chunk and one scalar comes back; without them, per-row losses whose weights are
computed afterwards from the same pass (D-PACE needs each row's confidence). Also here: each row's
most likely tokens (`top_logprobs`, trees and DFlash2's candidates) and the dense references the tests
and benchmarks check the kernel against.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from drafter.losses.divergences import DIVERGENCES

RANK_BUFFERS = 2.25  # a chunk's label ranks: a bool mask (1/4 of an fp32 logit buffer), its int64 count (2)


@dataclass
class RowLossSpec:
    labels: str                  # data | target
    loss: str                    # a divergence of DIVERGENCES (kl and tv need labels=target)
    chunk_rows: int              # rows of one side's fp32 logits alive at once
    softcap: float | None = None  # the target's final_logit_softcapping (Gemma), applied to its logits
    tv_ce_weight: float = 0.1    # w of loss=tv: w CE + (1 - w) TV


def chunk_rows_for(vocab_size: int, chunk_bytes: int = 256 * 2**20) -> int:
    return max(1, chunk_bytes // (4 * vocab_size))


def rows_per_chunk(labels: str, chunk_rows: int) -> int:
    """Rows of one chunk of `ChunkedLMHeadLoss`: a chunk of target labels holds both sides' logits, so
    it takes half the rows."""
    return chunk_rows if labels == "data" else max(1, chunk_rows // 2)


def logit_softcap(target) -> float | None:
    """The target's final-logit soft cap (cap * tanh(logits / cap)), if its config has one."""
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    return getattr(config, "final_logit_softcapping", None) or None


def teacher_logits(hidden: torch.Tensor, head_weight: torch.Tensor, softcap: float | None) -> torch.Tensor:
    logits = (hidden @ head_weight.T).float()
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


@torch.no_grad()
def target_next_tokens(final_hidden: torch.Tensor, head_weight: torch.Tensor, softcap: float | None,
                       chunk_rows: int) -> torch.Tensor:
    """The target's argmax [rows] at its final hidden states `final_hidden` [rows, H], as the loss kernel
    takes its hard labels with labels=target (what a feature store holds for them), `chunk_rows` rows of
    logits at a time, on the head's device."""
    final_hidden = final_hidden.to(head_weight.device)
    tokens = torch.empty(final_hidden.shape[0], dtype=torch.long, device=final_hidden.device)
    for start in range(0, final_hidden.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        tokens[rows] = teacher_logits(final_hidden[rows], head_weight, softcap).log_softmax(-1).argmax(-1)
    return tokens


def label_rank(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's label rank as argmax orders tokens (by logit, ties to the lower id): 0 = top-1."""
    label_logit = logits.gather(1, labels[:, None])
    vocab_ids = torch.arange(logits.shape[1], device=logits.device)
    return (logits > label_logit).sum(-1) + ((logits == label_logit) & (vocab_ids < labels[:, None])).sum(-1)


def drafter_logprobs(logits: torch.Tensor, in_place: bool) -> torch.Tensor:
    """log_softmax of a chunk's logits: in their own buffer (logits - logsumexp) where the weights are
    folded in and nothing else reads the logits, else a new buffer (log_softmax). The two round
    differently (by up to ~4e-6 in the loss); each path keeps the arithmetic it has always had."""
    if in_place:
        return logits.sub_(logits.logsumexp(-1, keepdim=True))
    return logits.log_softmax(-1)


class ChunkedLMHeadLoss(torch.autograd.Function):
    """Row losses through the frozen LM head, one chunk of rows at a time (module docstring).

    forward(hidden [rows, H], head_weight [V, H], data_labels [rows], teacher_hidden [rows, H] or None
    (labels=target: the target's final hidden states predicting each row; or its argmax there [rows],
    as a feature store holds it for the hard-label losses), spec, row_weights [rows] or None)
    -> (loss, ranks, hard_labels, hard_logprob, drafter_argmax):
      loss: with row_weights, sum_r w_r loss_r / sum_r w_r (the weights carry no gradient); without,
        the per-row losses [rows] (fp32), differentiable w.r.t. `hidden`;
      ranks: each row's data label rank as serving's argmax orders tokens (by logit, a tie going to
        the lower id): rank 0 means argmax returns the label;
      hard_labels: the data token, or the target's argmax with target labels;
      hard_logprob: the drafter's log-probability of that hard label;
      drafter_argmax: the token serving drafts there (these two without row_weights only: the folded
        default needs neither and leaves them unset).
    The gradient d loss_r / d hidden_r = (d loss_r / d logits_r) @ W is kept from the forward pass
    (scaled by w_r / sum w when the weights are given); backward scales it by the incoming gradient.
    The chunks are fixed by the shapes alone: no host synchronisation.
    """

    @staticmethod
    # over six: torch.autograd.Function.forward takes every input of apply() positionally
    def forward(ctx, hidden, head_weight, data_labels, teacher_hidden, spec: RowLossSpec, row_weights=None):
        divergence = DIVERGENCES[spec.loss]
        need_grad = ctx.needs_input_grad[0]
        rows = hidden.shape[0]
        folded = row_weights is not None
        total_weight = row_weights.sum().clamp_min(1e-12) if folded else None
        loss = hidden.new_zeros((), dtype=torch.float32) if folded else torch.empty(rows, dtype=torch.float32,
                                                                                    device=hidden.device)
        ranks = torch.empty_like(data_labels)
        hard_labels = data_labels.clone()
        hard_logprob = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        drafter_argmax = torch.empty_like(data_labels)
        row_grad = torch.empty_like(hidden) if need_grad else None
        chunk_rows = rows_per_chunk(spec.labels, spec.chunk_rows)
        log_t = None
        for start in range(0, rows, chunk_rows):
            chunk = slice(start, start + chunk_rows)
            logits = (hidden[chunk] @ head_weight.T).float()
            ranks[chunk] = label_rank(logits, data_labels[chunk])
            if not folded:  # what the weights and the cut of the other objectives are computed from
                drafter_argmax[chunk] = logits.argmax(-1)
            log_q = drafter_logprobs(logits, folded)
            del logits
            if spec.labels == "target" and teacher_hidden.dim() == 1:  # the target's argmax, stored
                hard_labels[chunk] = teacher_hidden[chunk]
            elif spec.labels == "target":
                log_t = teacher_logits(teacher_hidden[chunk], head_weight, spec.softcap).log_softmax(-1)
                hard_labels[chunk] = log_t.argmax(-1)
            hard = hard_labels[chunk, None]
            if not folded:
                hard_logprob[chunk] = log_q.gather(1, hard)[:, 0]
            row_loss, direction = divergence.rows(log_q, log_t, hard, spec, need_grad)
            if folded:
                w = row_weights[chunk].float()
                loss += (row_loss * w).sum()
                if need_grad:
                    direction.mul_(w[:, None] / total_weight)
            else:
                loss[chunk] = row_loss
            if need_grad:
                row_grad[chunk] = direction.to(head_weight.dtype) @ head_weight
        if need_grad:
            ctx.save_for_backward(row_grad)
        ctx.folded = folded
        ctx.mark_non_differentiable(ranks, hard_labels, hard_logprob, drafter_argmax)
        return (loss / total_weight if folded else loss), ranks, hard_labels, hard_logprob, drafter_argmax

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        (row_grad,) = ctx.saved_tensors
        scale = grad_loss if ctx.folded else grad_loss[:, None]
        return row_grad * scale.to(row_grad.dtype), None, None, None, None, None


def weighted_data_ce(hidden, head_weight, labels, row_weights, chunk_rows: int):
    """(sum_r w_r CE_r / sum_r w_r, label ranks [rows]): the default objective, the data token's cross
    entropy under fixed weights, through `ChunkedLMHeadLoss`."""
    loss, ranks, *_ = ChunkedLMHeadLoss.apply(hidden, head_weight, labels, None,
                                              RowLossSpec("data", "ce", chunk_rows), row_weights)
    return loss, ranks


def chunk_peak_bytes(spec: RowLossSpec, folded: bool, vocab_size: int, rows: int) -> int:
    """The fp32 [rows, vocab] buffers alive at the kernel's peak over `rows` rows, in bytes (the memory
    plan's figure). The peak is at a chunk's label ranks (`label_rank`, RANK_BUFFERS): beside them, this
    chunk's logits and what the previous chunk left alive: nothing with folded weights (its
    log-probabilities and gradient reuse the logits buffer), else its log-probabilities
    (`drafter_logprobs`), with target labels the target's too, and the divergence's own
    (`Divergence.buffers`)."""
    chunk = min(rows, rows_per_chunk(spec.labels, spec.chunk_rows))
    left_alive = 0
    if not folded and rows > chunk:
        left_alive = (2 if spec.labels == "target" else 1) + DIVERGENCES[spec.loss].buffers
    return math.ceil((left_alive + 1 + RANK_BUFFERS) * chunk * vocab_size * 4)


@torch.no_grad()
def top_logprobs(hidden, head_weight, k: int, chunk_rows: int, labels=None):
    """(log-probabilities, token ids) [rows, k] of each row's k most likely tokens under the frozen
    LM head, `chunk_rows` rows of fp32 logits at a time; with `labels` [rows], also each label's
    log-probability [rows] (a third value)."""
    values = hidden.new_empty((hidden.shape[0], k), dtype=torch.float32)
    ids = torch.empty((hidden.shape[0], k), dtype=torch.long, device=hidden.device)
    label_values = None if labels is None else hidden.new_empty(labels.shape, dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        logits = (hidden[rows] @ head_weight.T).float()
        logprobs = logits - logits.logsumexp(-1, keepdim=True)
        values[rows], ids[rows] = logprobs.topk(k, dim=-1)
        if labels is not None:
            label_values[rows] = logprobs.gather(1, labels[rows, None])[:, 0]
    return (values, ids) if labels is None else (values, ids, label_values)


def dense_lm_head_loss(hidden, head_weight, labels, row_weights):
    """Reference: the same loss with all logits materialised (for tests and bench/loss_memory.py)."""
    logits = (hidden @ head_weight.T).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    return (ce * row_weights).sum() / row_weights.sum().clamp_min(1e-12)


def dense_row_loss(hidden, head_weight, data_labels, teacher_hidden, spec: RowLossSpec) -> torch.Tensor:
    """Reference: the same per-row losses with every logit of both sides materialised (tests, bench)."""
    log_q = (hidden @ head_weight.T).float().log_softmax(-1)
    if spec.labels == "data":
        return -log_q.gather(1, data_labels[:, None])[:, 0]
    log_t = teacher_logits(teacher_hidden, head_weight, spec.softcap).log_softmax(-1)
    if spec.loss == "kl":
        return (log_t.exp() * (log_t - log_q)).sum(-1)
    ce = -log_q.gather(1, log_t.argmax(-1, keepdim=True))[:, 0]
    if spec.loss == "tv":
        tv = 0.5 * (log_q.exp() - log_t.exp()).abs().sum(-1)
        return spec.tv_ce_weight * ce + (1 - spec.tv_ce_weight) * tv
    return ce
