"""DDTree on hybrid targets (drafter/serving/path_verify.py): the tree verified as a batch of its
root-to-leaf paths, by the target's own forward on a per-row copy of its cache. Against the target's
own greedy `generate` on a tiny random target of each layer kind, with drafts scripted to be accepted
for 0, 1, some and all of their tokens; each commit branch (cut, refeed, a whole row) seen to run."""
import pytest
import torch

from conftest import make_drafter
from drafter.serving.decode import DecodeSettings, TreeVerifyUnsupported, generate
from drafter.serving.path_verify import PathBatch, fork
from drafter.serving.testing import ReplayDrafter
from drafter.target_model.cache import TargetCache
from drafter.tree.ddtree import build_tree
from families import random_target

PROMPT, NEW, BLOCK = 12, 64, 8
# accepted drafted tokens per step, in turn: none, one, all 7 of the block, some
SCHEDULE = (0, 1, BLOCK - 1, 3, BLOCK - 1, 2, 5)
# one of each layer kind: Gated DeltaNet (+ sliding attention), Mamba-2 (beside attention, in parallel
# with it), short conv (LFM2's over the tree itself, Inkling-2-Loop's as a batch of paths), chunked
# attention, compressors
HYBRIDS = ("qwen3_5_text", "lara_mini", "nemotron_h", "falcon_h1", "lfm2", "inkling2_loop_text", "llama4_text",
           "deepseek_v4")


class ScheduledDrafter(ReplayDrafter):
    """Drafts a known continuation, accepted for SCHEDULE[step] tokens at each step: the true token
    leads each slot up to there; at the next slot a decoy leads and the true token is never in the
    tree. At the second slot of a step a decoy outranks the true token, so the tree branches there
    and the accepted path is not the first row."""

    def __init__(self, drafter, continuation, schedule=SCHEDULE):
        super().__init__(drafter, continuation)
        self.schedule, self.steps = schedule, 0

    def draft_states(self, target, ctx_features, block_ids, cache, depth=None):
        hidden, logits = self.drafter.draft_states(target, ctx_features, block_ids, cache, depth)
        accept = self.schedule[self.steps % len(self.schedule)]
        self.steps += 1
        proposal = torch.zeros_like(logits)
        vocab = logits.shape[-1]
        for k in range(logits.shape[1]):
            position = cache.length + 1 + k
            if position >= len(self.continuation):
                break
            true = self.continuation[position]
            if k < accept:
                proposal[0, k, true] = 10.0
                if k == 1 and accept < BLOCK - 1:
                    proposal[0, k, (true + 1) % vocab] = 10.5
            else:
                proposal[0, k, true], proposal[0, k, (true + 1) % vocab] = -10.0, 10.0
                break
        return hidden, proposal


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request):
    target = random_target(request.param)
    prompt = torch.randint(0, 250, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = target.generate(prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0, PROMPT:]
    return request.param, target, prompt, expected.tolist()


def scheduled(target, prompt, expected, schedule=SCHEDULE):
    return ScheduledDrafter(make_drafter(target, num_layers=1, block_size=BLOCK),
                            prompt[0].tolist() + expected, schedule)


def test_ddtree_on_each_hybrid_layer_kind_is_the_targets_greedy_generate(hybrid):
    """64 new tokens (past conv widths 3-4, windows and chunks of 8, compressors of 4 and 8), each
    step accepting as scheduled: none, one, the whole block, some."""
    name, target, prompt, expected = hybrid
    result = generate(target, prompt, NEW, drafter=scheduled(target, prompt, expected),
                      settings=DecodeSettings("ddtree", 16))
    assert result.output_ids == expected, name
    assert list(result.acceptance_lengths[:len(SCHEDULE)]) == [a + 1 for a in SCHEDULE], name


@pytest.mark.parametrize("family", ["deepseek_v4", "llama4_text", "nemotron_h"])
def test_steps_that_end_on_a_state_boundary(family):
    """From position 12, steps accepting 3, 7, 0, 6 drafted tokens commit up to positions 16, 24, 25
    and 32: at the end of compressor windows (4 and 8 positions), of attention chunks (8) and of
    Mamba-2 scan chunks (8), then one position past one; the rejected drafts ran past each."""
    target = random_target(family)
    prompt = torch.randint(0, 250, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    expected = generate(target, prompt, 24).output_ids
    result = generate(target, prompt, 24, drafter=scheduled(target, prompt, expected, (3, 7, 0, 6)),
                      settings=DecodeSettings("ddtree", 16))
    assert result.output_ids == expected
    assert [PROMPT + sum(result.acceptance_lengths[:i + 1]) for i in range(4)] == [16, 24, 25, 32]


def test_each_commit_runs_where_it_should():
    """Short conv and attention only (Inkling-2-Loop), or chunked attention (Llama 4): the accepted row
    is cut back, never re-run. A recurrent state (Qwen3.5's Gated DeltaNet) after a partial acceptance
    is re-run from the untouched prefix cache (the recompute stage); after whole-block acceptances
    only, the accepted row is the cache as it stands, with no re-run."""
    for name, schedule, recompute in (("inkling2_loop_text", SCHEDULE, False), ("llama4_text", SCHEDULE, False),
                                      ("qwen3_5_text", SCHEDULE, True), ("qwen3_5_text", (BLOCK - 1,), False)):
        assert TargetCache(random_target(name)).tree_form() == "paths"
        target = random_target(name)
        prompt = torch.randint(0, 250, (1, PROMPT), generator=torch.Generator().manual_seed(3))
        expected = generate(target, prompt, 40).output_ids
        result = generate(target, prompt, 40, drafter=scheduled(target, prompt, expected, schedule),
                          settings=DecodeSettings("ddtree", 16))
        assert result.output_ids == expected, name
        assert ("recompute" in result.stage_seconds) == recompute, (name, schedule)


def test_the_path_batch_is_the_trees_root_to_leaf_paths():
    """One row per leaf, in order the root and the nodes down to it, padded after its end; each
    verify row's logits come from a row through it, at its depth."""
    tree = build_tree(torch.randn(4, 6, generator=torch.Generator().manual_seed(0)), 20)
    batch = PathBatch.of(tree, torch.tensor(99), start=30)
    parents = tree.parents.tolist()
    leaves = [i for i in range(tree.size) if i not in parents]
    assert batch.rows == len(leaves) > 1
    for row, leaf in enumerate(leaves):
        path, node = [], leaf
        while node >= 0:
            path.insert(0, node + 1)
            node = parents[node]
        path = [0] + path
        assert batch.tree_rows[row, :len(path)].tolist() == path
        assert (batch.tree_rows[row, len(path):] == path[-1]).all()
        assert batch.input_ids[row, :len(path)].tolist() == [99] + node_paths(tree)[leaf]
        assert batch.lengths[row] == len(path)
    assert (batch.position_ids == 30 + torch.arange(batch.input_ids.shape[1])).all()
    rows = batch.tree_rows[batch.node_row, batch.node_column]
    assert rows.tolist() == list(range(tree.size + 1))  # every verify row read where it sits


@pytest.mark.parametrize("family", ["qwen3_5_text", "lfm2", "llama4_text"])
def test_each_nodes_logits_are_a_causal_forward_over_its_path(family):
    """On a cache of 11 positions (past a chunk of 8), every node's logits read from the path batch
    equal those of one plain forward over the prompt and the node's path."""
    target = random_target(family)
    prompt = torch.randint(0, 250, (1, 12), generator=torch.Generator().manual_seed(7))
    cache = TargetCache(target)
    cache.forward(prompt[:, :-1])
    cache.rollback(11)
    tree = build_tree(torch.randn(4, 256, generator=torch.Generator().manual_seed(8)), 14)
    batch = PathBatch.of(tree, prompt[0, -1], start=11)
    logits = batch.node_logits(fork(cache, batch.rows).forward(batch.input_ids, position_ids=batch.position_ids).logits)
    with torch.no_grad():
        for row, path in enumerate([[]] + node_paths(tree)):
            causal = target(torch.cat([prompt, torch.tensor([path], dtype=torch.long)], dim=1)).logits[0, -1]
            # fp32 order differs between a batch of paths and one sequence; a wrong row moves logits by units
            torch.testing.assert_close(logits[row], causal, rtol=0, atol=1e-3)


def node_paths(tree) -> list[list[int]]:
    """Each node's tokens from depth 1 down to it, from its parents."""
    paths = []
    for token, parent in zip(tree.tokens.tolist(), tree.parents.tolist()):
        paths.append((paths[parent] if parent >= 0 else []) + [token])
    return paths


def test_a_fork_copies_every_state_and_leaves_the_prefix_cache_alone():
    """The forked cache holds each layer's state once per row; a forward on it changes nothing in
    the cache it was forked from."""
    target = random_target("falcon_h1")  # Mamba-2 and attention in one cache layer
    cache = TargetCache(target)
    cache.forward(torch.randint(0, 250, (1, 9), generator=torch.Generator().manual_seed(0)))
    before = [tensor.clone() for tensor in _states(cache)]
    rows = fork(cache, 3)
    assert [t.shape[0] for t in _states(rows)] == [3] * len(before)
    assert all(torch.equal(t, b.expand_as(t)) for t, b in zip(_states(rows), before))
    rows.forward(torch.randint(0, 250, (3, 4), generator=torch.Generator().manual_seed(1)))
    assert all(torch.equal(t, b) for t, b in zip(_states(cache), before)) and cache.length == 9


def _states(cache):
    return [state for layer in cache.cache.layers
            for state in [*layer.conv_states.values(), *layer.recurrent_states.values(), layer.keys, layer.values]]


def test_own_cache_layers_without_their_own_batch_copy_are_refused_by_name(monkeypatch):
    """A model's own cache layer that does not say how to copy its state per row cannot be forked:
    ddtree stops before any work, naming the family and the layer class."""
    from transformers.cache_utils import DynamicSlidingWindowLayer
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4
    for name in ("DeepseekV4HCACache", "DeepseekV4CSACache"):
        monkeypatch.setattr(getattr(v4, name), "reorder_cache", DynamicSlidingWindowLayer.reorder_cache)
    target = random_target("deepseek_v4")
    prompt = torch.zeros((1, 4), dtype=torch.long)
    with pytest.raises(TreeVerifyUnsupported, match=r"deepseek_v4 .*DeepseekV4CSACache, DeepseekV4HCACache"):
        generate(target, prompt, 8, drafter=make_drafter(target), settings=DecodeSettings("ddtree", 4))


@pytest.mark.parametrize("family", ["qwen3_5_text", "lara_mini", "falcon_h1", "lfm2"])
def test_the_memory_plan_counts_the_cache_a_path_batch_copies(family):
    """The measured footprint gives the bytes of a decode cache of 30 positions (past the sliding
    window of 8, whose layers hold 7) and of its copy per row."""
    from drafter.serving.path_memory import _layer_bytes, cache_footprint
    target = random_target(family)
    footprint = cache_footprint(target)
    cache = TargetCache(target)
    cache.forward(torch.randint(0, 250, (1, 30), generator=torch.Generator().manual_seed(0)))
    cache.rollback(30)
    held = lambda c: sum(_layer_bytes(layer) for layer in c.cache.layers)  # noqa: E731
    assert held(cache) == footprint.row_bytes(30)
    assert held(fork(cache, 5)) == 5 * footprint.row_bytes(30)


def test_a_budget_whose_path_batch_cannot_fit_is_refused_by_name():
    """Refused naming the family, the budget and the largest budget that fits, which does fit."""
    from drafter.infra.memory import MemoryPlanError
    from drafter.serving.path_memory import check_path_batch_fits
    target = random_target("qwen3_5_text")
    at_16 = check_path_batch_fits(target, 16, BLOCK, 200, free_bytes=2**40)
    assert at_16.rows == 16 and at_16.tokens == 10 * 8  # the worst tree of 16 nodes: 10 leaves at depth 7
    with pytest.raises(MemoryPlanError, match=r"ddtree@16 on qwen3_5_text .* use a budget of at most (\d+)") as error:
        check_path_batch_fits(target, 16, BLOCK, 200, free_bytes=at_16.total - 1)
    fitting = int(error.value.args[0].rsplit(" ", 1)[1])
    assert fitting < 16 and check_path_batch_fits(target, fitting, BLOCK, 200, at_16.total - 1).total < at_16.total
    with pytest.raises(MemoryPlanError, match="no budget fits"):
        check_path_batch_fits(target, 16, BLOCK, 200, free_bytes=1000)


def test_lfm2s_short_conv_runs_a_tree_in_one_flat_forward():
    """LFM2 verifies a tree as one flat forward (its convs along each row's ancestors, drafter/target_model/
    tree_conv.py; the attention under the tree mask): every node's logits are those of a plain forward
    over its path; the compacted cache (attention keys and conv history) serves the next token exactly."""
    from drafter.tree.ddtree import tree_verify_inputs
    from drafter.target_model.tree_conv import tree_convolution
    target = random_target("lfm2")
    cache = TargetCache(target)
    assert cache.tree_form() == "mask"
    prompt = torch.randint(0, 250, (1, 12), generator=torch.Generator().manual_seed(7))
    cache.forward(prompt[:, :-1])
    cache.rollback(11)
    tree = build_tree(torch.randn(4, 256, generator=torch.Generator().manual_seed(8)), 14)
    input_ids, positions, visible = tree_verify_inputs(tree, prompt[0, -1], 11)
    mask = cache.tree_attention_mask(visible, positions[0] - 11, 11, target.dtype)
    with tree_convolution(target, torch.cat([torch.tensor([-1]), tree.parents + 1])):
        logits = cache.forward(input_ids, position_ids=positions, attention_mask=mask).logits[0]
    paths = node_paths(tree)
    with torch.no_grad():
        for row, path in enumerate([[]] + paths):
            causal = target(torch.cat([prompt, torch.tensor([path], dtype=torch.long)], dim=1)).logits[0, -1]
            torch.testing.assert_close(logits[row], causal, rtol=0, atol=1e-3)
        deepest = max(range(tree.size), key=lambda i: (len(paths[i]), i))
        rows = torch.tensor([0] + [i + 1 for i in range(tree.size) if paths[i] == paths[deepest][:len(paths[i])]])
        assert rows.tolist() != list(range(len(rows)))  # rows really move
        cache.compact(input_ids.shape[1], rows)
        cache.rollback(cache.length)  # as the decode loop does: each conv history back to its kernel
        after = cache.forward(torch.tensor([[5]])).logits[0, -1]
        expected = target(torch.cat([prompt, torch.tensor([paths[deepest] + [5]])], dim=1)).logits[0, -1]
    torch.testing.assert_close(after, expected, rtol=0, atol=1e-3)


def test_on_an_attention_only_target_both_forms_commit_the_same_steps(monkeypatch):
    """The batch of paths and the tree mask, on the same Qwen3 target and drafts: the same tokens and
    the same tokens per step (scheduled acceptances and a random drafter's), and at temperature 0.8
    from the same seed the same samples (each form draws one per verify row, in the same order)."""
    target = random_target("qwen3")
    prompt = torch.randint(0, 250, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    expected = generate(target, prompt, 40).output_ids
    drafter = make_drafter(target, num_layers=1, block_size=BLOCK)

    def both(proposer):  # a fresh proposer per run: the scheduled one counts its steps
        runs = [generate(target, prompt, 40, drafter=proposer(), settings=DecodeSettings("ddtree", 16))]
        with monkeypatch.context() as patched:
            patched.setattr(TargetCache, "tree_form", lambda self: "paths")
            runs.append(generate(target, prompt, 40, drafter=proposer(), settings=DecodeSettings("ddtree", 16)))
        return runs

    for mask, paths in (both(lambda: drafter), both(lambda: scheduled(target, prompt, expected))):
        assert mask.output_ids == paths.output_ids == expected
        assert mask.acceptance_lengths == paths.acceptance_lengths
    assert max(paths.acceptance_lengths) == BLOCK
    sampled = []
    for form in ("mask", "paths"):
        with monkeypatch.context() as patched:
            patched.setattr(TargetCache, "tree_form", lambda self: form)
            torch.manual_seed(0)
            sampled.append(generate(target, prompt, 40, drafter=drafter,
                                    settings=DecodeSettings("ddtree", 16, temperature=0.8)))
    assert sampled[0].output_ids == sampled[1].output_ids != expected
    assert sampled[0].acceptance_lengths == sampled[1].acceptance_lengths
