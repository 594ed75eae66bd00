"""Position weights and the first-failure cut: how much each block slot's row loss counts, computed
without gradient from the drafter's current predictions where they depend on them. Registered by
their `objective.position_weights` / `objective.truncate` names (drafter/losses/__init__.py).

  exp     exp(-(k-1)/gamma) at slot k (DFlash)
  dpace   the chain's soft acceptance mass that depends on slot k (D-PACE)
  tree    the same with the acceptance read off the DDTree the drafter's marginals build (ours)
  first_failure   nothing after a block's first argmax miss (Spec-AUF)
"""
import torch

from drafter.losses.lm_head import top_logprobs
from drafter.tree.ddtree import build_tree_from_logprobs, teacher_forced_accept


def position_weights(block_size: int, gamma: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """w [B]: 0 at slot 0 (the anchor), exp(-(k-1)/gamma) at slot k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    return torch.where(k == 0, 0.0, torch.exp(-(k - 1) / gamma))


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
def tree_accepted_depth(hidden, head_weight, labels, budget: int, chunk_rows: int) -> torch.Tensor:
    """Per block [N]: the depth to which `labels` [N, L] follow the best-`budget` DDTree built from the
    drafter's marginals at `hidden` [N, L, H] (its teacher-forced acceptance, the bonus not counted)."""
    blocks, depth, width = hidden.shape
    k = min(budget, head_weight.shape[0])
    logprobs, ids = top_logprobs(hidden.reshape(-1, width), head_weight, k, chunk_rows)
    tree = build_tree_from_logprobs(logprobs.view(blocks, depth, k), ids.view(blocks, depth, k), budget)
    return teacher_forced_accept(tree, labels) - 1


@torch.no_grad()
def up_to_first_failure(hit: torch.Tensor, supervised: torch.Tensor) -> torch.Tensor:
    """objective.truncate=first_failure (Spec-AUF): bool [N, L], the supervised slots up to and
    including each block's first miss (`hit` [N, L]: the drafter's argmax is the slot's label).

    A chain verify accepts a block's drafts up to its first miss, and nothing after it counts, so the
    slots behind a miss are trained for drafts that serving discards; the missed slot itself is kept:
    it is the one whose fix lengthens the accepted run. The cut is read off the argmax: no gradient."""
    clean_before = torch.cat([torch.ones_like(hit[:, :1]), hit[:, :-1].long().cumprod(-1).bool()], -1)
    return clean_before & supervised
