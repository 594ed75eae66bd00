"""Served tau during training (drafter/serving/served.py): the replay walk, replay == generate at T=0, and
generation split over ranks, bounded in time, off the training RNG streams."""
import copy
import json
import random

import datasets
import numpy as np
import pytest
import torch

from conftest import fit_drafter, make_drafter
from drafter.config import DrafterVariant
from drafter.config import ObjectiveConfig
from drafter.pipeline.benchmarks import load_prompts
from drafter.metric_sums import finalize_metrics
from drafter.models.blocks import DraftingSetup, FeatureBatch
from drafter.serving.decode import DecodeSettings, generate
from drafter.serving.served import (PromptShare, acceptance_and_slot_hits, anchor_acceptance, bench_prompts, every_anchor, generation_tau,
                                    held_out_prompts, mean_tau, replay_steps, replayed_tau, response_spans,
                                    serve_walk)
from drafter.target_model.model import context_features
from eval.ddtree_accept import summarize
from tiny_tokenizer import build_tiny_tokenizer

B, MAX_NEW, BUDGETS = 8, 48, (4, 16)
METHODS = ["dflash", "ddtree@4", "ddtree@16"]


def test_walk_by_hand():
    #            0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15
    loss_mask = [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 0, 1]
    accepted = [-1, -1, 2, 9, 9, 0, 5, 9, -1, -1, -1, 0, 0, -1, -1, -1]
    assert response_spans(loss_mask) == [(2, 9), (11, 14), (15, 16)]
    # turn 1: the prefill gives position 2; anchor 2 commits 2 + bonus -> 5; anchor 5 commits the bonus
    # only -> 6; anchor 6 would commit 6 but the turn's last token is 8 -> 2 more
    assert serve_walk(accepted, 2, 9) == [3, 1, 2]
    assert serve_walk(accepted, 11, 14) == [1, 1]
    assert serve_walk(accepted, 15, 16) == []  # a one-token turn: the prefill's token, no step
    assert mean_tau([[3, 1, 2], [1, 1], []]).tolist() == [(6 / 3) + (2 / 2), 2]
    with pytest.raises(ValueError, match=r"position 8 of the response at \[8, 11\) was not scored"):
        serve_walk(accepted, 8, 11)  # an unscored position ends the walk with an error, not a hang


def test_every_anchor_is_every_position_followed_by_a_supervised_one():
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0], [0, 0, 0, 1, 1, 0, 0, 0]])
    anchors, valid = every_anchor(loss_mask)
    assert anchors.tolist() == [[1, 2, 5], [3, 0, 0]]
    assert valid.tolist() == [[True, True, True], [True, False, False]]


# ---------------------------------------------------------------------------------------------
# Replay == generate on the target's own greedy text
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def world(target):
    return served_world(target, DrafterVariant())


@pytest.fixture(scope="module")
def world_dflash2(target):
    """As `world`, with a DFlash2 drafter: `dflash` is its selector chain."""
    return served_world(target, DrafterVariant(arch="dflash2", selector_rank=8, selector_top_k=4))


@pytest.fixture(scope="module")
def world_gated_deltanet():
    """As `world`, on a hybrid target (Qwen3.5's Gated DeltaNet beside attention): `ddtree` is served
    as a batch of the tree's paths."""
    from families import random_target
    return served_world(random_target("qwen3_5_text"), DrafterVariant())


@pytest.fixture(scope="module")
def world_short_conv():
    """As `world_gated_deltanet`, with LFM2's short convolutions."""
    from families import random_target
    return served_world(random_target("lfm2"), DrafterVariant())


def served_world(target, variant):
    """An fp64 target, its greedy answers to 3 prompts (one with a second turn after its first
    answer) each cut at a stop token seen there for the first time, and a drafter trained on them
    just long enough to accept runs of very different lengths.

    fp64 keeps the training forward's and the serving forward's logits within ~1e-15 of each other,
    so after the fp32 cast that both paths make, ties broken differently are vanishingly rare: the
    comparisons below are exact. Every answer stops more than B tokens before max_new_tokens, so
    `generate`'s dflash never shortens a block."""
    target = copy.deepcopy(target).double()
    gen = torch.Generator().manual_seed(0)

    def answer(prompt):
        greedy = generate(target, torch.tensor([prompt]), MAX_NEW).output_ids
        end = next(j for j in range(22, MAX_NEW - B - 1) if greedy[j] not in greedy[:j])
        return greedy[:end + 1], greedy[end]

    responses, rows = [], []  # responses: (prompt ids, answer ids, stop token)
    for i in range(3):
        prompt = torch.randint(0, 250, (8,), generator=gen).tolist()
        out, stop = answer(prompt)
        responses.append((prompt, out, stop))
        ids, mask = prompt + out, [0] * len(prompt) + [1] * len(out)
        if i == 0:  # a second user turn, answered after the first answer
            prompt = ids + torch.randint(0, 250, (4,), generator=gen).tolist()
            out, stop = answer(prompt)
            responses.append((prompt, out, stop))
            ids, mask = prompt + out, mask + [0] * 4 + [1] * len(out)
        rows.append((ids, mask))
    width = max(len(ids) for ids, _ in rows) + 3  # right padding
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    loss_mask = torch.zeros_like(input_ids)
    for i, (ids, mask) in enumerate(rows):
        input_ids[i, :len(ids)], loss_mask[i, :len(mask)] = torch.tensor(ids), torch.tensor(mask)

    drafter = make_drafter(target, num_layers=1, block_size=B, variant=variant).double()
    cfg = ObjectiveConfig(num_anchors=48, ddtree_budget=8)
    fit_drafter(drafter, target, input_ids, loss_mask, cfg, steps=20, lr=3e-3)
    features = context_features(target, input_ids, drafter.target_layer_ids)
    served = {}
    for method in METHODS:
        name, _, budget = method.partition("@")
        served[method] = [generate(target, torch.tensor([prompt]), MAX_NEW, [stop], drafter=drafter,
                                   settings=DecodeSettings(name, int(budget) if budget else None))
                          for prompt, _, stop in responses]
    return target, drafter, responses, input_ids, loss_mask, features, served


@pytest.mark.parametrize("world_name", ["world", "world_dflash2", "world_gated_deltanet",
                                        "world_short_conv"])
def test_replay_equals_served_steps_at_temperature_zero(request, world_name):
    target, drafter, responses, input_ids, loss_mask, features, served = request.getfixturevalue(world_name)
    replayed = replay_steps(DraftingSetup(drafter, target, "dense", budgets=BUDGETS),
                            FeatureBatch(input_ids, loss_mask, features))
    for method in METHODS:
        assert [g.output_ids for g in served[method]] == [out for _, out, _ in responses]  # lossless
        assert replayed[method] == [g.acceptance_lengths for g in served[method]], method
    steps = [s for method in METHODS for g in served[method] for s in g.acceptance_lengths]
    assert {1, 2, 3} <= set(steps) and max(steps) >= 5  # the case is not trivial


def test_replayed_tau_is_eval_tau(world):
    """tau_<method> = eval/ddtree_accept.py's tau (mean over responses of each one's mean)."""
    target, drafter, _, input_ids, loss_mask, features, served = world
    tau = finalize_metrics(replayed_tau(DraftingSetup(drafter, target, "dense", budgets=BUDGETS),
                                        FeatureBatch(input_ids, loss_mask, features)))
    for method in METHODS:
        records = [{"source": f"prompt:{i}", "turn": 0, "acceptance_lengths": g.acceptance_lengths,
                    "output_ids": g.output_ids, "decode_seconds": g.decode_seconds,
                    "stage_seconds": g.stage_seconds} for i, g in enumerate(served[method])]
        assert tau[f"tau_{method}"] == summarize(records, records, greedy=False, save_samples=False)["tau"]
    assert tau["tau_dflash"] > 1.3 and tau["tau_ddtree@16"] > tau["tau_dflash"]


def test_every_anchor_slot_accuracy_counts_the_supervised_labels_the_chain_walked(world):
    """Slot k counts every anchor p whose label x_{p+k} is supervised; slot 1's hits are the anchors
    where DFlash accepts at least one token, and slot k hits at least where it accepts k."""
    target, drafter, _, input_ids, loss_mask, features, _ = world
    accepted, slot_hits = acceptance_and_slot_hits(DraftingSetup(drafter, target, "dense", budgets=BUDGETS,
                                                                 blocks_per_forward=7),
                                                   FeatureBatch(input_ids, loss_mask, features))
    chain = accepted["dflash"]
    anchors, valid = every_anchor(loss_mask)
    rows = torch.arange(len(anchors))[:, None].expand_as(anchors)[valid]
    positions = anchors[valid]
    length = loss_mask.shape[1]
    for k in range(1, B):
        at = positions + k
        counted = (at < length) & loss_mask[rows, at.clamp(max=length - 1)].bool()
        assert slot_hits[k - 1, 1] == counted.sum(), k
        assert slot_hits[k - 1, 0] >= (counted & (chain[rows, positions] >= k)).sum(), k
    counted = loss_mask[rows, (positions + 1).clamp(max=length - 1)].bool() & (positions + 1 < length)
    assert slot_hits[0, 0] == (counted & (chain[rows, positions] >= 1)).sum()
    assert 0 < slot_hits[0, 0] < slot_hits[0, 1]


def test_chunking_does_not_change_acceptance(world):
    target, drafter, _, input_ids, loss_mask, features, _ = world
    whole = anchor_acceptance(DraftingSetup(drafter, target, "dense", budgets=BUDGETS),
                              FeatureBatch(input_ids, loss_mask, features))
    chunked = anchor_acceptance(DraftingSetup(drafter, target, "dense", budgets=BUDGETS, blocks_per_forward=7,
                                              chunk_bytes=3 * (B - 1) * 256 * 4),
                                FeatureBatch(input_ids, loss_mask, features))
    anchors, valid = every_anchor(loss_mask)
    for method in METHODS:
        assert torch.equal(chunked[method], whole[method])
        is_anchor = torch.zeros_like(whole[method], dtype=torch.bool)
        is_anchor[torch.arange(len(anchors))[:, None].expand_as(anchors)[valid], anchors[valid]] = True
        assert (whole[method][~is_anchor] == -1).all() and (whole[method][is_anchor] >= 0).all()


# ---------------------------------------------------------------------------------------------
# Generation during training
# ---------------------------------------------------------------------------------------------

def response_tau(steps):
    return sum(steps) / len(steps)


def test_generation_is_split_over_ranks_and_sums_to_the_single_rank_figures(world):
    target, drafter, responses, *_ = world
    prompts = [prompt for prompt, _, _ in responses]
    setup, settings = DraftingSetup(drafter, target,
                                    budgets=(4,)), dict(max_new_tokens=16, max_seconds=600, stop_token_ids=())
    ranks = [generation_tau(setup, prompts, PromptShare(rank, 2), **settings) for rank in range(2)]
    assert sorted(ranks[0]) == ["gen_seconds", "gen_tau_ddtree@4", "gen_tau_dflash"]
    for method in METHODS[:2]:
        name, _, budget = method.partition("@")
        expected = [response_tau(generate(target, torch.tensor([p]), 16, drafter=drafter,
                                          settings=DecodeSettings(name,
                                                                  int(budget) if budget else None)).acceptance_lengths)
                    for p in prompts]
        for rank, out in enumerate(ranks):  # rank r decodes prompts r, r + 2, ...
            assert out[f"gen_tau_{method}"].tolist() == pytest.approx([sum(expected[rank::2]), 2])
    total = finalize_metrics({k: ranks[0][k] + ranks[1][k] for k in ranks[0]})
    assert total["gen_tau_dflash"] > 1.3 and 0 < total["gen_seconds"] < 600


def test_generation_leaves_rng_streams_and_drafter_mode_alone(world):
    target, drafter, responses, *_ = world
    prompts = [prompt for prompt, _, _ in responses]
    setup, settings = DraftingSetup(drafter, target, budgets=(4,)), dict(max_new_tokens=12, max_seconds=600)
    reference = generation_tau(setup, prompts, **settings)
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    states = torch.get_rng_state(), np.random.get_state(), random.getstate()
    drafter.train()
    try:
        out = generation_tau(setup, prompts, **settings)
        assert drafter.training  # given back in the mode it came in
    finally:
        drafter.eval()
    assert torch.equal(torch.get_rng_state(), states[0])
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), states[1]))
    assert random.getstate() == states[2]
    for key in ("gen_tau_dflash", "gen_tau_ddtree@4"):
        assert torch.equal(out[key], reference[key])  # decoded in eval mode all the same


class FakeClock:
    """time.perf_counter stand-in: one second passes per reading."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        self.now += 1.0
        return self.now


def test_no_prompt_starts_after_the_time_budget(world, monkeypatch):
    import drafter.serving.served as served

    target, drafter, responses, *_ = world
    prompts = [prompt for prompt, _, _ in responses]
    monkeypatch.setattr(served, "time", FakeClock())
    out = generation_tau(DraftingSetup(drafter, target, budgets=BUDGETS), prompts, max_new_tokens=6, max_seconds=2.5)
    # readings: start 1, before prompt 1: 2 (1 s spent), before prompt 2: 3 (2 s), before prompt 3: 4 (3 s)
    assert [out[f"gen_tau_{m}"][1].item() for m in METHODS] == [2, 2, 2]
    none = generation_tau(DraftingSetup(drafter, target, budgets=BUDGETS), prompts, max_new_tokens=6, max_seconds=0)
    assert [none[f"gen_tau_{m}"].tolist() for m in METHODS] == [[0, 0]] * 3
    assert np.isnan(finalize_metrics(none)["gen_tau_dflash"])


def test_held_out_prompts_are_the_tokens_before_the_first_supervised_one(tmp_path):
    rows = {"input_ids": [[5, 6, 7, 8, 9], [1, 2, 3], [4, 4, 4, 4], [7, 7]],
            "loss_mask": [[0, 0, 1, 1, 1], [1, 1, 1], [0, 0, 0, 1], [0, 1]]}
    dataset = datasets.Dataset.from_dict(rows)
    np.random.seed(0)
    state = np.random.get_state()
    prompts = held_out_prompts(dataset, max_prompts=10, seed=3)
    assert sorted(prompts) == [[4, 4, 4], [5, 6], [7]]  # row 1 starts supervised: no prompt
    assert held_out_prompts(dataset, 10, seed=3) == prompts  # seeded
    some = held_out_prompts(dataset, max_prompts=2, seed=3)
    assert some == prompts[:2]
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), state))


def test_bench_prompts_render_the_first_user_turn(tmp_path):
    tokenizer = build_tiny_tokenizer()
    path = tmp_path / "bench.jsonl"
    rows = [{"prompt": "What is the capital of France?"}, {"turns": ["Hello world", "And tomorrow?"]},
            {"messages": [{"role": "system", "content": "Answer briefly."},
                          {"role": "user", "content": "def add(a, b):"}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first_turns = {"What is the capital of France?": [], "Hello world": [],
                   "def add(a, b):": [{"role": "system", "content": "Answer briefly."}]}
    for count in (2, 3):
        prompts = bench_prompts(str(path), tokenizer, enable_thinking=False, max_prompts=count)
        _, chosen = load_prompts(str(path), count)  # the same seeded subset eval/ddtree_accept.py takes
        assert len(prompts) == count
        for ids, prompt in zip(prompts, chosen):
            messages = first_turns[prompt.turns[0]] + [{"role": "user", "content": prompt.turns[0]}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 enable_thinking=False)
            assert ids == tokenizer(text, add_special_tokens=False).input_ids
