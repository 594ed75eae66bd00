"""The GPU path, checked and measured in one script (random weights, nothing downloaded).

    python bench/gpu_check.py           # one CUDA GPU: Qwen3-8B-shaped target, 5-layer drafter, bf16
    python bench/gpu_check.py --tiny    # tiny shapes on the CPU (fp32; tests/test_gpu_check.py runs it)

Each check prints `pass`, `FAIL: <why>` or `skipped (no CUDA)`; the script ends with one JSON line
holding every figure and exits 1 when a check failed.

  flex_vs_dense      2 sequences x 512 tokens, 32 anchors each (tiny: the plan's first batch): the
                     compiled flex path (attention="flex_compiled") against the dense path. Logits and
                     loss; on CUDA also the drafter's gradients (flex has no CPU backward). Tolerance:
                     relative L2 error |a - b| / |b| <= 2e-2 in bf16 (about five bf16 rounding steps),
                     1e-5 in fp32 on the CPU.
  compile_bound      10 batch shapes of a BucketSampler plan (16K tokens per batch; tiny: 1K), training
                     steps (tiny: forward only): the compiled block mask and kernel compile at most once
                     each per regime (batches of one sequence; of more), never for a new length.
  train_step         16,384 tokens per micro batch (4 x 4,096) with 2,048 anchors (512 per sequence):
                     runs without running out of memory; tokens/s, peak memory, MFU (FLOPs below).
  train_step_syncs   host syncs of one micro step's training_step forward and backward after warm-up:
                     exactly one, the anchor count (a shape); none in the target forward.
  ddtree_step_syncs  a DDTree step (draft, tree build with the tensor backend, verify inputs, target
                     forward over the tree, walk) without any host sync; the commit is the step's one.
  lossless           eval's lossless check on a random bf16 target (LM head scaled so its logits spread):
                     `ar` against ddtree and dflash drafting the `ar` text on 8 prompts, each first
                     divergence classed a tie or not (drafter/serving/lossless.py); fails on a verdict of "no".
  ds_engines         each ds_configs/*.json through deepspeed_config (a tiny YAML) and deepspeed_op_problem
                     (its failure line when the JSON's optimizer op cannot be compiled here); the engine built
                     around a 1-layer drafter in a 1-process world and stepped once, with the optimizer it
                     steps with (its `description`). On the CPU not zero2_offload.json's engine: DeepSpeed's
                     CPU Adam op needs a compiler build.
  launches           subprocesses on a tiny world (random target, 160 rows): train.py under `deepspeed
                     --num_gpus 1` and `torchrun --nproc_per_node 1` (train.engine=fsdp) to max_steps (30;
                     tiny: 6), a torchrun run SIGKILLed once a checkpoint is complete and rerun (its log must
                     say `resumed from`), and eval/ddtree_accept.py --check-public 2 on the deepspeed run's
                     checkpoint (--target: the world's shapes with the toy tokenizer; verdict "yes").

Every check has a time budget (BUDGETS_S; each sub-run of `launches` its own, SUB_RUN_BUDGETS_S): past
it the check is `FAIL: timeout after N s (hang?)` and the next check runs. In-process checks are
stopped by SIGALRM, between bytecodes only: a hang inside one C call is caught by the subprocess
checks alone (their whole process tree is killed). --checks a,b runs a subset.

On CUDA the syncs are what `torch.cuda.set_sync_debug_mode` reports; on the CPU what
`drafter.infra.host_sync.HostSyncCounter` counts, with the metric's DDTree built by the tensor backend
(CUDA's; the CPU's compiled heap reads host tensors).

FLOPs per training step are counted from the shapes (no profiler; the formula:
`drafter/training/step_flops.py`).
MFU = (all three) / step time / --peak-tflops (989 = H100/H200 SXM dense bf16).
"""
import argparse
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager, nullcontext
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist

from drafter.config import ObjectiveConfig, resolve_gamma
from drafter.data.loader import collate
from drafter.data.sampler import BucketSampler, make_buckets
from drafter.infra.engine import build_engine, deepspeed_config, deepspeed_op_problem
from drafter.infra.host_sync import host_syncs
from drafter.infra.memory import peak_memory_bytes
from drafter.models import DFlashDraftModel, DraftCache, compiled_graph_count
from drafter.models.blocks import attention_kernel, build_blocks, drafter_hidden, sample_anchors
from drafter.models.configure import drafter_config
from drafter.serving.decode import generate, pick
from drafter.serving.lossless import first_divergence, lossless_verdict, near_tie_share
from drafter.serving.testing import ReplayDrafter
from drafter.target.cache import TargetCache
from drafter.target.model import compute_dtype, context_features, feature_tap, random_qwen3
from drafter.training.attention_check import ATTENTION_TOLERANCE, relative_error
from drafter.training.objective import training_step
from drafter.training.run_config import load_config
from drafter.training.step_flops import drawn_blocks, formula_problem, step_flops
from drafter.tree import ddtree
from drafter.tree.ddtree import build_tree, committed_tokens, follow_tree, tree_verify_inputs

QWEN3_8B = dict(vocab_size=151_936, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, intermediate_size=12_288, rope_theta=1e6,
                max_position_embeddings=40_960)
QWEN3_8B_DRAFTER = dict(num_layers=5, block_size=16, target_layer_ids=[1, 9, 17, 25, 33],
                        mask_token_id=151_669)
TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=128, rope_theta=1e6)
TINY_DRAFTER = dict(num_layers=2, block_size=16, target_layer_ids=[1, 4], mask_token_id=511)

# per size: the throughput batch, the plan the compile check draws shapes from, the DDTree step
FULL_RUN = dict(batch=4, seq_len=4096, prompt=128, num_anchors=512, anchors_per_batch=2048,
                plan_tokens=16_384, plan_max_length=8192, plan_median=1500, budget=64, prompt_len=512)
TINY_RUN = dict(batch=2, seq_len=256, prompt=32, num_anchors=32, anchors_per_batch=64,
                plan_tokens=1024, plan_max_length=400, plan_median=150, budget=16, prompt_len=24)
TOLERANCE = ATTENTION_TOLERANCE  # relative L2 error, compiled flex vs dense: the first training step's check too
LOSSLESS_LOGIT_STD = 2.5  # the lossless check's target logits: spread enough that ties are the exception
START = time.perf_counter()  # reset by main
REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent

# seconds per check: (CUDA, --tiny on the CPU). In-process checks are stopped by SIGALRM, which Python
# handles between bytecodes: a hang inside one C call (a kernel, a collective) is caught only by the
# subprocess checks, whose budgets kill the process group (SUB_RUN_BUDGETS_S).
BUDGETS_S = {"flex_vs_dense": (900, 240), "compile_bound": (1200, 180), "train_step": (900, 120),
             "train_step_syncs": (600, 60), "ddtree_step_syncs": (600, 60), "lossless": (900, 120),
             "ds_engines": (900, 180), "launches": (3600, 900)}
SUB_RUN_BUDGETS_S = {"deepspeed": (900, 200), "torchrun": (900, 200), "kill_resume": (1200, 300),
                     "eval": (900, 200)}
LAUNCH_STEPS = (30, 6)  # train.max_steps of the launches: (CUDA, --tiny)


def log(message: str):
    print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - START:6.1f}s] {message}", flush=True)


class CheckFailed(Exception):
    pass


def require(condition: bool, message: str):
    if not condition:
        raise CheckFailed(message)


def sync_time(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@contextmanager
def build_on(device: torch.device, dtype: torch.dtype):
    """Modules built inside get their weights created (and initialised) directly on `device` in
    `dtype`: the 8B target is never materialised in fp32 on the CPU."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)  # later float tensors (anchor scores, weights) stay fp32


@contextmanager
def tensor_tree_backend(device: torch.device):
    """On the CPU, DDTree trees built by the tensor backend, the one CUDA uses (auto there)."""
    if device.type == "cuda":
        yield
        return
    with mock.patch.object(ddtree, "_compiled_heap", lambda: None):
        yield


# ----------------------------------------------------------------------------- models and batches

def build_models(tiny: bool, device: torch.device, dtype: torch.dtype):
    shapes, drafter_shapes = (TINY, TINY_DRAFTER) if tiny else (QWEN3_8B, QWEN3_8B_DRAFTER)
    with build_on(device, dtype):
        target = random_qwen3(**shapes, seed=0)
        torch.manual_seed(1)
        drafter = DFlashDraftModel(drafter_config(target.config, **drafter_shapes))
    if problem := formula_problem(target.config, drafter):
        sys.exit(problem)
    return target, drafter


def make_batch(vocab_size: int, batch: int, seq_len: int, prompt: int, device: torch.device, seed: int = 0):
    """Random tokens; loss mask on after the prompt."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (batch, seq_len), generator=gen).to(device)
    loss_mask = torch.ones(batch, seq_len, dtype=torch.long, device=device)
    loss_mask[:, :prompt] = 0
    return input_ids, loss_mask


def plan_batches(run: dict, vocab_size: int, count: int, device: torch.device) -> list[tuple]:
    """(input_ids, loss_mask) of the first `count` batch shapes of a BucketSampler plan over lognormal
    lengths: a 3-token prompt, then a supervised response."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(run["plan_median"]), 0.6, 4000).astype(int), 40,
                      run["plan_max_length"])
    sampler = BucketSampler(lengths, make_buckets(lengths, 6, run["plan_max_length"]), run["plan_tokens"])
    batches, shapes = [], set()
    for _, bucket, indices in sampler.batches_for_rank(0):
        rows = [{"input_ids": rng.integers(0, vocab_size, lengths[i]).tolist(),
                 "loss_mask": [0] * 3 + [1] * (lengths[i] - 3)} for i in indices]
        batch = collate(rows, bucket, sampler.max_length)
        if batch["input_ids"].shape not in shapes and len(batches) < count:
            shapes.add(batch["input_ids"].shape)
            batches.append((batch["input_ids"].to(device), batch["loss_mask"].to(device)))
    return batches


def objective_for(run: dict) -> ObjectiveConfig:
    """The config's objective section with the run's anchor counts, every other key at its default."""
    return ObjectiveConfig(num_anchors=run["num_anchors"], ddtree_budget=64, anchors_per_batch=run["anchors_per_batch"])


# ----------------------------------------------------------------------------- checks

def check_flex_vs_dense(target, drafter, device, run) -> dict:
    dtype = drafter.dtype
    if device.type == "cuda":
        input_ids, loss_mask = make_batch(target.config.vocab_size, 2, 512, 32, device, seed=1)
        objective = ObjectiveConfig(num_anchors=32)
    else:
        input_ids, loss_mask = plan_batches(run, target.config.vocab_size, 1, device)[0]
        objective = objective_for(run)
    features = context_features(target, input_ids, drafter.target_layer_ids)
    anchors, valid = sample_anchors(loss_mask, objective.num_anchors, torch.Generator().manual_seed(0),
                                    objective.anchors_per_batch)
    blocks = build_blocks(input_ids, loss_mask, anchors, valid, drafter.block_size,
                          drafter.mask_token_id, resolve_gamma(objective.gamma, drafter.block_size))
    head = target.get_output_embeddings()
    result = {}
    for attention in ("flex_compiled", "dense"):
        # with grad on CUDA: the graphs training compiles (no-grad ones would be compiled apart)
        with torch.set_grad_enabled(device.type == "cuda"):
            logits = head(drafter_hidden(drafter, target, features, blocks, attention)).detach().float()
            loss, _ = training_step(drafter, target, features, input_ids, loss_mask, objective,
                                    torch.Generator().manual_seed(0), attention)
        grads = None
        if device.type == "cuda":
            loss.backward()
            grads = torch.cat([p.grad.float().view(-1) for p in drafter.parameters()])
            drafter.zero_grad(set_to_none=True)
        result[attention] = (logits, loss.detach().float(), grads)
    (logits, loss, grads), (dense_logits, dense_loss, dense_grads) = result["flex_compiled"], result["dense"]
    tolerance = TOLERANCE[dtype]
    figures = {"shape": list(input_ids.shape), "anchors": anchors.shape[1], "tolerance": tolerance,
               "logits_rel_error": relative_error(logits, dense_logits),
               "loss_rel_error": abs(float(loss - dense_loss)) / abs(float(dense_loss)),
               "grads_rel_error": relative_error(grads, dense_grads) if grads is not None else "skipped (no CUDA)"}
    for name in ("logits_rel_error", "loss_rel_error", "grads_rel_error"):
        if isinstance(figures[name], float):
            require(figures[name] <= tolerance, f"{name} {figures[name]:.3g} > {tolerance}")
    return figures


def check_compile_bound(target, drafter, device, run) -> dict:
    """Graphs compiled per batch: at most 2 (block mask, kernel) for the first batch of a regime (one
    sequence, or more), none after."""
    objective = objective_for(run)
    training = device.type == "cuda"
    seen_regimes, per_batch = set(), []
    for i, (input_ids, loss_mask) in enumerate(plan_batches(run, target.config.vocab_size, 10, device)):
        before = compiled_graph_count()
        features = context_features(target, input_ids, drafter.target_layer_ids)
        with torch.set_grad_enabled(training):
            loss, _ = training_step(drafter, target, features, input_ids, loss_mask, objective,
                                    torch.Generator().manual_seed(i), "flex_compiled")
            if training:
                loss.backward()
                drafter.zero_grad(set_to_none=True)
        compiled = compiled_graph_count() - before
        regime = "one sequence" if len(input_ids) == 1 else "more"
        per_batch.append({"shape": list(input_ids.shape), "graphs": compiled})
        limit = 0 if regime in seen_regimes else 2
        require(compiled <= limit, f"batch {list(input_ids.shape)} compiled {compiled} graphs "
                                   f"(at most {limit}: regime '{regime}' {'seen' if limit == 0 else 'new'})")
        seen_regimes.add(regime)
    require(len(per_batch) == 10, f"the plan gave {len(per_batch)} shapes, not 10")
    return {"mode": "forward+backward" if training else "forward", "batches": per_batch,
            "regimes": sorted(seen_regimes), "graphs": sum(b["graphs"] for b in per_batch)}


def check_train_step(target, drafter, device, run, args) -> dict:
    """Warm-up and timed micro steps as train.py runs them on one rank, without DeepSpeed: target
    features, training_step, backward, AdamW (fused on CUDA; ZeRO keeps fp32 master weights)."""
    attention = attention_kernel("auto", device)
    objective = objective_for(run)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4, fused=device.type == "cuda")
    input_ids, loss_mask = make_batch(target.config.vocab_size, run["batch"], run["seq_len"], run["prompt"],
                                      device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timed, flops, blocks = [], [], 0
    for step in range(args.warmup + args.steps):
        anchors, valid_blocks, supervised_rows = drawn_blocks(drafter, input_ids, loss_mask, objective, seed=step)
        t0 = sync_time(device)
        features = context_features(target, input_ids, drafter.target_layer_ids)
        t1 = sync_time(device)
        loss, _ = training_step(drafter, target, features, input_ids, loss_mask, objective,
                                torch.Generator().manual_seed(step), attention)
        loss.backward()
        t2 = sync_time(device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t3 = sync_time(device)
        seconds = {"target_s": t1 - t0, "drafter_s": t2 - t1, "optimizer_s": t3 - t2, "step_s": t3 - t0}
        log(f"  {'warm-up' if step < args.warmup else 'timed'} step {step}: {seconds['step_s']:.3f}s "
            f"(target {seconds['target_s']:.3f} drafter {seconds['drafter_s']:.3f} "
            f"optimizer {seconds['optimizer_s']:.3f}) loss {loss.item():.4f}")
        if step >= args.warmup:
            timed.append(seconds)
            flops.append(step_flops(target.config, drafter, run["seq_len"], anchors, supervised_rows))
            blocks += valid_blocks
    total = {k: sum(t[k] for t in timed) for k in timed[0]}
    flops_by_part = {k: sum(f[k] for f in flops) for k in flops[0]}
    total_flops = sum(flops_by_part.values())
    return {
        "attention": attention, "batch": run["batch"], "seq_len": run["seq_len"],
        "tokens_per_micro_batch": run["batch"] * run["seq_len"], "anchors": run["batch"] * run["num_anchors"],
        "block_size": drafter.block_size, "timed_steps": args.steps,
        "tokens_per_s": run["batch"] * run["seq_len"] * args.steps / total["step_s"],
        "blocks_per_s": blocks / total["step_s"],
        "step_s": total["step_s"] / args.steps,
        "time_split_s": {k.removesuffix("_s"): total[k] / args.steps
                         for k in ("target_s", "drafter_s", "optimizer_s")},
        "peak_memory_gib": peak_memory_bytes(device) / 2**30,
        "peak_memory_kind": "cuda_max_allocated" if device.type == "cuda" else "cpu_max_rss",
        "tflop_per_step": {k: v / args.steps / 1e12 for k, v in flops_by_part.items()},
        "achieved_tflops": total_flops / total["step_s"] / 1e12,
        "peak_tflops": args.peak_tflops,
        "mfu": total_flops / total["step_s"] / (args.peak_tflops * 1e12),
    }


def check_train_step_syncs(target, drafter, device, run) -> dict:
    """One micro step after warm-up (compilation, allocator growth and the first-use set-up of kernels
    may synchronise once; a hot loop does not)."""
    attention = attention_kernel("auto", device)
    objective = objective_for(run)
    input_ids, loss_mask = make_batch(target.config.vocab_size, run["batch"], run["seq_len"], run["prompt"],
                                      device, seed=2)
    with tensor_tree_backend(device):
        for warm in (True, False):
            with host_syncs(device) as target_syncs:
                features = context_features(target, input_ids, drafter.target_layer_ids)
            with host_syncs(device) as step_syncs:
                loss, _ = training_step(drafter, target, features, input_ids, loss_mask, objective,
                                        torch.Generator().manual_seed(0), attention)
                loss.backward()
            drafter.zero_grad(set_to_none=True)
    require(len(step_syncs) == 1, f"{len(step_syncs)} host syncs in training_step, expected 1 (the anchor "
                                  f"count): {step_syncs}")
    require(not target_syncs, f"{len(target_syncs)} host syncs in the target forward: {target_syncs}")
    return {"training_step": len(step_syncs), "training_step_events": step_syncs,
            "target_forward": len(target_syncs), "target_forward_events": target_syncs}


def check_ddtree_step_syncs(target, drafter, device, run) -> dict:
    """Two DDTree steps after a prefill, as drafter.serving.decode's ddtree step runs them: everything up to
    the walk inside a region where a host sync raises; the commit after it."""
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, target.config.vocab_size, (1, run["prompt_len"]), generator=gen).to(device)
    cache, draft_cache = TargetCache(target), DraftCache()
    committed_per_step = []
    with torch.inference_mode(), tensor_tree_backend(device), feature_tap(target, drafter.target_layer_ids) as tap:
        out = cache.forward(prompt, logits_to_keep=1)
        root, start = int(out.logits[0, -1].argmax()), prompt.shape[1]
        context = tap.features()
        for _ in range(2):
            with host_syncs(device, forbid=True):
                block = torch.full((1, drafter.block_size), drafter.mask_token_id, device=device)
                block[0, 0] = root
                depth = min(run["budget"], drafter.block_size - 1)  # as decode's ddtree step drafts
                logits = drafter.draft_states(target, context, block, draft_cache, depth)[1][0]
                tree = build_tree(logits, run["budget"], "tensor")
                input_ids, position_ids, visible = tree_verify_inputs(tree, block[0, 0], start)
                mask = cache.tree_attention_mask(visible, position_ids[0] - start, start, target.dtype)
                out = cache.forward(input_ids, position_ids=position_ids, attention_mask=mask)
                features = tap.features()
                picks = pick(out.logits[0], 0.0)
                path, accepted = follow_tree(tree, picks)
            with host_syncs(device) as commit_syncs:
                committed, path = committed_tokens(input_ids[0], picks, path, accepted)
            require(len(commit_syncs) == 1, f"the commit synchronised {len(commit_syncs)} times: {commit_syncs}")
            cache.compact(input_ids.shape[1], path)
            context = features.index_select(1, path)
            root, start = committed[-1], start + len(committed)
            cache.rollback(start)
            committed_per_step.append(len(committed))
    return {"budget": run["budget"], "committed_per_step": committed_per_step}


def check_lossless(target, drafter, device, run) -> dict:
    """Greedy ddtree and dflash against `ar` in bf16 (a bf16 copy on the CPU), drafting the `ar`
    text (ReplayDrafter) so that verification accepts and the walk, commit and cache compaction run
    on long paths: every divergence must start where the target's top-2 logits (nearly) tie.

    A randomly initialised target's logits barely spread (std 0.02 * sqrt(hidden)), so nearly every
    step is a near-tie and any divergence would pass for one; its LM head is scaled for this check
    to logits of std LOSSLESS_LOGIT_STD, and the share of near-tie steps is required to stay below
    one half (on the tiny target: 17%, where a commit bug diverges at margins of 0.25 to 1.4)."""
    bf16_target, bf16_drafter = (m if m.dtype == torch.bfloat16 else copy.deepcopy(m).to(torch.bfloat16)
                                 for m in (target, drafter))
    head = bf16_target.get_output_embeddings()
    original = head.weight.data
    scale = LOSSLESS_LOGIT_STD / float(original.float().std() * target.config.hidden_size ** 0.5)
    head.weight.data = original * scale
    try:
        gen = torch.Generator().manual_seed(4)
        prompts = [torch.randint(0, target.config.vocab_size, (1, run["prompt_len"]), generator=gen).to(device)
                   for _ in range(8)]
        references = [generate(bf16_target, prompt, 48, method="ar") for prompt in prompts]
        share = near_tie_share([m for reference in references for m in reference.margins])
        figures = {"logit_scale": scale, "near_tie_share": share}
        require(share <= 0.5, f"{share:.0%} of ar's steps are near-ties: the verdict could not tell a bug")
        for method, budget in (("ddtree", run["budget"]), ("dflash", None)):
            divergences, lengths = [], []
            for prompt, reference in zip(prompts, references):
                replay = ReplayDrafter(bf16_drafter, prompt[0].tolist() + reference.output_ids)
                output = generate(bf16_target, prompt, 48, method=method, drafter=replay, budget=budget)
                divergences.append(first_divergence(output.output_ids, reference.output_ids, reference.margins))
                lengths += output.acceptance_lengths
            verdict = lossless_verdict(divergences)
            figures[method] = {"verdict": verdict, "tau": sum(lengths) / len(lengths),
                               "longest_step": max(lengths), "divergences": [None if d is None else {
                                   "position": d.position, "reference_token": d.reference_token, "token": d.token,
                                   "margin": d.margin, "tie": d.tie} for d in divergences]}
            require(verdict != "no", f"{method}: a divergence that is not a tie: {figures[method]}")
            require(max(lengths) >= 3, f"{method}: no step accepted two drafted tokens (the check saw no walk)")
    finally:
        head.weight.data = original
    return figures


# ----------------------------------------------------------------------------- the tiny world of the launches

def write_world(directory: Path, max_steps: int) -> Path:
    """A tiny prepared dataset (160 arithmetic sequences over 32 tokens, as datasets saves it, with
    stats.json) and a YAML for a random target: the shapes the tests' train.py runs use."""
    import datasets
    import yaml

    rng = np.random.default_rng(0)
    rows = {"input_ids": [], "loss_mask": [], "length": []}
    for _ in range(160):
        n, start, stride = int(rng.integers(24, 100)), int(rng.integers(0, 32)), int(rng.integers(1, 4))
        rows["input_ids"].append([(start + stride * t) % 32 for t in range(n)])
        rows["loss_mask"].append([0] * 4 + [1] * (n - 4))
        rows["length"].append(n)
    data = directory / "data"
    if not data.exists():
        datasets.Dataset.from_dict(rows).save_to_disk(str(data))
        (data / "stats.json").write_text(json.dumps({"settings": {"chat_template_kwargs": {"enable_thinking": False}}}))
    cfg = {
        "run": {"out_dir": str(directory / "run"), "seed": 0},
        "target": {"random": WORLD_TARGET},
        "drafter": {"num_layers": 1, "block_size": 8, "mask_token_id": 255},
        "objective": {"num_anchors": 16, "anchors_per_batch": 48, "ddtree_budget": 16, "ddtree_blocks": 4},
        "optim": {"lr": 3e-2, "warmup_ratio": 0.1},
        "noise": {"start": 0.0, "end": 0.01, "warmup_steps": 10},
        "data": {"path": str(data), "eval_fraction": 0.1, "max_length": 128, "num_buckets": 3,
                 "tokens_per_batch": 384, "num_workers": 1, "prefetch_factor": 2},
        "train": {"epochs": 3, "max_steps": max_steps, "log_every": 1, "save_every": max_steps,
                  "eval_every": max_steps, "eval_batches": 2, "threads_per_rank": 1, "tau_budgets": [4, 16],
                  "generate_every": 1000, "generate_max_prompts": 4, "generate_max_new_tokens": 8,
                  "generate_max_seconds": 5},
        "wandb": {"enabled": False},
    }
    path = directory / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


WORLD_TARGET = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "initializer_range": 0.3}
EVAL_PROMPTS = [{"prompt": "What is the capital of France?"}, {"prompt": "def add(a, b):"}]


def write_eval_target(directory: Path) -> Path:
    """eval/ddtree_accept.py needs a target directory with a tokenizer, which a random target has not:
    the world's target shapes with a vocabulary of 384 and the toy tokenizer (320 tokens; 256 cannot
    hold its bytes and special tokens). The drafter's weights do not depend on the vocabulary."""
    from drafter.synthesis.toy_tokenizer import build_tokenizer

    corpus = ["The quick brown fox jumps over the lazy dog.", "What is the capital of France? Paris.",
              "def add(a, b):\n    return a + b", "Let me think step by step: 2 + 2 = 4."]
    build_tokenizer(corpus * 4, 320).save_pretrained(directory)
    random_qwen3(**{**WORLD_TARGET, "vocab_size": 384}).save_pretrained(directory)
    return directory


# ----------------------------------------------------------------------------- sub-runs

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env() -> dict:
    """This checkout's packages and the venv's launchers first; no launcher variables of a caller."""
    env = {k: v for k, v in os.environ.items() if k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    python_path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**env, "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}", "PYTHONPATH": python_path,
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")}


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (torchrun's workers run in sessions of their own, which a
    signal to the launcher's process group does not reach)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        found.append(parent)
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:  # the task ended
                pass
    return found


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL to the job's process group and to every process below its launcher."""
    pids = process_tree(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def start_job(cmd: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "w") as out:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stdout=out, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)


def wait_job(proc: subprocess.Popen, timeout_s: float) -> int | None:
    """The job's return code, or None when it ran past `timeout_s`; a job still running then (or when
    this wait is interrupted, e.g. by the check's own budget) is killed."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if proc.poll() is None:
            kill_job(proc)


def sub_run(name: str, cmd: list[str], log_path: Path, timeout_s: float) -> dict:
    """One command run to its end (or killed at its budget): return code, wall time, last log lines."""
    log(f"  {name}: {' '.join(map(str, cmd))}")
    t0 = time.perf_counter()
    rc = wait_job(start_job(cmd, log_path), timeout_s)
    return job_figures(name, log_path, t0, rc, timeout_s)


def job_figures(name: str, log_path: Path, t0: float, rc: int | None, timeout_s: float) -> dict:
    lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    figures = {"rc": rc, "wall_s": round(time.perf_counter() - t0, 1), "last_lines": lines[-6:],
               "log": str(log_path)}
    if rc is None:
        figures["failure"] = f"{name}: timeout after {timeout_s} s (hang?)"
    log(f"  {name}: rc {rc} in {figures['wall_s']} s")
    return figures


# ----------------------------------------------------------------------------- engines and launches

@contextmanager
def one_process_group(device: torch.device):
    """A world of this one process (gloo on the CPU, NCCL on CUDA), as a launcher would set it up."""
    port = free_port()
    variables = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    saved = {key: os.environ.get(key) for key in variables}
    os.environ.update(variables)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
        remove_shm_buffers(port)


def remove_shm_buffers(port: int) -> None:
    """DeepSpeed's CPU all-reduce buffers (66 MB each in /dev/shm) of the world at `port`."""
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        path.unlink(missing_ok=True)


def ds_engine_step(cfg, ds: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """The DeepSpeed engine of `ds` around a 1-layer drafter of the world's target; one optimizer step."""
    with build_on(device, dtype):
        target = random_qwen3(**WORLD_TARGET)
    torch.manual_seed(0)
    drafter = DFlashDraftModel(drafter_config(target.config, num_layers=1, block_size=8, mask_token_id=255))
    engine = build_engine(cfg, drafter, device, dtype, ds)
    before = engine.full_state_dict()
    input_ids, loss_mask = make_batch(WORLD_TARGET["vocab_size"], 2, 64, 8, device)
    features = context_features(target, input_ids, engine.module.target_layer_ids)
    loss, _ = training_step(engine.module, target, features, input_ids, loss_mask, ObjectiveConfig(num_anchors=8),
                            torch.Generator().manual_seed(0), attention_kernel("auto", device))
    engine.backward(loss)
    result = engine.step(cfg.optim.lr)
    after = engine.full_state_dict()
    changed = sum(not torch.equal(before[name], after[name]) for name in before)
    figures = {"description": engine.description, "loss": loss.item(), "grad_norm": result.grad_norm,
               "applied": result.applied, "tensors_changed": f"{changed}/{len(before)}"}
    require(result.applied and changed, f"the step changed {changed} of {len(before)} tensors "
                                        f"(applied={result.applied}, grad norm {result.grad_norm})")
    return figures


def ds_engine_figures(json_path: Path, cfg_path: Path, device: torch.device, dtype: torch.dtype) -> dict:
    cfg = load_config(str(cfg_path), [f"train.ds_config={json_path}"])
    ds = deepspeed_config(cfg.train.ds_config, cfg, 1, dtype == torch.bfloat16, WORLD_TARGET["hidden_size"],
                          on_cpu=device.type == "cpu")
    figures = {"zero_stage": ds["zero_optimization"]["stage"], "optimizer_block": "optimizer" in ds}
    if problem := deepspeed_op_problem(ds, device):
        raise CheckFailed(f"{json_path.name}: {problem}")
    if device.type == "cpu" and "optimizer" in ds:
        figures["engine"] = ("not built on the CPU: DeepSpeed's CPU Adam op of the optimizer block needs a "
                             "compiler build (checked on CUDA)")
        return figures
    try:
        return {**figures, **ds_engine_step(cfg, ds, device, dtype)}
    except CheckFailed as failure:
        raise CheckFailed(f"{json_path.name}: {failure}") from None


def check_ds_engines(device: torch.device, dtype: torch.dtype) -> dict:
    """Every ds_configs/*.json through deepspeed_config and deepspeed_op_problem; its engine built
    in a 1-process world and stepped once (on the CPU not the offload JSON's)."""
    figures = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_ds_") as tmp, one_process_group(device):
        cfg_path = write_world(Path(tmp), max_steps=1)
        for json_path in sorted((REPO / "ds_configs").glob("*.json")):
            log(f"  {json_path.name}")
            figures[json_path.name] = ds_engine_figures(json_path, cfg_path, device, dtype)
    require(figures, "no ds_configs/*.json")
    return figures


def train_command(launcher: str, cfg: Path, out_dir: Path, steps: int, *overrides: str) -> list[str]:
    args = ["train.py", "--cfg", str(cfg), f"run.out_dir={out_dir}", f"train.max_steps={steps}", *overrides]
    port = str(free_port())
    if launcher == "deepspeed":
        return [str(VENV_BIN / "deepspeed"), "--num_gpus", "1", "--master_port", port, *args]
    return [str(VENV_BIN / "torchrun"), "--nproc_per_node", "1", "--master_port", port, *args,
            "train.engine=fsdp"]


def last_train_step(out_dir: Path) -> int | None:
    metrics = out_dir / "metrics.jsonl"
    if not metrics.exists():
        return None
    steps = [r["step"] for r in map(json.loads, metrics.read_text().splitlines()) if r.get("kind") == "train"]
    return max(steps, default=None)


def launch_failure(name: str, figures: dict, steps: int | None = None, expect: str | None = None) -> str | None:
    """Why the sub-run failed (naming it, with its last log line), or None."""
    last = next((line for line in reversed(figures["last_lines"]) if line.strip()), "(no output)")
    if "failure" in figures:
        return f"{figures['failure']}: {last}"
    if figures["rc"] != 0:
        return f"{name} exited with {figures['rc']}: {last}"
    if steps is not None and figures.get("last_step") != steps:
        return f"{name} ended at step {figures.get('last_step')}, not {steps}: {last}"
    if expect and expect not in Path(figures["log"]).read_text(errors="replace"):
        return f"{name}: its log never says {expect!r}: {last}"
    return None


def run_training(name: str, launcher: str, cfg: Path, out_dir: Path, steps: int, budget_s: float,
                 *overrides: str) -> dict:
    figures = sub_run(name, train_command(launcher, cfg, out_dir, steps, *overrides), out_dir.with_suffix(".log"),
                      budget_s)
    figures["last_step"] = last_train_step(out_dir)
    return figures


def complete_checkpoint(out_dir: Path) -> Path | None:
    """A finished save: step_<N> (renamed from step_<N>.tmp once written) holding trainer_state.json."""
    return next((p for p in sorted((out_dir / "checkpoints").glob("step_*"))
                 if not p.name.endswith(".tmp") and (p / "trainer_state.json").exists()), None)


def kill_and_resume(cfg: Path, out_dir: Path, steps: int, budget_s: float) -> dict:
    """torchrun's run killed (SIGKILL to the whole job) once a checkpoint is complete, then rerun."""
    cmd = train_command("torchrun", cfg, out_dir, steps, "train.save_every=2")
    log_path = out_dir.with_suffix(".killed.log")
    log(f"  kill_resume: {' '.join(cmd)}")
    t0, proc = time.perf_counter(), start_job(cmd, log_path)
    try:
        while proc.poll() is None and complete_checkpoint(out_dir) is None and time.perf_counter() - t0 < budget_s / 2:
            time.sleep(0.05)
        saved, running = complete_checkpoint(out_dir), proc.poll() is None
    finally:
        if proc.poll() is None:
            kill_job(proc)
    killed = job_figures("kill_resume (first run)", log_path, t0, proc.returncode, budget_s / 2)
    killed.pop("failure", None)  # killed on purpose
    if saved is None or not running:
        last = killed["last_lines"][-1] if killed["last_lines"] else "(no output)"
        why = "ended" if not running else "saved nothing"
        return {**killed, "failure": f"kill_resume: the first run {why} before a complete checkpoint: {last}"}
    resumed = run_training("kill_resume", "torchrun", cfg, out_dir, steps, budget_s / 2, "train.save_every=2")
    return {**resumed, "killed_after": saved.name, "killed_rc": killed["rc"], "killed_wall_s": killed["wall_s"]}


def run_eval(tmp: Path, ckpt: Path, budget_s: float, cuda: bool) -> dict:
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in EVAL_PROMPTS))
    target = write_eval_target(tmp / "eval_target")
    out = tmp / "eval.json"
    cmd = [sys.executable, "eval/ddtree_accept.py", "--ckpt", str(ckpt), "--target", str(target),
           "--bench", str(prompts), "--budgets", "4", "--max-new-tokens", "32" if cuda else "8",
           "--out", str(out), "--check-public", "2"]
    figures = sub_run("eval", cmd, tmp / "eval.log", budget_s)
    if figures["rc"] == 0:
        check = json.loads(out.read_text())["benchmarks"]["prompts"].get("public_check") or {}
        figures["public_check"] = {k: check.get(k) for k in ("prompts", "identical", "verdict", "tau")}
    return figures


def check_launches(device: torch.device, tiny: bool) -> dict:
    """train.py under deepspeed and torchrun (FSDP2), a SIGKILLed run resumed, and eval/ddtree_accept.py
    on the deepspeed run's checkpoint: each a subprocess with its own budget, all on the tiny world."""
    size = 1 if tiny else 0
    steps, budgets = LAUNCH_STEPS[size], {name: both[size] for name, both in SUB_RUN_BUDGETS_S.items()}
    cuda = device.type == "cuda"
    figures, failures = {}, []
    with tempfile.TemporaryDirectory(prefix="gpu_check_launches_") as tmp:
        tmp = Path(tmp)
        cfg = write_world(tmp, steps)
        figures["deepspeed"] = run_training("deepspeed", "deepspeed", cfg, tmp / "a", steps, budgets["deepspeed"])
        failures.append(launch_failure("deepspeed", figures["deepspeed"], steps))
        figures["torchrun"] = run_training("torchrun", "torchrun", cfg, tmp / "b", steps, budgets["torchrun"])
        failures.append(launch_failure("torchrun", figures["torchrun"], steps))
        figures["kill_resume"] = kill_and_resume(cfg, tmp / "c", steps, budgets["kill_resume"])
        failures.append(launch_failure("kill_resume", figures["kill_resume"], steps, expect="resumed from"))
        if failures[0] is None:
            figures["eval"] = run_eval(tmp, tmp / "a" / "checkpoints" / "latest", budgets["eval"], cuda)
            failures.append(launch_failure("eval", figures["eval"]))
            verdict = figures["eval"].get("public_check", {}).get("verdict")
            if failures[-1] is None and verdict != "yes":
                failures.append(f"eval: --check-public 2 verdict {verdict!r}, not 'yes'")
        else:
            figures["eval"] = "skipped (the deepspeed run made no checkpoint)"
    failures = [f for f in failures if f]
    require(not failures, "; ".join(failures))
    return figures


# ----------------------------------------------------------------------------- main

class CheckTimeout(Exception):
    pass


@contextmanager
def time_budget(seconds: int):
    """CheckTimeout in the main thread once `seconds` have passed (SIGALRM; only between bytecodes,
    so not inside a hung C call). Outside the main thread: no budget."""
    def expire(signum, frame):
        raise CheckTimeout(f"timeout after {seconds} s (hang?)")
    try:
        previous = signal.signal(signal.SIGALRM, expire)
    except ValueError:  # not the main thread
        yield
        return
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_check(name: str, function, *args, budget_s: int | None = None) -> tuple[str, dict]:
    log(f"{name} ..." + (f" (budget {budget_s} s)" if budget_s else ""))
    try:
        with time_budget(budget_s) if budget_s else nullcontext():
            figures = function(*args)
        status = "pass"
    except (CheckFailed, CheckTimeout) as failure:
        status, figures = f"FAIL: {failure}", {}
    except Exception as error:  # e.g. out of memory: reported, and the other checks still run
        traceback.print_exc()
        status, figures = f"FAIL: {type(error).__name__}: {error}", {}
    log(f"{name}: {status}")
    return status, figures


def run_checks(checks: list[tuple], budgets: dict[str, int], report: dict) -> None:
    """Each (name, function, *args) under its budget; every check runs whatever the others did."""
    for name, function, *check_args in checks:
        status, figures = run_check(name, function, *check_args, budget_s=budgets.get(name))
        report["checks"][name] = status
        report[name] = figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (fp32)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed training steps")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU")
    parser.add_argument("--checks", help=f"comma-separated subset of: {', '.join(BUDGETS_S)} (default: all)")
    args = parser.parse_args(argv)
    global START
    START = time.perf_counter()
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        sys.exit("CUDA is not available: the Qwen3-8B-shaped check needs a GPU (use --tiny on the CPU)")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.float32 if args.tiny else compute_dtype("auto", device)  # --tiny: fp32 on any CPU
    run = TINY_RUN if args.tiny else FULL_RUN
    device_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    shapes = "tiny" if args.tiny else "Qwen3-8B"
    log(f"device {device_name}; building target and drafter ({shapes} shapes, {dtype})")
    target, drafter = build_models(args.tiny, device, dtype)
    drafter.train()

    report = {"device": device_name, "shapes": "tiny" if args.tiny else "qwen3-8b", "dtype": str(dtype),
              "target_params": sum(p.numel() for p in target.parameters()),
              "drafter_params": sum(p.numel() for p in drafter.parameters()), "checks": {}}
    checks = [("flex_vs_dense", check_flex_vs_dense, target, drafter, device, run),
              ("compile_bound", check_compile_bound, target, drafter, device, run),
              ("train_step", check_train_step, target, drafter, device, run, args),
              ("train_step_syncs", check_train_step_syncs, target, drafter, device, run),
              ("ddtree_step_syncs", check_ddtree_step_syncs, target, drafter, device, run),
              ("lossless", check_lossless, target, drafter, device, run),
              ("ds_engines", check_ds_engines, device, dtype),
              ("launches", check_launches, device, args.tiny)]
    if args.checks:
        wanted = args.checks.split(",")
        if unknown := set(wanted) - set(BUDGETS_S):
            sys.exit(f"--checks: unknown {', '.join(sorted(unknown))}")
        checks = [check for check in checks if check[0] in wanted]
    budgets = {name: both[1 if args.tiny else 0] for name, both in BUDGETS_S.items()}
    run_checks(checks, budgets, report)
    if not cuda:
        report["checks"]["flex_vs_dense_gradients"] = "skipped (no CUDA)"
        report["checks"]["cuda_sync_debug_mode"] = "skipped (no CUDA)"
    report["wall_s"] = time.perf_counter() - START
    failed = [name for name, status in report["checks"].items() if status.startswith("FAIL")]
    log(f"{len(failed)} failed: {', '.join(failed)}" if failed else "no check failed")
    print(json.dumps(report, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
