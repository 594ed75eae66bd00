"""The draft step's cost when the LM head runs over only the slots a DDTree of B nodes can use
(`draft_states(depth=min(B, L))`, what `ddtree@B` serves), against the LM head over all L slots, in
the same run. The tree built is the same either way (tests/test_ddtree.py); only time changes.

    python bench/draft_step.py [--hidden 576 --vocab 49152 --layers 2 --block 16 --threads 1]

The default shapes are the SmolLM2-135M-Instruct world's (hidden 576, vocabulary 49,152, a 2-layer
drafter, block 16), where the LM head over 15 slots is most of a CPU draft step.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafter.models import DFlashDraftModel, DraftCache  # noqa: E402
from drafter.models.configure import drafter_config  # noqa: E402
from drafter.target_model.model import random_qwen3  # noqa: E402


def draft_ms(drafter, target, context, block, depths: list, repeats: int) -> list[float]:
    """Best time of one draft step (the context already cached, then the block) at each of `depths`,
    in ms; the settings take turns within every repeat, so that a change of machine load weighs on
    all of them alike."""
    best = [float("inf")] * len(depths)
    for repeat in range(repeats + 1):  # the first round warms up
        for i, depth in enumerate(depths):
            cache = DraftCache()
            drafter.draft_hidden(target, context, block, cache)  # the context is in the cache, as in decoding
            start = time.perf_counter()
            drafter.draft_states(target, context[:, -1:], block, cache, depth)
            if repeat:
                best[i] = min(best[i], (time.perf_counter() - start) * 1e3)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--budgets", default="4,8,16,32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    heads = max(1, args.hidden // 64)
    target = random_qwen3(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=4,
                          num_attention_heads=heads, num_key_value_heads=max(1, heads // 3), head_dim=64,
                          intermediate_size=4 * args.hidden).eval()
    config = drafter_config(target.config, num_layers=args.layers, block_size=args.block, mask_token_id=0)
    drafter = DFlashDraftModel(config).eval()
    features = len(drafter.target_layer_ids) * args.hidden
    gen = torch.Generator().manual_seed(0)
    context = torch.randn(1, args.context, features, generator=gen)
    block = torch.randint(0, args.vocab, (1, args.block), generator=gen)
    slots = args.block - 1
    budgets = [int(b) for b in args.budgets.split(",")]
    whole, *cut = draft_ms(drafter, target, context, block, [None] + [min(b, slots) for b in budgets], args.repeats)
    print(f"draft step, hidden {args.hidden}, vocabulary {args.vocab}, {args.layers} layers, block {args.block}, "
          f"{args.threads} thread(s): LM head over all {slots} slots {whole:.1f} ms")
    print("| method | slots | draft ms | of all slots |\n|---|---:|---:|---:|")
    for budget, ms in zip(budgets, cut):
        print(f"| ddtree@{budget} | {min(budget, slots)} | {ms:.1f} | {ms / whole:.2f} |")

if __name__ == "__main__":
    main()
