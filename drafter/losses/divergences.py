"""A row's divergence to its label, the small functions the loss kernel (`lm_head.ChunkedLMHeadLoss`)
calls on each chunk, registered by their `objective.loss` names:

  ce   -log q(y)                                 y the data token (labels=data) or argmax t (labels=target)
  kl   sum_v t(v) (log t(v) - log q(v))          forward KL to the target (labels=target)
  tv   w CE + (1 - w) 1/2 sum_v |q(v) - t(v)|    CE + total variation, w = tv_ce_weight (labels=target; DSpark)

q is the drafter's distribution at slot k and t the target's at sequence position p+k-1 (its LM head
on its own final-normed hidden state there, soft-capped as the target caps its logits), i.e. the
target's prediction of the very token slot k predicts. Each function takes the chunk's drafter
log-probabilities `log_q` (consumed: it may write into them), the target's `log_t` (or None), the hard
labels [rows, 1], the RowLossSpec and whether a gradient is needed, and returns (loss [rows],
d loss / d logits [rows, V] or None).
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Divergence:
    rows: Callable            # (log_q, log_t, hard, spec, need_grad) -> (loss [rows], d loss / d logits or None)
    needs_target: bool        # reads the target's distribution (objective.labels=target)
    buffers: int              # fp32 [chunk, vocab] buffers of its own that a chunk leaves alive (memory plan)


def cross_entropy_rows(log_q: torch.Tensor, log_t, hard: torch.Tensor, spec, need_grad: bool):
    """(-log q(hard) [rows], d loss / d logits = q - onehot(hard) or None). Consumes `log_q`."""
    loss = -log_q.gather(1, hard)[:, 0]
    if not need_grad:
        return loss, None
    direction = log_q.exp_()
    return loss, direction.scatter_add_(1, hard, -torch.ones_like(hard, dtype=direction.dtype))


def forward_kl_rows(log_q: torch.Tensor, log_t: torch.Tensor, hard, spec, need_grad: bool):
    """(sum_v t (log t - log q) [rows], d loss / d logits = q - t or None). Consumes `log_q`."""
    t = log_t.exp()
    loss = (t * (log_t - log_q)).sum(-1)
    return loss, (log_q.exp_().sub_(t) if need_grad else None)


def ce_tv_rows(log_q: torch.Tensor, log_t: torch.Tensor, hard: torch.Tensor, spec, need_grad: bool):
    """(w CE(hard) + (1 - w) TV(q, t) [rows], its gradient w.r.t. the logits or None), TV(q, t) =
    1/2 sum_v |q(v) - t(v)|, w = spec.tv_ce_weight. d TV / d z_u = 1/2 q_u (s_u - sum_v s_v q_v) with
    s = sign(q - t) (the softmax Jacobian applied to TV's subgradient). Consumes `log_q`."""
    ce_weight = spec.tv_ce_weight
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


DIVERGENCES = {
    "ce": Divergence(cross_entropy_rows, needs_target=False, buffers=0),
    "kl": Divergence(forward_kl_rows, needs_target=True, buffers=1),    # t
    "tv": Divergence(ce_tv_rows, needs_target=True, buffers=1),        # sign(q - t), then the gradient
}


def teacher_rows(final_hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The target's final hidden state that predicts each slot k >= 1: at sequence position p+k-1,
    [b, A, B-1, H] from `final_hidden` [b, T, H] and the blocks' positions [b, A, B] (slots past the
    sequence read its last position; they carry no weight). `final_hidden` may instead be the target's
    argmax at each position [b, T] (a feature store's, for the hard-label losses): then [b, A, B-1]."""
    b, T = final_hidden.shape[:2]
    predicting = positions[..., :-1].clamp(max=T - 1)  # slot k's position p+k, minus one
    if final_hidden.dim() == 2:
        return final_hidden.gather(1, predicting.reshape(b, -1)).view(predicting.shape)
    width = final_hidden.shape[2]
    gathered = final_hidden.gather(1, predicting.reshape(b, -1, 1).expand(-1, -1, width))
    return gathered.view(*predicting.shape, width)


def labels_needed(objective, draft_vocab: bool) -> str:
    """What of the target's labels a feature store must hold for `objective` (drafter.pipeline.feature_store_format's
    TARGET_LABELS): none with data labels; its whole distribution for a divergence to it (kl, tv) or
    over a draft vocabulary (whose argmax is over the K words, not the stored one over all); else its argmax."""
    if objective.labels != "target":
        return "none"
    divergence = DIVERGENCES.get(objective.loss)
    return "full" if draft_vocab or (divergence is not None and divergence.needs_target) else "argmax"
