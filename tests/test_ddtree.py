import itertools
import sys
from pathlib import Path

import pytest
import torch

from bench.tree_build import heapq_tree, topk_logprobs, trees_equal
from conftest import make_drafter
from drafter.serving.decode import DecodeSettings, generate, speculative_sample
from drafter.serving.testing import ReplayDrafter
from drafter.target_model.cache import TargetCache
from drafter.target_model.model import feature_tap
from drafter.tree import ddtree
from drafter.tree.ddtree import (build_tree, build_tree_from_logprobs, committed_tokens,
                                 compiled_backend_available, fixed_point, follow_tree, teacher_forced_accept,
                                 tree_verify_inputs, tree_visibility)
from families import random_target

BACKENDS = [pytest.param("compiled", marks=pytest.mark.skipif(
                not compiled_backend_available(), reason="no working C compiler: the compiled DDTree "
                "backend cannot be built here (set CC)")),
            "tensor"]


def random_logits(gen, depth, vocab, kind):
    if kind == "normal":
        return torch.randn(depth, vocab, generator=gen) * 2
    if kind == "tied":  # few distinct values: ties within and across depths
        return torch.randint(0, 3, (depth, vocab), generator=gen).float()
    # log-probs of exactly 0 (probability 1 in fp32): a child ties with its parent
    return torch.randint(0, 2, (depth, vocab), generator=gen).float() * 200


# ---------------------------------------------------------------------------------------------
# Tree build
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_build_equals_heapq_reference(backend):
    gen = torch.Generator().manual_seed(0)
    for case in range(150):
        depth, vocab, budget = (int(torch.randint(1, high, (1,), generator=gen)) for high in (7, 12, 80))
        logits = random_logits(gen, depth, vocab, ("normal", "tied", "peaked")[case % 3])
        logprobs, ids = topk_logprobs(logits, budget)
        reference = heapq_tree(logprobs, ids, budget)
        assert trees_equal(build_tree(logits, budget, backend), reference), (case, depth, vocab, budget)


def all_prefixes_ranked(logits):
    """Every token prefix (depth 1..L) sorted best first: score, then lexicographic token ranks."""
    logprobs, ids = topk_logprobs(logits, logits.shape[1])
    scores = fixed_point(logprobs).tolist()
    prefixes = []
    for depth in range(1, logits.shape[0] + 1):
        for ranks in itertools.product(range(logits.shape[1]), repeat=depth):
            score = sum(scores[d][r] for d, r in enumerate(ranks))
            prefixes.append((-score, ranks, tuple(int(ids[d, r]) for d, r in enumerate(ranks))))
    return [tokens for _, _, tokens in sorted(prefixes)]


def node_prefixes(tree):
    prefixes = []
    for i in range(tree.size):
        parent = int(tree.parents[i])
        prefixes.append((prefixes[parent] if parent >= 0 else ()) + (int(tree.tokens[i]),))
    return prefixes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["normal", "tied"])
def test_tree_is_the_best_prefixes_in_pop_order(backend, kind):
    """Against brute force over all prefixes (no heap): the N best, best first; parents first."""
    gen = torch.Generator().manual_seed(1)
    for budget in (1, 5, 17, 40):
        logits = random_logits(gen, 3, 4, kind)
        tree = build_tree(logits, budget, backend)
        assert node_prefixes(tree) == all_prefixes_ranked(logits)[:budget]
        parents = tree.parents.tolist()
        assert all(p < i for i, p in enumerate(parents))
        assert all(d == (1 if p < 0 else tree.depths[p] + 1) for d, p in zip(tree.depths.tolist(), parents))


@pytest.mark.parametrize("backend", BACKENDS)
def test_budget_beyond_all_prefixes_keeps_them_all(backend):
    logits = torch.randn(2, 3, generator=torch.Generator().manual_seed(2))
    tree = build_tree(logits, 20, backend)
    assert tree.size == 3 + 9
    assert sorted(node_prefixes(tree)) == sorted(all_prefixes_ranked(logits))


@pytest.mark.parametrize("backend", BACKENDS)
def test_budget_one_is_the_top_token(backend):
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(3))
    tree = build_tree(logits, 1, backend)
    assert tree.tokens.tolist() == [int(logits[0].argmax())]
    assert tree.parents.tolist() == [-1] and tree.depths.tolist() == [1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_build_equals_one_block_at_a_time(backend):
    gen = torch.Generator().manual_seed(4)
    logits = torch.stack([random_logits(gen, 4, 9, "tied") for _ in range(6)])
    logprobs, ids = topk_logprobs(logits, 30)
    batched = build_tree_from_logprobs(logprobs, ids, 30, backend)
    for block in range(6):
        single = build_tree(logits[block], 30, backend)
        assert torch.equal(batched.tokens[block], single.tokens)
        assert torch.equal(batched.parents[block], single.parents)


def test_teacher_forced_accept_walks_the_labels():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(8, 5, 6, generator=gen)
    labels = torch.stack([logits[b].argmax(-1) for b in range(8)])
    labels[::2, 2] = (labels[::2, 2] + 1) % 6       # a miss at depth 3 in half of the blocks
    labels[1, 0] = -100                             # an ignore index never matches
    logprobs, ids = topk_logprobs(logits, 12)
    tree = build_tree_from_logprobs(logprobs, ids, 12)
    accepted = teacher_forced_accept(tree, labels)
    for b in range(8):
        prefixes = set(node_prefixes(build_tree(logits[b], 12)))
        expected = 0
        while expected < 5 and tuple(labels[b, :expected + 1].tolist()) in prefixes:
            expected += 1
        assert int(accepted[b]) == expected + 1


def test_compiled_backend_is_the_installed_extension_and_pops_in_heap_order():
    """The heap `pip install -e .` built is what `auto` uses on the CPU, and it gives the reference's
    heapq tree, ties included (a heap that pops out of order fails here)."""
    if not compiled_backend_available():
        pytest.skip("the extension drafter.tree._tree_heap is not built here (a checkout without `pip install -e .`)")
    from drafter.tree import _tree_heap
    assert Path(_tree_heap.__file__).parent == Path(ddtree.__file__).parent
    generator = torch.Generator().manual_seed(3)
    for logits in (torch.randn(6, 11, generator=generator), torch.zeros(6, 5), torch.randn(16, 40, generator=generator)):
        for budget in (1, 7, 32):
            reference = heapq_tree(*topk_logprobs(logits, budget), budget)
            assert trees_equal(build_tree(logits, budget, "compiled"), reference)
            assert trees_equal(build_tree(logits, budget, "auto"), reference)


def test_without_the_extension_trees_fall_back_to_the_tensor_backend(monkeypatch):
    monkeypatch.setitem(sys.modules, "drafter.tree._tree_heap", None)  # `import` raises ImportError
    ddtree._compiled_heap.cache_clear()
    try:
        with pytest.warns(UserWarning, match="compiled heap is not built"):
            assert not compiled_backend_available()
        logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(12))
        assert trees_equal(build_tree(logits, 20), heapq_tree(*topk_logprobs(logits, 20), 20))
        with pytest.raises(RuntimeError, match="compiled DDTree backend is not built"):
            build_tree(logits, 20, "compiled")
    finally:
        ddtree._compiled_heap.cache_clear()


# ---------------------------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------------------------

def test_visibility_is_ancestors_and_self():
    tree = build_tree(torch.randn(4, 5, generator=torch.Generator().manual_seed(6)), 25)
    visible = tree_visibility(tree)
    for row in range(tree.size + 1):
        expected, node = {0, row}, row - 1
        while node >= 0:
            expected.add(node + 1)
            node = int(tree.parents[node])
        assert set(visible[row].nonzero().view(-1).tolist()) == expected


@pytest.mark.parametrize("family", ["qwen3", "mistral", "gpt_oss"])
def test_tree_forward_matches_causal_forward_and_compaction(family):
    """Each node's logits equal a plain causal forward over its path; the compacted cache and the
    path features equal those of a causal forward over the accepted path. The sliding-window
    families (window 8, a context of 11) check the tree mask over a window-only cache."""
    target = random_target(family)
    layer_ids = [1, 4]
    prompt = torch.randint(0, 250, (1, 12), generator=torch.Generator().manual_seed(7))
    cache = TargetCache(target)
    cache.forward(prompt[:, :-1])
    cache.rollback(prompt.shape[1] - 1)  # a sliding layer keeps only its window from here on
    start, root = prompt.shape[1] - 1, prompt[0, -1]
    tree = build_tree(torch.randn(3, 256, generator=torch.Generator().manual_seed(8)), 12)
    input_ids, positions, visible = tree_verify_inputs(tree, root, start)
    mask = cache.tree_attention_mask(visible, positions[0] - start, start, target.dtype)
    with feature_tap(target, layer_ids) as tap:
        out = cache.forward(input_ids, position_ids=positions, attention_mask=mask)
        features = tap.features()
    paths = node_prefixes(tree)
    for node in range(tree.size):
        causal = target(torch.cat([prompt, torch.tensor([paths[node]])], dim=1)).logits[0, -1]
        torch.testing.assert_close(out.logits[0, node + 1], causal, rtol=0, atol=1e-4)

    deepest = max(range(tree.size), key=lambda i: (len(paths[i]), i))  # the last one popped
    rows = [0] + [i + 1 for i in range(tree.size) if paths[i] == paths[deepest][:len(paths[i])]]
    rows = torch.tensor(rows)
    assert rows.tolist() != list(range(len(rows)))  # rows really move
    cache.compact(input_ids.shape[1], rows)
    accepted = torch.cat([prompt, torch.tensor([paths[deepest]])], dim=1)
    assert cache.length == start + len(rows)
    with feature_tap(target, layer_ids) as tap:  # the compacted cache serves the next forward exactly
        after = cache.forward(torch.tensor([[5]])).logits[0, -1]
        target(accepted)
        # fp32 order differs between the tree forward and the causal one: up to 2.1e-4 on one of 256
        # mistral values on an AVX-512 CPU; a wrong mask or row moves features by tenths
        torch.testing.assert_close(features.index_select(1, rows), tap.features()[:, start:], rtol=1e-4, atol=5e-4)
    expected = target(torch.cat([accepted, torch.tensor([[5]])], dim=1)).logits[0, -1]
    torch.testing.assert_close(after, expected, rtol=0, atol=1e-4)


def test_follow_tree_stops_at_first_missing_child():
    tree = build_tree(torch.randn(3, 4, generator=torch.Generator().manual_seed(9)), 10)
    paths = node_prefixes(tree)
    deepest = max(range(tree.size), key=lambda i: len(paths[i]))
    picks = torch.full((tree.size + 1,), 99)  # 99 is no node's token: every walk ends there
    picks[0] = paths[deepest][0]
    for i in range(tree.size):
        if paths[i] == paths[deepest][:len(paths[i])] and len(paths[i]) < len(paths[deepest]):
            picks[i + 1] = paths[deepest][len(paths[i])]
    padded, accepted = follow_tree(tree, picks)
    path = padded[:int(accepted) + 1]
    assert [paths[r - 1] for r in path[1:].tolist()] == [paths[deepest][:d] for d in
                                                         range(1, len(paths[deepest]) + 1)]
    assert padded.shape == (tree.depth_limit + 1,)  # static: the walk needs no host sync
    assert (padded[len(path):] == path[-1]).all() and int(picks[padded[-1]]) == 99
    input_ids, _, _ = tree_verify_inputs(tree, torch.tensor(7), 0)
    tokens, rows = committed_tokens(input_ids[0], picks, padded, accepted)
    assert tokens == list(paths[deepest]) + [99] and torch.equal(rows, path)


# ---------------------------------------------------------------------------------------------
# Generation: losslessness and agreement with the public loop
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 250, (1, 10), generator=torch.Generator().manual_seed(10))


def run(target, prompt, method, drafter=None, budget=None, max_new=30, stops=(), temperature=0.0):
    return generate(target, prompt, max_new, stops, drafter=drafter,
                    settings=DecodeSettings(method, budget, temperature=temperature))


def test_greedy_methods_are_lossless_and_trees_accept_more(target, prompt):
    drafter = make_drafter(target)
    reference = run(target, prompt, "ar", max_new=48)
    oracle = ReplayDrafter(drafter, prompt[0].tolist() + reference.output_ids)
    assert reference.acceptance_lengths == [1] * 47
    taus = {}
    for method, budget, proposers in [("dflash", None, (drafter, oracle)), ("ddtree", 1, (oracle,)),
                                      ("ddtree", 4, (oracle,)), ("ddtree", 32, (drafter, oracle))]:
        for proposer in proposers:
            result = run(target, prompt, method, proposer, budget, max_new=48)
            assert result.output_ids == reference.output_ids, (method, budget)
            assert sum(result.acceptance_lengths) + 1 == 48
        taus[method, budget] = 47 / len(result.acceptance_lengths)
    assert taus["ddtree", 1] <= 2 < taus["dflash", None] < taus["ddtree", 32]


def step_ends(result) -> set[int]:
    """Output indices of each step's last committed token (index 0 is the prefill's token)."""
    return set(itertools.accumulate(result.acceptance_lengths))


def test_stop_and_max_new_tokens_inside_an_accepted_block(target, prompt):
    drafter = make_drafter(target)
    reference = run(target, prompt, "ar", max_new=40)
    oracle = ReplayDrafter(drafter, prompt[0].tolist() + reference.output_ids)
    speculative = [("dflash", None), ("ddtree", 8)]
    ends = set.union(*(step_ends(run(target, prompt, m, oracle, b, max_new=40)) for m, b in speculative))
    first_seen = {}
    for i, token in enumerate(reference.output_ids):
        first_seen.setdefault(token, i)
    # a stop token, and a last token, that both methods would have committed mid-step
    stop = next(t for t, i in first_seen.items() if i >= 4 and i not in ends)
    max_new = next(n for n in range(20, 40) if n - 1 not in ends)
    expected = reference.output_ids[:first_seen[stop] + 1]
    for method, budget in [("ar", None)] + speculative:
        stopped = run(target, prompt, method, oracle, budget, max_new=40, stops=[stop])
        assert stopped.output_ids == expected, method
        assert sum(stopped.acceptance_lengths) + 1 == len(expected)
        truncated = run(target, prompt, method, oracle, budget, max_new=max_new)
        assert truncated.output_ids == reference.output_ids[:max_new], method
        assert sum(truncated.acceptance_lengths) + 1 == max_new


def test_speculative_sampling_keeps_the_target_distribution():
    gen = torch.Generator().manual_seed(11)
    target_probs = torch.softmax(torch.randn(2, 4, generator=gen) * 2, -1)
    draft_probs = torch.softmax(torch.randn(1, 4, generator=gen) * 2, -1)
    torch.manual_seed(0)
    trials, counts = 10000, torch.zeros(4)
    drafts = torch.multinomial(draft_probs[0], trials, replacement=True)
    for draft in drafts:
        accepted, bonus = speculative_sample(draft.view(1), target_probs, draft_probs)
        counts[int(draft) if accepted else bonus] += 1
    torch.testing.assert_close(counts / trials, target_probs[0], rtol=0, atol=0.02)


def test_the_conditional_tree_is_the_best_b_prefixes_by_enumeration():
    """build_conditional_tree (a DFlash2 selector's tree), against every prefix of a first-order
    tree scored and ranked by hand: its nodes are the best B prefixes, each node's parent is its
    prefix, nodes come in score order, and a walk along labels accepts while the label prefix is in."""
    from drafter.tree.ddtree import build_conditional_tree
    gen = torch.Generator().manual_seed(3)
    n, depth, k = 48, 3, 3
    candidates = torch.stack([torch.randperm(10, generator=gen)[:k].repeat(depth, 1) + 10 * torch.arange(depth)[:, None]
                              for _ in range(n)])                     # distinct ids per slot
    first = torch.randn(n, k, generator=gen).log_softmax(-1)
    later = torch.randn(n, depth - 1, k, k, generator=gen).log_softmax(-1)
    path = torch.randint(0, k, (n, depth), generator=gen)             # labels along a candidate path ...
    labels = candidates.gather(2, path[..., None])[..., 0]
    off = torch.randint(0, depth + 1, (n,), generator=gen)
    labels[torch.arange(depth)[None] >= off[:, None]] = 999           # ... that may leave the candidates
    for budget in (1, 4, 7, 39):
        tree = build_conditional_tree(first, later, candidates, budget)
        accepted = teacher_forced_accept(tree, labels) - 1
        for i in range(n):
            scores = {}
            for d in range(1, depth + 1):
                for ranks in itertools.product(range(k), repeat=d):
                    scores[ranks] = float(first[i, ranks[0]] + sum(later[i, j - 1, ranks[j - 1], ranks[j]]
                                                                   for j in range(1, d)))
            best = sorted(scores, key=scores.get, reverse=True)[:budget]
            prefixes = []  # each node's token prefix, from its parent chain
            for token, parent in zip(tree.tokens[i].tolist(), tree.parents[i].tolist()):
                prefixes.append((prefixes[parent] if parent >= 0 else ()) + (token,))
            by_tokens = {tuple(int(candidates[i, d, r]) for d, r in enumerate(ranks)): ranks for ranks in best}
            assert set(prefixes) == set(by_tokens), (budget, i)
            node_scores = [scores[by_tokens[p]] for p in prefixes]
            assert node_scores == sorted(node_scores, reverse=True), (budget, i)   # pop order
            assert tree.depths[i].tolist() == [len(p) for p in prefixes]
            deepest = 0
            for d in range(1, int(off[i]) + 1):
                if tuple(path[i, :d].tolist()) not in best:
                    break
                deepest = d
            assert int(accepted[i]) == deepest, (budget, i)


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
@pytest.mark.parametrize("kind", ["normal", "tied"])
def test_a_budget_b_tree_needs_only_the_first_b_slots(target, arch, kind):
    """ddtree@B drafts the LM head over min(B, L) slots only (`draft_states(depth=)`): no node of a
    B-node tree is deeper than B, and the tree the drafter builds from those slots is the one all L
    give, node for node (tokens, parents, depths, pop order), for DFlash's marginal tree (both
    backends) and DFlash2's selector tree, with logits tied on purpose too."""
    from conftest import VARIANTS
    drafter = make_drafter(target, block_size=8, variant=VARIANTS["dflash2"] if arch == "dflash2" else
                           VARIANTS["full"])
    gen = torch.Generator().manual_seed(5)
    blocks, slots = 24, drafter.block_size - 1
    hidden = torch.randn(blocks, slots, target.config.hidden_size, generator=gen)
    logits = torch.randn(blocks, slots, target.config.vocab_size, generator=gen) * 3
    if kind == "tied":
        logits = logits.round()  # many exact ties between tokens, slots and prefixes
    roots = torch.randint(0, 250, (blocks,), generator=gen)
    backends = (["tensor"] + ["compiled"] * compiled_backend_available()) if arch == "dflash" else ["auto"]
    for budget in (1, 2, 3, 5, 6, 7, 9):
        depth = min(budget, slots)
        for backend in backends:
            whole = drafter.block_trees(hidden, logits, roots, budget, backend)
            cut = drafter.block_trees(hidden[:, :depth], logits[:, :depth], roots, budget, backend)
            assert trees_equal(whole, cut), (arch, kind, budget, backend)
            assert int(whole.depths.max()) <= depth


def test_ddtree_decodes_the_same_with_the_lm_head_over_fewer_slots(trained, monkeypatch):
    """The served ddtree@B with the LM head cut to B slots commits the same tokens, step for step, as
    with the LM head over every slot (the drafter asked for all of them). The drafter is a trained one,
    so that its trees reach their full depth."""
    from drafter.models import DFlashDraftModel

    def decode(budget):
        return [generate(trained.target, p[None], 24, drafter=trained.drafter,
                         settings=DecodeSettings("ddtree", budget))
                for p in trained.prompts[:3]]

    cut = {budget: decode(budget) for budget in (2, 3)}
    whole_states = DFlashDraftModel.draft_states
    monkeypatch.setattr(DFlashDraftModel, "draft_states",
                        lambda self, t, c, b, cache, depth=None: whole_states(self, t, c, b, cache))
    for budget, runs in cut.items():
        whole = decode(budget)
        assert [r.output_ids for r in runs] == [r.output_ids for r in whole]
        assert [r.acceptance_lengths for r in runs] == [r.acceptance_lengths for r in whole]
        assert max(max(r.acceptance_lengths) for r in runs) == budget + 1  # trees accepted to full depth
