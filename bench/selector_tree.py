"""DDTree for a DFlash2 drafter: the tree from its selector's scores (what `ddtree@B` serves) against
the tree from its marginals.

    python bench/selector_tree.py --ckpt runs/variants/dflash2/seed0/checkpoints/latest \
        [--data artifacts/toy/heldout_data] [--budgets 8,16,32]

A DFlash2 drafter's selector re-scores each slot's top-K tokens by the token before it, so its
scores define a first-order tree: a node carrying token t at depth d has as children the K
candidates of slot d + 1, with log-probabilities log_softmax over those K of (logit + pair score
after t), the K-way distribution the selector is trained on. The best-B tree under those scores is
the B prefixes of highest summed log-probability (`ddtree.build_conditional_tree`, which
`DFlash2DraftModel.block_trees` builds and the decode loop serves). The marginal tree
(`ddtree.build_tree`, what a DFlash drafter serves) takes each slot's own distribution, whatever
came before.

Both are replayed under teacher forcing on the eval set exactly as training's replayed tau is
(`drafter/serving/served.py`'s `scored_blocks` and `walks_of`: a verify at every response position, then
serving walked response by response), on the same drafter forward, so the difference is the tree
alone. Also printed: the selector's chain (what `dflash` serves for DFlash2) against the marginals'
argmax chain. The "selector" rows are the drafter's own chain and tree (`chain_picks`, `block_trees`),
so any drafter runs; for a DFlash drafter they are its marginals' and the two rows agree.
"""
import argparse
import sys
from pathlib import Path

import datasets
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafter.pipeline.loader import collate  # noqa: E402
from drafter.models import load_drafter  # noqa: E402
from drafter.models.blocks import DraftingSetup, FeatureBatch  # noqa: E402
from drafter.serving.served import mean_tau, scored_blocks, walks_of  # noqa: E402
from drafter.target_model.model import context_features, load_target  # noqa: E402
from drafter.training.checkpoint import drafter_dir  # noqa: E402
from drafter.tree.ddtree import build_tree, teacher_forced_accept  # noqa: E402


@torch.no_grad()
def acceptance(drafter, target, batch, budgets) -> dict[str, torch.Tensor]:
    """Accepted tokens at every anchor of a collated batch, per method: {method: [b, T]}, -1 off."""
    input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    features = context_features(target, input_ids, drafter.target_layer_ids)
    methods = ["chain:selector", "chain:marginal"] + [f"{kind}@{b}" for b in budgets for kind in ("marginal", "selector")]
    accepted = {m: torch.full(input_ids.shape, -1, dtype=torch.long) for m in methods}
    for part in scored_blocks(DraftingSetup(drafter, target, "dense"), FeatureBatch(input_ids, loss_mask, features)):
        where = (part.rows, part.positions)
        chains = {"chain:selector": drafter.chain_picks(part.hidden, part.logits, part.predecessors),
                  "chain:marginal": part.logits.argmax(-1)}
        for name, drafted in chains.items():
            accepted[name][where] = (drafted == part.labels).long().cumprod(-1).sum(-1)
        for b in budgets:
            trees = {"marginal": build_tree(part.logits, b),
                     "selector": drafter.block_trees(part.hidden, part.logits, part.predecessors[:, 0], b)}
            for kind, tree in trees.items():
                accepted[f"{kind}@{b}"][where] = teacher_forced_accept(tree, part.labels) - 1
    return accepted


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="a drafter dir (DFlash2: its selector), or a run checkpoint holding drafter/")
    parser.add_argument("--target", default=None, help="default: the target path the drafter records")
    parser.add_argument("--data", default="artifacts/toy/heldout_data")
    parser.add_argument("--budgets", default="8,16,32")
    parser.add_argument("--max-rows", type=int, default=None)
    parser.add_argument("--batch-rows", type=int, default=16)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    drafter = load_drafter(drafter_dir(args.ckpt), dtype=torch.float32).eval()
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
