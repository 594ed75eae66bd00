"""Stand-in drafters for checking the decode loop (bench/gpu_check.py's losslessness check, the
serving tests): they keep the `ServedDrafter` interface (drafter/models/__init__.py) and propose
what the check needs instead of what a drafter learned."""
import torch

from drafter.tree.ddtree import build_tree


class ReplayDrafter:
    """A drafter whose proposals are a known continuation: the true token ranks first, except at
    every 4th position where a decoy outranks it, so that a chain stops there and a tree goes on.
    The real drafter still runs (its cache, its cost); only its logits are replaced."""

    def __init__(self, drafter, continuation: list[int]):
        self.drafter, self.continuation = drafter, continuation
        self.block_size, self.mask_token_id = drafter.block_size, drafter.mask_token_id
        self.target_layer_ids, self.drafts_marginals = drafter.target_layer_ids, drafter.drafts_marginals

    def draft_states(self, target, ctx_features, block_ids, cache, depth=None):
        hidden, logits = self.drafter.draft_states(target, ctx_features, block_ids, cache, depth)
        start = cache.length
        proposal = torch.zeros_like(logits)
        for k in range(logits.shape[1]):
            position = start + 1 + k
            if position < len(self.continuation):
                true = self.continuation[position]
                proposal[0, k, true] = 5.0
                if position % 4 == 0:
                    proposal[0, k, (true + 1) % logits.shape[-1]] = 6.0
        return hidden, proposal

    def draft_logits(self, target, ctx_features, block_ids, cache):
        return self.draft_states(target, ctx_features, block_ids, cache)[1]

    def draft_chain(self, target, ctx_features, block_ids, cache):
        """DFlash's path through the replaced logits: their argmax."""
        return self.draft_logits(target, ctx_features, block_ids, cache).argmax(-1)

    def block_trees(self, hidden, logits, roots, budget, backend="auto"):
        """DFlash's tree of the replaced logits."""
        return build_tree(logits, budget, backend)
