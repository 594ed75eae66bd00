"""DDTree for a DFlash2 drafter: the tree from the drafter's marginals against one from its selector.

    python bench/selector_tree.py --ckpt runs/variants/dflash2/seed0/checkpoints/latest \
        [--data artifacts/toy/heldout_data] [--budgets 8,16,32]

A DFlash2 drafter's selector re-scores each slot's top-K tokens by the token before it, so its
scores define a first-order tree: a node carrying token t at depth d has as children the K
candidates of slot d + 1, with log-probabilities log_softmax over those K of (logit + pair score
after t), the K-way distribution the selector is trained on. The best-B tree under those scores is
the B prefixes of highest summed log-probability. The marginal tree (`drafter.ddtree.build_tree`,
what `ddtree@B` serves) takes each slot's own distribution, whatever came before.

Both are replayed under teacher forcing on the eval set exactly as training's replayed tau is
(`drafter/served.py`'s `scored_blocks` and `walks_of`: a verify at every response position, then
serving walked response by response), on the same drafter forward, so the difference is the tree
alone. Also printed: the
selector's chain (what `dflash` serves for DFlash2) against the marginals' argmax chain.

The selector tree is found by a beam of B per depth (every prefix among the best B overall is among
the best B of its depth, and its parent among the best B of the parent's depth); a label prefix is in
the tree when every token is among its slot's K candidates and its score reaches the B-th best.
"""
import argparse
import sys
from pathlib import Path

import datasets
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafter.ddtree import build_tree, teacher_forced_accept  # noqa: E402
from drafter.model import DFlash2DraftModel, load_drafter  # noqa: E402
from drafter.sampler import collate  # noqa: E402
from drafter.served import mean_tau, scored_blocks, walks_of  # noqa: E402
from drafter.target import context_features, load_target  # noqa: E402


def selector_tables(selector, hidden, logits, anchor_tokens):
    """Candidates [N, L, K] and their conditional log-probabilities: after the anchor at slot 0
    [N, K], after each candidate of the slot before at slots 1.. [N, L-1, K, K] (previous, current)."""
    unary, candidates = selector.candidates(logits)
    first = unary[:, 0] + selector(hidden[:, 0], anchor_tokens, candidates[:, 0])
    query = (selector.predecessor_codebook[candidates[:, :-1]]
             * selector.hidden_projection(hidden[:, 1:])[:, :, None, :])      # [N, L-1, K, r]
    keys = selector.successor_codebook[candidates[:, 1:]]                      # [N, L-1, K, r]
    pair = torch.einsum("ndpr,ndcr->ndpc", query, keys)
    later = unary[:, 1:, None, :] + pair
    return candidates, first.log_softmax(-1), later.log_softmax(-1)


def selector_tree_accept(candidates, first, later, labels, budget: int) -> torch.Tensor:
    """Tokens committed (accepted depth + 1) at each anchor [N] when the walk follows labels [N, L]
    through the best-`budget` tree of the selector's conditional scores."""
    n, depth_limit, k = candidates.shape
    beam_score, beam_index = first.topk(min(budget, k), dim=-1)
    kept = [beam_score]
    for d in range(1, depth_limit):
        step = later[:, d - 1].gather(1, beam_index[:, :, None].expand(-1, -1, k))   # [N, W, K]
        total = (beam_score[:, :, None] + step).flatten(1)
        beam_score, flat = total.topk(min(budget, total.shape[1]), dim=-1)
        beam_index = flat % k
        kept.append(beam_score)
    union = torch.cat(kept, dim=1)
    threshold = union.topk(min(budget, union.shape[1]), dim=-1).values[:, -1]          # [N]
    hit = candidates == labels[..., None]                                              # [N, L, K]
    present = hit.any(-1)
    index = hit.float().argmax(-1)
    path = [first.gather(1, index[:, :1])[:, 0]]
    for d in range(1, depth_limit):
        path.append(later[torch.arange(n), d - 1, index[:, d - 1], index[:, d]])
    score = torch.stack(path, 1).cumsum(1)
    inside = (present & (score >= threshold[:, None])).long().cumprod(1)
    return inside.sum(1) + 1


@torch.no_grad()
def acceptance(drafter, target, batch, budgets) -> dict[str, torch.Tensor]:
    """Accepted tokens at every anchor of a collated batch, per method: {method: [b, T]}, -1 off."""
    input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    features = context_features(target, input_ids, drafter.target_layer_ids)
    methods = ["chain:selector", "chain:marginal"] + [f"{kind}@{b}" for b in budgets for kind in ("marginal", "selector")]
    accepted = {m: torch.full(input_ids.shape, -1, dtype=torch.long) for m in methods}
    for part in scored_blocks(drafter, target, features, input_ids, loss_mask, "dense"):
        where = (part.rows, part.positions)
        chains = {"chain:selector": drafter.chain_picks(part.hidden, part.logits, part.predecessors),
                  "chain:marginal": part.logits.argmax(-1)}
        for name, drafted in chains.items():
            accepted[name][where] = (drafted == part.labels).long().cumprod(-1).sum(-1)
        tables = selector_tables(drafter.candidate_selector, part.hidden, part.logits, part.predecessors[:, 0])
        for b in budgets:
            accepted[f"marginal@{b}"][where] = teacher_forced_accept(build_tree(part.logits, b), part.labels) - 1
            accepted[f"selector@{b}"][where] = selector_tree_accept(*tables, part.labels, b) - 1
    return accepted


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="a DFlash2 drafter dir, or a run checkpoint holding drafter/")
    parser.add_argument("--target", default=None, help="default: the target path the drafter records")
    parser.add_argument("--data", default="artifacts/toy/heldout_data")
    parser.add_argument("--budgets", default="8,16,32")
    parser.add_argument("--max-rows", type=int, default=None)
    parser.add_argument("--batch-rows", type=int, default=16)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    directory = Path(args.ckpt) / "drafter" if (Path(args.ckpt) / "drafter").is_dir() else Path(args.ckpt)
    drafter = load_drafter(directory, dtype=torch.float32).eval()
    if not isinstance(drafter, DFlash2DraftModel):
        sys.exit(f"{args.ckpt}: a {type(drafter).__name__}, not a DFlash2 drafter: it has no selector")
    target_path = args.target or drafter.config.dflash_config.get("target_path")
    if not target_path:
        sys.exit(f"{args.ckpt}: the drafter records no target path; pass --target")
    target = load_target(target_path, "cpu", torch.float32)
    rows = datasets.load_from_disk(args.data)
    if args.max_rows:
        rows = rows.select(range(min(args.max_rows, len(rows))))
    budgets = [int(b) for b in args.budgets.split(",")]
    walks = {}
    for first in range(0, len(rows), args.batch_rows):
        batch = collate(rows.select(range(first, min(first + args.batch_rows, len(rows)))), bucket=0)
        for method, responses in walks_of(acceptance(drafter, target, batch, budgets), batch["loss_mask"]).items():
            walks.setdefault(method, []).extend(responses)
    print(f"replayed tau of {args.ckpt} on {args.data} ({len(rows)} rows):")
    print("| method | tau |\n|---|---:|")
    for method, responses in walks.items():
        total, count = mean_tau(responses).tolist()
        print(f"| {method} | {total / count:.3f} |")


if __name__ == "__main__":
    main()
