"""Served acceptance length (tau) during training: replayed under teacher forcing, and generated.

tau is the tokens committed per target verify forward, bonus included (docs/design.md, "tau"). The
random-anchor metrics of `training.metrics.rank_metrics` (`anchor_streak`, ...) are not tau: they
average the accepted length over uniformly random anchors, while serving lands on one anchor every
L(p) tokens, so a run of L accepted tokens is one step when served but L anchors, each with a long
streak, there.

Replay (`replay_steps`, `replayed_tau`). One masked drafter forward per chunk of anchors scores a block
at every response position p (the training forward: the block sees the target's features of
positions < p); `anchor_acceptance` turns each block into the drafted tokens a verify at p would
accept when the target's tokens are the text's: for `dflash` the leading slots where the drafter's
path (its argmax; a DFlash2 drafter's selector chain, each slot's predecessor the text's token, which
is the served chain while every pick is right) is the text's token, for `ddtree@B` the depth reached
by walking the best-first tree of B nodes (the drafter's `block_trees`: the block's marginals,
or a DFlash2 drafter's selector scores, as serving builds it) along the text. Then serving is replayed as
`drafter.serving.decode.generate` runs it, once per response, i.e. per maximal run [s, e) of supervised
positions (one assistant turn; every turn is a response, as eval/ddtree_accept.py counts turns):
the prefill yields token s, so the first step's anchor is p = s; a step at p commits
min(accepted(p) + 1, e - 1 - p) tokens (the drafted tokens accepted and the bonus, cut at the turn's
last token, which is its stop token) and moves p there; the response ends at p = e - 1.
tau of a response = mean tokens per step; `tau_<method>` = mean over responses with at least one
step (eval/ddtree_accept.py's `tau`).

When the text is the target's own greedy output this is the served tau at temperature 0, step for
step (tests/test_served.py). Otherwise it is the tau the drafter would get if the target had written
that text. One known gap: `generate`'s `dflash` shortens its last blocks when fewer than B positions
remain before `max_new_tokens` (as the public loop does), which replay does not model; a response
cut by `max_new_tokens` can differ in its last steps.

Generation (`generation_tau`): the target and the drafter decode a fixed prompt set through
`generate` at temperature 0, this rank's share of it (`PromptShare`), bounded in time; it returns
[sum, count] pairs for the caller to all-reduce. Under a tensor-parallel target the members of a group
decode the group's share in lockstep (every forward of the sharded target is a collective over the
group), agree on when time is up, and one of them counts the group's responses.
"""
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from drafter.pipeline.benchmarks import load_prompts
from drafter.pipeline.chat_template import prompt_token_ids
from drafter.losses.lm_head import chunk_rows_for
from drafter.models.blocks import DraftingSetup, FeatureBatch, anchor_candidates, build_blocks, drafter_hidden
from drafter.serving.decode import DecodeSettings, generate, speculative_methods, tree_verify_refusal
from drafter.target_model.tensor_parallel import TPGroup
from drafter.tree.ddtree import teacher_forced_accept


# ---------------------------------------------------------------------------------------------
# Replay under teacher forcing
# ---------------------------------------------------------------------------------------------

def every_anchor(loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors [b, A], valid [b, A]): every position p with p and p + 1 supervised (training's "pair"
    rule, `anchor_candidates`), in order; rows with fewer get `valid=False` filler anchors at 0."""
    mask = loss_mask.bool()
    candidates = anchor_candidates(mask, "pair")
    count = candidates.sum(1)
    width = max(int(count.max()), 1)
    order = torch.argsort((~candidates).to(torch.uint8), dim=1, stable=True)[:, :width]
    valid = torch.arange(width, device=mask.device) < count[:, None]
    return torch.where(valid, order, 0), valid


@dataclass
class AnchorBlocks:
    """One chunk of scored blocks: the drafter's states and logits at block slots 1..B-1, the text's
    labels there and each slot's predecessor (the anchor, then the text), and where the anchors are."""
    rows: torch.Tensor           # [n] batch row of each anchor (CPU)
    positions: torch.Tensor      # [n] its position (CPU)
    hidden: torch.Tensor         # [n, B-1, H]
    logits: torch.Tensor         # [n, B-1, V] fp32
    labels: torch.Tensor         # [n, B-1]
    predecessors: torch.Tensor   # [n, B-1]


@torch.no_grad()
def scored_blocks(setup: DraftingSetup, batch: FeatureBatch):
    """The drafter's block at every anchor of the batch (`every_anchor`), chunk by chunk (AnchorBlocks).

    batch.features [b, T, K*H] are `target.context_features` of batch.input_ids (right-padded). At most
    `setup.blocks_per_forward` blocks (all rows together) go through the drafter at once, and at most
    `setup.chunk_bytes` of fp32 logits exist at once.
    """
    drafter, target, input_ids, loss_mask = setup.drafter, setup.target, batch.input_ids, batch.loss_mask
    b = input_ids.shape[0]
    block_size = drafter.block_size
    rows_per_chunk = chunk_rows_for(drafter.head_weight(target).shape[0] * (block_size - 1), setup.chunk_bytes)
    anchors, valid = every_anchor(loss_mask)
    per_row = max(1, setup.blocks_per_forward // b)
    for first in range(0, anchors.shape[1], per_row):
        chunk, chunk_valid = anchors[:, first:first + per_row], valid[:, first:first + per_row]
        if not chunk_valid.any():
            continue
        blocks = build_blocks(input_ids, loss_mask, chunk, chunk_valid, block_size, drafter.mask_token_id,
                              gamma=1.0)
        hidden = drafter_hidden(drafter, target, batch.features, blocks, setup.attention)[chunk_valid][:, 1:]
        labels = blocks.labels[chunk_valid][:, 1:]
        predecessors = blocks.labels[chunk_valid][:, :-1]  # the anchor, then the text
        rows, positions = chunk_valid.nonzero(as_tuple=True)
        positions = chunk[rows, positions]
        for start in range(0, len(labels), rows_per_chunk):
            part = slice(start, start + rows_per_chunk)
            # as DFlashDraftModel.draft_logits computes them at serving time
            logits = drafter.head_logits(target, hidden[part])
            yield AnchorBlocks(rows[part].cpu(), positions[part].cpu(), hidden[part], logits, labels[part],
                               predecessors[part])


@torch.no_grad()
def anchor_acceptance(setup: DraftingSetup, batch: FeatureBatch) -> dict[str, torch.Tensor]:
    """Drafted tokens a verify at each anchor would accept, per method (`dflash` and `ddtree@B` for the
    setup's budgets): {method: [b, T] long on the CPU}, -1 where p is no anchor. The labels are the
    text as it goes on, past the response's end too (`serve_walk` cuts every step at that end)."""
    return acceptance_and_slot_hits(setup, batch)[0]


@torch.no_grad()
def acceptance_and_slot_hits(setup: DraftingSetup,
                             batch: FeatureBatch) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`anchor_acceptance`, and from the same blocks each slot's top-1 accuracy at every anchor:
    [B-1, 2] (hits, count) for slots 1..B-1, slot k counted where its label x_{p+k} is supervised.
    Every anchor, not training's random draw of a few: the learning curve's slot accuracy."""
    drafter = setup.drafter
    chain, *trees = speculative_methods(setup.budgets)
    accepted = {str(m): torch.full(batch.input_ids.shape, -1, dtype=torch.long) for m in (chain, *trees)}
    supervised = batch.loss_mask.bool().cpu()
    length = supervised.shape[1]
    slot_hits = torch.zeros(drafter.block_size - 1, 2, dtype=torch.float64)
    for part in scored_blocks(setup, batch):
        where = (part.rows, part.positions)
        drafted = drafter.chain_picks(part.hidden, part.logits, part.predecessors)
        hits = drafted == part.labels
        accepted[str(chain)][where] = hits.long().cumprod(-1).sum(-1).cpu()
        label_at = part.positions[:, None] + torch.arange(1, drafter.block_size)
        counted = (label_at < length) & supervised[part.rows[:, None], label_at.clamp(max=length - 1)]
        slot_hits[:, 0] += (hits.cpu() & counted).sum(0)
        slot_hits[:, 1] += counted.sum(0)
        for method in trees:
            tree = drafter.block_trees(part.hidden, part.logits, part.predecessors[:, 0], method.budget,
                                       setup.tree_backend)
            accepted[str(method)][where] = (teacher_forced_accept(tree, part.labels) - 1).cpu()
    return accepted, slot_hits


def walks_of(accepted: dict[str, torch.Tensor], loss_mask: torch.Tensor) -> dict[str, list[list[int]]]:
    """Tokens per step of every response of the batch (row by row, turn by turn), per method, from
    the accepted tokens at each anchor (`anchor_acceptance`)."""
    spans = [response_spans(row) for row in loss_mask.tolist()]
    walks = {}
    for method, table in accepted.items():
        table = table.tolist()
        walks[method] = [serve_walk(table[row], start, end)
                         for row, row_spans in enumerate(spans) for start, end in row_spans]
    return walks


def response_spans(loss_mask_row: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of supervised positions (one assistant turn each)."""
    spans, start = [], None
    for position, supervised in enumerate(list(loss_mask_row) + [0]):
        if supervised and start is None:
            start = position
        elif not supervised and start is not None:
            spans.append((start, position))
            start = None
    return spans


def serve_walk(accepted: list[int], start: int, end: int) -> list[int]:
    """Tokens committed per step when serving the response at [start, end): the prefill gives the
    token at `start`, a step at anchor p commits accepted[p] + 1 (the bonus included), at most up
    to the response's last token end - 1."""
    steps, p = [], start
    while p < end - 1:
        if accepted[p] < 0:
            raise ValueError(f"position {p} of the response at [{start}, {end}) was not scored")
        step = min(accepted[p] + 1, end - 1 - p)
        steps.append(step)
        p += step
    return steps


def replay_steps(setup: DraftingSetup, batch: FeatureBatch) -> dict[str, list[list[int]]]:
    """Tokens per step of every response of the batch (row by row, turn by turn), per method, as
    `generate` would commit them serving that text (module docstring)."""
    return walks_of(anchor_acceptance(setup, batch), batch.loss_mask)


def mean_tau(steps_per_response: list[list[int]]) -> torch.Tensor:
    """[sum over responses of the response's mean tokens per step, responses] (float64); responses
    without a step (a single token) are left out, as eval/ddtree_accept.py does."""
    taus = [sum(steps) / len(steps) for steps in steps_per_response if steps]
    return torch.tensor([sum(taus), len(taus)], dtype=torch.float64)


def replayed_tau(setup: DraftingSetup, batch: FeatureBatch) -> dict[str, torch.Tensor]:
    """{`tau_dflash`, `tau_ddtree@B`: [sum, count]} over the batch's responses, and `replay_acc_pos`:
    [B-1, 2] each slot's top-1 hits and count over every anchor (`acceptance_and_slot_hits`), to be
    summed over batches and ranks and divided (metric_sums.finalize_metrics)."""
    accepted, slot_hits = acceptance_and_slot_hits(setup, batch)
    steps = walks_of(accepted, batch.loss_mask)
    return {**{f"tau_{method}": mean_tau(responses) for method, responses in steps.items()},
            "replay_acc_pos": slot_hits}


# ---------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------

def held_out_prompts(dataset, max_prompts: int, seed: int) -> list[list[int]]:
    """The prompt side (tokens before the first supervised position) of up to `max_prompts` rows of a
    prepared dataset, taken in a seeded shuffle of its rows (a numpy Generator of its own: the
    global RNGs are not touched). Rows whose first token is supervised are skipped."""
    prompts = []
    for index in np.random.default_rng(seed).permutation(len(dataset)):
        if len(prompts) == max_prompts:
            break
        row = dataset[int(index)]
        first = next((i for i, supervised in enumerate(row["loss_mask"]) if supervised), 0)
        if first > 0:
            prompts.append(list(row["input_ids"][:first]))
    return prompts


def bench_prompts(spec: str, tokenizer, enable_thinking: bool, max_prompts: int) -> list[list[int]]:
    """Token ids of the first user turn (after any history) of up to `max_prompts` prompts of a
    benchmark (`drafter.pipeline.benchmarks.load_prompts`: a hub name or a JSONL file), rendered as
    eval/ddtree_accept.py renders them. Later turns of multi-turn prompts are not used."""
    _, prompts = load_prompts(spec, max_prompts)
    return [prompt_token_ids(tokenizer, list(p.history) + [{"role": "user", "content": p.turns[0]}],
                             enable_thinking) for p in prompts]


@dataclass(frozen=True)
class PromptShare:
    """Which prompts a rank decodes, prompts[index::count], and with whom. The members of a tensor-
    parallel group (`group`, their process group; None for a rank that decodes alone) take the same
    share and decode it in lockstep; only the member that `reports` counts its responses and time, so
    that every group counts once in the all-reduced sums."""
    index: int = 0
    count: int = 1
    group: object = None
    reports: bool = True

    @classmethod
    def of(cls, tp: TPGroup, world_size: int) -> "PromptShare":
        """Group g of the world_size / G groups of consecutive ranks takes prompts[g::groups]; its first
        member reports. At tp 1 every rank is a group of one."""
        return cls(tp.ranks[0] // tp.size, world_size // tp.size, tp.group, tp.index == 0)


def agreed_elapsed(clock: float, group, device: torch.device) -> float:
    """Seconds since `clock`; within a group the largest of its members' (a collective over it), so
    that every member stops before the same prompt: a member still decoding would wait forever on
    the sharded forwards of one that stopped."""
    elapsed = time.perf_counter() - clock
    if group is None:
        return elapsed
    value = torch.tensor([elapsed], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return float(value)


def generation_tau(setup: DraftingSetup, prompts: list[list[int]], share: PromptShare = PromptShare(), *,
                   max_new_tokens: int, max_seconds: float, stop_token_ids=()) -> dict[str, torch.Tensor]:
    """Served tau of `setup.drafter` on this rank's share of `prompts` (prompts[share.index::share.count])
    at temperature 0.

    Each prompt is decoded by every method (`dflash`, `ddtree@B` for the setup's budgets, its trees
    built by its tree backend) through `drafter.serving.decode.generate`;
    no prompt starts once `max_seconds` have passed (on the clock of the slowest member of a tensor-
    parallel group: `agreed_elapsed`), so a call lasts at most max_seconds plus one prompt. Returns
    {`gen_tau_dflash`, `gen_tau_ddtree@B`: [sum of per-response tau, responses], `gen_seconds`:
    [seconds, 1]} (float64, CPU) for the caller to all-reduce (sum) and divide: the mean tau over the
    responses and the mean seconds per decoding group (a rank, or a tp group). A rank that decoded
    nothing contributes its seconds and zero responses; a member that does not report contributes
    zeros throughout. On a target that refuses tree verification (a cache layer neither tree form can
    verify: `decode.tree_verify_refusal`) only `dflash` is generated; the replayed `tau_ddtree@B` of the eval
    steps is exact there. The only collectives are those of a group (its sharded forwards and the
    time agreement). The drafter is put in eval mode and given back in the mode it came in; the
    global torch, CUDA and numpy RNGs are not used.
    """
    target, drafter = setup.target, setup.drafter
    methods = speculative_methods(setup.budgets)
    if tree_verify_refusal(target):  # the replayed tau_ddtree@B stands in for these (eval steps)
        methods = [m for m in methods if not m.is_tree]
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    clock = time.perf_counter()
    device = target.device
    steps = {str(method): [] for method in methods}
    was_training = drafter.training
    drafter.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for prompt in prompts[share.index::share.count]:
                if agreed_elapsed(clock, share.group, device) >= max_seconds:
                    break
                ids = torch.tensor([prompt], dtype=torch.long, device=device)
                for method in methods:
                    result = generate(target, ids, max_new_tokens, stop_token_ids, drafter=drafter,
                                      settings=DecodeSettings.of(method, tree_backend=setup.tree_backend))
                    steps[str(method)].append(result.acceptance_lengths)
    finally:
        drafter.train(was_training)
    out = {f"gen_tau_{method}": mean_tau(responses) for method, responses in steps.items()}
    out["gen_seconds"] = torch.tensor([time.perf_counter() - clock, 1.0], dtype=torch.float64)
    weight = 1.0 if share.reports else 0.0
    return {name: value * weight for name, value in out.items()}
