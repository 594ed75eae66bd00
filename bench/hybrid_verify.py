"""What verifying a DDTree costs on a hybrid target, against a DFlash chain verify of the same block.

    python bench/hybrid_verify.py [--context 256] [--block 16] [--threads 1] [--repeats 5]

A random Qwen3.5-shaped target (Gated DeltaNet x3 then full attention, twice: 8 layers of width 512,
a 32k vocabulary; ~60M parameters) on the CPU, with a prefix cache of --context positions. Trees of
8/16/32/64 nodes are built from draft logits whose top-1 carries most of the mass at every depth,
as a trained drafter's does (deep along the best path, bushy near the root). Timed, best of
--repeats, each from the same prefix cache:
  chain       one forward of the block's 16 tokens (DFlash's verify; the baseline)
  paths       the tree as a batch of its root-to-leaf paths: the per-row cache copy and the batch
              forward of leaves x (depth + 1) tokens (drafter/serving/path_verify.py)
  refeed      the commit after a partial acceptance on a recurrent target: the accepted path (here
              half the tree's depth, plus the root) re-run on the prefix cache
  flat        one forward of the nodes + 1 as a flat sequence: what a tree mask costs on an
              attention-only target of this shape, and the floor a state fork (each node's state
              computed once from its parent's) would approach. Wrong on this target: timing only.
Printed: each form's time over the chain's. Every timed forward runs on a copy of the prefix cache
(one row for the chain and the refeed), so that each repeat starts from the same state.
"""
import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafter.serving.ddtree import build_tree  # noqa: E402
from drafter.serving.path_verify import PathBatch, fork  # noqa: E402
from drafter.target.cache import TargetCache  # noqa: E402
from drafter.target.model import freeze  # noqa: E402

BUDGETS = (8, 16, 32, 64)
SHAPE = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
             head_dim=64, intermediate_size=1536, layer_types=["linear_attention"] * 3 + ["full_attention"],
             linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=4,
             linear_num_value_heads=8, tie_word_embeddings=False, max_position_embeddings=4096)


def hybrid_target() -> torch.nn.Module:
    shape = dict(SHAPE, layer_types=SHAPE["layer_types"] * (SHAPE["num_hidden_layers"] // 4))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return freeze(AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_5_text", **shape)))


def peaked_logits(depth: int, vocab: int, seed: int) -> torch.Tensor:
    """Per-depth draft logits whose top-1 takes ~70% of the mass and a few runners-up most of the rest."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(depth, vocab, generator=gen)
    top = torch.randint(0, vocab, (depth, 4), generator=gen)
    logits.scatter_(1, top, torch.tensor([12.0, 10.0, 9.5, 9.0]).expand(depth, 4))
    return logits


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = hybrid_target()
    vocab = target.config.vocab_size
    print(f"qwen3_5_text-shaped hybrid, {sum(p.numel() for p in target.parameters()) / 1e6:.0f}M parameters, "
          f"{args.context} cached positions, block {args.block}, {args.threads} thread(s)")
    prefix = TargetCache(target)
    with torch.inference_mode():
        prefix.forward(torch.randint(0, vocab, (1, args.context), generator=torch.Generator().manual_seed(1)))
        prefix.rollback(args.context)
        start = args.context

        def verify(ids):  # on a copy of the prefix cache, which stays as it is
            fork(prefix, ids.shape[0]).forward(ids, position_ids=start + torch.arange(ids.shape[1])[None])

        chain = best_time(lambda: verify(torch.zeros((1, args.block), dtype=torch.long)), args.repeats)
        chain_refeed = best_time(lambda: verify(torch.zeros((1, args.block // 2), dtype=torch.long)), args.repeats)
        print(f"chain verify of {args.block} tokens: {chain * 1e3:.1f} ms; DFlash's refeed after accepting half of "
              f"it (on this target too): {chain_refeed / chain:.2f} of that\n")
        print(f"{'budget':>6} {'leaves':>6} {'depth':>5} {'tokens':>6} {'paths':>7} {'refeed':>7} "
              f"{'paths+refeed':>12} {'flat':>6}   (time over the chain's)")
        for budget in BUDGETS:
            tree = build_tree(peaked_logits(args.block - 1, vocab, budget), budget)
            batch = PathBatch.of(tree, torch.tensor(0), start)
            depth = batch.input_ids.shape[1] - 1
            paths = best_time(lambda: verify(batch.input_ids), args.repeats)
            refeed = best_time(lambda: verify(batch.input_ids[:1, :depth // 2 + 1]), args.repeats)
            flat = best_time(lambda: verify(torch.zeros((1, tree.size + 1), dtype=torch.long)), args.repeats)
            print(f"{budget:>6} {batch.rows:>6} {depth:>5} {batch.input_ids.numel():>6} {paths / chain:>7.2f} "
                  f"{refeed / chain:>7.2f} {(paths + refeed) / chain:>12.2f} {flat / chain:>6.2f}")


if __name__ == "__main__":
    main()
