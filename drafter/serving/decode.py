"""Generation with a frozen HF target: plain autoregressive decoding (`ar`), DFlash single-path
speculative decoding (`dflash`) and DDTree tree verification (`ddtree`), on one prompt.

All three share one loop and the conventions of the public `dflash_generate`: the prefill's
token is the first output and the first root; each step commits the tokens accepted after the root
plus the target's bonus token, at most up to `max_new_tokens` in all; a stop token among them ends
generation after it. `acceptance_lengths` holds the tokens committed per target verify forward
(tau, bonus included). At temperature 0 every method returns exactly the `ar` tokens (up to
floating-point ties: `drafter/serving/lossless.py` tells them from bugs).

Above temperature 0 both speculative methods default to sample-and-match, as the DFlash and DDTree
papers and their reference loops do: the target samples one token at every verify row, and the walk
accepts a drafted token (DFlash: the drafter's argmax; DDTree: a child in the tree) only if it equals
the target's sample at its parent's row; the first sample without a match is the bonus. Every
committed token is then a target sample given the tokens before it, so the output follows the
target's distribution. `sampling="rejection"` switches DFlash to speculative rejection sampling
(drafted tokens sampled from the drafter, accepted with probability min(1, p/q)), also lossless in
distribution but not what the papers' T > 0 numbers use.
"""
import functools
import time
from dataclasses import dataclass, field

import torch

from drafter.infra.progress import StageTimer
from drafter.models import DraftCache
from drafter.serving.path_memory import check_path_batch_fits
from drafter.serving.path_verify import PathVerifier
from drafter.target_model.cache import TargetCache, probe_decoding
from drafter.target_model.model import TargetError, feature_tap, model_type
from drafter.target_model.tree_conv import tree_convolution
from drafter.tree.ddtree import DraftTree, committed_tokens, follow_tree, tree_verify_inputs

METHODS = ("ar", "dflash", "ddtree")
SAMPLING = ("match", "rejection")
STAGES = ("draft", "tree_build", "verify", "recompute", "commit")


@dataclass(frozen=True)
class Method:
    """A decoding method by the name every report gives it: `ar`, `dflash`, or `ddtree@B` (DDTree
    verifying a tree of B nodes). Parsed once, here; reports key their rows by `str(method)`."""
    name: str
    budget: int | None = None

    def __post_init__(self):
        if self.name not in METHODS:
            raise ValueError(f"method {self.name!r} not in {METHODS}")
        if self.is_tree and (self.budget is None or self.budget < 1):
            raise ValueError(f"tree budgets must be >= 1, got {self.budget}")
        if not self.is_tree and self.budget is not None:
            raise ValueError(f"{self.name} takes no tree budget (got @{self.budget})")

    @classmethod
    def parse(cls, text: str) -> "Method":
        """`ar`, `dflash` or `ddtree@B`; anything else is a ValueError naming it."""
        name, at, budget = text.partition("@")
        if at and not budget.isdigit():
            raise ValueError(f"method {text!r}: the tree budget after @ must be a whole number")
        return cls(name, int(budget) if at else None)

    @property
    def is_tree(self) -> bool:
        return self.name == "ddtree"

    def __str__(self) -> str:
        return f"ddtree@{self.budget}" if self.is_tree else self.name


def speculative_methods(budgets) -> list[Method]:
    """`dflash` and `ddtree@B` for every budget, in that order."""
    return [Method("dflash")] + [Method("ddtree", int(b)) for b in budgets]


@dataclass
class Generation:
    """One response: generated tokens after the prompt, tau per step, and timings (seconds).

    `margins` (for `ar` only, empty otherwise): per output token, the target's top-1 minus top-2
    logit at the step that produced it; it tells a floating-point tie from a real divergence
    (`drafter.serving.lossless`).
    """
    output_ids: list[int]
    acceptance_lengths: list[int]
    decode_seconds: float
    stage_seconds: dict[str, float] = field(default_factory=dict)
    margins: list[float] = field(default_factory=list)


def stop_token_ids(target, tokenizer=None) -> list[int]:
    """The target's end-of-sequence ids: its generation config's, else the tokenizer's."""
    eos = target.generation_config.eos_token_id
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def pick(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The target's token per row of logits [..., V]: argmax, or a sample at `temperature`."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs.view(-1, probs.shape[-1]), 1).view(probs.shape[:-1])


def speculative_sample(draft_tokens: torch.Tensor, target_probs: torch.Tensor,
                       draft_probs: torch.Tensor) -> tuple[int, int]:
    """(accepted count, bonus token) for a drafted path [m] with target probs [m+1, V] and draft
    probs [m, V]: accept token i with probability min(1, p/q); at the first rejection sample from
    the normalised residual max(p - q, 0), else the bonus from the last target row."""
    m = draft_tokens.shape[0]
    rows = torch.arange(m, device=draft_tokens.device)
    p, q = target_probs[rows, draft_tokens], draft_probs[rows, draft_tokens]
    accepted = int((torch.rand_like(q) * q < p).long().cumprod(0).sum())
    if accepted == m:
        return m, int(torch.multinomial(target_probs[m], 1))
    residual = (target_probs[accepted] - draft_probs[accepted]).clamp(min=0)
    if residual.sum() <= 0:
        residual = target_probs[accepted]
    return accepted, int(torch.multinomial(residual, 1))


class _Steps:
    """One decode step per method: returns the committed tokens after the root and the context
    features of the root and the accepted tokens (None for `ar`)."""

    def __init__(self, target, drafter, settings: "DecodeSettings", max_length, timer, tap):
        self.target, self.drafter, self.tap, self.method = target, drafter, tap, settings.method
        self.budget, self.temperature = settings.budget, settings.temperature
        self.rejection = settings.sampling == "rejection" and settings.temperature > 0
        self.max_length, self.timer, self.tree_backend = max_length, timer, settings.tree_backend
        self.cache = TargetCache(target)
        # trees through conv, recurrent, compressor or chunked-attention layers: a batch of their paths
        self.paths = (PathVerifier(tap, functools.partial(pick, temperature=self.temperature), timer)
                      if self.cache.tree_form() == "paths" else None)
        self.draft_cache = DraftCache()
        self.margins = [] if settings.method == "ar" else None  # 0-d tensors, read once at the end

    def next_token(self, logits: torch.Tensor) -> int:
        """The target's next token from one row of logits; records the top-2 margin for `ar`."""
        if self.margins is not None:
            top_two = logits.float().topk(2).values
            self.margins.append(top_two[0] - top_two[1])
        return int(pick(logits, self.temperature))

    def prefill(self, prompt_ids: torch.Tensor):
        out = self.cache.forward(prompt_ids, logits_to_keep=1)
        context = self.tap.features() if self.tap else None
        return self.next_token(out.logits[0, -1]), context

    def ar(self, root: int, start: int, context):
        with self.timer("verify"):
            out = self.cache.forward(torch.tensor([[root]], device=self.target.device))
        with self.timer("commit"):
            return [self.next_token(out.logits[0, -1])], None

    def block(self, root: int, block_size: int) -> torch.Tensor:
        block = torch.full((1, block_size), self.drafter.mask_token_id, device=self.target.device)
        block[0, 0] = root
        return block

    def draft(self, root: int, block_size: int, context):
        block = self.block(root, block_size)
        return block, self.drafter.draft_logits(self.target, context, block, self.draft_cache)[0]

    def dflash(self, root: int, start: int, context):
        verify_size = min(self.drafter.block_size, self.max_length - start)  # as the public loop
        with self.timer("draft"):
            if self.rejection:
                block, logits = self.draft(root, verify_size, context)
                draft_probs = torch.softmax(logits / self.temperature, dim=-1)
                block[0, 1:] = torch.multinomial(draft_probs, 1)[:, 0]
            else:  # the drafter's path: its argmax, or a DFlash2 drafter's selector chain
                block = self.block(root, verify_size)
                block[0, 1:] = self.drafter.draft_chain(self.target, context, block, self.draft_cache)[0]
        with self.timer("verify"):
            recurrent = self.cache.snapshot()
            out = self.cache.forward(block)
            features = self.tap.features()
        with self.timer("commit"):
            drafted = block[0, 1:]
            if self.rejection:
                target_probs = torch.softmax(out.logits[0].float() / self.temperature, dim=-1)
                accepted, bonus = speculative_sample(drafted, target_probs, draft_probs)
            else:  # greedy verify at T = 0, sample-and-match above
                posterior = pick(out.logits[0], self.temperature)
                accepted = int((drafted == posterior[:-1]).long().cumprod(0).sum())
                bonus = int(posterior[accepted])
        if recurrent is not None and accepted + 1 < verify_size:
            self.advance_recurrent(recurrent, block[:, :accepted + 1], start)
        return drafted[:accepted].tolist() + [bonus], features[:, :accepted + 1]

    def advance_recurrent(self, recurrent, kept_ids: torch.Tensor, start: int):
        """A recurrent state (or a model's own cache layer) has absorbed the rejected drafts and cannot
        be cut back: put it back as it was before the verify and run the target over the tokens kept.
        (A stop token or the length limit can keep fewer; generation ends there, so the cache is not
        used again.)"""
        with self.timer("recompute"):
            self.cache.restore(recurrent)
            self.cache.rollback(start)
            self.cache.forward(kept_ids, logits_to_keep=1)

    def ddtree(self, root: int, start: int, context):
        with self.timer("draft"):
            block = self.block(root, self.drafter.block_size)
            depth = min(self.budget, self.drafter.block_size - 1)  # no deeper node fits the budget
            hidden, logits = self.drafter.draft_states(self.target, context, block, self.draft_cache, depth)
        with self.timer("tree_build"):  # the drafter's own tree: marginals, or a DFlash2 selector's scores
            tree = self.drafter.block_trees(hidden, logits, block[:, 0], self.budget, self.tree_backend)
            tree = DraftTree(tree.tokens[0], tree.parents[0], tree.depths[0], tree.depth_limit)
        if self.paths is not None:
            verified = self.paths.verify(self.cache, tree, block[0, 0], start)
            self.cache = verified.cache
            return verified.committed, verified.features
        with self.timer("verify"):
            input_ids, position_ids, visible = tree_verify_inputs(tree, block[0, 0], start)
            mask = self.cache.tree_attention_mask(visible, position_ids[0] - start, start, self.target.dtype)
            with tree_convolution(self.target, torch.cat([tree.parents.new_full((1,), -1), tree.parents + 1])):
                out = self.cache.forward(input_ids, position_ids=position_ids, attention_mask=mask)
            features = self.tap.features()
        with self.timer("commit"):
            picks = pick(out.logits[0], self.temperature)
            committed, path = committed_tokens(input_ids[0], picks, *follow_tree(tree, picks))
            self.cache.compact(input_ids.shape[1], path)
            return committed, features.index_select(1, path)


@dataclass(frozen=True)
class DecodeSettings:
    """How one generate call decodes: `method` ("ar", "dflash", or "ddtree" with `budget` tree nodes),
    at `temperature`, drafted tokens accepted by `sampling` ("match" or, for dflash, "rejection") above
    0, trees built by `tree_backend`; `synchronize_stages` times every stage exactly on CUDA."""
    method: str = "ar"
    budget: int | None = None
    temperature: float = 0.0
    sampling: str = "match"
    tree_backend: str = "auto"
    synchronize_stages: bool = False

    @classmethod
    def of(cls, method: Method, **settings) -> "DecodeSettings":
        """The settings that decode `method` (a parsed `Method`), the others as given."""
        return cls(method.name, method.budget, **settings)

    def check(self, drafter) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method {self.method!r} not in {METHODS}")
        if self.sampling not in SAMPLING:
            raise ValueError(f"sampling {self.sampling!r} not in {SAMPLING}")
        if self.sampling == "rejection" and self.method == "ddtree":
            raise ValueError("ddtree verifies by sample-and-match only (sampling='match')")
        if self.method != "ar" and drafter is None:
            raise ValueError(f"method {self.method!r} needs a drafter")
        if self.method == "ddtree" and (self.budget is None or self.budget < 1):
            raise ValueError("ddtree needs a tree budget >= 1")
        if self.sampling == "rejection" and drafter is not None and not drafter.drafts_marginals:
            raise ValueError(f"a {type(drafter).__name__} drafts its own chain, not samples of its marginals: "
                             "rejection sampling is not supported for it (use sampling='match')")


class TreeVerifyUnsupported(TargetError):
    """DDTree cannot verify a tree exactly on this target (see drafter.target_model.cache.TargetCache.tree_refusal)."""


def tree_verify_refusal(target) -> str | None:
    """Why `ddtree` is refused on `target` (a message naming the family), or None."""
    reason = TargetCache(target).tree_refusal()
    return None if reason is None else f"ddtree on {model_type(target)} is refused: {reason}"


@torch.inference_mode()
def generate(target, prompt_ids: torch.Tensor, max_new_tokens: int, stop_token_ids=(), *, drafter=None,
             settings: DecodeSettings = DecodeSettings()) -> Generation:
    """Generate after `prompt_ids` [1, n] as `settings` say (`ar` by default); `drafter` is a
    DFlashDraftModel (or DFlash2DraftModel: `dflash` walks its selector chain, `ddtree` the tree of its
    selector scores) for the speculative methods. `ddtree` verifies a tree mask on attention-only
    targets and a batch of the tree's paths on the others (`drafter/serving/path_verify.py`); a target
    neither can verify raises TreeVerifyUnsupported before any work."""
    settings.check(drafter)
    method, budget = settings.method, settings.budget
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    probe = probe_decoding(target)
    if probe.cannot_decode or (method != "ar" and probe.cannot_verify):
        raise TargetError(probe.cannot_decode or probe.cannot_verify)
    if method == "ddtree" and (refusal := tree_verify_refusal(target)):
        raise TreeVerifyUnsupported(refusal)
    if method == "ddtree" and target.device.type == "cuda" and TargetCache(target).tree_form() == "paths":
        check_path_batch_fits(target, budget, drafter.block_size, prompt_ids.shape[1] + max_new_tokens,
                              torch.cuda.mem_get_info(target.device)[0])
    timer = StageTimer(target.device, settings.synchronize_stages)
    max_length = prompt_ids.shape[1] + max_new_tokens
    if method == "ar":
        return _generate(_Steps(target, drafter, settings, max_length, timer, tap=None), prompt_ids, stop_token_ids)
    with feature_tap(target, drafter.target_layer_ids) as tap:
        return _generate(_Steps(target, drafter, settings, max_length, timer, tap), prompt_ids, stop_token_ids)


def _generate(steps: _Steps, prompt_ids, stop_token_ids) -> Generation:
    target, timer, max_length = steps.target, steps.timer, steps.max_length
    num_prompt = prompt_ids.shape[1]
    step = getattr(steps, steps.method)
    stops = set(stop_token_ids)

    root, context = steps.prefill(prompt_ids)
    tokens, start, lengths = prompt_ids[0].tolist() + [root], num_prompt, []
    stopped = root in stops
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    decode_start = time.perf_counter()
    while start + 1 < max_length and not stopped:
        committed, features = step(tokens[start], start, context)
        with timer("commit"):
            produced = min(len(committed), max_length - start - 1)
            for i, token in enumerate(committed[:produced]):
                if token in stops:
                    produced, stopped = i + 1, True
                    break
            tokens += committed[:produced]
            start += produced
            steps.cache.rollback(start)
            context = None if features is None else features[:, :produced]
        lengths.append(produced)
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    decode_seconds = time.perf_counter() - decode_start
    output_ids = tokens[num_prompt:]
    margins = torch.stack(steps.margins).tolist() if steps.margins else []
    return Generation(output_ids, lengths, decode_seconds, dict(timer.seconds), margins)
