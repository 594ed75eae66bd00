"""Block losses beyond fixed-weight cross entropy on the data: the target's own labels (distillation),
other divergences, position weights that depend on the drafter's current predictions (D-PACE,
tree-aware), the first-failure cut, and the expected accepted lengths of a chain and of a tree.

Every block slot k >= 1 is a row. A row's loss is one of
  data CE     -log q(x_{p+k})                           (labels=data, loss=ce)
  target CE   -log q(argmax t)                          (labels=target, loss=ce)
  forward KL  sum_v t(v) (log t(v) - log q(v))          (labels=target, loss=kl)
  CE + TV     w CE + (1 - w) 1/2 sum_v |q(v) - t(v)|    (labels=target, loss=tv; w = tv_ce_weight)
where q is the drafter's distribution at slot k and t the target's at sequence position p+k-1 (its LM
head on its own final-normed hidden state there, soft-capped as the target caps its logits), i.e. the
target's prediction of the very token slot k predicts. The batch loss is sum_r w_r loss_r / sum_r w_r
(or / the number of supervised rows: objective.normalize=count) with weights that carry no gradient.
The block losses (loss=expected_chain, expected_tree) are built on the rows' CE of the hard label
instead: minus a block's expected accepted length, a sum over its slots (`chain_acceptance`,
`soft_tree_acceptance`).

`ChunkedRowLoss` computes every row's loss and its gradient w.r.t. the drafter's hidden state in the
forward pass, a chunk of rows at a time, from the hidden states (the drafter's and the target's):
neither side's logits over all rows ever exist. Because the per-row gradient does not depend on the
weights, the weights may be computed from the same pass (D-PACE needs each row's confidence).
"""
from dataclasses import dataclass

import torch

LABELS = ("data", "target")
DIVERGENCES = ("ce", "kl", "tv")              # a row's loss (`ChunkedRowLoss`)
BLOCK_LOSSES = ("expected_chain", "expected_tree")  # minus a block's expected accepted length
LOSSES = DIVERGENCES + BLOCK_LOSSES
POSITION_WEIGHTS = ("exp", "dpace", "tree")
TRUNCATIONS = ("none", "first_failure")
NORMALIZATIONS = ("weights", "count")


@dataclass
class RowLossSpec:
    labels: str                  # data | target
    loss: str                    # ce | kl | tv (kl and tv need labels=target)
    chunk_rows: int              # rows of one side's fp32 logits alive at once
    softcap: float | None = None  # the target's final_logit_softcapping (Gemma), applied to its logits
    tv_ce_weight: float = 0.1    # w of loss=tv: w CE + (1 - w) TV


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


def cross_entropy_rows(log_q: torch.Tensor, hard: torch.Tensor, need_grad: bool):
    """(-log q(hard) [rows], d loss / d logits = q - onehot(hard) or None). Consumes `log_q`."""
    loss = -log_q.gather(1, hard)[:, 0]
    if not need_grad:
        return loss, None
    direction = log_q.exp_()
    return loss, direction.scatter_add_(1, hard, -torch.ones_like(hard, dtype=direction.dtype))


def forward_kl_rows(log_q: torch.Tensor, log_t: torch.Tensor, need_grad: bool):
    """(sum_v t (log t - log q) [rows], d loss / d logits = q - t or None). Consumes `log_q`."""
    t = log_t.exp()
    loss = (t * (log_t - log_q)).sum(-1)
    return loss, (log_q.exp_().sub_(t) if need_grad else None)


def ce_tv_rows(log_q: torch.Tensor, log_t: torch.Tensor, hard: torch.Tensor, ce_weight: float, need_grad: bool):
    """(w CE(hard) + (1 - w) TV(q, t) [rows], its gradient w.r.t. the logits or None), TV(q, t) =
    1/2 sum_v |q(v) - t(v)|. d TV / d z_u = 1/2 q_u (s_u - sum_v s_v q_v) with s = sign(q - t) (the
    softmax Jacobian applied to TV's subgradient). Consumes `log_q`."""
    ce = -log_q.gather(1, hard)[:, 0]
    q = log_q.exp_()
    sign = q - log_t.exp()
    tv = 0.5 * sign.abs().sum(-1)
    loss = ce_weight * ce + (1 - ce_weight) * tv
    if not need_grad:
        return loss, None
    sign.sign_()
    direction = sign.sub_((sign * q).sum(-1, keepdim=True)).mul_(q).mul_(0.5 * (1 - ce_weight))
    direction.add_(q, alpha=ce_weight)
    return loss, direction.scatter_add_(1, hard, torch.full_like(hard, -ce_weight, dtype=direction.dtype))


class ChunkedRowLoss(torch.autograd.Function):
    """Per-row losses [rows] (fp32, differentiable w.r.t. `hidden`) through the frozen LM head, plus,
    without gradient: each row's data-label rank (metrics), its hard label (the data token, or the
    target's argmax with target labels), the drafter's log-probability of that hard label and the
    drafter's argmax (the token serving drafts there: ties go to the lower id).

    The forward pass keeps d loss_r / d hidden_r = (d loss_r / d logits_r) @ W per row (for CE and KL
    q_r - t_r, t_r the one-hot hard label or the target's distribution); backward scales it by each
    row's incoming gradient.
    """

    @staticmethod
    def forward(ctx, hidden, head_weight, data_labels, teacher_hidden, spec: RowLossSpec):
        need_grad = ctx.needs_input_grad[0]
        rows = hidden.shape[0]
        row_loss = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        ranks = torch.empty_like(data_labels)
        hard_labels = data_labels.clone()
        hard_logprob = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        drafter_argmax = torch.empty_like(data_labels)
        row_grad = torch.empty_like(hidden) if need_grad else None
        chunk_rows = rows_per_chunk(spec.labels, spec.chunk_rows)
        for start in range(0, rows, chunk_rows):
            chunk = slice(start, start + chunk_rows)
            logits = (hidden[chunk] @ head_weight.T).float()
            ranks[chunk] = label_rank(logits, data_labels[chunk])
            drafter_argmax[chunk] = logits.argmax(-1)
            log_q = logits.log_softmax(-1)
            del logits
            if spec.labels == "target":
                log_t = teacher_logits(teacher_hidden[chunk], head_weight, spec.softcap).log_softmax(-1)
                hard_labels[chunk] = log_t.argmax(-1)
            hard = hard_labels[chunk, None]
            hard_logprob[chunk] = log_q.gather(1, hard)[:, 0]
            if spec.loss == "kl":
                row_loss[chunk], direction = forward_kl_rows(log_q, log_t, need_grad)
            elif spec.loss == "tv":
                row_loss[chunk], direction = ce_tv_rows(log_q, log_t, hard, spec.tv_ce_weight, need_grad)
            else:
                row_loss[chunk], direction = cross_entropy_rows(log_q, hard, need_grad)
            if need_grad:
                row_grad[chunk] = direction.to(head_weight.dtype) @ head_weight
        if need_grad:
            ctx.save_for_backward(row_grad)
        ctx.mark_non_differentiable(ranks, hard_labels, hard_logprob, drafter_argmax)
        return row_loss, ranks, hard_labels, hard_logprob, drafter_argmax

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
    ce = -log_q.gather(1, log_t.argmax(-1, keepdim=True))[:, 0]
    if spec.loss == "tv":
        tv = 0.5 * (log_q.exp() - log_t.exp()).abs().sum(-1)
        return spec.tv_ce_weight * ce + (1 - spec.tv_ce_weight) * tv
    return ce


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



@torch.no_grad()
def up_to_first_failure(hit: torch.Tensor, supervised: torch.Tensor) -> torch.Tensor:
    """objective.truncate=first_failure (Spec-AUF): bool [N, L], the supervised slots up to and
    including each block's first miss (`hit` [N, L]: the drafter's argmax is the slot's label).

    A chain verify accepts a block's drafts up to its first miss, and nothing after it counts, so the
    slots behind a miss are trained for drafts that serving discards; the missed slot itself is kept:
    it is the one whose fix lengthens the accepted run. The cut is read off the argmax: no gradient."""
    clean_before = torch.cat([torch.ones_like(hit[:, :1]), hit[:, :-1].long().cumprod(-1).bool()], -1)
    return clean_before & supervised


def chain_acceptance(label_logprob: torch.Tensor, supervised: torch.Tensor) -> torch.Tensor:
    """objective.loss=expected_chain: [N, L], the chance prod_{j<=k} q_j(y_j) that a chain verify
    whose target emits the labels y accepts through slot k, when slot j's draft is drawn from the
    drafter's marginal q_j (0 at unsupervised slots). Its sum over k is the block's expected accepted
    length E = sum_k prod_{j<=k} q_j(y_j). Differentiable through `label_logprob` [N, L], summed in
    log space (cumsum, then exp) so that long products do not underflow step by step."""
    logprob = torch.where(supervised, label_logprob, 0.0)
    return torch.where(supervised, logprob.cumsum(-1).exp(), 0.0)


def soft_tree_acceptance(label_logprob: torch.Tensor, threshold: torch.Tensor, temperature: float,
                         supervised: torch.Tensor) -> torch.Tensor:
    """objective.loss=expected_tree: [N, L], a smooth indicator that the label prefix y_1..y_k is a
    path of the best-B DDTree the drafter's marginals build; its sum over k is a surrogate of the
    tree's teacher-forced accepted depth.

    Why this form. DDTree keeps the B prefixes of highest score S(x_1..x_k) = sum_{j<=k} log q_j(x_j)
    over all depths, so the label prefix of depth k is in the tree iff S_k = S(y_1..y_k) beats the
    score of the (B+1)-th best prefix; `threshold` [N] (`tree_threshold`: midway between the B-th and
    the (B+1)-th best score, without gradient) separates the two. Scores only fall with depth
    (log q <= 0), so the prefixes in the tree are those of depths 1..D and D = sum_k [S_k > threshold]
    is the accepted depth. Replacing the step by sigmoid((S_k - threshold) / temperature) gives a
    surrogate that tends to D as the temperature goes to 0 and whose gradient raises the label's
    log-probability at every slot j <= k in proportion to how near prefix k sits to the tree's
    boundary: the depths the tree is about to gain or lose, not those it holds firmly or cannot reach.
    The threshold is held fixed: it is set by the other prefixes of the tree (raising q_j(y_j) lowers
    their marginals, so the threshold mostly falls with the push), and a threshold with gradient would
    let the loss rise by sinking the rest of the tree rather than by raising the labels. Unsupervised
    slots count 0."""
    score = torch.where(supervised, label_logprob, 0.0).cumsum(-1)
    inside = torch.sigmoid((score - threshold[:, None]) / temperature)
    return torch.where(supervised, inside, 0.0)
