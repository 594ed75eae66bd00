"""Our `dflash` decode held to the public `dflash` 0.1.0 loop, step by step.

A tau is worth something only if serving reproduces it. `public_steps` runs the package's own
`dflash_generate` with the package's own model class (DFlashDraftModel or DFlash2DraftModel, by the
export's `architectures`; `load_public`) on our export; `our_steps` runs `drafter.serving.decode.generate`
with method "dflash". Both record each step through forward hooks: the block the target verified
(root and drafted tokens), the two best tokens of the drafted path at every slot with their scores
(what the path takes the argmax of: the logits, or a DFlash2 selector's scores after the slot's
predecessor, `chain_top`), the drafter's most likely tokens there, and the target's two best tokens
at every verify row.

`compare` walks both records: identical when every step drafted the same tokens and committed as
many. Otherwise the first step that differs is classified, as a tie (rounding flipped a decision
that was within `tolerance`) or semantic (the loops compute different things there: a different
context, window or chain rule):
  "draft": the drafted tokens differ at a slot. A tie when each loop's token is the best by the
    chain rule on its own states, the loops' logits there agree within `tolerance` on every token
    both rank high, and the decision was that close: the two tokens' chain scores (a near-tie at
    the top), or, where one loop's token is at the edge of the other's DFlash2 candidates, that
    loop's K-th logit and the token's (a near-tie, or an exact one that topk broke differently).
  "target": the same drafts, but the target's argmax differs at a verify row. A tie when both loops
    rank the same two tokens on top there, within `tolerance` of each other and of each other's.
  "length": one loop stopped first with everything before equal (never a tie).
`score_gap`, the largest difference of the recorded chain scores over the steps that drafted alike,
says how far apart the two implementations are where they agree (rounding: about 1e-5 in fp32).
"""
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

from drafter.serving.decode import DecodeSettings, generate


@dataclass
class LoopSteps:
    """One loop's decode of one prompt: per step the verified block, the drafted path's top-2
    (scores [slots, 2], tokens [slots, 2]), the drafter's top logits ([slots, k], tokens: k = 2, or
    a DFlash2 selector's K + 1) and the target's top-2 (logits [rows, 2], tokens)."""
    acceptance_lengths: list[int]
    output_ids: list[int]
    blocks: list[list[int]]
    draft_top: list[tuple[torch.Tensor, torch.Tensor]]
    draft_logits: list[tuple[torch.Tensor, torch.Tensor]]
    target_top: list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class StepDifference:
    """Where two loops first part: the step, its kind ("draft", "target" or "length"), the block
    slot (draft: 1 = the first drafted token) or verify row (target), each loop's two best
    (token, score) there, the margin of the decision that flipped (module docstring), the largest
    difference of the two loops' logits (draft) or scores (target) on the tokens both rank high
    (None when they share none), and tie."""
    step: int
    kind: str
    position: int | None
    ours: list[tuple[int, float]] | None
    theirs: list[tuple[int, float]] | None
    margin: float | None
    gap: float | None
    tie: bool


@dataclass
class PublicAgreement:
    """How one prompt's decode by our loop compares with the public loop's."""
    identical: bool
    steps: int
    ours_tau: float
    public_tau: float
    score_gap: float
    difference: StepDifference | None


def public_class(directory):
    """The public package's model class for an exported drafter: the class of the same name as ours
    (its config's `architectures`, as the serving stacks choose it), DFlashDraftModel where it names none."""
    try:
        from dflash import model as public_model
    except ImportError as error:
        raise ImportError("the public loop needs the dflash package: "
                          "pip install --no-deps dflash==0.1.0") from error
    architectures = json.loads((Path(directory) / "config.json").read_text()).get("architectures") or []
    named = [getattr(public_model, name) for name in architectures if hasattr(public_model, name)]
    return named[0] if named else public_model.DFlashDraftModel


def load_public(directory, dtype: torch.dtype, device) -> torch.nn.Module:
    """Our export at `directory` as the public package loads it, in eval mode."""
    return public_class(directory).from_pretrained(directory, dtype=dtype).to(device).eval()


class _StepRecorder:
    """Forward hooks on a loop's drafter and on the target: each draft forward opens a step, the
    target forward after it (the verify) closes it. The prefill, and a recurrent target's recompute
    after a verify, find no open step and are skipped."""

    def __init__(self, drafter, logits_of):
        self.drafter, self.logits_of = drafter, logits_of
        self.logit_ranks = 2 if drafter.chain_candidates is None else drafter.chain_candidates + 1
        self.blocks, self.draft_top, self.draft_logits, self.target_top = [], [], [], []
        self.pending = None

    def on_draft(self, module, args, output):
        hidden = output.reshape(-1, *output.shape[-2:])[0, 1:]  # the drafted slots' states [L, H]
        self.pending = (hidden, self.logits_of(hidden).float())

    def on_verify(self, module, args, output):
        if self.pending is None:
            return
        hidden, logits = self.pending
        block = args[0][0]
        self.blocks.append(block.tolist())
        self.draft_top.append(self.drafter.chain_top(hidden, logits, block[:-1]))
        self.draft_logits.append(logits.topk(self.logit_ranks, dim=-1))
        self.target_top.append(output.logits[0].float().topk(2, dim=-1))
        self.pending = None

    @contextmanager
    def hooks(self, draft_module, target):
        handles = [draft_module.register_forward_hook(self.on_draft),
                   target.register_forward_hook(self.on_verify)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def steps(self, acceptance_lengths, output_ids) -> LoopSteps:
        return LoopSteps(list(acceptance_lengths), list(output_ids), self.blocks, self.draft_top,
                         self.draft_logits, self.target_top)


def our_steps(target, drafter, prompt_ids, max_new_tokens: int, stop_token_ids=()) -> LoopSteps:
    """Our `dflash` decode of `prompt_ids` [1, n], recorded step by step."""
    head = target.get_output_embeddings()
    recorder = _StepRecorder(drafter, lambda hidden: head(hidden.to(target.dtype)))
    with recorder.hooks(drafter, target):
        result = generate(target, prompt_ids, max_new_tokens, stop_token_ids, drafter=drafter,
                          settings=DecodeSettings("dflash"))
    return recorder.steps(result.acceptance_lengths, result.output_ids)


def public_steps(target, public, drafter, prompt_ids, max_new_tokens: int, stop_token_ids=()) -> LoopSteps:
    """The public `dflash_generate` with `public` (`load_public` of `drafter`'s export) on
    `prompt_ids`, recorded step by step; `drafter` only scores the recorded states (`chain_top`)."""
    from dflash import model as public_model

    head = target.get_output_embeddings()
    recorder = _StepRecorder(drafter, lambda hidden: public.compute_logits(hidden, head))
    clock = mock.patch.object(public_model, "_cuda_time", time.perf_counter)  # it syncs CUDA to time steps
    with recorder.hooks(public, target), clock:
        result = public_model.dflash_generate(public, target, prompt_ids, max_new_tokens,
                                              list(stop_token_ids) or None, return_stats=True)
    return recorder.steps(result.acceptance_lengths, result.output_ids[0, prompt_ids.shape[1]:].tolist())


def _ranked(top, index: int) -> list[tuple[int, float]]:
    """(token, score) pairs of one row of a recorded top-k, best first."""
    scores, tokens = top
    return [(int(t), float(s)) for t, s in zip(tokens[index], scores[index])]


def _shared_gap(ours, theirs) -> float | None:
    """The largest difference of two (token, score) lists on the tokens both hold (None: no such token)."""
    theirs = dict(theirs)
    gaps = [abs(score - theirs[token]) for token, score in ours if token in theirs]
    return max(gaps) if gaps else None


def _target_difference(step: int, row: int, ours: LoopSteps, theirs: LoopSteps, tolerance: float):
    """The same drafts, but the target's argmax differs at verify `row` (module docstring)."""
    ours_top, theirs_top = _ranked(ours.target_top[step], row), _ranked(theirs.target_top[step], row)
    margin = ours_top[0][1] - ours_top[1][1]
    same_pair = {t for t, _ in ours_top} == {t for t, _ in theirs_top}
    gap = _shared_gap(ours_top, theirs_top) if same_pair else None
    tie = gap is not None and max(margin, theirs_top[0][1] - theirs_top[1][1], gap) < tolerance
    return StepDifference(step, "target", row, ours_top, theirs_top, margin, gap, tie)


def _decision_margin(token: int, top: list[tuple[int, float]], logits: list[tuple[int, float]],
                     candidates: int | None) -> float:
    """How close one loop came to drafting `token` (the other loop's) instead of its own best
    `top[0]`: the gap of their chain scores when `token` is among its best two; when `token`'s logit
    is not above its K-th (`logits`: its best K + 1), so that its DFlash2 candidates could miss
    `token`, the K-th logit minus `token`'s (0 for an exact tie, which topk breaks as it likes);
    else at least its top-1 minus top-2 chain score."""
    scores = dict(top)
    if token in scores:
        return top[0][1] - scores[token]
    if candidates is not None:
        edge = logits[candidates - 1][1]
        value = dict(logits).get(token, logits[-1][1])  # not listed: at most the (K+1)-th
        if value <= edge:
            return edge - value
    return top[0][1] - top[1][1]


def _draft_difference(step: int, slot: int, ours: LoopSteps, theirs: LoopSteps, tolerance: float,
                      candidates: int | None) -> StepDifference:
    """The drafted tokens differ at block `slot` (module docstring)."""
    i = slot - 1
    ours_top, theirs_top = _ranked(ours.draft_top[step], i), _ranked(theirs.draft_top[step], i)
    ours_logits, theirs_logits = _ranked(ours.draft_logits[step], i), _ranked(theirs.draft_logits[step], i)
    ours_token, theirs_token = ours.blocks[step][slot], theirs.blocks[step][slot]
    rules_hold = ours_top[0][0] == ours_token and theirs_top[0][0] == theirs_token
    margin = min(_decision_margin(theirs_token, ours_top, ours_logits, candidates),
                 _decision_margin(ours_token, theirs_top, theirs_logits, candidates))
    gap = _shared_gap(ours_logits, theirs_logits)
    tie = rules_hold and gap is not None and max(gap, margin) < tolerance
    return StepDifference(step, "draft", slot, ours_top, theirs_top, margin, gap, tie)


def _mean_tau(lengths: list[int]) -> float:
    return sum(lengths) / len(lengths) if lengths else 0.0


def compare(ours: LoopSteps, theirs: LoopSteps, tolerance: float,
            candidates: int | None = None) -> PublicAgreement:
    """Step by step (module docstring): identical, or the first difference, classified; `candidates`
    is the drafter's `chain_candidates`."""
    score_gap, difference = 0.0, None
    for step, (block, public_block) in enumerate(zip(ours.blocks, theirs.blocks)):
        if block != public_block:
            slot = next(i for i, (a, b) in enumerate(zip(block, public_block)) if a != b)
            difference = _draft_difference(step, slot, ours, theirs, tolerance, candidates)
            break
        (scores, tokens), (public_scores, public_tokens) = ours.draft_top[step], theirs.draft_top[step]
        same = tokens == public_tokens
        score_gap = max(score_gap, float(((scores - public_scores).abs() * same).max()))
        if ours.acceptance_lengths[step] != theirs.acceptance_lengths[step]:
            # the row after the shorter acceptance: one loop's target took the drafted token there
            row = min(ours.acceptance_lengths[step], theirs.acceptance_lengths[step]) - 1
            difference = _target_difference(step, row, ours, theirs, tolerance)
            break
    else:
        if ours.acceptance_lengths != theirs.acceptance_lengths or ours.output_ids != theirs.output_ids:
            step = min(len(ours.blocks), len(theirs.blocks))
            difference = StepDifference(step, "length", None, None, None, None, None, False)
    return PublicAgreement(difference is None, len(ours.acceptance_lengths), _mean_tau(ours.acceptance_lengths),
                           _mean_tau(theirs.acceptance_lengths), score_gap, difference)


# over six: both loops' inputs (one target, our drafter and its public copy, one prompt) and the tolerance
def check_public(target, drafter, public, prompt_ids, max_new_tokens: int, stop_token_ids=(),
                 tolerance: float = 1e-3) -> PublicAgreement:
    """Decode `prompt_ids` with both loops and compare them (`compare`)."""
    ours = our_steps(target, drafter, prompt_ids, max_new_tokens, stop_token_ids)
    theirs = public_steps(target, public, drafter, prompt_ids, max_new_tokens, stop_token_ids)
    return compare(ours, theirs, tolerance, drafter.chain_candidates)
