"""Block losses beyond fixed-weight cross entropy on the data: the target's own labels (distillation)
and position weights that depend on the drafter's current predictions (D-PACE, tree-aware).

Every block slot k >= 1 is a row. A row's loss is one of
  data CE     -log q(x_{p+k})                           (labels=data, loss=ce)
  target CE   -log q(argmax t)                          (labels=target, loss=ce)
  forward KL  sum_v t(v) (log t(v) - log q(v))          (labels=target, loss=kl)
where q is the drafter's distribution at slot k and t the target's at sequence position p+k-1 (its LM
head on its own final-normed hidden state there, soft-capped as the target caps its logits), i.e. the
target's prediction of the very token slot k predicts. The batch loss is sum_r w_r loss_r / sum_r w_r
with weights that carry no gradient.

`ChunkedRowLoss` computes every row's loss and its gradient w.r.t. the drafter's hidden state in the
forward pass, a chunk of rows at a time, from the hidden states (the drafter's and the target's):
neither side's logits over all rows ever exist. Because the per-row gradient does not depend on the
weights, the weights may be computed from the same pass (D-PACE needs each row's confidence).
"""
from dataclasses import dataclass

import torch

LABELS = ("data", "target")
LOSSES = ("ce", "kl")
POSITION_WEIGHTS = ("exp", "dpace", "tree")


@dataclass
class RowLossSpec:
    labels: str                  # data | target
    loss: str                    # ce | kl (kl needs labels=target)
    chunk_rows: int              # rows of one side's fp32 logits alive at once
    softcap: float | None = None  # the target's final_logit_softcapping (Gemma), applied to its logits


def logit_softcap(target) -> float | None:
    """The target's final-logit soft cap (cap * tanh(logits / cap)), if its config has one."""
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    return getattr(config, "final_logit_softcapping", None) or None


def teacher_logits(hidden: torch.Tensor, head_weight: torch.Tensor, softcap: float | None) -> torch.Tensor:
    logits = (hidden @ head_weight.T).float()
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def label_rank(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's label rank as argmax orders tokens (by logit, ties to the lower id): 0 = top-1."""
    label_logit = logits.gather(1, labels[:, None])
    vocab_ids = torch.arange(logits.shape[1], device=logits.device)
    return (logits > label_logit).sum(-1) + ((logits == label_logit) & (vocab_ids < labels[:, None])).sum(-1)


def rows_per_chunk(labels: str, chunk_rows: int) -> int:
    """Rows of one chunk of `ChunkedRowLoss`: a chunk of target labels holds both sides' logits, so
    it takes half the rows."""
    return chunk_rows if labels == "data" else max(1, chunk_rows // 2)


class ChunkedRowLoss(torch.autograd.Function):
    """Per-row losses [rows] (fp32, differentiable w.r.t. `hidden`) through the frozen LM head, plus,
    without gradient: each row's data-label rank (metrics), its hard label (the data token, or the
    target's argmax with target labels) and the drafter's log-probability of that hard label.

    The forward pass keeps d loss_r / d hidden_r = (q_r - t_r) @ W per row (t_r the one-hot hard label
    or the target's distribution); backward scales it by each row's incoming gradient.
    """

    @staticmethod
    def forward(ctx, hidden, head_weight, data_labels, teacher_hidden, spec: RowLossSpec):
        need_grad = ctx.needs_input_grad[0]
        rows = hidden.shape[0]
        row_loss = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        ranks = torch.empty_like(data_labels)
        hard_labels = data_labels.clone()
        hard_logprob = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        row_grad = torch.empty_like(hidden) if need_grad else None
        chunk_rows = rows_per_chunk(spec.labels, spec.chunk_rows)
        for start in range(0, rows, chunk_rows):
            chunk = slice(start, start + chunk_rows)
            logits = (hidden[chunk] @ head_weight.T).float()
            ranks[chunk] = label_rank(logits, data_labels[chunk])
            log_q = logits.log_softmax(-1)
            del logits
            if spec.labels == "target":
                log_t = teacher_logits(teacher_hidden[chunk], head_weight, spec.softcap).log_softmax(-1)
                hard_labels[chunk] = log_t.argmax(-1)
            hard = hard_labels[chunk, None]
            hard_logprob[chunk] = log_q.gather(1, hard)[:, 0]
            if spec.loss == "kl":
                t = log_t.exp()
                row_loss[chunk] = (t * (log_t - log_q)).sum(-1)
            else:
                row_loss[chunk] = -hard_logprob[chunk]
            if need_grad:  # d loss / d logits = q - t: the target's distribution, or the one-hot hard label
                direction = log_q.exp_()
                if spec.loss == "kl":
                    direction.sub_(t)
                else:
                    direction.scatter_add_(1, hard, -torch.ones_like(hard, dtype=direction.dtype))
                row_grad[chunk] = direction.to(head_weight.dtype) @ head_weight
        if need_grad:
            ctx.save_for_backward(row_grad)
        ctx.mark_non_differentiable(ranks, hard_labels, hard_logprob)
        return row_loss, ranks, hard_labels, hard_logprob

    @staticmethod
    def backward(ctx, grad_row_loss, *unused):
        (row_grad,) = ctx.saved_tensors
        return row_grad * grad_row_loss[:, None].to(row_grad.dtype), None, None, None, None


def dense_row_loss(hidden, head_weight, data_labels, teacher_hidden, spec: RowLossSpec) -> torch.Tensor:
    """Reference: the same per-row losses with every logit of both sides materialised (tests, bench)."""
    log_q = (hidden @ head_weight.T).float().log_softmax(-1)
    if spec.labels == "data":
        return -log_q.gather(1, data_labels[:, None])[:, 0]
    log_t = teacher_logits(teacher_hidden, head_weight, spec.softcap).log_softmax(-1)
    if spec.loss == "kl":
        return (log_t.exp() * (log_t - log_q)).sum(-1)
    return -log_q.gather(1, log_t.argmax(-1, keepdim=True))[:, 0]


def teacher_rows(final_hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The target's final hidden state that predicts each slot k >= 1: at sequence position p+k-1,
    [b, A, B-1, H] from `final_hidden` [b, T, H] and the blocks' positions [b, A, B] (slots past the
    sequence read its last position; they carry no weight)."""
    b, T, width = final_hidden.shape
    predicting = positions[..., :-1].clamp(max=T - 1)  # slot k's position p+k, minus one
    gathered = final_hidden.gather(1, predicting.reshape(b, -1, 1).expand(-1, -1, width))
    return gathered.view(*predicting.shape, width)


@torch.no_grad()
def dpace_weights(label_logprob: torch.Tensor, supervised: torch.Tensor, smoothing: float) -> torch.Tensor:
    """D-PACE weights [N, L] for slots 1..L of N blocks: w_k = sum_{j=k}^{L} prod_{i<=j} s_i with
    s_i = (1 - a) q_i + a, q_i = exp(-CE_i) the drafter's probability of slot i's label and a the
    smoothing. prod_{i<=j} s_i estimates the chance that a chain verify accepts through slot j; slot k
    matters to every acceptance at depth >= k. Unsupervised slots accept nothing and weigh 0."""
    smoothed = (1 - smoothing) * label_logprob.exp() + smoothing
    reach = torch.cumprod(smoothed * supervised, dim=-1)
    return reach.flip(-1).cumsum(-1).flip(-1) * supervised


@torch.no_grad()
def tree_weights(accepted_depth: torch.Tensor, supervised: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Tree-aware weights [N, L]: D-PACE's form with the chain's acceptance estimate replaced by the
    tree's actual reach.

    Why. DDTree accepts slot j when the labels' prefix x_1..x_j is a path of the tree that the
    drafter's marginals build (the `budget` most probable prefixes), not when each label is the
    drafter's top-1. Teacher-forced, the tokens a tree verify commits are 1 + the number of depths j
    whose label prefix is in the tree, so "prefix j in the tree" is the acceptance event at depth j and
    slot k enters every such event with j >= k. D-PACE estimates those events by a chain's soft
    acceptance prod_{i<=j} ((1-a) q_i + a), which decays with depth even where a tree of a few hundred
    nodes still holds the label path (a label of probability 0.3 at each depth is in a 64-node tree for
    several depths, a chain of 0.3^j is not); so under DDTree it under-trains the late slots the tree
    actually uses. Here the event is read off the tree itself: reach_j = 1 while the label prefix is
    in the tree (j <= d, the accepted depth), and decays as a^(j-d) past it, a's smoothing keeping
    some signal for depths the tree does not reach yet (without it a weak drafter would train only
    slots 1..d and never grow the tree). w_k = sum_{j=k}^{L} reach_j: the acceptance mass that
    depends on slot k. Unsupervised slots weigh 0."""
    depth = torch.arange(1, supervised.shape[-1] + 1, device=supervised.device)
    beyond = (depth - accepted_depth[:, None]).clamp(min=0)
    reach = torch.pow(torch.full_like(supervised, smoothing, dtype=torch.float32), beyond) * supervised
    return reach.flip(-1).cumsum(-1).flip(-1) * supervised

