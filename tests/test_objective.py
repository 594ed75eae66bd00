import math

import numpy as np
import pytest
import torch

from conftest import MASK_ID, VARIANTS, fit_drafter, make_drafter
from drafter.config import ConfigError
from drafter.config import ObjectiveConfig, resolve_gamma
from drafter.pipeline.loader import collate
from drafter.pipeline.sampler import BucketSampler, make_buckets
from drafter.infra.host_sync import HostSyncCounter
from drafter.losses.lm_head import dense_lm_head_loss, top_logprobs, weighted_data_ce
from drafter.losses.weights import position_weights
from drafter.metric_sums import finalize_metrics
from drafter.models import layers
from drafter.models import CandidateSelector, DraftCache, LayerAttention, compiled_graph_count
from drafter.models import blocks as block_module
from drafter.models.blocks import (ATTENTION_KERNELS, DraftingSetup, FeatureBatch, attention_kernel, build_blocks,
                                   dense_block_mask, drafter_hidden, sample_anchors)
from drafter.models.configure import drafter_config
from drafter.models.dflash2 import SelectorRows, selector_loss, selector_metrics
from drafter.target_model.model import context_features, random_qwen3_config
from drafter.training.metrics import ddtree_accept_metric, rank_metrics, sample_complete_blocks
from drafter.training.objective import training_step
from drafter.tree import ddtree
from drafter.tree.ddtree import build_tree, teacher_forced_accept

B = 8


def padded_batch(lengths, seed=0, vocab=250):
    gen = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), T), generator=gen)
    loss_mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        loss_mask[i, 3:n] = 1  # a 3-token "prompt", then supervised response
        ids[i, n:] = 0  # padding
    return ids, loss_mask


def training_logits(drafter, target, features, blocks, attention):
    hidden = drafter_hidden(drafter, target, features, blocks, attention)
    return target.lm_head(hidden)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("attention", ["dense", "flex"])
def test_training_logits_equal_inference_logits(target, attention, variant):
    """docs/design.md contract 2 on a padded batch of sequences of different lengths, several anchors each,
    for every drafter variant (contract 11)."""
    drafter = make_drafter(target, variant=VARIANTS[variant])
    ids, loss_mask = padded_batch([29, 40, 17])
    features = context_features(target, ids, drafter.target_layer_ids)
    anchors, valid = sample_anchors(loss_mask, 5, torch.Generator().manual_seed(3))
    blocks = build_blocks(ids, loss_mask, anchors, valid, B, MASK_ID, gamma=7.0)
    with torch.no_grad():
        train = training_logits(drafter, target, features, blocks, attention)
    checked = 0
    for i in range(ids.shape[0]):
        for a in range(anchors.shape[1]):
            if not valid[i, a]:
                continue
            p = int(anchors[i, a])
            block = torch.tensor([[int(ids[i, p])] + [MASK_ID] * (B - 1)])
            infer = drafter.draft_logits(target, features[i:i + 1, :p], block, DraftCache())
            torch.testing.assert_close(train[i, a, 1:], infer[0], rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked >= 12  # every sequence contributed anchors, including the short one


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("attention", ["dense", "flex"])
def test_features_at_or_after_anchor_have_no_influence(target, attention, variant):
    drafter = make_drafter(target, variant=VARIANTS[variant])
    ids, loss_mask = padded_batch([33, 26], seed=1)
    features = context_features(target, ids, drafter.target_layer_ids)
    anchors, valid = sample_anchors(loss_mask, 4, torch.Generator().manual_seed(0))
    blocks = build_blocks(ids, loss_mask, anchors, valid, B, MASK_ID, gamma=7.0)
    with torch.no_grad():
        base = training_logits(drafter, target, features, blocks, attention)
        p = int(anchors[0, 1])
        perturbed = features.clone()
        perturbed[0, p:] += 5 * torch.randn_like(perturbed[0, p:])
        moved = training_logits(drafter, target, perturbed, blocks, attention)
    torch.testing.assert_close(moved[0, :2], base[0, :2], rtol=0, atol=1e-5)  # anchors <= p
    assert (moved[0, 2:] - base[0, 2:]).abs().max() > 1e-3  # later anchors do see position p
    torch.testing.assert_close(moved[1], base[1], rtol=0, atol=0)  # other sequences untouched


def test_flex_and_dense_paths_agree(drafter, target):
    ids, loss_mask = padded_batch([40, 22], seed=2)
    features = context_features(target, ids, drafter.target_layer_ids)
    anchors, valid = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(1))
    blocks = build_blocks(ids, loss_mask, anchors, valid, B, MASK_ID, gamma=7.0)
    with torch.no_grad():
        dense = training_logits(drafter, target, features, blocks, attention="dense")
        flex = training_logits(drafter, target, features, blocks, attention="flex")
    torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-4)


def test_block_mask_sees_strict_past_and_own_block_only():
    anchors = torch.tensor([[2, 5]])
    mask = dense_block_mask(anchors, seq_len=8, block_size=3)[0, 0]
    # block 0 (anchor 2): context 0..1 visible, 2.. not; own keys 8..10 only
    assert mask[0, :8].tolist() == [True, True] + [False] * 6
    assert mask[4, :8].tolist() == [True] * 5 + [False] * 3
    assert mask[1, 8:].tolist() == [True, True, True, False, False, False]
    assert mask[5, 8:].tolist() == [False, False, False, True, True, True]


def test_block_mask_of_sliding_and_causal_layers():
    """Hand-built cases: a window (3) shorter than the context counts the query and block positions;
    a causal block sees its earlier slots; a bidirectional window (2) cuts later slots too."""
    anchors = torch.tensor([[2, 5]])
    sliding = dense_block_mask(anchors, 8, 3, LayerAttention(window=3, causal=True))[0, 0]
    # block 1 (anchor 5) queries at positions 5, 6, 7: context 3..4, 4, nothing
    assert sliding[3, :8].tolist() == [False] * 3 + [True, True] + [False] * 3
    assert sliding[4, :8].tolist() == [False] * 4 + [True] + [False] * 3
    assert not sliding[5, :8].any()
    assert sliding[3, 11:].tolist() == [True, False, False]
    assert sliding[5, 11:].tolist() == [True, True, True]
    assert sliding[0, :8].tolist() == [True, True] + [False] * 6  # anchor 2: both context positions
    causal = dense_block_mask(anchors, 8, 3, LayerAttention(causal=True))[0, 0]
    assert causal[5, :8].tolist() == [True] * 5 + [False] * 3  # the whole context before the anchor
    assert causal[3:6, 11:].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert not causal[3:6, 8:11].any()
    both_ways = dense_block_mask(anchors, 8, 3, LayerAttention(window=2))[0, 0]
    assert both_ways[3:6, 11:].tolist() == [[True, True, False], [True, True, True], [False, True, True]]
    assert both_ways[3, :8].tolist() == [False] * 4 + [True] + [False] * 3


def test_anchors_are_supervised_distinct_and_redrawn():
    _, loss_mask = padded_batch([30, 12], seed=3)
    loss_mask[0, 10] = 0  # p=9 and p=10 are no longer candidates
    gen = torch.Generator().manual_seed(0)
    anchors, valid = sample_anchors(loss_mask, 100, gen)
    for i in range(2):
        chosen = anchors[i][valid[i]].tolist()
        expected = [p for p in range(loss_mask.shape[1] - 1) if loss_mask[i, p] and loss_mask[i, p + 1]]
        assert chosen == expected  # all candidates, sorted, nothing else
    few, few_valid = sample_anchors(loss_mask, 4, gen)
    again, _ = sample_anchors(loss_mask, 4, gen)
    assert few_valid.all() and few.shape == (2, 4)
    assert not torch.equal(few, again)  # redrawn every call
    same, _ = sample_anchors(loss_mask, 4, torch.Generator().manual_seed(0))
    first, _ = sample_anchors(loss_mask, 4, torch.Generator().manual_seed(0))
    assert torch.equal(same, first)  # seeded
    anchors, valid = sample_anchors(loss_mask, 100, gen, candidates="supervised")
    for i in range(2):  # objective.anchor_candidates=supervised: every supervised position
        assert anchors[i][valid[i]].tolist() == [p for p in range(loss_mask.shape[1]) if loss_mask[i, p]]
    assert 9 in anchors[0].tolist() and 29 in anchors[0].tolist()  # p+1 unsupervised, or past the end


def test_block_slots_past_sequence_or_supervised_span_get_zero_weight():
    ids = torch.arange(12)[None]
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1]])
    anchors, valid = torch.tensor([[2, 9]]), torch.tensor([[True, True]])
    blocks = build_blocks(ids, loss_mask, anchors, valid, 6, MASK_ID, gamma=7.0)
    w = position_weights(6, 7.0)
    # anchor 2: slots 1..3 (pos 3..5) supervised, pos 6 unsupervised ends the span
    assert torch.equal(blocks.weights[0, 0], w * torch.tensor([0, 1, 1, 1, 0, 0.]))
    # anchor 9: pos 10, 11 exist; 12.. run past the sequence
    assert torch.equal(blocks.weights[0, 1], w * torch.tensor([0, 1, 1, 0, 0, 0.]))
    assert blocks.ids[0, 0].tolist() == [2] + [MASK_ID] * 5
    assert blocks.labels[0, 0, :4].tolist() == [2, 3, 4, 5]  # same-position labels
    assert blocks.positions[0, 1].tolist() == list(range(9, 15))


@pytest.mark.parametrize("gamma", [2.0, 10.0])
def test_loss_weights_follow_configured_gamma(drafter, target, gamma):
    """The loss is sum_k w_k CE_k / sum_k w_k with w_k = exp(-(k-1)/gamma) for the configured gamma."""
    ids, loss_mask = padded_batch([40, 40], seed=4)
    features = context_features(target, ids, drafter.target_layer_ids)
    cfg = ObjectiveConfig(num_anchors=6, gamma=gamma)
    loss, _ = training_step(DraftingSetup(drafter, target, "dense"), FeatureBatch(ids, loss_mask, features), cfg,
                            torch.Generator().manual_seed(5))
    anchors, valid = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(5))
    blocks = build_blocks(ids, loss_mask, anchors, valid, B, MASK_ID, gamma=1.0)
    with torch.no_grad():
        logits = training_logits(drafter, target, features, blocks, attention="dense")
    ce = torch.nn.functional.cross_entropy(logits[..., 1:, :].reshape(-1, 256),
                                           blocks.labels[..., 1:].reshape(-1), reduction="none")
    supervised = (blocks.weights[..., 1:] > 0).reshape(-1)  # gamma=1.0 above only marks the slots
    w = torch.exp(-torch.arange(B - 1) / gamma).repeat(ce.numel() // (B - 1)) * supervised
    torch.testing.assert_close(loss.detach(), (w * ce).sum() / w.sum(), rtol=1e-5, atol=1e-6)
    assert position_weights(16, gamma)[2] / position_weights(16, gamma)[1] == pytest.approx(math.exp(-1 / gamma))


@pytest.mark.parametrize("variant", ["full", "dflash2"])
def test_training_step_metrics_are_those_of_its_logits(target, variant):
    """The rank metrics and anchor_ddtree@B from training_step equal those computed from the dense
    logits of the same anchors and sampled blocks (the row layout of the loss and the top-k rows);
    DFlash2's selector metrics are those of the serving chain's picks (`chain_picks`) after the
    text's tokens."""
    drafter = make_drafter(target, variant=VARIANTS[variant])
    if variant == "dflash2":
        with torch.no_grad():  # pair scores as large as the logits' gaps: the selector re-ranks
            drafter.candidate_selector.successor_codebook.mul_(20)
    ids, loss_mask = padded_batch([40, 33, 21], seed=8)
    features = context_features(target, ids, drafter.target_layer_ids)
    cfg = ObjectiveConfig(num_anchors=6, ddtree_budget=12, ddtree_blocks=5)
    with torch.no_grad():
        _, metrics = training_step(DraftingSetup(drafter, target, "dense"), FeatureBatch(ids, loss_mask, features),
                                   cfg, torch.Generator().manual_seed(9))
        gen = torch.Generator().manual_seed(9)
        anchors, valid = sample_anchors(loss_mask, cfg.num_anchors, gen)
        blocks = build_blocks(ids, loss_mask, anchors, valid, B, MASK_ID, gamma=7.0)
        sampled, sampled_valid = sample_complete_blocks(blocks, cfg.ddtree_blocks, gen)
        logits = training_logits(drafter, target, features, blocks, "dense")
    label_logit = logits.gather(-1, blocks.labels[..., None])
    expected = rank_metrics((logits > label_logit).sum(-1), blocks)
    assert expected["top8_acc"][0] > 0  # some labels rank high enough to tell slots apart
    for name, value in expected.items():
        torch.testing.assert_close(metrics[name], value, msg=name)
    assert sampled_valid.all()
    block_logits = logits.view(-1, B, logits.shape[-1])[sampled, 1:]
    committed = teacher_forced_accept(build_tree(block_logits, 12), blocks.labels.view(-1, B)[sampled, 1:])
    torch.testing.assert_close(metrics["anchor_ddtree@12"], torch.tensor([committed.sum().item(), 5.0]))
    if variant == "dflash2":
        with torch.no_grad():
            hidden = drafter_hidden(drafter, target, features, blocks, "dense")[:, :, 1:]
            picks = drafter.chain_picks(hidden, logits[:, :, 1:], blocks.labels[..., :-1])
        labels = blocks.labels[..., 1:]
        in_top = (logits[:, :, 1:].topk(drafter.candidate_selector.top_k).indices == labels[..., None]).any(-1)
        expected = selector_metrics((picks == labels) & in_top, blocks)
        assert 0 < expected["selector_acc"][0] < expected["selector_acc"][1]
        assert (picks != logits[:, :, 1:].argmax(-1)).any()  # the predecessors matter
        for name, value in expected.items():
            torch.testing.assert_close(metrics[name], value, msg=name)
    else:
        assert "selector_acc" not in metrics


def test_default_gamma_by_block_size():
    assert [resolve_gamma(None, b) for b in (16, 10, 8)] == [7.0, 5.0, 4.0]
    assert resolve_gamma(10, 16) == 10.0
    with pytest.raises(ConfigError, match=r"drafter.block_size=12 has no default .* 8, 10, 16\); set objective.gamma"):
        resolve_gamma(None, 12)


def test_chunked_loss_matches_dense_loss_and_gradients():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=gen, requires_grad=True)
    head = torch.randn(300, 16, generator=gen)
    labels = torch.randint(0, 300, (37,), generator=gen)
    weights = torch.rand(37, generator=gen)
    loss, ranks = weighted_data_ce(hidden, head, labels, weights, 8)
    (grad,) = torch.autograd.grad(3 * loss, hidden)
    ref_hidden = hidden.detach().clone().requires_grad_(True)
    ref = dense_lm_head_loss(ref_hidden, head, labels, weights)
    (ref_grad,) = torch.autograd.grad(3 * ref, ref_hidden)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, ref_grad)
    logits = hidden.detach() @ head.T
    assert torch.equal(ranks, (logits > logits.gather(1, labels[:, None])).sum(1))


def test_top_logprobs_are_the_top_of_the_log_softmax():
    gen = torch.Generator().manual_seed(1)
    hidden, head = torch.randn(37, 16, generator=gen), torch.randn(300, 16, generator=gen)
    values, ids = top_logprobs(hidden, head, 5, chunk_rows=8)
    top = (hidden @ head.T).log_softmax(-1).topk(5)
    torch.testing.assert_close(values, top.values)
    assert torch.equal(ids, top.indices)


def test_streak_and_accuracy_metrics_on_known_ranks():
    ids = torch.arange(20)[None]
    loss_mask = torch.ones(1, 20, dtype=torch.long)
    anchors, valid = torch.tensor([[0, 5, 10]]), torch.tensor([[True, True, False]])
    blocks = build_blocks(ids, loss_mask, anchors, valid, 5, MASK_ID, gamma=7.0)
    ranks = torch.tensor([[[0, 0, 0, 5, 0], [0, 3, 0, 0, 9], [0, 0, 0, 0, 0]]])
    m = finalize_metrics(rank_metrics(ranks, blocks))
    assert m["anchor_streak"] == pytest.approx((1 + 2 + 1 + 0) / 2)  # (2 accepted + bonus), (0 + bonus)
    assert m["anchor_top4_streak"] == pytest.approx((1 + 2 + 1 + 3) / 2)
    assert m["anchor_top8_streak"] == pytest.approx((1 + 4 + 1 + 3) / 2)
    assert m["acc"] == pytest.approx(5 / 8)
    assert m["top4_acc"] == pytest.approx(6 / 8) and m["top8_acc"] == pytest.approx(7 / 8)
    assert m["acc_pos"] == pytest.approx([0.5, 1.0, 0.5, 0.5])


def test_training_step_reports_all_metrics_and_learns(target):
    drafter = make_drafter(target, num_layers=1)
    ids, loss_mask = padded_batch([48, 48, 30], seed=6)
    cfg = ObjectiveConfig(num_anchors=8, ddtree_budget=16)
    losses = fit_drafter(drafter, target, ids, loss_mask, cfg, steps=25, lr=3e-3)
    features = context_features(target, ids, drafter.target_layer_ids)
    _, metrics = training_step(DraftingSetup(drafter, target, "dense"), FeatureBatch(ids, loss_mask, features), cfg,
                               torch.Generator().manual_seed(24))
    m = finalize_metrics(metrics)
    for key in ("loss", "acc", "top4_acc", "top8_acc", "anchor_streak", "anchor_top4_streak",
                "anchor_top8_streak", "anchor_ddtree@16"):
        assert math.isfinite(m[key]), key
    assert 1.0 <= m["anchor_streak"] <= m["anchor_top4_streak"] <= m["anchor_top8_streak"] <= B
    assert 1.0 <= m["anchor_ddtree@16"] <= B
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])


def test_attention_setting_selects_the_kernel_by_device():
    assert attention_kernel("auto", "cuda") == "flex_compiled"
    assert attention_kernel("auto", torch.device("cpu")) == "dense"
    assert [attention_kernel(name, "cpu") for name in ATTENTION_KERNELS] == list(ATTENTION_KERNELS)
    with pytest.raises(ValueError, match="objective.attention='flexx'"):
        attention_kernel("flexx", "cuda")


def plan_batches(count: int) -> list[dict]:
    """Padded batches of `count` different shapes (sequences, padded length) in the order a real
    BucketSampler plan gives them; each row: a 3-token prompt, then a supervised response."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.0, 0.6, 400).astype(int), 40, 400)
    sampler = BucketSampler(lengths, make_buckets(lengths, 4, 400), tokens_per_batch=1024)
    batches, shapes = [], set()
    for _, bucket, indices in sampler.batches_for_rank(0):
        rows = [{"input_ids": rng.integers(0, 250, lengths[i]).tolist(),
                 "loss_mask": [0] * 3 + [1] * (lengths[i] - 3)} for i in indices]
        batch = collate(rows, bucket, sampler.max_length)
        if batch["input_ids"].shape not in shapes:
            shapes.add(batch["input_ids"].shape)
            batches.append(batch)
    return batches[:count]


@pytest.mark.slow  # compiles with inductor on the CPU: about a minute
def test_compiled_flex_equals_dense_and_compiles_once_for_all_shapes(target, monkeypatch):
    """The training forward through the compiled path (compiled block mask, compiled
    flex_attention, selected by attention="flex_compiled", not by the device) over 12 batch shapes of
    a real plan gives the dense path's logits and loss, for a drafter with a sliding causal layer and
    a full one (contract 11). Bound: one compilation of the block mask (the layer kinds differ only
    in its key-interval tensors) and one of the kernel (2 graphs) for all batches of two or more
    sequences; a new padded length or anchor count never compiles again. The first batch holds as many sequences as the model has
    key/value heads (duck sizing would bake it in), and some batches have a single 128-query tile
    (the filler blocks keep them out of their own compilation)."""
    calls = {"mask": 0, "kernel": 0}
    for name, module, attribute in (("mask", block_module, "_compiled_create_block_mask"),
                                    ("kernel", layers, "_compiled_flex_attention")):
        def spy(*args, _compiled=getattr(module, attribute), _name=name, **kwargs):
            calls[_name] += 1
            return _compiled(*args, **kwargs)
        monkeypatch.setattr(module, attribute, spy)
    drafter = make_drafter(target, block_size=16, variant=VARIANTS["sliding"])
    cfg = ObjectiveConfig(num_anchors=32, anchors_per_batch=64,
                          ddtree_budget=16)
    batches = plan_batches(12)
    batches.sort(key=lambda batch: len(batch["input_ids"]) != target.config.num_key_value_heads)
    shapes = [(len(b["input_ids"]), b["input_ids"].shape[1]) for b in batches]
    assert len(batches) == 12 and all(n >= 2 for n, _ in shapes)
    start, anchor_counts = compiled_graph_count(), set()
    for i, batch in enumerate(batches):
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        features = context_features(target, ids, drafter.target_layer_ids)
        anchors, valid = sample_anchors(loss_mask, cfg.num_anchors, torch.Generator().manual_seed(i),
                                        cfg.anchors_per_batch)
        anchor_counts.add(anchors.shape[1])
        blocks = build_blocks(ids, loss_mask, anchors, valid, 16, MASK_ID, gamma=7.0)
        with torch.no_grad():
            compiled = training_logits(drafter, target, features, blocks, "flex_compiled")
            dense = training_logits(drafter, target, features, blocks, "dense")
            losses = [training_step(DraftingSetup(drafter, target, attention), FeatureBatch(ids, loss_mask, features),
                                    cfg, torch.Generator().manual_seed(i))[0]
                      for attention in ("flex_compiled", "dense")]
        torch.testing.assert_close(compiled, dense, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
        if i == 0:
            first = compiled_graph_count() - start
            assert first <= 2
        assert compiled_graph_count() - start == first, f"batch {i} {shapes[i]} compiled again"
    assert len({T for _, T in shapes}) >= 10 and len(anchor_counts) >= 4
    assert min(anchor_counts) * 16 <= 128  # a single query tile, padded
    assert calls == {"mask": 2 * 12 * 2, "kernel": 2 * 12 * 2}  # they ran (2 layer kinds, 2 layers)
    assert compiled_graph_count() >= 2  # here or earlier in this process


def test_a_micro_step_waits_on_the_host_once(target, monkeypatch):
    """A micro step's library work (target features, training_step forward and
    backward) makes one host sync, the anchor count (the drafter's input shape). The old code made
    42 here (8 loss chunks): one per chunk, four more in each of the 7 chunks holding sampled
    blocks, three nonzero, the anchor count, the target's packed-sequence check and the tree
    build's first host-to-device copy."""
    monkeypatch.setattr(ddtree, "_compiled_heap", lambda: None)  # the tree backend CUDA uses
    drafter = make_drafter(target).train()
    ids, loss_mask = padded_batch([48, 40, 30], seed=7)
    cfg = ObjectiveConfig(num_anchors=8, ddtree_budget=16,
                          chunk_bytes=4 * 256 * 20)  # 20-row chunks: 8 of them
    with HostSyncCounter() as counter:
        features = context_features(target, ids, drafter.target_layer_ids)
        loss, metrics = training_step(DraftingSetup(drafter, target, "dense"), FeatureBatch(ids, loss_mask, features),
                                      cfg, torch.Generator().manual_seed(0))
        loss.backward()
    assert len(counter.events) == 1, counter.events
    assert counter.events[0].startswith("aten._local_scalar_dense at ")
    assert "drafter/models/blocks.py" in counter.events[0]  # sample_anchors
    assert metrics["anchor_ddtree@16"][1] == cfg.ddtree_blocks  # the metric saw its blocks


def test_sampled_blocks_are_distinct_complete_ones_in_a_fixed_shape():
    ids = torch.arange(40)[None].repeat(2, 1)
    loss_mask = torch.ones(2, 40, dtype=torch.long)
    loss_mask[1, 20:] = 0
    anchors = torch.tensor([[0, 10, 30, 35], [2, 10, 15, 0]])
    valid = torch.tensor([[True, True, True, True], [True, True, True, False]])
    blocks = build_blocks(ids, loss_mask, anchors, valid, 6, MASK_ID, gamma=7.0)
    complete = {0, 1, 2, 4, 5}  # 35 runs past the end, 15 past the supervised span, 0 is a filler
    index, ok = sample_complete_blocks(blocks, 7, torch.Generator().manual_seed(0))
    assert index.shape == ok.shape == (7,) and len(set(index.tolist())) == 7
    assert set(index[ok].tolist()) == complete and not (set(index[~ok].tolist()) & complete)
    chosen = torch.zeros(8)
    for seed in range(300):
        index, ok = sample_complete_blocks(blocks, 2, torch.Generator().manual_seed(seed))
        assert ok.all() and set(index.tolist()) <= complete
        chosen[index] += 1
    torch.testing.assert_close(chosen[sorted(complete)] / 300, torch.full((5,), 2 / 5), rtol=0, atol=0.1)
    # the metric counts valid blocks only
    logprobs = torch.zeros(7, 5, 1)
    ids, labels = torch.zeros(7, 5, 1, dtype=torch.long), torch.zeros(7, 5, dtype=torch.long)
    value = ddtree_accept_metric(logprobs, ids, labels, budget=4, valid=torch.tensor([True] * 3 + [False] * 4))
    assert value.tolist() == [3 * 5.0, 3.0]  # each valid block: 4 accepted + the bonus


def test_label_rank_orders_ties_as_argmax_does():
    """A label tied with the top logit is top-1 only if argmax would return it (the lowest id among
    the tied): ranks count every token that argmax ordering puts first."""
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randint(-2, 3, (40, 4), generator=gen).float()  # small integers: exact ties
    head = torch.randint(-1, 2, (30, 4), generator=gen).float()
    labels = torch.randint(0, 30, (40,), generator=gen)
    _, ranks = weighted_data_ce(hidden, head, labels, torch.ones(40), 7)
    logits = (hidden @ head.T).tolist()
    expected = [sorted(range(30), key=lambda t: (-row[t], t)).index(int(label))
                for row, label in zip(logits, labels)]
    assert ranks.tolist() == expected
    argmax = (hidden @ head.T).argmax(-1)
    assert torch.equal(ranks == 0, argmax == labels)
    assert sum(row.count(max(row)) > 1 for row in logits) > 5  # the case really has ties at the top


def count_prefixes_above(logprobs: list[list[float]], score: float, limit: int) -> int:
    """How many prefixes (any depth) of independent per-depth distributions score above `score`,
    counting up to `limit`: depth-first over each depth's log-probs sorted descending."""
    count = 0

    def walk(depth, partial):
        nonlocal count
        for lp in logprobs[depth]:
            if partial + lp <= score or count >= limit:
                return
            count += 1
            if depth + 1 < len(logprobs):
                walk(depth + 1, partial + lp)

    walk(0, 0.0)
    return count


def independent_ddtree_accept(logits: torch.Tensor, labels: list[int], budget: int) -> int:
    """Tokens a best-`budget` tree commits along `labels`, without building a tree: the label prefix
    of depth d is in the tree iff fewer than `budget` prefixes score higher."""
    logprobs = logits.double().log_softmax(-1)
    ranked = [sorted(row.tolist(), reverse=True) for row in logprobs]
    accepted, score = 0, 0.0
    for depth, label in enumerate(labels):
        score += float(logprobs[depth, label])
        if count_prefixes_above(ranked, score, budget) >= budget:
            break
        accepted += 1
    return accepted + 1


def test_ddtree_accept_on_a_hand_built_case():
    """Per-depth probabilities (ids 10.., 20.., 30.. by depth); budget 4 keeps the prefixes
    a (.6), aa (.3), b (.25), aaa (.21): labels a a a commit 4, b a a commit 2, c a a commit 1."""
    probs = torch.tensor([[0.6, 0.25, 0.15], [0.5, 0.3, 0.2], [0.7, 0.2, 0.1]])
    ids = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    labels = torch.tensor([[10, 20, 30], [11, 20, 30], [12, 20, 30]])
    value = ddtree_accept_metric(probs.log().expand(3, 3, 3), ids.expand(3, 3, 3), labels, budget=4)
    assert value.tolist() == [4 + 2 + 1, 3]
    assert [independent_ddtree_accept(probs.log(), [0, 0, 0], 4),
            independent_ddtree_accept(probs.log(), [1, 0, 0], 4),
            independent_ddtree_accept(probs.log(), [2, 0, 0], 4)] == [4, 2, 1]


def test_training_step_ddtree_accept_is_each_blocks_own_walk(trained):
    """anchor_ddtree@B from the training step equals, block by block, an independent count (no tree
    builder, no top-k rows) over every complete block, so a block paired with another block's labels
    or marginals shows."""
    drafter, target = trained.drafter, trained.target
    ids = trained.sequences
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, trained.prompts.shape[1]:] = 1
    features = context_features(target, ids, drafter.target_layer_ids)
    cfg = ObjectiveConfig(num_anchors=6, ddtree_budget=16,
                          ddtree_blocks=1000)
    with torch.no_grad():
        _, metrics = training_step(DraftingSetup(drafter, target, "dense"), FeatureBatch(ids, loss_mask, features),
                                   cfg, torch.Generator().manual_seed(3))
        anchors, valid = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(3))  # the same draw
        blocks = build_blocks(ids, loss_mask, anchors, valid, 8, MASK_ID, gamma=7.0)
        logits = training_logits(drafter, target, features, blocks, attention="dense")
    complete = (blocks.weights[..., 1:] > 0).all(-1)
    walks = [independent_ddtree_accept(logits[b, a, 1:], blocks.labels[b, a, 1:].tolist(), 16)
             for b, a in complete.nonzero().tolist()]
    assert len(set(walks)) > 3  # blocks differ, so a mispairing changes the sum
    assert metrics["anchor_ddtree@16"].tolist() == [sum(walks), len(walks)]


def test_selector_loss_on_a_hand_built_case():
    """DFlash2's K-way cross entropy (K = 3) on two rows with logits [3, 2, 1, 0, -1, -2]: gold 1 is
    among the top 3, gold 4 is not and replaces the third candidate. With pair terms of +10 for
    token 1 and +20 for token 4 the selector picks both golds, but the inserted one counts as a
    miss (serving never has it)."""
    vocab = 6
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0, -2.0])
    hidden = torch.cat([logits.expand(2, -1), torch.ones(2, 1)], 1)  # the last channel feeds the selector
    head = torch.cat([torch.eye(vocab), torch.zeros(vocab, 1)], 1)
    rows = SelectorRows(hidden, predecessors=torch.tensor([5, 5]), labels=torch.tensor([1, 4]),
                        weights=torch.tensor([1.0, 3.0]))
    config = drafter_config(random_qwen3_config(vocab_size=vocab, hidden_size=vocab + 1, num_hidden_layers=2,
                                                num_attention_heads=1, num_key_value_heads=1, head_dim=8),
                            num_layers=1, block_size=4, mask_token_id=0, target_layer_ids=[0])
    selector = CandidateSelector(config, rank=1, top_k=3)
    with torch.no_grad():
        selector.hidden_projection.weight.copy_(torch.eye(vocab + 1)[-1:])
        selector.predecessor_codebook.fill_(1.0)
        selector.successor_codebook.zero_()
    lse = lambda *x: torch.logsumexp(torch.tensor(x), 0)  # noqa: E731
    loss, hit = selector_loss(selector, rows, head, chunk_rows=1)
    expected = ((lse(3.0, 2.0, 1.0) - 2.0) + 3 * (lse(3.0, 2.0, -1.0) + 1.0)) / 4
    torch.testing.assert_close(loss, expected)
    assert hit.tolist() == [False, False]  # the top candidate, 0, is picked
    with torch.no_grad():
        selector.successor_codebook[1] = 10.0
        selector.successor_codebook[4] = 20.0
    loss, hit = selector_loss(selector, rows, head, chunk_rows=1)
    expected = ((lse(3.0, 12.0, 1.0) - 12.0) + 3 * (lse(3.0, 12.0, 19.0) - 19.0)) / 4
    torch.testing.assert_close(loss, expected)
    assert hit.tolist() == [True, False]
