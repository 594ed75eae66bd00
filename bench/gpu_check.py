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
  ds_engines         each ds_configs/*.json's DeepSpeed engine built in a 1-process world and stepped once.
  launches           train.py under deepspeed and torchrun, a SIGKILLed run resumed, and eval/ddtree_accept.py's
                     public check, as subprocesses on a tiny world; with 2+ GPUs, deepspeed and torchrun
                     on 2 of them too (NCCL between ranks).
                     (ds_engines and launches, the preflight's run checks: bench/preflight_runs.py.)

Every check has a time budget (BUDGETS_S; each sub-run of `launches` its own, SUB_RUN_BUDGETS_S in
bench/preflight_runs.py): past it the check is `FAIL: timeout after N s (hang?)` and the next check
runs. In-process checks are stopped by SIGALRM, between bytecodes only: a hang inside one C call is
caught by the subprocess checks alone (their whole process tree is killed). --checks a,b runs a
subset. The harness (log, budgets, the check loop): bench/check_harness.py.

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
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.* when run as a script, from anywhere

from bench import check_harness  # noqa: E402
from bench.check_harness import build_on, log, make_batch, require, run_checks  # noqa: E402
from bench.preflight_runs import check_ds_engines, check_launches  # noqa: E402
from drafter.config import ObjectiveConfig, resolve_gamma  # noqa: E402
from drafter.pipeline.loader import collate  # noqa: E402
from drafter.pipeline.sampler import BucketSampler, make_buckets  # noqa: E402
from drafter.infra.host_sync import host_syncs  # noqa: E402
from drafter.infra.memory import peak_memory_bytes  # noqa: E402
from drafter.models import DFlashDraftModel, DraftCache, compiled_graph_count  # noqa: E402
from drafter.models.blocks import (DraftingSetup, FeatureBatch, attention_kernel, build_blocks,  # noqa: E402
                                   drafter_hidden, sample_anchors)
from drafter.models.configure import drafter_config  # noqa: E402
from drafter.serving.decode import DecodeSettings, generate, pick  # noqa: E402
from drafter.serving.lossless import first_divergence, lossless_verdict, near_tie_share  # noqa: E402
from drafter.serving.testing import ReplayDrafter  # noqa: E402
from drafter.target_model.cache import TargetCache  # noqa: E402
from drafter.target_model.model import compute_dtype, context_features, feature_tap, random_qwen3  # noqa: E402
from drafter.training.attention_check import ATTENTION_TOLERANCE, relative_error  # noqa: E402
from drafter.training.objective import training_step  # noqa: E402
from drafter.training.step_flops import drawn_blocks, formula_problem, step_flops  # noqa: E402
from drafter.tree import ddtree  # noqa: E402
from drafter.tree.ddtree import build_tree, committed_tokens, follow_tree, tree_verify_inputs  # noqa: E402

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

# seconds per check: (CUDA, --tiny on the CPU). In-process checks are stopped by SIGALRM, which Python
# handles between bytecodes: a hang inside one C call (a kernel, a collective) is caught only by the
# subprocess checks, whose budgets kill the process group (preflight_runs.SUB_RUN_BUDGETS_S).
BUDGETS_S = {"flex_vs_dense": (900, 240), "compile_bound": (1200, 180), "train_step": (900, 120),
             "train_step_syncs": (600, 60), "ddtree_step_syncs": (600, 60), "lossless": (900, 120),
             "ds_engines": (900, 180), "launches": (6000, 900)}


def sync_time(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


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
            loss, _ = training_step(DraftingSetup(drafter, target, attention),
                                    FeatureBatch(input_ids, loss_mask, features), objective,
                                    torch.Generator().manual_seed(0))
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
            loss, _ = training_step(DraftingSetup(drafter, target, "flex_compiled"),
                                    FeatureBatch(input_ids, loss_mask, features), objective,
                                    torch.Generator().manual_seed(i))
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
        loss, _ = training_step(DraftingSetup(drafter, target, attention),
                                FeatureBatch(input_ids, loss_mask, features), objective,
                                torch.Generator().manual_seed(step))
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
                loss, _ = training_step(DraftingSetup(drafter, target, attention),
                                        FeatureBatch(input_ids, loss_mask, features), objective,
                                        torch.Generator().manual_seed(0))
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
        references = [generate(bf16_target, prompt, 48) for prompt in prompts]
        share = near_tie_share([m for reference in references for m in reference.margins])
        figures = {"logit_scale": scale, "near_tie_share": share}
        require(share <= 0.5, f"{share:.0%} of ar's steps are near-ties: the verdict could not tell a bug")
        for method, budget in (("ddtree", run["budget"]), ("dflash", None)):
            divergences, lengths = [], []
            for prompt, reference in zip(prompts, references):
                replay = ReplayDrafter(bf16_drafter, prompt[0].tolist() + reference.output_ids)
                output = generate(bf16_target, prompt, 48, drafter=replay, settings=DecodeSettings(method, budget))
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


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (fp32)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed training steps")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU")
    parser.add_argument("--checks", help=f"comma-separated subset of: {', '.join(BUDGETS_S)} (default: all)")
    args = parser.parse_args(argv)
    check_harness.START = time.perf_counter()  # log's clock
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
    report["wall_s"] = time.perf_counter() - check_harness.START
    failed = [name for name, status in report["checks"].items() if status.startswith("FAIL")]
    log(f"{len(failed)} failed: {', '.join(failed)}" if failed else "no check failed")
    print(json.dumps(report, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
