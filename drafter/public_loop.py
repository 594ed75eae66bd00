"""Our `dflash` decode held to the public `dflash` 0.1.0 loop, step by step.

A tau is worth something only if serving reproduces it. `public_steps` runs the package's own
`dflash_generate` with the package's own model class (DFlashDraftModel or DFlash2DraftModel, by the
export's `architectures`; `load_public`) on our export; `our_steps` runs `drafter.decode.generate`
with method "dflash". Both record each step through forward hooks: the block the target verified
(root and drafted tokens), the two best tokens of the drafted path at every slot with their scores
(what the path takes the argmax of: the logits, or a DFlash2 selector's scores after the slot's
predecessor, `chain_top`), and the target's two best tokens at every verify row.

`compare` walks both records: identical when every step drafted the same tokens and committed as
many. Otherwise the first step that differs is classified. "draft": the drafted tokens differ at a
slot. "target": the same drafts, but the target's argmax differs at a verify row. "length": one
loop stopped first with everything before equal. A "draft" or "target" difference is a tie when
both loops rank the same two tokens on top there, each within `tolerance` of the other, and the
two loops' scores of them also agree within `tolerance`: rounding swapped a near-tie. Anything else
is semantic: the loops compute different things there (a different context, window or chain).
`score_gap`, the largest difference of the recorded scores over the steps that drafted alike, says
how far apart the two implementations are where they agree (rounding: about 1e-5 in fp32).
"""
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

from drafter.decode import generate


@dataclass
class LoopSteps:
    """One loop's decode of one prompt: per step the verified block, the drafted path's top-2
    (scores [slots, 2], tokens [slots, 2]) and the target's top-2 (logits [rows, 2], tokens)."""
    acceptance_lengths: list[int]
    output_ids: list[int]
    blocks: list[list[int]]
    draft_top: list[tuple[torch.Tensor, torch.Tensor]]
    target_top: list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class StepDifference:
    """Where two loops first part: the step, its kind ("draft", "target" or "length"), the block
    slot (draft: 1 = the first drafted token) or verify row (target) and each loop's two best
    (token, score) there, our top-1 minus top-2 margin, the largest difference of the two loops'
    scores of those tokens (None when they rank different tokens on top), and tie."""
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
    """The public package's model class for an exported drafter: DFlash2DraftModel or DFlashDraftModel,
    by the config's `architectures`, as the serving stacks choose it."""
    try:
        from dflash import model as public_model
    except ImportError as error:
        raise ImportError("the public loop needs the dflash package: "
                          "pip install --no-deps dflash==0.1.0") from error
    architectures = json.loads((Path(directory) / "config.json").read_text()).get("architectures") or []
    dflash2 = "DFlash2DraftModel" in architectures
    return public_model.DFlash2DraftModel if dflash2 else public_model.DFlashDraftModel


def load_public(directory, dtype: torch.dtype, device) -> torch.nn.Module:
    """Our export at `directory` as the public package loads it, in eval mode."""
    return public_class(directory).from_pretrained(directory, dtype=dtype).to(device).eval()


class _StepRecorder:
    """Forward hooks on a loop's drafter and on the target: each draft forward opens a step, the
    target forward after it (the verify) closes it. The prefill, and a recurrent target's recompute
    after a verify, find no open step and are skipped."""

    def __init__(self, drafter, logits_of):
        self.drafter, self.logits_of = drafter, logits_of
        self.blocks, self.draft_top, self.target_top = [], [], []
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
                         self.target_top)


def our_steps(target, drafter, prompt_ids, max_new_tokens: int, stop_token_ids=()) -> LoopSteps:
    """Our `dflash` decode of `prompt_ids` [1, n], recorded step by step."""
    head = target.get_output_embeddings()
    recorder = _StepRecorder(drafter, lambda hidden: head(hidden.to(target.dtype)))
    with recorder.hooks(drafter, target):
        result = generate(target, prompt_ids, max_new_tokens, stop_token_ids, method="dflash", drafter=drafter)
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


def _top_two(top, index: int) -> list[tuple[int, float]]:
    scores, tokens = top
    return [(int(t), float(s)) for t, s in zip(tokens[index], scores[index])]


def _difference(step: int, kind: str, position: int, ours, theirs, tolerance: float) -> StepDifference:
    """A draft or target difference at one slot or row, from each loop's top-2 there."""
    ours, theirs = _top_two(*ours), _top_two(*theirs)
    margin = ours[0][1] - ours[1][1]
    same_pair = {t for t, _ in ours} == {t for t, _ in theirs}
    gap = max(abs(score - dict(theirs)[token]) for token, score in ours) if same_pair else None
    tie = gap is not None and max(margin, theirs[0][1] - theirs[1][1], gap) < tolerance
    return StepDifference(step, kind, position, ours, theirs, margin, gap, tie)


def _mean_tau(lengths: list[int]) -> float:
    return sum(lengths) / len(lengths) if lengths else 0.0


def compare(ours: LoopSteps, theirs: LoopSteps, tolerance: float) -> PublicAgreement:
    """Step by step (module docstring): identical, or the first difference, classified."""
    score_gap, difference = 0.0, None
    for step, (block, public_block) in enumerate(zip(ours.blocks, theirs.blocks)):
        if block != public_block:
            slot = next(i for i, (a, b) in enumerate(zip(block, public_block)) if a != b)
            difference = _difference(step, "draft", slot, (ours.draft_top[step], slot - 1),
                                     (theirs.draft_top[step], slot - 1), tolerance)
            break
        (scores, tokens), (public_scores, public_tokens) = ours.draft_top[step], theirs.draft_top[step]
        same = tokens == public_tokens
        score_gap = max(score_gap, float(((scores - public_scores).abs() * same).max()))
        if ours.acceptance_lengths[step] != theirs.acceptance_lengths[step]:
            # the row after the shorter acceptance: one loop's target took the drafted token there
            row = min(ours.acceptance_lengths[step], theirs.acceptance_lengths[step]) - 1
            difference = _difference(step, "target", row, (ours.target_top[step], row),
                                     (theirs.target_top[step], row), tolerance)
            break
    else:
        if ours.acceptance_lengths != theirs.acceptance_lengths or ours.output_ids != theirs.output_ids:
            step = min(len(ours.blocks), len(theirs.blocks))
            difference = StepDifference(step, "length", None, None, None, None, None, False)
    return PublicAgreement(difference is None, len(ours.acceptance_lengths), _mean_tau(ours.acceptance_lengths),
                           _mean_tau(theirs.acceptance_lengths), score_gap, difference)


def check_public(target, drafter, public, prompt_ids, max_new_tokens: int, stop_token_ids=(),
                 tolerance: float = 1e-3) -> PublicAgreement:
    """Decode `prompt_ids` with both loops and compare them (`compare`)."""
    ours = our_steps(target, drafter, prompt_ids, max_new_tokens, stop_token_ids)
    theirs = public_steps(target, public, drafter, prompt_ids, max_new_tokens, stop_token_ids)
    return compare(ours, theirs, tolerance)
