"""The training losses as registered components over one chunked LM-head kernel.

Every block slot k >= 1 is a row. The objective (config `objective.*`) is assembled from small
registered parts, each chosen by name:

  labels            data | target          the data token, or the target's own next-token distribution
  loss              DIVERGENCES            a row's loss (divergences.py: ce, kl, tv)
                    | BLOCK_LOSSES         minus a block's expected accepted length (acceptance.py)
  position_weights  POSITION_WEIGHTS       how much each slot's row counts (weights.py: exp, dpace, tree)
  truncate          TRUNCATIONS            none | first_failure (weights.py)
  normalize         NORMALIZATIONS         weights: / sum of the weights | count: / supervised slots

The batch loss is sum_r w_r loss_r / (sum_r w_r, or the number of supervised rows), the weights
carrying no gradient. A block loss spreads minus the block's expected accepted length over its slots
as minus the chance that the verify accepts through each one, so it is normalised as the row losses
are: the loss is minus the expected fraction of the supervised slots accepted, in [-1, 0]. Its
gradient is a product of the slots' label probabilities, ~(1/V)^k from a random start, so
`block_ce_weight` x the default objective (data-or-target CE under exp weights) is added to it.

`lm_head.ChunkedLMHeadLoss` computes every row's loss and its gradient w.r.t. the drafter's hidden
state in the forward pass, a chunk of rows at a time, from the hidden states (the drafter's and the
target's): neither side's logits over all rows ever exist. The default (data CE, exp weights) folds
its fixed weights into the kernel; every other objective gets per-row losses and computes its weights
from the same pass. Each divergence declares the buffers it keeps (`Divergence.buffers`), which the
memory plan reads (`loss_chunk_peak_bytes`).
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch

from drafter.losses.acceptance import chain_acceptance, soft_tree_acceptance, tree_threshold
from drafter.losses.divergences import DIVERGENCES, teacher_rows
from drafter.losses.lm_head import (ChunkedLMHeadLoss, RowLossSpec, chunk_peak_bytes, chunk_rows_for,
                                    weighted_data_ce)
from drafter.losses.weights import dpace_weights, tree_accepted_depth, tree_weights, up_to_first_failure

__all__ = ["BLOCK_LOSSES", "DIVERGENCES", "LABELS", "NORMALIZATIONS", "OBJECTIVE_SETTINGS", "POSITION_WEIGHTS",
           "TRUNCATIONS", "SlotRows",
           "block_loss", "loss_chunk_peak_bytes", "one_pass_loss", "row_loss_spec"]
LABELS = ("data", "target")


@dataclass
class SlotRows:
    """A batch's block slots 1..L after the kernel, [N blocks, L] each: what the weights, the block
    losses and the cut are computed from."""
    loss: torch.Tensor            # per-row losses (differentiable)
    weights: torch.Tensor         # the blocks' fixed exp(-(k-1)/gamma) weights, 0 where unsupervised
    supervised: torch.Tensor      # bool
    hard_labels: torch.Tensor     # the data token, or the target's argmax
    hard_logprob: torch.Tensor    # the drafter's log-probability of the hard label (no gradient)
    drafter_argmax: torch.Tensor  # the token serving drafts
    hidden: torch.Tensor          # the drafter's states [N, L, H], detached (trees)
    head: torch.Tensor            # the frozen LM head weight
    chunk_rows: int


def expected_chain(rows: SlotRows, cfg) -> torch.Tensor:
    return -chain_acceptance(-rows.loss, rows.supervised)


def expected_tree(rows: SlotRows, cfg) -> torch.Tensor:
    threshold = tree_threshold(rows.hidden, rows.head, cfg.ddtree_budget, rows.chunk_rows)
    return -soft_tree_acceptance(-rows.loss, threshold, cfg.tree_temperature, rows.supervised)


def dpace(rows: SlotRows, cfg) -> torch.Tensor:
    return dpace_weights(rows.hard_logprob, rows.supervised, cfg.weight_smoothing)


def tree(rows: SlotRows, cfg) -> torch.Tensor:
    depth = tree_accepted_depth(rows.hidden, rows.head, rows.hard_labels, cfg.ddtree_budget, rows.chunk_rows)
    return tree_weights(depth, rows.supervised, cfg.weight_smoothing)


# name -> (SlotRows, cfg) -> the slots' losses [N, L], weighted by 1 on every supervised slot
BLOCK_LOSSES: dict[str, Callable] = {"expected_chain": expected_chain, "expected_tree": expected_tree}
# name -> (SlotRows, cfg) -> weights [N, L]
POSITION_WEIGHTS: dict[str, Callable] = {"exp": lambda rows, cfg: rows.weights, "dpace": dpace, "tree": tree}
# the objective.* keys each part reads beyond its name, by the key that chooses it: set while another
# part is chosen, they would do nothing, and the config refuses them (drafter/config.py `unread_settings`)
OBJECTIVE_SETTINGS: dict[str, dict[str, tuple[str, ...]]] = {
    "loss": {"tv": ("tv_ce_weight",), "expected_chain": ("block_ce_weight",),
             "expected_tree": ("tree_temperature", "block_ce_weight")},
    "position_weights": {"dpace": ("weight_smoothing",), "tree": ("weight_smoothing",)}}
# name -> SlotRows -> a mask to multiply the weights by, or None
TRUNCATIONS: dict[str, Callable] = {
    "none": lambda rows: None,
    "first_failure": lambda rows: up_to_first_failure(rows.drafter_argmax == rows.hard_labels, rows.supervised)}
# name -> (weights, supervised) -> the loss's denominator
NORMALIZATIONS: dict[str, Callable] = {"weights": lambda weights, supervised: weights.sum(),
                                       "count": lambda weights, supervised: supervised.sum()}


def one_pass_loss(cfg) -> bool:
    """Data CE under fixed weights, normalised by them: the kernel folds the weights in."""
    return (cfg.labels == "data" and cfg.loss == "ce" and cfg.position_weights == "exp"
            and cfg.truncate == "none" and cfg.normalize == "weights")


def row_loss_spec(cfg, chunk_rows: int, softcap: float | None = None) -> RowLossSpec:
    """The kernel's rows for `cfg` (the target's logits capped at `softcap`): the block losses are
    built on each row's CE of its label."""
    return RowLossSpec(cfg.labels, "ce" if cfg.loss in BLOCK_LOSSES else cfg.loss, chunk_rows, softcap,
                       cfg.tv_ce_weight)


def loss_chunk_peak_bytes(cfg, vocab_size: int, rows: int) -> int:
    """The loss's fp32 logit buffers alive at its peak over `rows` block slots, in bytes (the memory plan)."""
    return chunk_peak_bytes(row_loss_spec(cfg, chunk_rows_for(vocab_size, cfg.chunk_bytes)), one_pass_loss(cfg),
                            vocab_size, rows)


def block_loss(hidden, head, blocks, final_hidden, cfg, softcap: float | None = None):
    """(loss, data-label ranks [rows]) of the drafter's final states `hidden` [b, A, B, H] on the batch's
    `blocks` (models.blocks.Blocks) under the objective `cfg` (the head's rows cfg.chunk_bytes at a
    time); `final_hidden` [b, T, H]: the target's final-normed hidden states, needed with
    cfg.labels == "target", its logits capped at `softcap` (or, from a feature store, its argmax [b, T]
    at each position, for the losses that read no more)."""
    chunk_rows = chunk_rows_for(head.shape[0], cfg.chunk_bytes)
    b, num_blocks, block_size, width = hidden.shape
    states, labels = hidden[:, :, 1:].reshape(-1, width), blocks.labels[..., 1:].reshape(-1)
    fixed = blocks.weights[..., 1:].reshape(-1)
    if one_pass_loss(cfg):
        return weighted_data_ce(states, head, labels, fixed, chunk_rows)
    if cfg.labels == "target" and final_hidden is None:
        raise ValueError("objective.labels=target needs the target's final hidden states (final_hidden)")
    teacher = None
    if cfg.labels == "target":  # final hidden states, or the argmax tokens a feature store holds
        teacher = teacher_rows(final_hidden, blocks.positions)
        teacher = teacher.reshape(-1) if final_hidden.dim() == 2 else teacher.reshape(-1, width).to(hidden.dtype)
    row_loss, ranks, hard_labels, hard_logprob, drafter_argmax = ChunkedLMHeadLoss.apply(
        states, head, labels, teacher, row_loss_spec(cfg, chunk_rows, softcap), None)
    shape = (-1, block_size - 1)
    rows = SlotRows(row_loss.view(shape), fixed.view(shape), fixed.view(shape) > 0, hard_labels.view(shape),
                    hard_logprob.view(shape), drafter_argmax.view(shape),
                    hidden.detach()[:, :, 1:].reshape(-1, block_size - 1, width), head, chunk_rows)
    cut = TRUNCATIONS[cfg.truncate](rows)
    if cfg.loss not in BLOCK_LOSSES:
        return weighted_mean(rows.loss, POSITION_WEIGHTS[cfg.position_weights](rows, cfg), cut, rows, cfg), ranks
    loss = weighted_mean(BLOCK_LOSSES[cfg.loss](rows, cfg), rows.supervised.float(), cut, rows, cfg)
    if cfg.block_ce_weight > 0:  # from a random start a block loss's gradient is ~0: CE gets it going
        loss = loss + cfg.block_ce_weight * weighted_mean(rows.loss, rows.weights, cut, rows, cfg)
    return loss, ranks


def weighted_mean(slot_loss: torch.Tensor, weights: torch.Tensor, cut, rows: SlotRows, cfg) -> torch.Tensor:
    """sum w l / the normaliser, over the slots the cut keeps (`cut`: a mask, or None)."""
    if cut is not None:
        weights = weights * cut
    denominator = NORMALIZATIONS[cfg.normalize](weights, rows.supervised)
    return (slot_loss * weights).sum() / denominator.clamp_min(1e-12)
