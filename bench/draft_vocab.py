"""What a draft vocabulary (`drafter.draft_vocab_size` = K) saves, in one run: the training step's
drafter time (forward and backward of `training_step` on fixed target features) and the served draft
step's time (DFlash's chain; DDTree@B's states and tree), each with the LM head cut to K of the
target's words against the whole head.

    python bench/draft_vocab.py [--sizes 4096,8192,16384 --hidden 576 --vocab 49152 --threads 1]

The default shapes are the SmolLM2-135M-Instruct world's (hidden 576, vocabulary 49,152, a 2-layer
drafter, block 16) and its training batch (64 anchors of one 512-token answer: 960 LM-head rows).
The weights are random: the time of a step does not depend on them, nor on which K words are kept.
"""
import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafter.config import ObjectiveConfig  # noqa: E402
from drafter.models import DFlashDraftModel, DraftCache  # noqa: E402
from drafter.models.blocks import DraftingSetup, FeatureBatch  # noqa: E402
from drafter.models.configure import drafter_config  # noqa: E402
from drafter.models.draft_vocab import DraftVocab  # noqa: E402
from drafter.target_model.model import context_features, random_qwen3  # noqa: E402
from drafter.training.objective import training_step  # noqa: E402


def with_draft_vocab(drafter, size: int, vocab_size: int, seed: int):
    """A copy of `drafter` whose head is `size` random words of the target's (None: the whole head)."""
    if size is None:
        return drafter
    config = copy.deepcopy(drafter.config)
    config.draft_vocab_size = size
    cut = DFlashDraftModel(config)
    cut.load_state_dict(drafter.state_dict(), strict=False)
    words = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))[:size].sort().values
    cut.set_draft_vocab(DraftVocab.of(words, vocab_size))
    return cut


def best_ms(steps: dict, repeats: int) -> dict:
    """Best time of each step (a callable returning the ms it timed); the steps take turns within every
    repeat, so that a change of machine load weighs on all of them alike; the first round warms up."""
    best = dict.fromkeys(steps, float("inf"))
    for repeat in range(repeats + 1):
        for name, step in steps.items():
            ms = step()
            if repeat:
                best[name] = min(best[name], ms)
    return best


def training_drafter_step(drafter, target, features, ids, loss_mask, cfg):
    """One training step of the drafter on fixed target features: forward and backward."""
    def step():
        start = time.perf_counter()
        loss, _ = training_step(DraftingSetup(drafter, target, "dense"), FeatureBatch(ids, loss_mask, features), cfg,
                                torch.Generator().manual_seed(0))
        loss.backward()
        ms = (time.perf_counter() - start) * 1e3
        drafter.zero_grad(set_to_none=True)
        return ms
    return step


def served_draft_step(drafter, target, context, block, method: str, budget: int):
    """One draft step after a cached context: DFlash's chain, or DDTree@budget's states and tree."""
    def step():
        cache = DraftCache()
        drafter.draft_hidden(target, context, block, cache)  # the context is in the cache, as in decoding
        start = time.perf_counter()
        if method == "dflash":
            drafter.draft_chain(target, context[:, -1:], block, cache)
        else:
            hidden, logits = drafter.draft_states(target, context[:, -1:], block, cache,
                                                  min(budget, block.shape[1] - 1))
            drafter.block_trees(hidden, logits, block[:, 0], budget)
        return (time.perf_counter() - start) * 1e3
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4096,8192,16384")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--answer", type=int, default=512, help="tokens of the training answer")
    parser.add_argument("--anchors", type=int, default=64)
    parser.add_argument("--context", type=int, default=256, help="cached context of the served step")
    parser.add_argument("--budget", type=int, default=8, help="DDTree's node budget")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--train-repeats", type=int, default=3)
    parser.add_argument("--serve-repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    heads = max(1, args.hidden // 64)
    target = random_qwen3(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=4,
                          num_attention_heads=heads, num_key_value_heads=max(1, heads // 3), head_dim=64,
                          intermediate_size=4 * args.hidden).eval().requires_grad_(False)
    config = drafter_config(target.config, num_layers=args.layers, block_size=args.block, mask_token_id=0)
    torch.manual_seed(0)
    full = DFlashDraftModel(config)
    sizes = [None] + [int(k) for k in args.sizes.split(",")]
    drafters = {k: with_draft_vocab(full, k, args.vocab, seed=1) for k in sizes}
    name = {k: "full" if k is None else f"K={k}" for k in sizes}

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, args.vocab, (1, args.answer), generator=gen)
    loss_mask = torch.ones_like(ids)
    with torch.no_grad():
        features = context_features(target, ids, full.target_layer_ids)
    cfg = ObjectiveConfig(num_anchors=args.anchors, anchors_per_batch=args.anchors, ddtree_budget=32,
                          ddtree_blocks=16)
    for drafter in drafters.values():
        drafter.train()
    train = best_ms({k: training_drafter_step(d, target, features, ids, loss_mask, cfg)
                     for k, d in drafters.items()}, args.train_repeats)

    context = torch.randn(1, args.context, features.shape[-1], generator=gen)
    block = torch.randint(1, args.vocab, (1, args.block), generator=gen)
    block[0, 1:] = 0
    for drafter in drafters.values():
        drafter.eval()
    with torch.no_grad():
        serve = {method: best_ms({k: served_draft_step(d, target, context, block, method, args.budget)
                                    for k, d in drafters.items()}, args.serve_repeats)
                 for method in ("dflash", f"ddtree@{args.budget}")}

    rows = args.anchors * (args.block - 1)
    print(f"hidden {args.hidden}, vocabulary {args.vocab}, {args.layers} drafter layers, block {args.block}, "
          f"{args.threads} thread(s); training: {args.anchors} anchors of a {args.answer}-token answer "
          f"({rows} head rows), forward + backward, best of {args.train_repeats}; served: one draft step after "
          f"a {args.context}-token cached context, best of {args.serve_repeats}")
    methods = list(serve)
    print("| head | training step ms | of full | " + " | ".join(f"{m} draft ms | of full" for m in methods) + " |")
    print("|---|---:|---:|" + "---:|---:|" * len(methods))
    for k in sizes:
        cells = [f"{train[k]:.0f}", f"{train[k] / train[None]:.2f}"]
        cells += [x for m in methods for x in (f"{serve[m][k]:.1f}", f"{serve[m][k] / serve[m][None]:.2f}")]
        print(f"| {name[k]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
