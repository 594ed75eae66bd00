"""Objectives beyond data CE (drafter/losses/): distillation labels and loss, D-PACE and tree-aware
position weights, each against an independent computation (the target's own full logits, weights by
hand, a hand-built tree)."""
import copy
import math
import re

import pytest
import torch
import torch.nn.functional as F

from conftest import MASK_ID, make_drafter
from drafter.config import ConfigError
from drafter.config import ObjectiveConfig
from drafter.losses.acceptance import chain_acceptance, soft_tree_acceptance, tree_threshold
from drafter.losses.divergences import teacher_rows
from drafter.losses.lm_head import ChunkedLMHeadLoss, RowLossSpec, dense_row_loss, logit_softcap
from drafter.losses.weights import dpace_weights, tree_accepted_depth, tree_weights, up_to_first_failure
from drafter.models.blocks import DraftingSetup, FeatureBatch, build_blocks, drafter_hidden, sample_anchors
from drafter.target_model.model import context_features, features_and_final_hidden, random_qwen3
from drafter.training.objective import training_step
from drafter.training.run_config import load_config
from runs import REPO
from test_objective import padded_batch

B = 8


def test_final_hidden_is_what_the_lm_head_reads_and_features_are_context_features(target):
    ids, _ = padded_batch([20, 13])
    layer_ids = [1, 3]
    features, final = features_and_final_hidden(target, ids, layer_ids)
    torch.testing.assert_close(features, context_features(target, ids, layer_ids), rtol=0, atol=1e-6)
    with torch.no_grad():
        logits = target(ids).logits
    torch.testing.assert_close(target.lm_head(final), logits, rtol=1e-5, atol=1e-5)


def reference_rows(target, drafter, ids, loss_mask, cfg, seed):
    """The full-logits reference: drafter logits [b, A, B, V] of the step's blocks, and the target's own
    logits from its forward, read at p+k-1 for slot k."""
    anchors, valid = sample_anchors(loss_mask, cfg.num_anchors, torch.Generator().manual_seed(seed))
    blocks = build_blocks(ids, loss_mask, anchors, valid, B, MASK_ID, gamma=10.0)
    features = context_features(target, ids, drafter.target_layer_ids)
    drafter_logits = target.lm_head(drafter_hidden(drafter, target, features, blocks, "dense"))
    with torch.no_grad():
        target_logits = target(ids).logits
    T = ids.shape[1]
    at = (blocks.positions[..., 1:] - 1).clamp(max=T - 1)  # slot k >= 1 <- position p+k-1
    teacher = torch.stack([target_logits[i, at[i]] for i in range(ids.shape[0])])
    return blocks, drafter_logits[..., 1:, :], teacher


@pytest.mark.parametrize("loss", ["kl", "ce", "tv"])
def test_target_labels_match_the_targets_full_logits(drafter, target, loss):
    """Forward KL to (CE on the argmax of, and 0.1 x that CE + 0.9 x the total variation to) the
    target's distribution one position before each slot, the teacher taken from the target's own
    full forward, equals training_step's loss, and the gradients agree."""
    ids, loss_mask = padded_batch([40, 29], seed=3)
    cfg = ObjectiveConfig(num_anchors=6, gamma=10.0,
                          labels="target", loss=loss, chunk_bytes=4 * 256 * 5)  # 5 rows a chunk
    features, final = features_and_final_hidden(target, ids, drafter.target_layer_ids)
    step_loss, _ = training_step(DraftingSetup(drafter, target, "dense"),
                                 FeatureBatch(ids, loss_mask, features, final), cfg, torch.Generator().manual_seed(4))
    step_grads = torch.autograd.grad(step_loss, list(drafter.parameters()))
    blocks, logits, teacher = reference_rows(target, drafter, ids, loss_mask, cfg, seed=4)
    log_q = logits.float().log_softmax(-1)
    ce = F.cross_entropy(log_q.flatten(0, -2), teacher.argmax(-1).flatten(), reduction="none").view_as(log_q[..., 0])
    if loss == "kl":
        rows = F.kl_div(log_q, teacher.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    elif loss == "tv":
        rows = 0.1 * ce + 0.9 * (log_q.exp() - teacher.softmax(-1)).abs().sum(-1) / 2
    else:
        rows = ce
    w = blocks.weights[..., 1:]
    expected = (rows * w).sum() / w.sum()
    torch.testing.assert_close(step_loss, expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(step_grads, torch.autograd.grad(expected, list(drafter.parameters()))):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert not torch.equal(teacher.argmax(-1), blocks.labels[..., 1:])  # the target is not the data here


@pytest.mark.parametrize("labels, loss, softcap", [("data", "ce", None), ("target", "ce", None),
                                                   ("target", "kl", None), ("target", "kl", 5.0),
                                                   ("target", "tv", None), ("target", "tv", 5.0)])
def test_chunked_row_losses_equal_dense_ones_with_gradients(labels, loss, softcap):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 16, generator=gen, requires_grad=True)
    teacher = torch.randn(23, 16, generator=gen) * 2
    head = torch.randn(300, 16, generator=gen)
    data_labels = torch.randint(0, 300, (23,), generator=gen)
    weights = torch.rand(23, generator=gen)
    spec = RowLossSpec(labels, loss, chunk_rows=4, softcap=softcap, tv_ce_weight=0.3)
    rows, ranks, hard, hard_logprob, argmax = ChunkedLMHeadLoss.apply(hidden, head, data_labels, teacher, spec)
    (grad,) = torch.autograd.grad((rows * weights).sum(), hidden)
    ref_hidden = hidden.detach().clone().requires_grad_(True)
    ref = dense_row_loss(ref_hidden, head, data_labels, teacher, spec)
    (ref_grad,) = torch.autograd.grad((ref * weights).sum(), ref_hidden)
    torch.testing.assert_close(rows, ref)
    torch.testing.assert_close(grad, ref_grad)
    logits = hidden.detach() @ head.T
    assert torch.equal(ranks, (logits > logits.gather(1, data_labels[:, None])).sum(1))
    assert torch.equal(argmax, logits.argmax(-1))
    teacher_logits = teacher @ head.T
    if softcap:  # the cap changes the distribution, not the argmax
        teacher_logits = softcap * torch.tanh(teacher_logits / softcap)
    expected_hard = teacher_logits.argmax(-1) if labels == "target" else data_labels
    assert torch.equal(hard, expected_hard)
    torch.testing.assert_close(hard_logprob, logits.log_softmax(-1).gather(1, hard[:, None])[:, 0])
    if softcap:
        uncapped = dense_row_loss(hidden.detach(), head, data_labels, teacher, RowLossSpec(labels, loss, 4, None, 0.3))
        assert (uncapped - rows.detach()).abs().max() > 1e-2


def test_the_targets_softcap_is_read_from_its_config(target):
    assert logit_softcap(target) is None
    capped = type("Target", (), {"config": type("Config", (), {"final_logit_softcapping": 30.0})()})()
    assert logit_softcap(capped) == 30.0


def test_teacher_rows_read_one_position_before_each_slot():
    final = torch.arange(2 * 6, dtype=torch.float32).view(2, 6, 1)  # value = 6 * row + position
    positions = torch.tensor([[[1, 2, 3, 4]], [[3, 4, 5, 6]]])
    assert teacher_rows(final, positions)[..., 0].tolist() == [[[1, 2, 3]], [[9, 10, 11]]]


def test_dpace_weights_by_hand():
    q = torch.tensor([[0.8, 0.4, 0.9, 0.5]])
    supervised = torch.tensor([[True, True, True, False]])
    s = [(1 - 0.5) * v + 0.5 for v in q[0, :3].tolist()]  # 0.9, 0.7, 0.95
    reach = [s[0], s[0] * s[1], s[0] * s[1] * s[2]]
    expected = [sum(reach[k:]) for k in range(3)] + [0.0]
    torch.testing.assert_close(dpace_weights(q.log(), supervised, 0.5), torch.tensor([expected]))
    assert dpace_weights(q.log(), torch.ones(1, 4, dtype=torch.bool), 1.0).tolist() == [[4, 3, 2, 1]]


def test_tree_aware_weights_on_a_hand_built_tree():
    """Three depths over a vocabulary of 4; the head is the identity, so hidden states are logits.
    Marginals: depth 1 {0: .6, 1: .4}, depth 2 {2: .5, 3: .5}, depth 3 {0: .9, ...}. A budget-3 tree
    holds the prefixes by probability: (0) .6, (1) .4, (0,2) = (0,3) = .3 (ties: lower rank first), so
    (0), (1), (0,2). The labels (1, 2, 0) follow it to depth 1 only (prefix (1,2) = .2 is not in it),
    the labels (0, 2, 0) to depth 2 (prefix (0,2,0) = .27 misses the budget), though neither label
    path is the chain of argmaxes beyond depth 1. Budget 6 adds (0,3) .3 and (0,2,0) .27 (and
    (0,3,0)); budget 7 then (1,2) .2."""
    probs = torch.tensor([[0.6, 0.4, 1e-9, 1e-9], [1e-9, 1e-9, 0.5, 0.5], [0.9, 0.05, 0.03, 0.02]])
    hidden = probs.log()[None].expand(2, -1, -1).contiguous()
    labels = torch.tensor([[1, 2, 0], [0, 2, 0]])
    depth = tree_accepted_depth(hidden, torch.eye(4), labels, budget=3, chunk_rows=2)
    assert depth.tolist() == [1, 2]
    assert tree_accepted_depth(hidden, torch.eye(4), labels, budget=6, chunk_rows=2).tolist() == [1, 3]
    assert tree_accepted_depth(hidden, torch.eye(4), labels, budget=7, chunk_rows=2).tolist() == [2, 3]
    supervised = torch.ones(2, 3, dtype=torch.bool)
    a = 0.5  # reach: depth <= d -> 1, then a^(j - d)
    expected = torch.tensor([[1 + a + a * a, a + a * a, a * a], [1 + 1 + a, 1 + a, a]])
    torch.testing.assert_close(tree_weights(depth, supervised, a), expected)
    supervised[0, 2] = False
    torch.testing.assert_close(tree_weights(depth, supervised, a)[0], torch.tensor([1 + a, a, 0]))


@pytest.mark.parametrize("weights", ["dpace", "tree"])
def test_prediction_dependent_weights_carry_no_gradient(drafter, target, weights):
    """The step's gradient is that of sum_r w_r CE_r / sum_r w_r with the weights held fixed at their
    values, computed here from the dense logits of the same blocks."""
    ids, loss_mask = padded_batch([40, 33], seed=5)
    cfg = ObjectiveConfig(num_anchors=6, gamma=10.0,
                          position_weights=weights, ddtree_budget=160)
    features = context_features(target, ids, drafter.target_layer_ids)
    step_loss, _ = training_step(DraftingSetup(drafter, target, "dense"), FeatureBatch(ids, loss_mask, features), cfg,
                                 torch.Generator().manual_seed(6))
    step_grads = torch.autograd.grad(step_loss, list(drafter.parameters()))
    blocks, logits, _ = reference_rows(target, drafter, ids, loss_mask, cfg, seed=6)
    log_q = logits.float().log_softmax(-1)
    ce = -log_q.gather(-1, blocks.labels[..., 1:, None])[..., 0].reshape(-1, B - 1)
    supervised = (blocks.weights[..., 1:] > 0).reshape(-1, B - 1)
    if weights == "dpace":
        w = dpace_weights(-ce.detach(), supervised, 0.5)
    else:
        hidden = drafter_hidden(drafter, target, features, blocks, "dense")[:, :, 1:].reshape(-1, B - 1, 64)
        depth = tree_accepted_depth(hidden, target.lm_head.weight, blocks.labels[..., 1:].reshape(-1, B - 1), 160, 50)
        assert 0 < depth.float().mean() < B - 1  # the tree follows some labels some of the way
        w = tree_weights(depth, supervised, 0.5)
    expected = (ce * w).sum() / w.sum()
    torch.testing.assert_close(step_loss, expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(step_grads, torch.autograd.grad(expected, list(drafter.parameters()))):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    exp_loss, _ = training_step(DraftingSetup(drafter, target, "dense"), FeatureBatch(ids, loss_mask, features),
                                ObjectiveConfig(num_anchors=6, gamma=10.0), torch.Generator().manual_seed(6))
    assert abs(exp_loss.item() - step_loss.item()) > 1e-4  # the weights do change the loss


def test_the_run_name_says_the_objective():
    cfg = load_config(str(REPO / "configs" / "v3.yaml"),
                      ["data.path=/x", "objective.labels=target", "objective.loss=kl", "objective.position_weights=tree"])
    assert cfg.run.name == "v3-g10-b95-target-kl-tree"
    assert load_config(str(REPO / "configs" / "v3.yaml"), ["data.path=/x"]).run.name == "v3-g10-b95"
    cfg = load_config(str(REPO / "configs" / "v3.yaml"),
                      ["data.path=/x", "objective.loss=expected_tree", "objective.truncate=first_failure"])
    assert cfg.run.name == "v3-g10-b95-expected_tree-first_failure"


@pytest.mark.parametrize("loss", ["expected_chain", "expected_tree"])
def test_block_losses_refuse_position_weights_naming_both_keys(loss):
    with pytest.raises(ConfigError, match=re.escape(f"objective.loss={loss} weighs the slots by itself: "
                                                    "objective.position_weights must stay exp (got dpace)")):
        load_config(str(REPO / "configs" / "v3.yaml"),
                    ["data.path=/x", f"objective.loss={loss}", "objective.position_weights=dpace"])
    load_config(str(REPO / "configs" / "v3.yaml"),
                ["data.path=/x", f"objective.loss={loss}", "objective.labels=target"])  # with either labels


VARIANTS = {"target-kl": dict(labels="target", loss="kl"), "target-ce": dict(labels="target", loss="ce"),
            "dpace": dict(position_weights="dpace"), "tree": dict(position_weights="tree", ddtree_budget=16),
            "tv": dict(labels="target", loss="tv"), "first-failure": dict(truncate="first_failure"),
            "expected-chain": dict(loss="expected_chain"),
            "expected-tree": dict(loss="expected_tree", ddtree_budget=16)}


def cfg_budget(variant: str) -> int:
    return VARIANTS[variant].get("ddtree_budget", ObjectiveConfig.ddtree_budget)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_objective_learns_and_differs_from_the_default(target, variant):
    """20 AdamW steps from the same start: every variant's loss falls (the block losses, minus an
    expected accepted fraction, at least double their size), and its trajectory is its own (the
    default's first step is the same computation; later steps move apart)."""
    ids, loss_mask = padded_batch([48, 48, 30], seed=6)
    features, final = features_and_final_hidden(target, ids, [1, 3])

    def fit(**objective):
        drafter = make_drafter(target, num_layers=1, target_layer_ids=[1, 3])
        cfg = ObjectiveConfig(num_anchors=8, gamma=10.0, **objective)
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
        losses = []
        for step in range(20):
            loss, metrics = training_step(DraftingSetup(drafter, target, "dense"),
                                          FeatureBatch(ids, loss_mask, features, final), cfg,
                                          torch.Generator().manual_seed(step))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses, metrics

    losses, metrics = fit(**VARIANTS[variant])
    default, _ = fit()
    if losses[0] > 0:
        assert sum(losses[-4:]) < 0.8 * sum(losses[:4])
    else:
        assert sum(losses[-4:]) < 2 * sum(losses[:4]) < 0
    assert math.isfinite(metrics["acc"][0]) and math.isfinite(metrics[f"anchor_ddtree@{cfg_budget(variant)}"][0])
    assert abs(losses[-1] - default[-1]) > 1e-3


def test_the_objective_keys_define_the_run():
    from drafter.training.checkpoint import run_identity
    identity = run_identity(load_config(str(REPO / "configs" / "v3.yaml"), ["data.path=/x"]))
    for key in ("objective.labels", "objective.loss", "objective.position_weights", "objective.weight_smoothing",
                "objective.tv_ce_weight", "objective.tree_temperature", "objective.block_ce_weight",
                "objective.truncate", "objective.normalize", "objective.anchor_candidates"):
        assert key in identity, key


def test_muon_steps_the_matrices_and_adamw_the_rest():
    from omegaconf import OmegaConf

    from drafter.config import OptimConfig
    from drafter.infra.engine import build_optimizers
    drafter = make_drafter(random_qwen3(vocab_size=256, num_hidden_layers=4), num_layers=1)
    params = list(drafter.parameters())
    muon, adamw = build_optimizers(params, OmegaConf.structured(OptimConfig(name="muon")))
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    matrices = {id(p) for p in muon.param_groups[0]["params"]}
    assert matrices == {id(p) for p in params if p.dim() == 2} and id(drafter.fc.weight) in matrices
    assert all(p.dim() == 1 for p in adamw.param_groups[0]["params"]) and adamw.param_groups[0]["params"]
    (only,) = build_optimizers(params, OmegaConf.structured(OptimConfig()))
    assert isinstance(only, torch.optim.AdamW) and len(only.param_groups[0]["params"]) == len(params)


def test_muon_under_deepspeed_takes_the_engine_s_optimizer_and_other_names_are_refused(tmp_path):
    """(DeepSpeed's Muon, its JSON checks and its steps: tests/test_train.py, tests/test_muon_zero.py.)"""
    from drafter.infra.deepspeed_engine import deepspeed_config
    from drafter.infra.engine import EngineConfigError
    cfg = load_config(str(REPO / "configs" / "v3.yaml"), ["data.path=/x", "optim.name=muon", "optim.grad_clip=0"])
    assert "optimizer" not in deepspeed_config(str(REPO / "ds_configs" / "zero2.json"), cfg, 2, True, 64, on_cpu=False)
    with pytest.raises(EngineConfigError, match="optimizer.type='AdamW' in the JSON contradicts optim.name = 'muon'"):
        deepspeed_config(str(REPO / "ds_configs" / "zero2_offload.json"), cfg, 2, True, 64, on_cpu=False)
    with pytest.raises(ConfigError, match=re.escape("optim.name='lion' is not one of adamw, muon")):
        load_config(str(REPO / "configs" / "v3.yaml"), ["data.path=/x", "optim.name=lion"])


@pytest.mark.slow
def test_distillation_tree_weights_and_muon_train_resume_exactly_and_export_under_fsdp(tmp_path):
    """Two ranks (torchrun, FSDP2: Muon's Newton-Schulz on sharded matrices): target KL labels,
    tree-aware weights and Muon, 4 steps saving every 2; a resume from step 2 replays steps 3 and 4
    exactly; the export loads in the public package."""
    from runs import launch, records, run_to_end, train_losses, write_run
    cfg = write_run(tmp_path)
    run = tmp_path / "run"
    common = ["objective.labels=target", "objective.loss=kl", "objective.position_weights=tree",
              "optim.name=muon", "train.engine=fsdp", "train.eval_every=4", "train.save_every=2",
              "train.keep_last=5", "train.max_steps=4", "train.generate_every=0"]
    out = run_to_end(cfg, *common, launcher="torchrun")
    assert "2 ranks on cpu" in out and "tiny-g4-b95-target-kl-tree-muon" in out
    first = train_losses(run)
    assert list(first) == [1, 2, 3, 4] and first[4] < first[1]
    assert records(run, "eval")[-1]["tau_ddtree@16"] >= 1
    out = run_to_end(cfg, *common, f"train.resume={run / 'checkpoints' / 'step_2'}", launcher="torchrun")
    assert "resumed from" in out and "at step 2" in out
    resumed = train_losses(run)
    for step in (3, 4):
        assert resumed[step] == pytest.approx(first[step], rel=1e-6, abs=1e-7), step
    from dflash.model import DFlashDraftModel as PublicDraftModel
    PublicDraftModel.from_pretrained(run / "checkpoints" / "step_4" / "drafter", dtype=torch.float32)


def test_total_variation_by_hand():
    """q = (.5, .3, .2), t = (.2, .3, .5): TV = 1/2 (.3 + 0 + .3) = .3; the hard label is t's argmax, 2."""
    q, t = torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([[0.2, 0.3, 0.5]])
    data_labels = torch.tensor([0])
    for weight, expected in ((0.0, 0.3), (0.1, 0.1 * -math.log(0.2) + 0.9 * 0.3)):
        spec = RowLossSpec("target", "tv", chunk_rows=1, tv_ce_weight=weight)
        rows, _, hard, _, _ = ChunkedLMHeadLoss.apply(q.log(), torch.eye(3), data_labels, t.log(), spec)
        assert hard.tolist() == [2]
        assert rows.item() == pytest.approx(expected, rel=1e-6)


def test_first_failure_cut_by_hand():
    """Slots up to and including the first miss keep their weight; unsupervised slots stay out."""
    hit = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 0, 1, 1, 1]], dtype=torch.bool)
    supervised = torch.ones_like(hit)
    supervised[3, 3:] = False
    assert up_to_first_failure(hit, supervised).long().tolist() == [
        [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]


def test_expected_chain_length_by_enumeration():
    """sum_k chain_acceptance over a block = sum over every draft d ~ prod_j q_j of the leading slots
    where d_j = y_j, enumerated over the 3^3 drafts of a vocabulary of 3; a third slot without
    supervision ends the chain."""
    import itertools
    q = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.1, 0.1, 0.8]], dtype=torch.float64)
    labels = [0, 1, 2]

    def enumerated(depth):
        total = 0.0
        for draft in itertools.product(range(3), repeat=depth):
            p = math.prod(q[j, d].item() for j, d in enumerate(draft))
            total += p * next((j for j in range(depth) if draft[j] != labels[j]), depth)
        return total
    label_logprob = q.log()[torch.arange(3), labels][None]
    supervised = torch.ones(1, 3, dtype=torch.bool)
    assert chain_acceptance(label_logprob, supervised).sum().item() == pytest.approx(enumerated(3), rel=1e-12)
    supervised[0, 2] = False
    assert chain_acceptance(label_logprob, supervised).sum().item() == pytest.approx(enumerated(2), rel=1e-12)
    assert enumerated(3) == pytest.approx(0.6 + 0.6 * 0.5 + 0.6 * 0.5 * 0.8)


def brute_force_tree(logprobs: torch.Tensor, budget: int) -> list[tuple[int, ...]]:
    """The best-`budget` prefixes of independent per-depth distributions [L, V] by enumerating them
    all: by score, ties to the lexicographically smaller tuple of ranks (ddtree's rule)."""
    import itertools
    depth, vocab = logprobs.shape
    order = logprobs.argsort(-1, descending=True)
    prefixes = []
    for length in range(1, depth + 1):
        for ranks in itertools.product(range(vocab), repeat=length):
            tokens = tuple(order[j, r].item() for j, r in enumerate(ranks))
            score = sum(logprobs[j, t].item() for j, t in enumerate(tokens))
            prefixes.append((-score, ranks, tokens))
    return [tokens for _, _, tokens in sorted(prefixes)[:budget]]


def tree_case(seed: int, vocab: int = 4, depth: int = 3):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(depth, vocab, generator=gen, dtype=torch.float64) * 1.5
    labels = torch.randint(0, vocab, (depth,), generator=gen)
    return logits, labels


def surrogate_depth(logits, labels, budget, temperature):
    """The expected_tree surrogate of one block (identity LM head: the hidden states are the logits)."""
    threshold = tree_threshold(logits[None].float(), torch.eye(logits.shape[-1]), budget, chunk_rows=2)
    label_logprob = logits.log_softmax(-1).gather(1, labels[:, None])[:, 0][None]
    return soft_tree_acceptance(label_logprob, threshold.to(label_logprob.dtype), temperature,
                                torch.ones_like(label_logprob, dtype=torch.bool)).sum()


def test_tree_surrogate_tends_to_the_brute_force_accepted_depth():
    """Vocabulary 4, 3 slots, budget 5: the best-5 tree by enumerating all 84 prefixes, the true
    accepted depth = the longest label prefix in it. The surrogate is within 1e-3 of it at temperature
    1e-3 in every case, and moves away as the temperature grows."""
    depths, far = [], 0
    for seed in range(40):
        logits, labels = tree_case(seed)
        tree = brute_force_tree(logits.log_softmax(-1), 5)
        true_depth = next((k for k in range(3, 0, -1) if tuple(labels[:k].tolist()) in tree), 0)
        depths.append(true_depth)
        assert surrogate_depth(logits, labels, 5, 1e-3).item() == pytest.approx(true_depth, abs=1e-3), seed
        far += abs(surrogate_depth(logits, labels, 5, 1.0).item() - true_depth) > 0.05
        assert tree_accepted_depth(logits[None].float(), torch.eye(4), labels[None], 5, 2).item() == true_depth
    assert set(depths) == {0, 1, 2, 3} and far > 10


def test_tree_surrogate_gradient_raises_the_labels_and_grows_the_tree():
    """The surrogate's gradient w.r.t. the marginals' logits is positive on every label and negative
    elsewhere (through the softmax); on a block whose label path leaves the tree, a few ascent steps
    on it bring the true accepted depth up."""
    grown = 0
    for seed in range(40):
        logits, labels = tree_case(seed)
        logits.requires_grad_(True)
        (grad,) = torch.autograd.grad(surrogate_depth(logits, labels, 5, 0.5), logits)
        on_label = torch.zeros_like(grad, dtype=torch.bool).scatter_(1, labels[:, None], True)
        assert (grad[on_label] > 0).all() and (grad[~on_label] < 0).all(), seed
        before = tree_accepted_depth(logits.detach()[None].float(), torch.eye(4), labels[None], 5, 2).item()
        if before == 3:
            continue
        moved = logits.detach().clone().requires_grad_(True)
        for _ in range(10):
            (step,) = torch.autograd.grad(surrogate_depth(moved, labels, 5, 0.5), moved)
            moved = (moved + step).detach().requires_grad_(True)
        after = tree_accepted_depth(moved.detach()[None].float(), torch.eye(4), labels[None], 5, 2).item()
        assert after >= before, seed
        grown += after > before
    assert grown > 10


BLOCK_OBJECTIVES = {"first-failure": dict(truncate="first_failure"),
                    "target-tv-first-failure": dict(labels="target", loss="tv", truncate="first_failure"),
                    "count": dict(normalize="count"),
                    "expected-chain": dict(loss="expected_chain"),
                    "expected-chain-alone": dict(loss="expected_chain", block_ce_weight=0.0),
                    "expected-chain-count": dict(loss="expected_chain", normalize="count", truncate="first_failure"),
                    "expected-tree": dict(loss="expected_tree", ddtree_budget=24, tree_temperature=0.5,
                                          block_ce_weight=0.7)}


@pytest.mark.parametrize("variant", list(BLOCK_OBJECTIVES))
def test_cut_normaliser_and_block_losses_match_the_full_logits(trained, variant):
    """training_step (chunked rows, 10 a chunk) of a drafter that has learned something (its chains
    and trees accept a few slots) against the dense logits of the same blocks: the first-failure cut
    from their argmax, the supervised count, the expected chain length as products of label
    probabilities, the tree surrogate on the dense label log-probabilities, each block loss plus
    block_ce_weight x the exp-weighted CE; the losses and gradients agree, so nothing past the cut
    and no threshold carries gradient."""
    objective = BLOCK_OBJECTIVES[variant]
    target, drafter = trained.target, copy.deepcopy(trained.drafter).requires_grad_(True)
    ids = trained.sequences
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, trained.prompts.shape[1]:] = 1
    loss_mask[:, -5:] = 0  # blocks cut short by the end of the supervised span
    cfg = ObjectiveConfig(num_anchors=6, gamma=10.0,
                          chunk_bytes=4 * 256 * 10, **objective)
    features, final = features_and_final_hidden(target, ids, drafter.target_layer_ids)
    step_loss, _ = training_step(DraftingSetup(drafter, target, "dense"),
                                 FeatureBatch(ids, loss_mask, features, final), cfg, torch.Generator().manual_seed(4))
    step_grads = torch.autograd.grad(step_loss, list(drafter.parameters()))
    blocks, logits, teacher = reference_rows(target, drafter, ids, loss_mask, cfg, seed=4)
    log_q = logits.float().log_softmax(-1).reshape(-1, B - 1, logits.shape[-1])
    labels = (teacher.argmax(-1) if cfg.labels == "target" else blocks.labels[..., 1:]).reshape(-1, B - 1)
    label_logprob = log_q.gather(-1, labels[..., None])[..., 0]
    supervised = (blocks.weights[..., 1:] > 0).reshape(-1, B - 1)
    weights = blocks.weights[..., 1:].reshape(-1, B - 1)
    if cfg.loss == "tv":
        t = teacher.softmax(-1).reshape(log_q.shape)
        rows = 0.1 * -label_logprob + 0.9 * (log_q.exp() - t).abs().sum(-1) / 2
    elif cfg.loss == "expected_chain":
        rows, weights = -torch.cumprod(label_logprob.exp(), -1), supervised.float()
        assert 0.1 < (-rows * weights).sum() / weights.sum() < 0.9  # the chain accepts some of the way
    elif cfg.loss == "expected_tree":
        hidden = drafter_hidden(drafter, target, features, blocks, "dense")[:, :, 1:].reshape(-1, B - 1, 64)
        threshold = tree_threshold(hidden, target.lm_head.weight, 24, 50)
        assert torch.isfinite(threshold).all()
        rows = -torch.sigmoid((label_logprob.cumsum(-1) - threshold[:, None]) / 0.5)
        weights = supervised.float()
    else:
        rows = -label_logprob
    keep = torch.ones_like(supervised)
    if cfg.truncate == "first_failure":
        hit = (log_q.argmax(-1) == labels).long()
        first_miss = torch.where(hit.min(-1).values.bool(), B - 1, (1 - hit).argmax(-1))  # index of the first miss
        keep = torch.arange(B - 1)[None] <= first_miss[:, None]
        assert not keep.all() and keep[:, 1:].any()  # cuts, some after a hit

    def mean(rows, weights):
        weights = weights * keep
        return (rows * weights).sum() / (weights.sum() if cfg.normalize == "weights" else supervised.sum())

    expected = mean(rows, weights)
    if cfg.loss.startswith("expected_"):
        expected = expected + cfg.block_ce_weight * mean(-label_logprob, blocks.weights[..., 1:].reshape(-1, B - 1))
    torch.testing.assert_close(step_loss, expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(step_grads, torch.autograd.grad(expected, list(drafter.parameters()))):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_the_objective_section_is_the_training_steps_objective():
    """One config: train.py hands the training step the config's typed objective section itself (no
    copy that could drop a key); the block size and mask token are the drafter's, the soft cap the
    target's."""
    from dataclasses import fields

    from omegaconf import OmegaConf
    section = load_config(str(REPO / "configs" / "v3.yaml"), [
        "data.path=/x", "objective.labels=target", "objective.loss=tv", "objective.tv_ce_weight=0.3",
        "objective.position_weights=dpace", "objective.weight_smoothing=0.2", "objective.truncate=first_failure",
        "objective.normalize=count",
        "objective.anchor_candidates=supervised", "objective.ddtree_budget=24"]).objective
    cfg = OmegaConf.to_object(section)
    assert type(cfg) is ObjectiveConfig
    assert {f.name: getattr(cfg, f.name) for f in fields(ObjectiveConfig)} == OmegaConf.to_container(section)
    assert (cfg.loss, cfg.tv_ce_weight, cfg.weight_smoothing, cfg.ddtree_budget) == ("tv", 0.3, 0.2, 24)
