"""The teacher-forced metrics of a training step's blocks (`block_metrics`), as [sum, count] tensors
(drafter/metric_sums.py) so that nothing waits for the device until a log line is written."""
from typing import TYPE_CHECKING

import torch

from drafter.losses.lm_head import chunk_rows_for, top_logprobs
from drafter.metric_sums import sum_count
from drafter.tree.ddtree import build_tree_from_logprobs, teacher_forced_accept

if TYPE_CHECKING:
    from drafter.config import ObjectiveConfig
    from drafter.models.blocks import Blocks


def block_metrics(hidden, head, blocks: "Blocks", ranks, cfg: "ObjectiveConfig",
                  generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A training step's teacher-forced metrics from the drafter's final states `hidden` [b, A, B, H]
    (detached) and each row's label rank `ranks` [b * A * (B-1)] (the loss kernel's): `rank_metrics`,
    and anchor_ddtree@budget (cfg.ddtree_budget) over cfg.ddtree_blocks complete blocks drawn with
    `generator`, the head's rows cfg.chunk_bytes at a time."""
    budget, chunk_rows = cfg.ddtree_budget, chunk_rows_for(head.shape[0], cfg.chunk_bytes)
    b, num_blocks, block_size, width = hidden.shape
    label_rank = torch.full_like(blocks.labels, torch.iinfo(torch.long).max)
    label_rank[..., 1:] = ranks.view(b, num_blocks, block_size - 1)
    metrics = rank_metrics(label_rank, blocks)
    sampled, sampled_valid = sample_complete_blocks(blocks, cfg.ddtree_blocks, generator)
    k = min(budget, head.shape[0])
    topk_logprobs, topk_ids = top_logprobs(hidden.reshape(-1, block_size, width)[sampled, 1:].reshape(-1, width),
                                           head, k, chunk_rows)
    metrics[f"anchor_ddtree@{budget}"] = ddtree_accept_metric(
        topk_logprobs.view(len(sampled), block_size - 1, k), topk_ids.view(len(sampled), block_size - 1, k),
        blocks.labels.view(-1, block_size)[sampled, 1:], budget, sampled_valid)
    return metrics


def sample_complete_blocks(blocks: "Blocks", count: int, generator: torch.Generator):
    """(index [n], valid [n]), n = min(count, number of blocks): flat indices of distinct blocks drawn
    uniformly from those whose slots 1..B-1 are all supervised; `valid` is False where fewer than n
    such blocks exist (those indices are other blocks). Static shapes: no host sync."""
    complete = (blocks.weights[..., 1:] > 0).all(-1).view(-1)
    scores = torch.rand(complete.shape, generator=generator, device=generator.device)
    scores = scores.to(complete.device, non_blocking=True).masked_fill(~complete, -1.0)
    top_scores, index = scores.topk(min(count, len(complete)))
    return index, top_scores >= 0


def rank_metrics(label_rank: torch.Tensor, blocks: "Blocks") -> dict[str, torch.Tensor]:
    """Teacher-forced metrics from each slot's label rank in the drafter's distribution.

    acc / top4_acc / top8_acc: P(label is the drafter's top-1 / in its top-4 / top-8), over supervised
        slots, overall and per block position (`acc_pos` etc. hold a [sum, count] row per slot 1..B-1).
        Ranks order ties as argmax does (lower token id first), so a label tied with a lower id is a miss.
    anchor_streak: mean over the step's random anchors of the tokens one greedy single-path verify
        would commit there = 1 (bonus) + the number of leading slots whose label is the drafter's
        top-1; blocks cut short by the sequence end count only their supervised slots. This is not
        DFlash tau: serving visits one anchor every L tokens, so anchors inside long accepted runs
        weigh L times less there (drafter/serving/served.py replays serving: tau_dflash).
    anchor_top4_streak / anchor_top8_streak: the same where a slot counts as accepted if its label is
        in the drafter's top-4 / top-8, an optimistic stand-in for a tree with 4 / 8 children everywhere.
    """
    supervised = blocks.weights[..., 1:] > 0
    rank = label_rank[..., 1:]
    metrics = {}
    for name, k in (("acc", 1), ("top4_acc", 4), ("top8_acc", 8)):
        hit = (rank < k) & supervised
        metrics[name] = sum_count(hit, supervised)
        metrics[f"{name}_pos"] = torch.stack([hit.float().sum((0, 1)), supervised.float().sum((0, 1))], 1)
    for name, k in (("anchor_streak", 1), ("anchor_top4_streak", 4), ("anchor_top8_streak", 8)):
        accepted = ((rank < k) & supervised).long().cumprod(-1).sum(-1)
        metrics[name] = sum_count(accepted + 1, blocks.valid)
    return metrics


def ddtree_accept_metric(topk_logprobs, topk_ids, labels, budget: int,
                         valid: torch.Tensor | None = None) -> torch.Tensor:
    """anchor_ddtree@B: exact teacher-forced DDTree acceptance at budget B per random anchor, as
    [sum, count].

    For each sampled complete block, build the best-first tree of B nodes from the block's per-position
    marginals (top-k per position suffices: no depth holds more than B nodes) and walk it along the
    labels; the value is the tokens that verify would commit (accepted depth + 1 bonus). Averaged over
    random anchors it overstates DDTree tau as `anchor_streak` overstates DFlash tau (see rank_metrics);
    drafter/serving/served.py's tau_ddtree@B is the served figure. Blocks where `valid` [blocks] is False
    count for nothing.
    """
    if labels.shape[0] == 0:
        return topk_logprobs.new_zeros(2)
    committed = teacher_forced_accept(build_tree_from_logprobs(topk_logprobs, topk_ids, budget), labels)
    return sum_count(committed, torch.ones_like(committed, dtype=torch.bool) if valid is None else valid)
