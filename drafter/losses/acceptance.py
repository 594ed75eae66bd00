"""Block losses: minus a block's expected accepted length, a sum over its slots of the chance that the
verify accepts through each one, differentiable through the drafter's probabilities of the labels.
Registered by their `objective.loss` names (drafter/losses/__init__.py).

  expected_chain   the DFlash chain's: sum_k prod_{j<=k} q_j(y_j)
  expected_tree    a smooth surrogate of the best-B DDTree's accepted depth (ours)
"""
import math

import torch

from drafter.losses.lm_head import top_logprobs
from drafter.tree.ddtree import build_tree_from_logprobs


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


@torch.no_grad()
def tree_threshold(hidden, head_weight, budget: int, chunk_rows: int) -> torch.Tensor:
    """Per block [N]: the log-probability that separates the prefixes of the best-`budget` DDTree
    built from the drafter's marginals at `hidden` [N, L, H] from the rest: midway between the
    budget-th best prefix score and the next one (the tree of budget + 1 nodes is built in pop order,
    best first); -inf when every prefix fits the budget (`soft_tree_acceptance`)."""
    blocks, depth, width = hidden.shape
    k = min(budget + 1, head_weight.shape[0])
    logprobs, ids = top_logprobs(hidden.reshape(-1, width), head_weight, k, chunk_rows)
    logprobs, ids = logprobs.view(blocks, depth, k), ids.view(blocks, depth, k)
    tree = build_tree_from_logprobs(logprobs, ids, budget + 1)
    if tree.size <= budget:
        return logprobs.new_full((blocks,), -math.inf)
    at_depth = (tree.depths - 1)[..., None].expand(-1, -1, k)
    own = torch.where(ids.gather(1, at_depth) == tree.tokens[..., None], logprobs.gather(1, at_depth), 0.0).sum(-1)
    score = own
    for _ in range(depth - 1):  # a node's score: its own log-prob plus its parent's (parents come first)
        score = own + torch.where(tree.parents >= 0, score.gather(1, tree.parents.clamp(min=0)), 0.0)
    return (score[:, budget - 1] + score[:, budget]) / 2
