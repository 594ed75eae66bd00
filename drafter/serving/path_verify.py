"""DDTree verified as a batch of its root-to-leaf paths, by the target's own forward: the form for
targets a flat tree cannot pass through (conv, recurrent and compressor layers, whose every branch must
continue its parent's state; chunked attention, which has no tree mask here). LFM2's short convs are
the exception: they read along the tree itself (drafter/target_model/tree_conv.py), in the flat form.

Rows. One row per leaf: the root (the bonus token) and the nodes from depth 1 down to the leaf, at
positions start.., right-padded to the deepest leaf. Each row continues the prefix's cache, copied per
row (`fork`: every layer through its own class's `reorder_cache`, the one batch op that every
transformers cache layer and DeepSeek-V4's compressor caches implement), and the batch runs as an
ordinary causal forward, so every attention kind applies its own mask (full, sliding, chunked) and
every conv or recurrent layer its own scan. Padding comes after a row's last real token: under a causal
forward no real token sees it, so every real token's logits are exact; only the state at the row's end
has absorbed it.

Logits. Node v's logits are read in the first row through v, at column depth(v); the walk is the flat
tree's (`follow_tree`).

Commit. The accepted path is a prefix of row r, the first row through the accepted node:
  cut     when every layer holding state can be cut back to a position (attention keys, conv history
          recorded past its width: Inkling-2-Loop), or the accepted path is all of row r and r is unpadded (a
          full-depth acceptance): row r of the fork becomes the cache, rolled back to start + a + 1
          (a the accepted nodes). No extra forward.
  refeed  otherwise (a recurrent state or a compressor that ran past the accepted node: it cannot
          be cut back): the fork is dropped, and the prefix cache, which the verify never touched, runs
          the root and the accepted nodes (a + 1 tokens, the `recompute` stage: the step `dflash`
          takes after a partial acceptance on the same targets).

Cost model (docs/targets.md, "DDTree on hybrid targets"): a verify runs leaves x (depth + 1) tokens,
where the flat tree runs nodes + 1, plus a refeed of a + 1 tokens on recurrent targets; memory per row
is the whole cache of the prefix (every recurrent and conv state, and the attention keys of every
prefix position), so the verify's transient cache is `leaves` times the decode's. A step reads the
device three times (the batch's width, which its shape needs; the walk's tokens; the accepted row),
where the flat tree's step reads it once.
"""
import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

from drafter.target_model.cache import TargetCache, forks_by_row, is_own_layer, is_state_layer
from drafter.tree.ddtree import DraftTree, committed_tokens, follow_tree, tree_visibility


@dataclass
class PathBatch:
    """A tree's verify rows as a batch of root-to-leaf paths. `tree_rows` [P, W] names each cell's
    verify row of the flat form (0 = root, 1 + i = node i); `lengths` [P] are the real cells per row."""
    input_ids: torch.Tensor      # [P, W]
    position_ids: torch.Tensor   # [P, W]
    tree_rows: torch.Tensor      # [P, W], padding cells repeat the row's last real one
    lengths: torch.Tensor        # [P]
    node_row: torch.Tensor       # [N+1] the first batch row through each verify row
    node_column: torch.Tensor    # [N+1] its column there (its depth)
    tree_ids: torch.Tensor       # [N+1] the flat form's input ids: the root, then the nodes

    @classmethod
    def of(cls, tree: DraftTree, root_token: torch.Tensor, start: int) -> "PathBatch":
        size, device = tree.size, tree.tokens.device
        visible = tree_visibility(tree)                      # a verify row sees itself and its ancestors
        has_child = torch.zeros(size + 1, dtype=torch.bool, device=device)
        has_child[tree.parents + 1] = True
        through = visible[~has_child]                        # [P, N+1]: the verify rows on each leaf's path
        lengths = through.sum(1)
        width = int(lengths.max())                           # the shapes need it: one host sync
        # ancestors precede descendants in pop order, so a path's verify rows sorted are in depth order
        columns = torch.arange(size + 1, device=device)
        tree_rows = torch.where(through, columns, size + 1).sort(dim=1).values[:, :width]
        last = tree_rows.gather(1, (lengths - 1)[:, None])
        tree_rows = torch.where(tree_rows > size, last, tree_rows)
        tree_ids = torch.cat([root_token.view(1), tree.tokens])
        depths = torch.cat([torch.zeros(1, dtype=torch.long, device=device), tree.depths])
        positions = start + torch.arange(width, device=device).expand_as(tree_rows)
        return cls(tree_ids[tree_rows], positions, tree_rows, lengths, through.int().argmax(0), depths, tree_ids)

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    def node_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[N+1, V] logits per verify row of the flat form, from the batch's [P, W, V]."""
        return logits[self.node_row, self.node_column]


def fork(cache: TargetCache, rows: int) -> TargetCache:
    """A copy of `cache` with its state repeated `rows` times along the batch; `cache` is untouched."""
    forked = copy.copy(cache)
    forked.cache = forks_by_row(cache.cache, torch.zeros(rows, dtype=torch.long, device=cache.target.device))
    return forked


def can_cut(cache: TargetCache) -> bool:
    """Whether every layer's state can be cut back to a position: attention keys, and conv history
    recorded past its width; no recurrent state, no compressor (a model's own cache layer)."""
    return not any(is_own_layer(layer) or (is_state_layer(layer) and any(
        layer.is_recurrent_states_initialized.values())) for layer in cache.cache.layers)


@dataclass
class PathVerify:
    """What one path-batch verify committed: the tokens after the root, the context features of the root
    and the accepted nodes [1, a+1, K*H], and the cache to continue on."""
    committed: list[int]
    features: torch.Tensor
    cache: TargetCache


@dataclass(frozen=True)
class PathVerifier:
    """What stays fixed over one decode: the feature tap, `choose` (the target's token per row of
    logits: argmax, or a sample) and the stage timer."""
    tap: object
    choose: Callable[[torch.Tensor], torch.Tensor]
    timer: object

    def verify(self, cache: TargetCache, tree: DraftTree, root_token: torch.Tensor, start: int) -> PathVerify:
        """Verify `tree` on `cache` (holding positions 0..start-1) as a batch of its paths, and commit
        (module docstring)."""
        with self.timer("verify"):
            batch = PathBatch.of(tree, root_token, start)
            rows = fork(cache, batch.rows)
            out = rows.forward(batch.input_ids, position_ids=batch.position_ids)
            features = self.tap.features()
        with self.timer("commit"):
            picks = self.choose(batch.node_logits(out.logits))
            committed, path = committed_tokens(batch.tree_ids, picks, *follow_tree(tree, picks))
            kept = len(path)                                      # the root and the accepted nodes
            row = batch.node_row[path[-1]]
            row, length = torch.stack([row, batch.lengths[row]]).tolist()
            whole_row = kept == length == batch.input_ids.shape[1]
            features = features[row:row + 1, :kept]
            if whole_row or can_cut(rows):
                rows.cache = forks_by_row(rows.cache, torch.tensor([row], device=batch.input_ids.device))
                rows.rollback(start + kept)
                return PathVerify(committed, features, rows)
        with self.timer("recompute"):
            cache.forward(batch.input_ids[row:row + 1, :kept], logits_to_keep=1)
        return PathVerify(committed, features, cache)
