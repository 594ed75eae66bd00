"""DDTree tree build: our builder against a straightforward heapq version on the same logits.

    python bench/tree_build.py [--depth 15] [--budgets 16,...,1024] [--vocabs 4096,32768] [--device cpu]
                               [--min-run-time 0.1]

Both start from the same draft logits [L, V]. `topk` is the shared first step (top-k and
log-softmax normaliser, the same call in both); `heapq` is the reference's best-first search in
Python on the CPU; `ours` is `build_tree` after that step (compiled heap on the CPU, tensor ops with
--backend tensor or on CUDA). The ratio is heapq / ours for the search; `end-to-end` includes topk
on both sides. Each time is the best block of calls over about --min-run-time seconds after a warm-up
(drafter/infra/timing.py; CUDA synchronised around each block). Each row also checks that the two
trees are equal.
"""
import argparse
import heapq

import torch

from drafter.infra.timing import best_time
from drafter.tree.ddtree import DraftTree, build_tree_from_logprobs, fixed_point


def topk_logprobs(draft_logits: torch.Tensor, budget: int):
    """Each depth's top-min(budget, V) log-probs and token ids, as the reference computes them."""
    logits = draft_logits.float()
    top_logits, top_ids = logits.topk(min(budget, logits.shape[-1]), dim=-1)
    return top_logits - logits.logsumexp(-1, keepdim=True), top_ids


def heapq_tree(logprobs: torch.Tensor, token_ids: torch.Tensor, budget: int) -> DraftTree:
    """The reference best-first search with Python's heapq on one block's top-k [L, K] log-probs.

    Heap entries are (-score, rank tuple, ...): ties pop the lexicographically smaller rank tuple.
    """
    scores = fixed_point(logprobs[:, :budget]).tolist()
    ids = token_ids.tolist()
    depth_limit, k = len(scores), len(scores[0])
    heap = [(-scores[0][0], (0,), 0, -1)]  # (-score, ranks, parent score, parent node)
    tokens, parents, depths = [], [], []
    while heap and len(tokens) < budget:
        negative_score, ranks, parent_score, parent = heapq.heappop(heap)
        depth, rank = len(ranks), ranks[-1]
        node = len(tokens)
        tokens.append(ids[depth - 1][rank])
        parents.append(parent)
        depths.append(depth)
        if rank + 1 < k:
            sibling = parent_score + scores[depth - 1][rank + 1]
            heapq.heappush(heap, (-sibling, ranks[:-1] + (rank + 1,), parent_score, parent))
        if depth < depth_limit:
            child = -negative_score + scores[depth][0]
            heapq.heappush(heap, (-child, ranks + (0,), -negative_score, node))
    as_tensor = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return DraftTree(as_tensor(tokens), as_tensor(parents), as_tensor(depths), depth_limit)


def trees_equal(a: DraftTree, b: DraftTree) -> bool:
    return all(torch.equal(x.cpu(), y.cpu()) for x, y in
               ((a.tokens, b.tokens), (a.parents, b.parents), (a.depths, b.depths)))


def best_ms(fn, min_run_time: float) -> float:
    return best_time(fn, min_run_time) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=int, default=15, help="drafted positions per block (B - 1)")
    parser.add_argument("--budgets", default="16,32,64,128,256,512,1024")
    parser.add_argument("--vocabs", default="4096,32768")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="auto", choices=["auto", "compiled", "tensor"])
    parser.add_argument("--min-run-time", type=float, default=0.1, help="seconds of timed calls per measure")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)

    print(f"L={args.depth}, device={device}, backend={args.backend}, best of {args.min_run_time} s of calls, ms")
    print("| budget | vocab | topk | heapq | ours | ratio | end-to-end | equal |")
    print("|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for vocab in map(int, args.vocabs.split(",")):
        for budget in map(int, args.budgets.split(",")):
            logits = (torch.randn(args.depth, vocab, generator=generator) * 3).to(device)
            logprobs, ids = topk_logprobs(logits, budget)
            cpu_logprobs, cpu_ids = logprobs.cpu(), ids.cpu()
            ours = build_tree_from_logprobs(logprobs, ids, budget, args.backend)
            equal = trees_equal(ours, heapq_tree(cpu_logprobs, cpu_ids, budget))
            topk_ms = best_ms(lambda: topk_logprobs(logits, budget), args.min_run_time)
            # the reference copies the top-k to the host and walks the heap there
            heapq_ms = best_ms(lambda: heapq_tree(logprobs.cpu(), ids.cpu(), budget), args.min_run_time)
            ours_ms = best_ms(lambda: build_tree_from_logprobs(logprobs, ids, budget, args.backend),
                              args.min_run_time)
            print(f"| {budget} | {vocab} | {topk_ms:.3f} | {heapq_ms:.3f} | {ours_ms:.3f} "
                  f"| {heapq_ms / ours_ms:.1f}x | {(topk_ms + heapq_ms) / (topk_ms + ours_ms):.1f}x "
                  f"| {'yes' if equal else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
