"""Served as measured (drafter/serving/public_loop.py): the public `dflash` 0.1.0 loop, with its own model class
loading our export, accepts exactly as our `dflash` decode, step by step, for every drafter variant;
and the step comparison tells a rounding tie from a semantic difference."""
import pytest
import torch

from conftest import VARIANTS, randomize_
from drafter.config import DrafterVariant
from drafter.models import DFlash2DraftModel, drafter_class
from drafter.models.configure import drafter_config
from drafter.serving.public_loop import LoopSteps, compare, load_public, our_steps, public_steps
from drafter.target_model.model import random_qwen3

pytest.importorskip("dflash.model")

VOCAB, BLOCK, PROMPT, NEW_TOKENS = 8, 8, 12, 40
CONTRACT_VARIANTS = {**VARIANTS, "dflash2_full": DrafterVariant(arch="dflash2", conv_group_size=16,
                                                                selector_rank=8, selector_top_k=4)}


@pytest.fixture(scope="module")
def spread_target():
    """An 8-token target with spread logits (LM head scaled up): random drafters match its greedy
    tokens often enough for partial acceptance, and no top-2 is near a tie."""
    target = randomize_(random_qwen3(vocab_size=VOCAB, num_hidden_layers=4), seed=0, scale=0.3)
    with torch.no_grad():
        target.lm_head.weight.mul_(3.0)
    return target


def spread_drafter(target, variant: DrafterVariant):
    """A random drafter of `variant`, its logits spread by the target's scaled head; a DFlash2
    selector's pair scores as large as the logits' gaps, so that the chain re-ranks."""
    config = drafter_config(target.config, num_layers=2, block_size=BLOCK, mask_token_id=VOCAB - 1,
                            target_layer_ids=[1, 2], variant=variant)
    drafter = randomize_(drafter_class(config)(config), seed=1).eval()
    if isinstance(drafter, DFlash2DraftModel):
        with torch.no_grad():
            drafter.candidate_selector.successor_codebook.mul_(30.0)
    return drafter


@pytest.mark.parametrize("variant", CONTRACT_VARIANTS)
def test_public_loop_accepts_as_ours_step_by_step(spread_target, tmp_path, variant):
    """Prompts longer than every window, ~35 blocks each with partial acceptance: every step drafts
    the same tokens and commits as many in both loops, and the drafted path's scores agree to
    rounding (1e-4) at every slot of every step. Seen failing: a window one position longer (the
    training and inference masks alike, either interval); a sliding layer's cache cropped as without
    past recording (the block's keys counted in its window - 1) or to window - 3 (window - 2 is
    still exact: the next block's new context always holds its root); the selector scoring a slot
    with the previous slot's state, or after the wrong predecessor."""
    drafter = spread_drafter(spread_target, CONTRACT_VARIANTS[variant])
    drafter.save_pretrained(tmp_path)
    public = load_public(tmp_path, torch.float32, "cpu")
    assert type(public).__name__ == type(drafter).__name__
    windows = [a.window for a in drafter.layer_attention if a.window is not None]
    assert all(PROMPT > window for window in windows)
    committed = []
    for seed in (0, 1):
        prompt = torch.randint(0, VOCAB - 1, (1, PROMPT), generator=torch.Generator().manual_seed(seed))
        ours = our_steps(spread_target, drafter, prompt, NEW_TOKENS)
        agreement = compare(ours, public_steps(spread_target, public, drafter, prompt, NEW_TOKENS), 1e-3)
        assert agreement.identical, agreement.difference
        assert agreement.score_gap < 1e-4
        assert agreement.steps >= 25
        committed += ours.acceptance_lengths
    assert any(1 < length < BLOCK for length in committed)  # partial acceptance, not all-or-nothing


def steps(blocks, lengths, draft_top, target_top, draft_logits=None, output_ids=(1, 2, 3)) -> LoopSteps:
    """A recorded decode by hand: per step, per slot or row, (token, score) pairs best first."""
    def top(rows):
        return (torch.tensor([[s for _, s in row] for row in rows]),
                torch.tensor([[t for t, _ in row] for row in rows]))
    return LoopSteps(lengths, list(output_ids), blocks, [top(r) for r in draft_top],
                     [top(r) for r in (draft_logits or draft_top)], [top(r) for r in target_top])


ROWS = [[(4, 5.0), (1, 1.0)], [(6, 5.0), (1, 1.0)], [(3, 5.0), (1, 1.0)]]


def test_compare_tells_ties_from_semantic_differences():
    """By hand: identical; a swapped near-tie (tie, with its margin); a swap where the loops' logits
    differ by more than the tolerance (semantic); a drafted token that is not the best by the chain
    rule on its own states (semantic); same drafts with a different verify argmax (target); equal
    steps but one loop ran on (length)."""
    near = [[(4, 3.0), (5, 1.0)], [(6, 2.0004), (2, 2.0)]]
    swapped = [[(4, 3.0), (5, 1.0)], [(2, 2.0002), (6, 2.0001)]]
    far = [[(4, 3.0), (5, 1.0)], [(2, 2.5), (6, 2.0)]]
    ours = steps([[0, 4, 6]], [3], [near], [ROWS])
    same = compare(ours, steps([[0, 4, 6]], [3], [near], [ROWS]), 1e-3)
    assert same.identical and same.score_gap == 0 and same.ours_tau == same.public_tau == 3
    tie = compare(ours, steps([[0, 4, 2]], [2], [swapped], [ROWS]), 1e-3).difference
    assert (tie.step, tie.kind, tie.position, tie.tie) == (0, "draft", 2, True)
    assert tie.margin == pytest.approx(1e-4, abs=1e-5) and tie.gap == pytest.approx(3e-4, abs=1e-5)
    semantic = compare(ours, steps([[0, 4, 2]], [2], [far], [ROWS]), 1e-3).difference
    assert (semantic.kind, semantic.tie, semantic.gap) == ("draft", False, pytest.approx(0.5))
    off_rule = compare(steps([[0, 4, 2]], [3], [near], [ROWS]), steps([[0, 4, 6]], [3], [near], [ROWS]), 1e-3)
    assert off_rule.difference.gap == 0 and not off_rule.difference.tie

    sure = [[(4, 3.0), (5, 1.0)], [(6, 2.0), (2, 0.5)]]
    sure_ours = steps([[0, 4, 6]], [3], [sure], [ROWS])
    other_row = [ROWS[0], [(1, 5.0), (6, 4.9)], ROWS[2]]
    target = compare(sure_ours, steps([[0, 4, 6]], [2], [sure], [other_row]), 1e-3).difference
    assert (target.kind, target.position, target.tie) == ("target", 1, False)
    longer = compare(sure_ours, steps([[0, 4, 6]], [3], [sure], [ROWS], output_ids=(1, 2, 3, 4)), 1e-3)
    assert not longer.identical and (longer.difference.kind, longer.difference.tie) == ("length", False)


def test_compare_tells_a_dflash2_candidate_edge_tie():
    """DFlash2, 2 candidates: our selector drafts 7, our 2nd most likely token; the public loop's
    candidates miss 7, whose logit there is a hair below its 2nd (a tie at the candidates' edge,
    margin 3e-5), unless the loops' logits differ by more than the tolerance (semantic)."""
    ours = steps([[0, 7]], [1], [[[(7, 5.0), (3, 4.0)]]], [ROWS[:2]],
                 draft_logits=[[[(3, 1.0), (7, 0.9), (5, 0.89995)]]])
    edge = steps([[0, 3]], [2], [[[(3, 4.0), (5, 2.0)]]], [ROWS[:2]],
                 draft_logits=[[[(3, 1.0), (5, 0.90003), (7, 0.9)]]])
    tie = compare(ours, edge, 1e-3, candidates=2).difference
    assert (tie.kind, tie.position, tie.tie) == ("draft", 1, True)
    assert tie.margin == pytest.approx(3e-5, abs=1e-6) and tie.gap == pytest.approx(8e-5, abs=1e-6)
    wide = steps([[0, 3]], [2], [[[(3, 4.0), (5, 2.0)]]], [ROWS[:2]],
                 draft_logits=[[[(3, 1.0), (5, 0.95), (7, 0.9)]]])
    assert not compare(ours, wide, 1e-3, candidates=2).difference.tie
