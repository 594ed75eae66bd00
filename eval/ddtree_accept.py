"""Acceptance length, speedup and losslessness of a DFlash drafter under DDTree verification.

    python eval/ddtree_accept.py --ckpt runs/v3/checkpoints/latest \\
        [--bench gsm8k,math500=/data/math500,prompts.jsonl] [--budgets 16,32,64,128,256,512] \\
        [--temperature 0] [--max-new-tokens 2048] [--max-samples N] [--out results.json] [--save-samples] \\
        [--check-public N] [--threads N] [--no-hf-baseline]
    torchrun --nproc_per_node 8 eval/ddtree_accept.py ...        # prompts split over the ranks
    torchrun --nproc_per_node 8 eval/ddtree_accept.py --tp 4 ... # a target sharded over 4 ranks: 2 copies
    ... eval/ddtree_accept.py ... target.tp_size=4 target.dtype=bf16  # the same, as training's overrides write it

Runs, on the same prompts: plain autoregressive decoding (`ar`), transformers' own greedy `generate`
(`hf`, a baseline: temperature 0 and --tp 1 only, --no-hf-baseline leaves it out), DFlash single-path
verification (`dflash`) and DDTree at each budget (`ddtree@N`). The target and the chat settings come from the
drafter's config (`dflash_config.target_path`, `chat_template_kwargs`); `--target` and
`--enable-thinking` override them. Writes the JSON report, prints a markdown table and saves two
plots next to --out. Definitions: docs/design.md, "tau" (tau counts the bonus token; speedup is the
ratio of decode time per output token to `ar`'s, prefill excluded). At temperature 0, `lossless`
compares every method's tokens with `ar`'s (`drafter/serving/lossless.py`): yes, ties-only (every divergence
starts where the target's top-2 logits were within --tie-tolerance: a floating-point tie) or no.

A target with conv, recurrent or compressor layers, or chunked attention (Qwen3.5, Qwen3-Next, Nemotron-H,
LFM2, DeepSeek-V4, Llama 4) verifies each tree as a batch of its root-to-leaf paths
(`drafter/serving/path_verify.py`), generated and timed like any other target. A target whose cache
neither form can verify (`drafter.serving.decode.tree_verify_refusal`: a model's own cache layer that
cannot copy its state per row) is refused by name; there, at temperature 0, each `ddtree@N` row is
the exact DDTree tau of `ar`'s own greedy text, replayed under teacher forcing (`drafter.serving.served`: the
tree of N nodes built from the drafter's block at each step's anchor, walked along the text) and
labelled `replayed`, with no timing; above temperature 0 those rows are left out. A target whose cached
multi-token forward does not continue its state (Jamba; `drafter.target_model.cache.probe_decoding`) gets
its `dflash` row replayed the same way.

--check-public N runs the public `dflash` 0.1.0 loop (`dflash_generate`, with the package's own
DFlashDraftModel or DFlash2DraftModel loading the checkpoint's export) and ours on the first turn of the
first N prompts of each benchmark and compares them step by step (`drafter.serving.public_loop`): how many
decode identically (same drafts, same acceptance at every step), each loop's tau, and each other
prompt's first difference, classified as a tie (both loops rank the same two tokens within
--tie-tolerance of each other) or semantic. Its verdict reads like `lossless`: yes, ties-only or no.
It runs on the first rank only, at temperature 0 and --tp 1.

With --tp G, consecutive groups of G ranks each hold one copy of the target sharded by tensor
parallelism (drafter/target_model/tensor_parallel.py); a group's members decode the same prompts in lockstep (the
sharded forwards are collectives, and their outputs are the same on every member), the groups split
the prompts, and each group's first rank reports. The figures, the table and the plots are
`drafter/serving/eval_report.py`'s.

Speed on a CPU: every speed figure is one process's, with the threads, ranks, dtype and CPU capability
the report records with it (config: `threads`, `world_size`, `dtype`, `cpu_capability`, `regime`).
--threads N sets torch's threads per rank (default: the node's cores shared by its local ranks; more is
refused). One process with all cores (`python eval/ddtree_accept.py ...`) is the latency regime, "one
stream, N threads", and the documented default for speed figures on a CPU; `torchrun --nproc_per_node 2
... --threads 1` decodes two streams at once, "throughput, 2 ranks x 1 threads": its ms/token is one
stream's, each slowed by the other.
"""
import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, StoppingCriteria, StoppingCriteriaList

from drafter.pipeline.benchmarks import load_prompts
from drafter.pipeline.chat_template import prompt_token_ids
from drafter.pipeline.feature_store import FeatureStore
from drafter.pipeline.feature_store_format import FeatureStoreError, identity_mismatch, row_key, target_file_identity
from drafter.errors import ConfigError, model_path_problem
from drafter.infra.cpu_dtype import say_once
from drafter.infra.cpu_layout import serve_column_major_, serving_layout
from drafter.infra.launch import (LaunchError, init_distributed, launched_world_size, local_device, local_world_size,
                                  cores_per_rank, set_cpu_threads, usable_cores)
from drafter.infra.progress import progress_bar
from drafter.models import load_drafter
from drafter.models.blocks import DraftingSetup, FeatureBatch
from drafter.serving.decode import (SAMPLING, DecodeSettings, Generation, Method, generate, speculative_methods,
                                    stop_token_ids, tree_verify_refusal)
from drafter.serving.eval_report import HF, best_method, markdown_table, save_plots, summarize, summarize_public
from drafter.serving.lossless import BF16_TIE_TOLERANCE, near_tie_share
from drafter.serving.public_loop import PublicAgreement, check_public, load_public
from drafter.serving.served import PromptShare, replay_steps
from drafter.target_model.cache import probe_decoding
from drafter.target_model.model import TargetError, compute_dtype, context_features
from drafter.target_model.tensor_parallel import (TensorParallelError, check_tensor_parallel, feature_code_version,
                                                  form_tp_group, load_tp_target)
from drafter.training.checkpoint import drafter_dir, read_config_json


EVAL_DTYPES = ("auto", "float32", "bfloat16", "float16")
TRAINING_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}  # target.dtype as training writes it -> --dtype
# The training overrides this script shares (as trailing key=value arguments), and the flag each is an alias of.
SHARED_OVERRIDES = {"target.tp_size": "--tp", "target.path": "--target", "target.dtype": "--dtype"}


def apply_shared_overrides(parser, args):
    """The trailing key=value arguments set their flags' values, so that a training command's target
    overrides can be pasted as they are. An override this script does not share, or one that
    contradicts its flag, is refused by name; then the flags left unset take their defaults."""
    for item in args.overrides:
        key, _, value = item.partition("=")
        if key not in SHARED_OVERRIDES:
            parser.error(f"{item}: not an override this script takes; it takes {', '.join(SHARED_OVERRIDES)} "
                         "(key=value)")
        flag = SHARED_OVERRIDES[key]
        if key == "target.tp_size":
            try:
                value = int(value)
            except ValueError:
                parser.error(f"{item}: target.tp_size takes an integer")
        if key == "target.dtype":
            value = TRAINING_DTYPES.get(value, value)
            if value not in EVAL_DTYPES:
                parser.error(f"{item}: target.dtype takes one of {', '.join([*TRAINING_DTYPES, *EVAL_DTYPES])}")
        given = getattr(args, flag.lstrip("-"))
        if given is not None and given != value:
            parser.error(f"{flag} {given} and {item} disagree: give one of them")
        setattr(args, flag.lstrip("-"), value)
    args.tp = 1 if args.tp is None else args.tp
    args.dtype = args.dtype or "auto"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", required=True, help="a drafter dir, or a run checkpoint holding drafter/")
    parser.add_argument("--target", help="target path or hub id (default: the drafter config's); "
                        "alias: target.path=...")
    parser.add_argument("--bench", default="gsm8k,math500,humaneval,mbpp,mt-bench,alpaca",
                        help="comma-separated: hub benchmark NAMEs, NAME=PATH for a local copy of one "
                             "(save_to_disk directory or JSONL of its rows), or prompt JSONL files")
    parser.add_argument("--budgets", default="16,32,64,128,256,512")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--sampling", choices=SAMPLING, default="match",
                        help="at temperature > 0: sample-and-match (the papers'), or rejection "
                             "sampling for dflash (ddtree always matches)")
    parser.add_argument("--tie-tolerance", type=float, default=BF16_TIE_TOLERANCE,
                        help="a divergence from ar where the target's top-1 minus top-2 logit is below "
                             "this is a floating-point tie (lossless: ties-only)")
    parser.add_argument("--max-new-tokens", type=int, default=2048)
    parser.add_argument("--max-samples", type=int, help="at most this many prompts per benchmark "
                        "(a seeded shuffle, also of local prompt files)")
    parser.add_argument("--gather-timeout", type=float, default=720,
                        help="minutes the ranks that finish first wait for the others")
    parser.add_argument("--out", default="results.json")
    parser.add_argument("--save-samples", action="store_true", help="store token ids per response")
    parser.add_argument("--enable-thinking", choices=["true", "false"],
                        help="override the checkpoint's chat_template_kwargs.enable_thinking")
    parser.add_argument("--dtype", choices=EVAL_DTYPES, help="auto (the default): bfloat16 on GPU; on a CPU "
                        "bfloat16 where a start-up probe runs it faster than float32, else float32; alias: target.dtype=... (bf16, fp32 as training writes them)")
    parser.add_argument("--tree-backend", default="auto", choices=["auto", "compiled", "tensor"])
    parser.add_argument("--sync-stages", action="store_true",
                        help="synchronise CUDA around every stage so that stage times are exact")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--features", default=None,
                        help="a feature store (data/features.py) of this target: replayed rows it holds read "
                             "their features from it, so that drafters are replayed on the same features")
    parser.add_argument("--tp", type=int, help="ranks that share one tensor-parallel copy of the target "
                        "(torchrun; it must divide the ranks of a node; default 1); alias: target.tp_size=G")
    parser.add_argument("--check-public", type=int, default=0, metavar="N",
                        help="also decode the first N prompts of each benchmark with the public dflash 0.1.0 "
                             "loop and compare it with ours step by step (module docstring)")
    parser.add_argument("--threads", type=int, help="torch's CPU threads per rank (default: the node's cores "
                        "divided by its local ranks; more is refused)")
    parser.add_argument("--hf-baseline", action=argparse.BooleanOptionalAction,
                        help="also time transformers' own greedy generate on the same prompts (method hf; "
                             "default: on at temperature 0, skipped with a note under --tp > 1)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="the training overrides this shares: " + ", ".join(SHARED_OVERRIDES))
    args = parser.parse_args(argv)
    apply_shared_overrides(parser, args)
    try:
        args.budgets = [int(b) for b in args.budgets.split(",") if b]
    except ValueError:
        parser.error(f"--budgets {args.budgets!r}: comma-separated positive integers, e.g. 16,32,64")
    if any(b < 1 for b in args.budgets):
        parser.error("--budgets must be positive integers")
    if len(set(args.budgets)) < len(args.budgets):
        parser.error(f"--budgets {','.join(map(str, args.budgets))}: a budget is listed twice")
    if not any(args.bench.split(",")):
        parser.error("--bench names no benchmark")
    if args.target == "":
        parser.error("--target is empty (leave it out for the target the checkpoint records)")
    if args.max_samples is not None and args.max_samples < 1:
        parser.error("--max-samples must be >= 1")
    if args.tp < 1:
        parser.error("--tp must be >= 1")
    if args.check_public < 0:
        parser.error("--check-public must be >= 0")
    if args.check_public and (args.temperature > 0 or args.tp > 1):
        parser.error("--check-public compares greedy decodes on one whole target: it needs --temperature 0 "
                     "and --tp 1")
    if args.hf_baseline and args.temperature > 0:
        parser.error("--hf-baseline runs transformers' greedy generate: it needs --temperature 0")
    if args.hf_baseline is None:
        args.hf_baseline = args.temperature <= 0
    if args.check_public and importlib.util.find_spec("dflash") is None:
        parser.error("--check-public runs the public loop of the dflash package, which is not installed: "
                     "pip install --no-deps dflash==0.1.0")
    return args


def target_path_of(args) -> str:
    """--target, or the target the drafter's config records."""
    directory = drafter_dir(args.ckpt)
    recorded = (read_config_json(directory / "config.json").get("dflash_config") or {}).get("target_path")
    if not (args.target or recorded):
        raise ValueError(f"{directory}/config.json records no dflash_config.target_path: pass --target")
    path = args.target or recorded
    if problem := model_path_problem(path):
        where = "--target" if args.target else f"the target path {directory}/config.json records,"
        raise FileNotFoundError(f"{where} {path}: {problem}" + ("" if args.target else " (pass --target)"))
    return path


def tensor_parallel_group(args, target_path: str, world_size: int, device: torch.device):
    """This rank's group of --tp ranks, after checking that the target can be split so (before it loads)."""
    try:
        check_tensor_parallel(AutoConfig.from_pretrained(target_path), args.tp,
                              local_world_size(world_size), world_size, key="--tp")
    except (TensorParallelError, OSError, ValueError) as error:  # also a hub id that cannot be fetched
        raise SystemExit(f"error: {error}") from None
    return form_tp_group(args.tp, backend="nccl" if device.type == "cuda" else None)


def cpu_threads(requested: int | None, world_size: int) -> int:
    """Sets torch's threads for this rank (launch.set_cpu_threads: `requested`, default the node's cores
    shared by its local ranks) and returns them; more than that share stops the eval in one line."""
    share = cores_per_rank(world_size)
    if requested is not None and not 1 <= requested <= share:
        raise SystemExit(f"error: --threads {requested}: this node has {usable_cores()} cores for "
                         f"{local_world_size(world_size)} local "
                         f"rank(s), so at most {share} threads per rank")
    set_cpu_threads(requested, world_size)
    return torch.get_num_threads()


def speed_regime(threads: int, world_size: int, tp: int) -> str:
    """How the report's speed figures were measured: one stream, or ranks decoding streams at once."""
    each = f"{threads} thread{'s' if threads != 1 else ''}"
    if world_size == 1:
        return f"one stream, {each}"
    if tp == world_size:
        return f"one stream, tensor-parallel over {tp} ranks x {each}"
    return f"throughput, {world_size} ranks x {each}"


class FirstTokenClock(StoppingCriteria):
    """Never stops generate; notes when it is first called, once the prefill's token is chosen: `ar`'s
    clock starts there too (prefill excluded)."""

    def __init__(self, device: torch.device):
        self.device, self.start = device, None

    def __call__(self, input_ids, scores, **kwargs):
        if self.start is None:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.start = time.perf_counter()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def setup_distributed(gather_timeout_minutes: float) -> tuple[int, int, torch.device]:
    """(rank, world size, device) under any launcher train.py takes (torchrun, srun, or none: a world
    of one without a process group).

    The only collective is the gather of the results at the end, where the ranks that finish first
    wait for the slowest: a CPU (gloo) group with an explicit timeout, not NCCL's default one."""
    try:
        if launched_world_size() == 1:
            return 0, 1, local_device()
        return init_distributed(gather_timeout_minutes, backend="gloo")
    except LaunchError as error:
        raise SystemExit(f"launch error: {error}") from None


def replay_store(directory: str, target_path: str, layer_ids: list[int]) -> FeatureStore:
    """The store --features names; one that is not whole, or is another target's or other layers', stops
    the eval in one line."""
    try:
        store = FeatureStore(directory)
    except FeatureStoreError as error:
        raise SystemExit(f"error: --features {directory}: {error}") from None
    stored_path = store.identity.get("target.path")
    if stored_path is None or Path(stored_path).resolve() != Path(target_path).resolve():
        raise SystemExit(f"error: --features {directory}: target.path: the store has {stored_path}, this eval "
                         f"{target_path}")
    if store.layer_ids != list(layer_ids):
        raise SystemExit(f"error: --features {directory}: layer_ids: the store has {store.layer_ids}, the drafter "
                         f"reads {list(layer_ids)}")
    # the same path may hold another target since the dump (retrained, re-downloaded), or other feature code
    expected = {**target_file_identity(target_path, None), "feature_code": feature_code_version()}
    if problem := identity_mismatch(store.identity, expected):
        raise SystemExit(f"error: --features {directory}: {problem}")
    return store


class Evaluator:
    """The models and settings shared by every benchmark."""

    def __init__(self, args, device: torch.device, target_path: str, tp_group):
        dtype = compute_dtype(args.dtype, device)
        directory = drafter_dir(args.ckpt)
        self.drafter = load_drafter(directory, dtype=dtype).to(device).eval()
        recorded = self.drafter.config.dflash_config
        self.target_path = target_path
        self.target = load_tp_target(self.target_path, tp_group, device, dtype)
        self.layout = self.serve_in_fastest_layout(device, dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(self.target_path)
        thinking = recorded.get("chat_template_kwargs", {}).get("enable_thinking", False)
        self.enable_thinking = thinking if args.enable_thinking is None else args.enable_thinking == "true"
        self.stop_token_ids = stop_token_ids(self.target, self.tokenizer)
        probe = probe_decoding(self.target)
        if probe.cannot_decode:
            raise TargetError(probe.cannot_decode)
        self.verify_refusal = probe.cannot_verify
        self.tree_refusal = self.verify_refusal or tree_verify_refusal(self.target)
        self.args, self.dtype = args, dtype
        methods = speculative_methods(args.budgets)
        baseline = [HF] if args.hf_baseline and args.tp == 1 else []
        self.hf_note = ("hf: skipped under --tp > 1 (transformers' generate runs a whole target)"
                        if args.hf_baseline and args.tp > 1 else None)
        self.methods = [Method("ar")] + baseline + [m for m in methods if args.temperature <= 0 or not self.replays(m)]
        if args.check_public and self.verify_refusal:
            raise TargetError(f"--check-public: the public loop verifies by one cached multi-token forward, "
                              f"which this target cannot continue ({self.verify_refusal})")
        if args.check_public and self.drafter.draft_vocab is not None:
            raise ConfigError(f"--check-public: {directory} drafts over a draft vocabulary (d2t, t2d), which the "
                              "public dflash 0.1.0 loop does not read")
        self.public = load_public(directory, dtype, device) if args.check_public else None
        self.store = replay_store(args.features, target_path, self.drafter.target_layer_ids) if args.features else None

    def serve_in_fastest_layout(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """On the CPU, the target's and drafter's weights in the layout this CPU multiplies fastest
        (drafter/infra/cpu_layout.py); both plain decoders (ar, hf) run in it too."""
        if device.type != "cpu":
            return None
        layout = serving_layout(self.target, dtype)
        say_once(f"serving {layout.reason}")
        if layout.column:
            serve_column_major_(self.target)
            serve_column_major_(self.drafter)
        return "column" if layout.column else "row"

    def replays(self, method: Method) -> bool:
        """Whether `method` is replayed on `ar`'s text instead of generated (module docstring)."""
        if method == HF:
            return False
        refusal = self.tree_refusal if method.is_tree else self.verify_refusal
        return method.name != "ar" and refusal is not None

    def replayed_record(self, ar_record: dict, method: Method) -> dict:
        """The steps `method` would take serving `ar`'s answer, from the training path."""
        ids = torch.tensor([ar_record["prompt_ids"] + ar_record["output_ids"]], device=self.target.device)
        loss_mask = torch.zeros_like(ids)
        loss_mask[0, len(ar_record["prompt_ids"]):] = 1
        features = self.replay_features(ids)
        budgets = (method.budget,) if method.is_tree else ()
        steps = replay_steps(DraftingSetup(self.drafter, self.target, "dense", budgets=budgets),
                             FeatureBatch(ids, loss_mask, features))
        return {**ar_record, "acceptance_lengths": steps[str(method)][0] if steps[str(method)] else [],
                "decode_seconds": None, "stage_seconds": {}, "margins": [], "replayed": True}

    def replay_features(self, ids: torch.Tensor) -> torch.Tensor:
        """The context features of the text `ids` [1, T]: --features' where it holds the row, else the target's."""
        if self.store is not None:
            stored = self.store.row(row_key(ids[0].cpu().numpy()), ids.shape[1])
            if stored is not None:
                return stored[0][None].to(self.target.device, self.dtype)
        return context_features(self.target, ids, self.drafter.target_layer_ids)

    def generate(self, method: Method | str, prompt_ids: torch.Tensor, max_new_tokens: int):
        if method == HF:
            return self.generate_hf(prompt_ids, max_new_tokens)
        return generate(self.target, prompt_ids, max_new_tokens, self.stop_token_ids, drafter=self.drafter,
                        settings=DecodeSettings.of(method, temperature=self.args.temperature,
                                                   sampling=self.args.sampling if method.name == "dflash" else "match",
                                                   tree_backend=self.args.tree_backend,
                                                   synchronize_stages=self.args.sync_stages))

    @torch.inference_mode()
    def generate_hf(self, prompt_ids: torch.Tensor, max_new_tokens: int) -> Generation:
        """transformers' own greedy `generate` with `ar`'s ids, stops and token budget, timed as `ar` is
        (from the prefill's token to the last). The target's generation_config is set aside meanwhile,
        so that none of its settings (temperature, top_p, a repetition penalty) changes greedy decoding."""
        clock, stops = FirstTokenClock(self.target.device), self.stop_token_ids
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else (stops or [0])[0]
        saved, self.target.generation_config = self.target.generation_config, GenerationConfig()
        try:
            output = self.target.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids),
                                          max_new_tokens=max_new_tokens, eos_token_id=stops or None,
                                          pad_token_id=pad, do_sample=False, num_beams=1,
                                          stopping_criteria=StoppingCriteriaList([clock]))
        finally:
            self.target.generation_config = saved
        if self.target.device.type == "cuda":
            torch.cuda.synchronize()
        output_ids = output[0, prompt_ids.shape[1]:].tolist()
        return Generation(output_ids, [1] * (len(output_ids) - 1), time.perf_counter() - clock.start)

    def prompt_ids(self, messages: list[dict]) -> torch.Tensor:
        ids = prompt_token_ids(self.tokenizer, messages, self.enable_thinking)
        return torch.tensor([ids], dtype=torch.long, device=self.target.device)

    def run_prompt(self, prompt, method: Method) -> list[dict]:
        """One record per user turn; later turns follow this method's own earlier answers."""
        messages, records = list(prompt.history), []
        for turn, text in enumerate(prompt.turns):
            messages.append({"role": "user", "content": text})
            ids = self.prompt_ids(messages)
            result = self.generate(method, ids, self.args.max_new_tokens)
            records.append({"source": prompt.source, "turn": turn, "prompt_ids": ids[0].tolist(),
                            "output_ids": result.output_ids,
                            "acceptance_lengths": result.acceptance_lengths,
                            "decode_seconds": result.decode_seconds,
                            "stage_seconds": result.stage_seconds, "margins": result.margins})
            answer = self.tokenizer.decode(result.output_ids, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": answer})
        return records

    def check_public(self, prompts) -> list[tuple[str, PublicAgreement]]:
        """(source, comparison) of our dflash and the public loop on each prompt's first turn."""
        checked = []
        for prompt in prompts:
            ids = self.prompt_ids(list(prompt.history) + [{"role": "user", "content": prompt.turns[0]}])
            checked.append((prompt.source, check_public(self.target, self.drafter, self.public, ids,
                                                        self.args.max_new_tokens, self.stop_token_ids,
                                                        self.args.tie_tolerance)))
        return checked

    def warm_up(self, prompt):
        """First calls pay for allocation and kernel selection: keep them out of the timings."""
        ids = self.prompt_ids(list(prompt.history) + [{"role": "user", "content": prompt.turns[0]}])
        for method in self.methods:
            if not self.replays(method):
                self.generate(method, ids, min(16, self.args.max_new_tokens))


def run_benchmark(evaluator: Evaluator, name: str, prompts, share: PromptShare) -> dict[str, list[dict]]:
    """Records per method for this rank's group's share of the prompts (a group: --tp ranks, or one).
    Rank 0 shows its progress, prompt by prompt and method by method."""
    shard = prompts[share.index::share.count]
    records = {str(method): [] for method in evaluator.methods}
    if shard:
        evaluator.warm_up(shard[0])
    progress = progress_bar(total=len(shard) * len(evaluator.methods), desc=name, unit="run",
                            enabled=share.index == 0 and share.reports)  # rank 0
    for prompt in shard:
        for method in evaluator.methods:
            progress.set_postfix(method=str(method), refresh=False)
            if evaluator.replays(method):
                turns = [r for r in records["ar"] if r["source"] == prompt.source]
                records[str(method)] += [evaluator.replayed_record(r, method) for r in turns]
            else:
                records[str(method)] += evaluator.run_prompt(prompt, method)
            progress.update()
    progress.close()
    return records


def gather_records(records: dict[str, dict[str, list[dict]]], world_size: int) -> dict:
    """Every rank's records of every benchmark, merged on rank 0 (one gather, after all benchmarks,
    under the process group's explicit timeout); None on the other ranks."""
    gathered = [None] * world_size if dist.get_rank() == 0 else None
    dist.gather_object(records, gathered, dst=0)
    if gathered is None:
        return None
    return {bench: {m: [r for part in gathered for r in part[bench][m]] for m in methods}
            for bench, methods in records.items()}


def in_prompt_order(records: dict[str, list[dict]], prompts) -> dict[str, list[dict]]:
    order = {(p.source, t): i for i, p in enumerate(prompts) for t in range(len(p.turns))}
    return {m: sorted(rs, key=lambda r: order[(r["source"], r["turn"])]) for m, rs in records.items()}


def report(records_by_bench: dict, args, evaluator: Evaluator, world_size: int, threads: int,
           public_checks: dict[str, list[tuple[str, PublicAgreement]]]) -> dict:
    benchmarks = {}
    for bench, records in records_by_bench.items():
        methods = {m: summarize(rs, records["ar"], args.temperature <= 0, args.save_samples,
                                args.tie_tolerance)
                   for m, rs in records.items()}
        ar_time = methods["ar"]["time_per_output_token"]
        hf_time = methods.get(HF, {}).get("time_per_output_token")
        for summary in methods.values():
            tpot = summary["time_per_output_token"]
            summary["speedup"] = ar_time / tpot if ar_time and tpot else None
            summary["speedup_over_hf"] = hf_time / tpot if hf_time and tpot else None
            # the tau at which this method's time per step (draft, tree, verify, commit) equals ar's
            # time per token: speedup = tau_pooled / break_even_tau (none without a verify step)
            summary["break_even_tau"] = (tpot * summary["tau_pooled"] / ar_time
                                         if ar_time and tpot and summary["tau_pooled"] else None)
        margins = [m for r in records["ar"] for m in r["margins"]]
        benchmarks[bench] = {"methods": methods, "best_method": best_method(methods),
                             "ar_over_hf": ar_time / hf_time if ar_time and hf_time else None,
                             "near_tie_share": near_tie_share(margins, args.tie_tolerance)
                             if args.temperature <= 0 else None}
        if public_checks.get(bench):
            benchmarks[bench]["public_check"] = summarize_public(public_checks[bench])
    config = {"ckpt": args.ckpt, "target": evaluator.target_path, "budgets": args.budgets,
              "temperature": args.temperature, "sampling": args.sampling,
              "tie_tolerance": args.tie_tolerance, "max_new_tokens": args.max_new_tokens,
              "enable_thinking": evaluator.enable_thinking, "dtype": str(evaluator.dtype),
              "weight_layout": evaluator.layout,
              "device": str(evaluator.target.device), "world_size": world_size, "tp_size": args.tp,
              "threads": threads, "regime": speed_regime(threads, world_size, args.tp),
              "cpu_capability": torch.backends.cpu.get_cpu_capability()
              if evaluator.target.device.type == "cpu" else None,
              "hf_baseline": HF in evaluator.methods, "hf_note": evaluator.hf_note,
              "block_size": evaluator.drafter.block_size, "tree_verify_refusal": evaluator.tree_refusal,
              "verify_refusal": evaluator.verify_refusal, "check_public": args.check_public,
              "stage_times_synchronized":
              args.sync_stages or evaluator.target.device.type != "cuda"}
    return {"config": config, "benchmarks": benchmarks}


def load_prompt_sets(bench: str, max_samples: int | None) -> dict[str, list]:
    """--bench's prompt sets by name (a ValueError names the entry, file and row that cannot be read)."""
    prompt_sets = {}
    for spec in filter(None, bench.split(",")):
        name, prompts = load_prompts(spec, max_samples)
        if name in prompt_sets:
            raise ValueError(f"--bench: two entries are named {name!r}; rename a file")
        prompt_sets[name] = prompts
    return prompt_sets


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    rank, world_size, device = setup_distributed(args.gather_timeout)
    threads = cpu_threads(args.threads, world_size)
    try:  # what the flags name, checked before any model loads
        target_path = target_path_of(args)
        prompt_sets = load_prompt_sets(args.bench, args.max_samples)
    except (OSError, ValueError) as error:  # also a hub benchmark that cannot be fetched
        raise SystemExit(f"error: {error}") from None
    tp_group = tensor_parallel_group(args, target_path, world_size, device)
    share = PromptShare.of(tp_group, world_size)  # the groups split the prompts, as generation in training does
    torch.manual_seed(args.seed + share.index)  # a group's members sample alike, in lockstep
    evaluator = Evaluator(args, device, target_path, tp_group)
    if rank == 0 and evaluator.hf_note:
        print(evaluator.hf_note, flush=True)
    records = {}
    for name, prompts in prompt_sets.items():
        if rank == 0:
            print(f"{name}: {len(prompts)} prompts, methods {', '.join(map(str, evaluator.methods))}", flush=True)
        ran = run_benchmark(evaluator, name, prompts, share)
        records[name] = ran if share.reports else {method: [] for method in ran}  # one report per group
    if world_size > 1:
        records = gather_records(records, world_size)
        dist.destroy_process_group()
    if rank != 0:
        return None
    records = {name: in_prompt_order(records[name], prompts) for name, prompts in prompt_sets.items()}
    public_checks = {name: evaluator.check_public(prompts[:args.check_public])
                     for name, prompts in prompt_sets.items()} if args.check_public else {}
    results = report(records, args, evaluator, world_size, threads, public_checks)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(markdown_table(results))
    plots = save_plots(results, out)
    print(f"wrote {out}, {', '.join(map(str, plots))}")
    return results


if __name__ == "__main__":
    main()
