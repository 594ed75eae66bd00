"""What verifying a DDTree costs on hybrid targets, against a DFlash chain verify of the same block.

    python bench/hybrid_verify.py [--context 256] [--block 16] [--threads 1] [--min-run-time 0.3]

Two random hybrids of realistic shape on the CPU (width 512, 8 layers, a 32k vocabulary; ~60M
parameters each), each with a prefix cache of --context positions:
  qwen3_5_text  Gated DeltaNet x3 then full attention, twice (a recurrent state: no tree form but paths)
  lfm2          short conv and full attention alternating (its convs also run along the tree itself)
Trees of 8/16/32/64 nodes are built from draft logits whose top-1 carries most of the mass at every
depth, as a trained drafter's does (deep along the best path, bushy near the root). Timed, the best
call over about --min-run-time seconds after a warm-up (drafter/infra/timing.py), each from the same
prefix cache:
  chain       one forward of the block's 16 tokens (DFlash's verify; the baseline)
  paths       the tree as a batch of its root-to-leaf paths: the per-row cache copy and the batch
              forward of leaves x (depth + 1) tokens (drafter/serving/path_verify.py)
  refeed      (qwen3_5_text) the commit after a partial acceptance on a recurrent target: the accepted
              path (here half the tree's depth, plus the root) re-run on the prefix cache
  flat        (qwen3_5_text) one forward of the nodes + 1 as a flat sequence: what a tree mask costs
              on an attention-only target of this shape, and the floor a tree-structured state fork
              would approach. Wrong on this target: timing only.
  tree conv   (lfm2) the tree in one flat forward, the convs along each node's ancestors and the
              attention under the tree mask (drafter/target_model/tree_conv.py): exact, nodes + 1 tokens
Printed: each form's time over the chain's. Every timed forward runs on a copy of the prefix cache
(one row for the chain, the refeed and the flat forms), so that each repeat starts from the same state.
"""
import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafter.infra.timing import best_time  # noqa: E402
from drafter.serving.path_verify import PathBatch, fork  # noqa: E402
from drafter.target_model.cache import TargetCache  # noqa: E402
from drafter.target_model.model import freeze  # noqa: E402
from drafter.target_model.tree_conv import tree_convolution  # noqa: E402
from drafter.tree.ddtree import build_tree, tree_verify_inputs  # noqa: E402

BUDGETS = (8, 16, 32, 64)
COMMON = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
              head_dim=64, tie_word_embeddings=False, max_position_embeddings=4096)
SHAPES = {
    "qwen3_5_text": dict(COMMON, intermediate_size=1536,
                         layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2, linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
                         linear_num_key_heads=4, linear_num_value_heads=8),
    "lfm2": dict(COMMON, layer_types=["conv", "full_attention"] * 4, conv_L_cache=3, block_auto_adjust_ff_dim=False,
                 block_ff_dim=1536, intermediate_size=1536, full_attn_idxs=None),
}


def hybrid_target(family: str) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return freeze(AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **SHAPES[family])))


def peaked_logits(depth: int, vocab: int, seed: int) -> torch.Tensor:
    """Per-depth draft logits whose top-1 takes ~70% of the mass and a few runners-up most of the rest."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(depth, vocab, generator=gen)
    top = torch.randint(0, vocab, (depth, 4), generator=gen)
    logits.scatter_(1, top, torch.tensor([12.0, 10.0, 9.5, 9.0]).expand(depth, 4))
    return logits


def bench(family: str, args) -> None:
    target = hybrid_target(family)
    vocab = target.config.vocab_size
    prefix = TargetCache(target)
    prefix.forward(torch.randint(0, vocab, (1, args.context), generator=torch.Generator().manual_seed(1)))
    prefix.rollback(args.context)
    start = args.context

    def verify(ids, positions=None, **kwargs):  # on a copy of the prefix cache, which stays as it is
        positions = start + torch.arange(ids.shape[1])[None] if positions is None else positions
        fork(prefix, ids.shape[0]).forward(ids, position_ids=positions, **kwargs)

    def tree_conv(tree):
        ids, positions, visible = tree_verify_inputs(tree, torch.tensor(0), start)
        mask = prefix.tree_attention_mask(visible, positions[0] - start, start, target.dtype)
        with tree_convolution(target, torch.cat([torch.tensor([-1]), tree.parents + 1])):
            verify(ids, positions, attention_mask=mask)

    chain = best_time(lambda: verify(torch.zeros((1, args.block), dtype=torch.long)), args.min_run_time)
    print(f"\n{family}-shaped hybrid, {sum(p.numel() for p in target.parameters()) / 1e6:.0f}M parameters: chain "
          f"verify of {args.block} tokens {chain * 1e3:.1f} ms")
    other = "refeed paths+refeed   flat" if family == "qwen3_5_text" else "tree conv"
    print(f"{'budget':>6} {'leaves':>6} {'depth':>5} {'tokens':>6} {'paths':>7} {other}   (time over the chain's)")
    for budget in BUDGETS:
        tree = build_tree(peaked_logits(args.block - 1, vocab, budget), budget)
        batch = PathBatch.of(tree, torch.tensor(0), start)
        depth = batch.input_ids.shape[1] - 1
        paths = best_time(lambda: verify(batch.input_ids), args.min_run_time)
        row = f"{budget:>6} {batch.rows:>6} {depth:>5} {batch.input_ids.numel():>6} {paths / chain:>7.2f}"
        if family == "qwen3_5_text":
            refeed = best_time(lambda: verify(batch.input_ids[:1, :depth // 2 + 1]), args.min_run_time)
            flat = best_time(lambda: verify(torch.zeros((1, tree.size + 1), dtype=torch.long)),
                             args.min_run_time)
            row += f" {refeed / chain:>6.2f} {(paths + refeed) / chain:>12.2f} {flat / chain:>6.2f}"
        else:
            row += f" {best_time(lambda: tree_conv(tree), args.min_run_time) / chain:>9.2f}"
        print(row)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--min-run-time", type=float, default=0.3, help="seconds of timed calls per measure")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{args.context} cached positions, block {args.block}, {args.threads} thread(s)")
    with torch.inference_mode():
        for family in SHAPES:
            bench(family, args)


if __name__ == "__main__":
    main()
