"""The serving loop (`drafter.serving.decode.generate`) held to the training path, the public `dflash` loop and
the target's distribution, with a drafter that has learned something (conftest `trained`): with a
random drafter every step accepts about nothing, and a loop that feeds the wrong context still
passes a losslessness check."""
import copy
import math
from collections import Counter

import pytest
import torch

from conftest import MASK_ID, randomize_
from drafter.models import DFlashDraftModel
from drafter.models.blocks import build_blocks, drafter_hidden
from drafter.models.configure import drafter_config
from drafter.serving import decode
from drafter.serving.decode import DecodeSettings, generate
from drafter.serving.lossless import BF16_TIE_TOLERANCE, first_divergence, lossless_verdict, near_tie_share
from drafter.serving.public_loop import check_public, load_public
from drafter.target_model.model import context_features, random_qwen3
from drafter.tree.ddtree import build_tree, teacher_forced_accept

SPECULATIVE = [("dflash", None), ("ddtree", 4), ("ddtree", 32)]


def training_logits(trained, sequence: torch.Tensor, anchors: list[int], block_size: int) -> torch.Tensor:
    """The training forward's drafter logits [A, block_size - 1, V] for blocks at `anchors` of
    `sequence` [T]: features of the whole sequence, the block mask, no serving code."""
    ids = sequence[None]
    features = context_features(trained.target, ids, trained.drafter.target_layer_ids)
    anchor_ids = torch.tensor([anchors])
    every = torch.ones_like(anchor_ids, dtype=torch.bool)
    blocks = build_blocks(ids, torch.ones_like(ids), anchor_ids, every, block_size, MASK_ID, gamma=7.0)
    with torch.no_grad():
        hidden = drafter_hidden(trained.drafter, trained.target, features, blocks, attention="dense")
        return trained.target.lm_head(hidden)[0, :, 1:]


def replayed_lengths(trained, sequence: torch.Tensor, num_prompt: int, method: str, budget) -> list[int]:
    """Tokens per step that serving must commit on `sequence` (the target's own greedy text), from
    the training path alone: start at the prefill's token, accept along the true tokens (DFlash: the
    drafter's argmax chain; DDTree: the best-`budget` tree of the block's logits), commit the accepted
    tokens plus the bonus, jump there. The last DFlash blocks shrink to the room left, as serving's."""
    max_length, block_size = len(sequence), trained.drafter.block_size
    lengths, p = [], num_prompt
    while p + 1 < max_length:
        size = min(block_size, max_length - p) if method == "dflash" else block_size
        logits = training_logits(trained, sequence, [p], size)[0]
        labels = torch.full((size - 1,), -1)
        true = sequence[p + 1:p + size]
        labels[:len(true)] = true
        if method == "dflash":
            committed = int((logits.argmax(-1) == labels).long().cumprod(0).sum()) + 1
        else:
            committed = int(teacher_forced_accept(build_tree(logits, budget), labels))
        lengths.append(min(committed, max_length - p - 1))
        p += lengths[-1]
    return lengths


@pytest.mark.parametrize("world,method,budget", [("trained", *case) for case in SPECULATIVE]
                         + [("trained_sliding", "dflash", None), ("trained_sliding", "ddtree", 32)])
def test_served_steps_follow_the_training_path(request, monkeypatch, world, method, budget):
    """At every decode step the drafter sees exactly the context the training forward gives the block
    at that anchor (same logits), and each step commits what a teacher-forced replay of the training
    path says it must: accepted tokens plus the bonus, no more, no less. Also for sliding layers."""
    trained = request.getfixturevalue(world)
    calls = []
    draft_hidden = trained.drafter.draft_hidden

    def recording(target, ctx_features, block_ids, cache):  # every method drafts through draft_hidden
        context_end = cache.length + ctx_features.shape[1]
        hidden = draft_hidden(target, ctx_features, block_ids, cache)
        logits = target.get_output_embeddings()(hidden[:, 1:].to(target.dtype)).float()
        calls.append((context_end, block_ids.clone(), logits))
        return hidden

    monkeypatch.setattr(trained.drafter, "draft_hidden", recording)
    num_prompt = trained.prompts.shape[1]
    taus = []
    for i in (0, 5):
        sequence = trained.sequences[i]
        calls.clear()
        result = generate(trained.target, trained.prompts[i:i + 1], len(sequence) - num_prompt,
                          drafter=trained.drafter, settings=DecodeSettings(method, budget))
        assert result.output_ids == sequence[num_prompt:].tolist()  # lossless: the target's text

        anchors = [num_prompt + sum(result.acceptance_lengths[:step]) for step in range(len(calls))]
        assert len(calls) == len(result.acceptance_lengths)
        for step, ((context_end, block, logits), anchor) in enumerate(zip(calls, anchors)):
            assert context_end == anchor, f"step {step}: context ends at {context_end}, anchor {anchor}"
            assert int(block[0, 0]) == int(sequence[anchor]), f"step {step}: wrong root token"
            expected = training_logits(trained, sequence, [anchor], block.shape[1])
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"step {step} (anchor {anchor}): {m}")

        assert result.acceptance_lengths == replayed_lengths(trained, sequence, num_prompt, method, budget)
        taus.append(sum(result.acceptance_lengths) / len(result.acceptance_lengths))
    assert min(taus) > (3.0 if budget != 4 and world == "trained" else 2.5), taus  # it has learned


@pytest.mark.parametrize("world", ["trained", "trained_sliding", "trained_dflash2"])
def test_dflash_matches_public_dflash_generate(request, tmp_path, world):
    """Token for token and step for step the public package's loop on the same trained drafter, for
    full and for sliding layers and for DFlash2 (both walk its selector chain), stop token included
    (tests/test_public_loop.py holds every variant to it with spread random drafters)."""
    pytest.importorskip("dflash.model")
    trained = request.getfixturevalue(world)
    trained.drafter.save_pretrained(tmp_path)
    public = load_public(tmp_path, torch.float32, "cpu")
    num_prompt = trained.prompts.shape[1]
    taus = []
    for i, max_new, stop_at in [(1, 40, None), (2, 33, 25)]:
        prompt = trained.prompts[i:i + 1]
        stops = [int(trained.sequences[i, num_prompt + stop_at])] if stop_at else ()
        agreement = check_public(trained.target, trained.drafter, public, prompt, max_new, stops)
        assert agreement.identical, agreement.difference
        taus.append(agreement.ours_tau)
    assert min(taus) > {"trained": 3.0, "trained_sliding": 2.5, "trained_dflash2": 2.0}[world], taus  # random: 1


# ---------------------------------------------------------------------------------------------
# bf16: divergences from ar are ties, bugs are not
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bf16(trained):
    """The trained world in bf16, 6 prompts and the target's `ar` answers to them (32 tokens)."""
    target = copy.deepcopy(trained.target).to(torch.bfloat16)
    drafter = copy.deepcopy(trained.drafter).to(torch.bfloat16)
    prompts = torch.randint(0, 250, (6, 8), generator=torch.Generator().manual_seed(31))
    return target, drafter, [(p[None], generate(target, p[None], 32)) for p in prompts]


def divergences(bf16, method, budget):
    target, drafter, references = bf16
    found = []
    for prompt, reference in references:
        output = generate(target, prompt, 32, drafter=drafter, settings=DecodeSettings(method, budget))
        found.append(first_divergence(output.output_ids, reference.output_ids, reference.margins))
    return found


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 4)])
def test_bf16_divergences_are_ties(bf16, method, budget):
    """In bf16 the one-row (ar) and multi-row (verify) forwards round differently and flip argmax
    where the target's top-2 logits (nearly) tie: several prompts diverge, every divergence starts at
    a margin below the tolerance, and the verdict says ties-only, not no (in fp32: no divergence,
    test_served_steps_follow_the_training_path)."""
    found = [d for d in divergences(bf16, method, budget) if d is not None]
    assert len(found) >= 3  # the test sees real bf16 divergences
    assert all(d.margin < BF16_TIE_TOLERANCE and d.token != d.reference_token for d in found), found
    assert lossless_verdict(found) == "ties-only"


def test_bf16_verdict_still_catches_a_real_bug(bf16, monkeypatch):
    """A loop whose bonus is not the target's token diverges where the target was sure: "no".
    (A loop that drops the bonus keeps the output; test_served_steps_follow_the_training_path
    catches that one by its tau.)"""
    margins = [m for _, reference in bf16[2] for m in reference.margins]
    assert near_tie_share(margins) < 0.5  # on this target a near-tie is the exception
    dflash_step = decode._Steps.dflash

    def wrong_bonus(self, root, start, context):
        committed, features = dflash_step(self, root, start, context)
        return committed[:-1] + [(committed[-1] + 1) % 256], features

    monkeypatch.setattr(decode._Steps, "dflash", wrong_bonus)
    found = divergences(bf16, "dflash", None)
    assert all(d is not None for d in found)
    assert lossless_verdict(found) == "no"


def test_divergence_position_tokens_and_margin():
    margins = [3.0, 0.1, 2.0, 0.0]
    assert first_divergence([5, 6, 7, 8], [5, 6, 7, 8], margins) is None
    tie = first_divergence([5, 9, 1], [5, 6, 7, 8], margins)
    assert (tie.position, tie.reference_token, tie.token, tie.margin, tie.tie) == (1, 6, 9, 0.1, True)
    sure = first_divergence([5, 6, 1, 2], [5, 6, 7, 8], margins)
    assert (sure.position, sure.margin, sure.tie) == (2, 2.0, False)
    short = first_divergence([5, 6], [5, 6, 7, 8], margins)  # ended early: never a tie
    assert (short.position, short.token, short.reference_token, short.tie) == (2, None, 7, False)
    assert first_divergence([5, 9], [5, 6], margins, tolerance=0.05).tie is False
    verdicts = [lossless_verdict(d) for d in ([None, None], [None, tie], [tie, sure])]
    assert verdicts == ["yes", "ties-only", "no"]
    assert near_tie_share(margins, 0.5) == 0.5 and near_tie_share([]) is None


# ---------------------------------------------------------------------------------------------
# Temperature > 0: the committed tokens follow the target's distribution
# ---------------------------------------------------------------------------------------------

VOCAB = 3


@pytest.fixture(scope="module")
def tiny_world():
    """A 3-token target with spread-out next-token distributions, a drafter whose proposals differ
    from them, and a prompt."""
    target = randomize_(random_qwen3(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                     intermediate_size=16), seed=40, scale=0.4)
    config = drafter_config(target.config, num_layers=1, block_size=3, mask_token_id=VOCAB - 1,
                            target_layer_ids=[0])
    drafter = randomize_(DFlashDraftModel(config), seed=41, scale=0.6).eval()  # accepts often
    return target, drafter, torch.tensor([[0, 1, 2, 1, 0]])


def target_joint(target, prompt, length: int) -> dict[tuple, float]:
    """P(first `length` output tokens) under the target at temperature 1, by enumeration."""
    joint = {(): 1.0}
    for _ in range(length):
        prefixes = list(joint)
        with torch.no_grad():
            logits = target(torch.cat([prompt.expand(len(prefixes), -1),
                                       torch.tensor(prefixes, dtype=torch.long).view(len(prefixes), -1)], 1))
        probs = torch.softmax(logits.logits[:, -1].double(), -1)
        joint = {prefix + (t,): joint[prefix] * float(probs[i, t])
                 for i, prefix in enumerate(prefixes) for t in range(VOCAB)}
    return joint


def chi_square_bound(dof: int, z: float = 3.09) -> float:
    """The chi-square quantile at 1 - 1e-3 (z = 3.09), Wilson-Hilferty approximation."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("method,budget,sampling", [("dflash", None, "match"), ("ddtree", 4, "match"),
                                                    ("dflash", None, "rejection")])
def test_sampled_tokens_follow_the_target_distribution(tiny_world, method, budget, sampling):
    """End to end at T = 1, over 300 runs: the first 3 output tokens (the prefill's and the first
    verify step's) have the target's joint distribution (chi-square, 1e-3 level), and the drafted
    tokens were accepted often enough that the walk, not only the bonus, produced them."""
    target, drafter, prompt = tiny_world
    expected = target_joint(target, prompt, 3)
    torch.manual_seed(0)
    runs, counts, first_step = 300, Counter(), []
    for _ in range(runs):
        result = generate(target, prompt, 3, drafter=drafter,
                          settings=DecodeSettings(method, budget, temperature=1.0, sampling=sampling))
        counts[tuple(result.output_ids)] += 1
        first_step.append(result.acceptance_lengths[0])
    assert sum(length > 1 for length in first_step) > runs / 4
    cells = sorted(expected, key=expected.get, reverse=True)
    big = [c for c in cells if expected[c] * runs >= 5]  # pool the rare ones into one cell
    observed = [counts[c] for c in big] + [runs - sum(counts[c] for c in big)]
    wanted = [expected[c] * runs for c in big] + [runs * (1 - sum(expected[c] for c in big))]
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, wanted) if e > 0)
    assert statistic < chi_square_bound(len(observed) - 1), (statistic, len(observed))


def test_rejection_sampling_is_refused_for_a_dflash2_drafter(trained_dflash2):
    """DFlash2 drafts its selector chain, not samples of its marginals: no min(1, p/q) test applies."""
    with pytest.raises(ValueError, match="rejection sampling is not supported for it"):
        generate(trained_dflash2.target, trained_dflash2.prompts[:1], 4, drafter=trained_dflash2.drafter,
                 settings=DecodeSettings("dflash", temperature=1.0, sampling="rejection"))


@pytest.mark.parametrize("sampling", ["match", "rejection"])
def test_dflash_drafts_the_argmax_to_match_and_samples_to_reject(tiny_world, monkeypatch, sampling):
    """At T = 1 the default (sample-and-match, the papers' loop) verifies the drafter's argmax chain
    against the target's samples; rejection sampling verifies tokens sampled from the drafter."""
    target, drafter, prompt = tiny_world
    drafts, verified = [], []
    draft_logits = drafter.draft_logits
    monkeypatch.setattr(drafter, "draft_logits",
                        lambda *args: drafts.append(draft_logits(*args)) or drafts[-1])
    hook = target.register_forward_pre_hook(lambda module, args: verified.append(args[0][0].clone()))
    torch.manual_seed(0)
    try:
        for _ in range(20):
            generate(target, prompt, 3, drafter=drafter,
                     settings=DecodeSettings("dflash", temperature=1.0, sampling=sampling))
    finally:
        hook.remove()
    blocks = [ids for ids in verified if len(ids) != prompt.shape[1]]  # each draft's verify, in order
    assert len(blocks) == len(drafts) >= 20
    chains = [torch.equal(block[1:], logits[0].argmax(-1)) for block, logits in zip(blocks, drafts)]
    assert all(chains) if sampling == "match" else not all(chains)
