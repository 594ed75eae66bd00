"""DDTree: a draft tree from one DFlash block, its verification by the target, and the bookkeeping.

Tree build. The drafter gives per-depth distributions q_1..q_L for one block. The tree with budget N
is the N most probable prefixes under the product of the q's (DDTree, arXiv 2604.12989), found by the
reference's best-first search: a heap of prefixes of top-k ranks (r_1..r_d) keyed by summed
log-probability; pop the best, push its next sibling and its first child, stop at N. On a score tie
the lexicographically smaller rank tuple pops first (a prefix before its extensions: Python's tuple
order in the reference heap). Nodes are numbered in pop order, so a parent precedes its children.

Two backends give the same nodes in the same order:
  compiled  the heap itself in C (`tree_heap.c`, built by `pip install` as the extension module
            drafter.tree._tree_heap); CPU tensors only.
  tensor    torch ops with static shapes and no host sync (any device): per depth, a beam of the
            best N prefixes kept in lexicographic order, then the best N over all depths.
Scores are log-probs in fixed point (int64, 2^-32 nats), so sums are exact on every device and in
every order, and ties are real ties. When fewer than N prefixes exist (k + k^2 + ... + k^L < N with
k = min(N, V)) the tree holds all of them.

Verification. One target forward over [root (the bonus token) + N nodes] at positions start + depth,
each node seeing the whole past and its own ancestors. The walk starts at the root and moves to the
child carrying the target's token at the current node (argmax, or a sample at temperature > 0: the
sampled walk is lossless); the token that finds no child is the next bonus. The cache rows of the
accepted path are then moved down and the rest cropped (`drafter.target_model.cache`); their features are
the drafter's next context features.
"""
import ctypes
import functools
import importlib
import warnings
from dataclasses import dataclass

import torch


SCORE_SCALE = 2.0 ** 32    # fixed-point step of a log-probability: 2^-32 nats
SCORE_FLOOR = -2.0 ** 20   # lower clamp (-inf included), so that sums over many depths fit int64
BACKENDS = ("auto", "compiled", "tensor")


@dataclass
class DraftTree:
    """Nodes in pop order; tensors [..., N] (a leading batch dimension when built batched).

    tokens: token id of each node; parents: index of the parent node, -1 for children of the root;
    depths: 1 for children of the root. `depth_limit` is the block's number of drafted positions.
    """
    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    depth_limit: int

    @property
    def size(self) -> int:
        return self.tokens.shape[-1]


# ---------------------------------------------------------------------------------------------
# Tree build
# ---------------------------------------------------------------------------------------------

def build_tree(draft_logits: torch.Tensor, budget: int, backend: str = "auto") -> DraftTree:
    """The best-`budget` draft tree from draft logits [L, V] (or batched [b, L, V])."""
    logits = draft_logits.float()
    k = max(1, min(budget, logits.shape[-1]))
    top_logits, top_ids = logits.topk(k, dim=-1)
    return build_tree_from_logprobs(top_logits - logits.logsumexp(-1, keepdim=True), top_ids, budget,
                                    backend)


def build_tree_from_logprobs(topk_logprobs: torch.Tensor, topk_token_ids: torch.Tensor, budget: int,
                             backend: str = "auto") -> DraftTree:
    """The best-`budget` draft tree from each depth's top-k log-probs [..., L, K], sorted descending
    along K, and their token ids [..., L, K]. K may exceed the budget (only the first `budget`
    columns can matter). Leading dimensions are a batch of independent blocks.

    backend: "compiled" (C heap, CPU), "tensor" (torch ops, any device, no host sync) or "auto"
    (compiled for CPU tensors when a C compiler is available, tensor otherwise).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} not in {BACKENDS}")
    batch_shape, (depth_limit, k) = topk_logprobs.shape[:-2], topk_logprobs.shape[-2:]
    k = min(k, max(budget, 0))
    if depth_limit == 0 or k == 0:
        empty = torch.zeros((*batch_shape, 0), dtype=torch.long, device=topk_logprobs.device)
        return DraftTree(empty, empty.clone(), empty.clone(), depth_limit)
    scores = fixed_point(topk_logprobs[..., :k]).reshape(-1, depth_limit, k)
    if backend == "auto":
        backend = "compiled" if scores.device.type == "cpu" and _compiled_heap() is not None else "tensor"
    select = _best_first_compiled if backend == "compiled" else _best_first_tensor
    depths, ranks, parents = select(scores, budget)
    flat_ids = topk_token_ids[..., :k].reshape(scores.shape[0], depth_limit * k)
    tokens = flat_ids.gather(1, (depths - 1) * k + ranks)
    n = tokens.shape[1]
    return DraftTree(tokens.view(*batch_shape, n), parents.view(*batch_shape, n),
                     depths.view(*batch_shape, n), depth_limit)


def build_conditional_tree(first_logprobs: torch.Tensor, later_logprobs: torch.Tensor,
                           candidate_ids: torch.Tensor, budget: int) -> DraftTree:
    """The best-`budget` draft tree when a slot's distribution depends on the token before it (a
    DFlash2 drafter's selector): slot 1 offers its K candidates with first_logprobs [b, K]; slot
    d > 1 offers its K candidates after the slot-(d-1) candidate i with later_logprobs [b, L-1, K, K]
    (row i); candidate_ids [b, L, K]. A prefix scores the sum of its log-probabilities.

    Depth by depth, the best `budget` prefixes of that depth are kept (every prefix among the best B
    overall is among the best B of its depth, its parent among those of the parent's depth), stored
    in (parent, candidate) order as `_best_first_tensor` stores its beams; the best B of their union,
    in pop order, are the tree. Tensor ops only."""
    batch, depth_limit, k = candidate_ids.shape
    first, later = fixed_point(first_logprobs), fixed_point(later_logprobs)
    width = min(budget, k)
    keep = first.argsort(dim=1, descending=True, stable=True)[:, :width].sort(dim=1).values
    beams = [(first.gather(1, keep), torch.full_like(keep, -1), keep)]
    for depth in range(1, depth_limit):
        score, _, rank = beams[-1]
        after = later[:, depth - 1].gather(1, rank[:, :, None].expand(-1, -1, k))    # [b, W, K]
        candidate = (score[:, :, None] + after).flatten(1)
        width = min(budget, candidate.shape[1])
        keep = candidate.argsort(dim=1, descending=True, stable=True)[:, :width].sort(dim=1).values
        beams.append((candidate.gather(1, keep), keep // k, keep % k))
    depths, ranks, parents = _best_over_depths(beams, budget)
    tokens = candidate_ids.reshape(batch, depth_limit * k).gather(1, (depths - 1) * k + ranks)
    return DraftTree(tokens, parents, depths, depth_limit)


def fixed_point(logprobs: torch.Tensor) -> torch.Tensor:
    """Log-probabilities as int64 multiples of 2^-32 nats (clamped at SCORE_FLOOR)."""
    return (logprobs.double().clamp(min=SCORE_FLOOR) * SCORE_SCALE).round().long()


def compiled_backend_available() -> bool:
    """Whether the compiled backend can be built (or was) and loaded here."""
    return _compiled_heap() is not None


@functools.cache
def _compiled_heap():
    """`ddtree_best_first` from the built extension through ctypes, or None (with a warning) when the
    package was installed without it (no C compiler at `pip install` time) or run from a bare checkout."""
    try:
        extension = importlib.import_module("drafter.tree._tree_heap")
        function = ctypes.CDLL(extension.__file__).ddtree_best_first
    except (ImportError, OSError) as error:
        warnings.warn(f"DDTree trees on the CPU use the tensor backend: the compiled heap is not built "
                      f"({error}; `pip install -e .` builds it)")
        return None
    function.restype = ctypes.c_int64
    function.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 3
    return function


def _best_first_compiled(scores: torch.Tensor, budget: int):
    """The C heap; tensors on another device go through the host (a sync, as in the reference)."""
    function = _compiled_heap()
    if function is None:
        raise RuntimeError("the compiled DDTree backend is not built (see the warning)")
    host_scores = scores.cpu().contiguous()
    batch, depth_limit, k = host_scores.shape
    depths, ranks, parents = (torch.empty((batch, budget), dtype=torch.long) for _ in range(3))
    count = function(host_scores.data_ptr(), batch, depth_limit, k, budget, depths.data_ptr(),
                     ranks.data_ptr(), parents.data_ptr())
    if count < 0:
        raise MemoryError("ddtree_best_first could not allocate its heap")
    return tuple(t[:, :count].to(scores.device) for t in (depths, ranks, parents))


def _children_per_parent(width: int, k: int, budget: int, device: torch.device):
    """(counts [width], their sum): how many children of the parent at score position i (0 = best)
    can be among the best `budget` prefixes of the next depth: (i + 1) * (r + 1) <= budget, because
    every (parent, rank) pair at or above both positions scores at least as high (sums are exact)
    and sorts no later. The counts are computed on the device: a host-to-device copy would wait."""
    counts = (budget // torch.arange(1, width + 1, device=device)).clamp(max=k)
    return counts, sum(min(k, budget // (i + 1)) for i in range(width))


def _best_first_tensor(scores: torch.Tensor, budget: int):
    """Depth, rank and parent of the heap's nodes in pop order, [b, n] each, with torch ops.

    Depth by depth, keep the best `budget` prefixes of that depth (the parents of any prefix in the
    tree are among the best of theirs), stored in lexicographic rank order, so that candidates
    generated parent by parent, rank by rank, are in lexicographic order too and a stable sort by
    score applies the heap's tie rule. Across depths, lexicographic order is the preorder of the
    union of the beams, computed from subtree sizes. Shapes depend only on (L, k, budget).
    """
    batch, depth_limit, k = scores.shape
    device = scores.device
    batch_index = torch.arange(batch, device=device)[:, None]
    width = min(budget, k)
    beams = [(scores[:, 0, :width], torch.full((batch, width), -1, device=device),
              torch.arange(width, device=device).expand(batch, width))]
    for depth in range(1, depth_limit):
        parent_score = beams[-1][0]
        per_position, total = _children_per_parent(width, k, budget, device)
        by_score = parent_score.argsort(dim=1, descending=True, stable=True)
        position = torch.empty_like(by_score).scatter_(
            1, by_score, torch.arange(width, device=device).expand(batch, width))
        counts = per_position[position].reshape(-1)
        owner = torch.repeat_interleave(torch.arange(batch * width, device=device), counts,
                                        output_size=batch * total)
        first = counts.cumsum(0) - counts
        rank = (torch.arange(batch * total, device=device) - first[owner]).view(batch, total)
        parent = owner.view(batch, total) - batch_index * width
        candidate = parent_score.gather(1, parent) + scores[:, depth].gather(1, rank)
        width = min(budget, total)
        best = candidate.argsort(dim=1, descending=True, stable=True)[:, :width]
        keep = best.sort(dim=1).values
        beams.append((candidate.gather(1, keep), parent.gather(1, keep), rank.gather(1, keep)))
    return _best_over_depths(beams, budget)


def _best_over_depths(beams, budget: int):
    """The best `budget` prefixes of all beams, in pop order: score descending, then preorder."""
    ones = [torch.ones_like(score) for score, _, _ in beams]
    sizes = ones[:]  # subtree sizes within the union of the beams
    for depth in range(len(beams) - 1, 0, -1):
        sizes[depth - 1] = ones[depth - 1].scatter_add(1, beams[depth][1], sizes[depth])
    preorder = [sizes[0].cumsum(1) - sizes[0]]
    for depth in range(1, len(beams)):
        parent = beams[depth][1]
        below_parents = sizes[depth - 1] - 1
        before_parent = below_parents.cumsum(1) - below_parents
        before_here = sizes[depth].cumsum(1) - sizes[depth]
        preorder.append(preorder[-1].gather(1, parent) + 1 + before_here
                        - before_parent.gather(1, parent))
    offsets = [0]
    for score, _, _ in beams:
        offsets.append(offsets[-1] + score.shape[1])
    score = torch.cat([s for s, _, _ in beams], dim=1)
    rank = torch.cat([r for _, _, r in beams], dim=1)
    depth = torch.cat([torch.full_like(s, d + 1) for d, (s, _, _) in enumerate(beams)], dim=1)
    parent = torch.cat([p if d == 0 else p + offsets[d - 1] for d, (_, p, _) in enumerate(beams)], dim=1)
    union = score.shape[1]
    arange = torch.arange(union, device=score.device).expand_as(score)
    at_preorder = torch.empty_like(arange).scatter_(1, torch.cat(preorder, dim=1), arange)
    n = min(budget, union)
    order = score.gather(1, at_preorder).argsort(dim=1, descending=True, stable=True)[:, :n]
    chosen = at_preorder.gather(1, order)
    pop_index = torch.full_like(arange, -1).scatter_(1, chosen, arange[:, :n])
    parent = parent.gather(1, chosen)
    parent = torch.where(parent < 0, parent, pop_index.gather(1, parent.clamp(min=0)))
    return depth.gather(1, chosen), rank.gather(1, chosen), parent


# ---------------------------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------------------------

def tree_visibility(tree: DraftTree) -> torch.Tensor:
    """[N+1, N+1] bool over verify rows (0 = root, 1 + i = node i): a row sees itself and its ancestors."""
    rows = tree.size + 1
    device = tree.parents.device
    parent_row = torch.cat([torch.zeros(1, dtype=torch.long, device=device), tree.parents + 1])
    visible = torch.eye(rows, dtype=torch.bool, device=device)
    every_row = torch.arange(rows, device=device)
    ancestor = parent_row
    for _ in range(tree.depth_limit):
        visible[every_row, ancestor] = True
        ancestor = parent_row[ancestor]
    return visible


def tree_verify_inputs(tree: DraftTree, root_token: torch.Tensor, start: int):
    """(input_ids [1, N+1], position_ids [1, N+1], visibility [N+1, N+1]) of a target forward over the
    tree on top of a cache holding positions 0..start-1; the attention mask over the keys of each
    layer type comes from `drafter.target_model.cache.TargetCache.tree_attention_mask`."""
    device = tree.tokens.device
    input_ids = torch.cat([root_token.view(1), tree.tokens])[None]
    positions = start + torch.cat([torch.zeros(1, dtype=torch.long, device=device), tree.depths])[None]
    return input_ids, positions, tree_visibility(tree)


def _on_path(tree: DraftTree, wanted: torch.Tensor) -> torch.Tensor:
    """Nodes whose token equals `wanted` at the node and at every ancestor ([..., N] bool)."""
    match = tree.tokens == wanted
    is_top = tree.parents < 0
    parent = tree.parents.clamp(min=0)
    on_path = match & is_top
    for _ in range(tree.depth_limit - 1):
        on_path = match & (is_top | on_path.gather(-1, parent))
    return on_path


def follow_tree(tree: DraftTree, picks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The walk, given the target's token `picks` [N+1] at every verify row, without a host sync:
    (path [L+1], accepted []). path[d] is the verify row of the accepted node at depth d (path[0] = 0,
    the root) for d <= accepted; later entries repeat path[accepted], so picks[path[-1]] is the next
    bonus token. An unbatched tree only."""
    on_path = _on_path(tree, picks[tree.parents + 1])  # at most one node per depth
    depth_slot = torch.where(on_path, tree.depths, tree.depth_limit + 1)  # off-path nodes: a spare slot
    rows = torch.zeros(tree.depth_limit + 2, dtype=torch.long, device=picks.device)
    rows.scatter_(0, depth_slot, torch.arange(1, tree.size + 1, device=picks.device))
    accepted = on_path.sum()
    depth = torch.arange(tree.depth_limit + 1, device=picks.device)
    return rows.gather(0, torch.minimum(depth, accepted)), accepted


def committed_tokens(input_ids: torch.Tensor, picks: torch.Tensor, path: torch.Tensor,
                     accepted: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """A step's one host sync: (the accepted nodes' tokens and the bonus token, the path's accepted
    rows) from the verify input ids [N+1] and the walk (`follow_tree`)."""
    values = torch.cat([accepted.view(1), input_ids[path[1:]], picks[path[-1:]]]).tolist()
    count = values[0]
    return values[1:1 + count] + values[-1:], path[:count + 1]


def teacher_forced_accept(tree: DraftTree, labels: torch.Tensor) -> torch.Tensor:
    """Tokens committed (accepted depth + 1, the bonus included) when the walk follows `labels`
    [..., L], the true tokens at block positions 1..L; returns [...] long, no host sync. A label that
    no node carries (e.g. an ignore index) ends the walk."""
    on_path = _on_path(tree, labels.gather(-1, tree.depths - 1))
    return on_path.sum(-1) + 1
