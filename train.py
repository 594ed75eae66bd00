"""Train a DFlash drafter against a frozen target, with DeepSpeed ZeRO or torch FSDP2.

    deepspeed --num_gpus 8 train.py --cfg configs/v3.yaml [key.sub=value ...]
    torchrun --nproc_per_node 8 train.py --cfg configs/v3.yaml [train.engine=fsdp]
    srun python train.py --cfg configs/v3.yaml           # SLURM, one task per GPU
    torchrun --nproc_per_node 8 train.py --cfg ... target.tp_size=8   # a target larger than one GPU
    python train.py --cfg configs/toy.yaml               # one process; CPU + gloo without a GPU

config -> distributed init -> data -> resume decision -> target -> drafter -> engine -> loop ->
checkpoints. Every rank holds a frozen copy of the target (or, at target.tp_size G, its share of a copy
that G consecutive ranks hold together: drafter/tensor_parallel.py) and gets its own batch's
features; only the drafter is trained, through the engine interface of drafter/engine.py.
"""
import argparse
import hashlib
import itertools
import math
import os
import signal
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from drafter.checkpoint import (ResumeError, agree_on_checkpoint, check_resumable, load_checkpoint,
                                remove_partial_saves, run_identity, save_checkpoint, set_aside_previous_run)
from drafter.config import ConfigError, load_config, lr_factor, noise_std
from drafter.data import DataError, load_datasets
from drafter.engine import DeepSpeedEngine, FSDPEngine, deepspeed_config
from drafter.decode import stop_token_ids
from drafter.launch import LaunchError, init_distributed, remove_cpu_allreduce_buffer
from drafter.memory_plan import MemoryPlanError, check_fits, plan_inputs, plan_memory, target_model_config
from drafter.draft_config import drafter_config, drafter_variant
from drafter.mask_token import check_given_mask_token, choose_mask_token
from drafter.model import drafter_class, drafter_from_state_dict, load_drafter
from drafter.objective import ObjectiveConfig, attention_kernel, finalize_metrics, training_step
from drafter.run_lock import RunDirectoryBusy, hold_run_directory
from drafter.sampler import bucket_table, held_out_share, make_loader, plan_notes, sampler_from_config
from drafter.served import PromptShare, bench_prompts, generation_tau, held_out_prompts, replayed_tau
from drafter.distill import logit_softcap
from drafter.target import TargetError, input_embedding_scale, random_qwen3
from drafter.target_cache import probe_decoding
from drafter.tensor_parallel import (TargetFeatures, TensorParallelError, check_tensor_parallel, form_tp_group,
                                     load_tp_target, shard_target)
from drafter.tracking import RunLogger, console_line, eval_line

# What a user's choice of config, data or launch causes: reported as one line, without a traceback
# (EngineConfigError is a ConfigError).
USER_ERRORS = (ConfigError, DataError, ResumeError, LaunchError, TargetError, RunDirectoryBusy, MemoryPlanError,
               TensorParallelError)


# ----------------------------------------------------------------------------- setup

def set_cpu_threads(cfg):
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    threads = cfg.train.threads_per_rank or max(1, (os.cpu_count() or 1) // local_ranks)
    torch.set_num_threads(threads)


def training_dtype(cfg, device) -> torch.dtype:
    """The target's dtype, which is also the drafter's compute dtype (bf16 on GPUs by default)."""
    return {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
            "bf16": torch.bfloat16, "fp32": torch.float32}[cfg.target.dtype]


def node_ranks(world_size: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def build_target_and_tokenizer(cfg, device, dtype, tp_group):
    """The frozen target: whole, or this rank's share of its tensor-parallel group's copy."""
    if cfg.target.path is None:
        return shard_target(random_qwen3(**cfg.target.random).to(dtype), tp_group).to(device), None
    tokenizer = AutoTokenizer.from_pretrained(cfg.target.path)
    return load_tp_target(cfg.target.path, tp_group, device, dtype), tokenizer


def build_drafter(cfg, target, tokenizer, data, rank):
    """fp32 weights (the engines keep fp32 masters and compute in the training dtype). Without
    drafter.mask_token_id the mask token is chosen from the tokenizer and the training `data`
    (drafter/mask_token.py) and recorded in the export's dflash_config; one given is checked against
    the data."""
    if cfg.drafter.init_from:
        if not (Path(cfg.drafter.init_from) / "config.json").is_file():
            raise ConfigError(f"drafter.init_from={cfg.drafter.init_from}: no exported drafter there (no config.json)")
        return load_drafter(cfg.drafter.init_from, dtype=torch.float32)
    mask_token_id = cfg.drafter.mask_token_id
    if mask_token_id is None:
        if tokenizer is None:
            raise ConfigError("drafter.mask_token_id is required for a random target")
        mask = choose_mask_token(tokenizer, target.config.vocab_size, data)
        if rank == 0:
            print(mask.line(), flush=True)
        mask_token_id = mask.id
    else:
        check_given_mask_token(mask_token_id, data)
    config = drafter_config(target.config, num_layers=cfg.drafter.num_layers,
                            block_size=cfg.drafter.block_size, mask_token_id=mask_token_id,
                            target_layer_ids=cfg.drafter.target_layer_ids,
                            variant=drafter_variant(cfg.drafter),
                            input_embedding_scale=input_embedding_scale(target), target_path=cfg.target.path,
                            chat_template_kwargs=dict(cfg.target.chat_template_kwargs))
    torch.manual_seed(cfg.run.seed)  # same initial weights on every rank
    return drafter_class(config)(config)


def engine_settings(cfg, world_size, device, dtype, hidden_size):
    """What the engine is built from, checked before any model loads (the DeepSpeed JSON's
    contradictions with the YAML fail here)."""
    if cfg.train.engine == "deepspeed":
        return deepspeed_config(cfg.train.ds_config, cfg, world_size, dtype == torch.bfloat16, hidden_size,
                                on_cpu=device.type == "cpu")
    return None


def check_memory_plan(cfg, model_config, world_size, device, dtype, ds_config, rank):
    """Printed before any weights load; on a GPU, a plan that cannot fit the device stops the run."""
    plan = plan_memory(plan_inputs(cfg, model_config, world_size, ds_config, dtype.itemsize))
    gpu_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    if rank == 0:
        print("\n".join(plan.lines(gpu_bytes)), flush=True)
    if gpu_bytes:
        check_fits(plan, gpu_bytes, node_ranks(world_size))


def build_engine(cfg, drafter, device, dtype, ds_config):
    if cfg.train.engine == "deepspeed":
        return DeepSpeedEngine(drafter.to(device), ds_config)
    return FSDPEngine(drafter.to(device), cfg, device, bf16=dtype == torch.bfloat16)


def data_position(cfg, sampler, world_size, ds_config) -> dict:
    """What the saved (epoch, micro step) position means: a resume must keep all of it."""
    stage = ds_config["zero_optimization"]["stage"] if ds_config else None
    return {"world_size": world_size, "optim.grad_accum": cfg.optim.grad_accum,
            "data.tokens_per_batch": cfg.data.tokens_per_batch, "buckets": sampler.boundaries.tolist(),
            "data.max_run": cfg.data.max_run, "data.seed": cfg.data.seed,
            "train_lengths_sha256": hashlib.sha256(sampler.lengths.tobytes()).hexdigest()[:16],
            "engine": cfg.train.engine + (f" zero-{stage}" if stage else "")}


def schedule_notes(cfg, state, total_steps) -> list[str]:
    """On resume the lr schedule keeps the length it started with, unless train.schedule_steps says
    otherwise (then the learning rate moves at once, as asked)."""
    if cfg.train.schedule_steps and cfg.train.schedule_steps != state["schedule_steps"]:
        before = lr_factor(cfg.optim, state["step"], state["schedule_steps"])
        state["schedule_steps"] = cfg.train.schedule_steps
        after = lr_factor(cfg.optim, state["step"], state["schedule_steps"])
        return [f"train.schedule_steps={cfg.train.schedule_steps}: the lr factor moves from {before:.3g} "
                f"to {after:.3g} at step {state['step']}"]
    if total_steps != state["schedule_steps"]:
        return [f"this run stops at step {total_steps}; the lr schedule keeps its {state['schedule_steps']} "
                "steps (no jump; set train.schedule_steps to change it)"]
    return []


def step_generator(seed: int, step: int, rank: int, salt: int = 0, device="cpu") -> torch.Generator:
    """Anchors and noise for (step, rank) come from their own seed: resume replays them exactly."""
    return torch.Generator(device=device).manual_seed(hash((seed, step, rank, salt)) % 2**63)


def add_feature_noise(features: torch.Tensor, std: float, num_layers: int,
                      generator: torch.Generator) -> torch.Tensor:
    """Gaussian noise with std `std` times each layer's per-token RMS, added in fp32: an absolute std
    would vanish in bf16 rounding on the large hidden states of real targets."""
    if std <= 0:
        return features
    per_layer = features.float().unflatten(-1, (num_layers, -1))
    rms = per_layer.pow(2).mean(-1, keepdim=True).sqrt()
    noise = torch.randn(per_layer.shape, generator=generator, device=features.device)
    return (per_layer + noise * (std * rms)).flatten(-2).to(features.dtype)


def comm_device() -> torch.device:
    """Where collective tensors live: NCCL only moves GPU tensors."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_sum(metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    names = sorted(metrics)
    flat = torch.cat([metrics[n].reshape(-1).double().to(comm_device()) for n in names])
    dist.all_reduce(flat)
    flat = flat.cpu()
    out, offset = {}, 0
    for n in names:
        size = metrics[n].numel()
        out[n] = flat[offset:offset + size].view(metrics[n].shape)
        offset += size
    return out


def any_rank(flag: bool) -> bool:
    value = torch.tensor([1.0 if flag else 0.0], device=comm_device())
    dist.all_reduce(value)
    return bool(value.item() > 0)


class Timers:
    """Wall time per stage. On CUDA a stage boundary needs a device sync, so timing is optional there."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled, self.device = enabled, device
        self.seconds = defaultdict(float)
        self._last = None

    def start(self):
        self._last = self._now() if self.enabled else None

    def lap(self, stage: str):
        if self.enabled:
            now = self._now()
            self.seconds[stage] += now - self._last
            self._last = now

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


# ----------------------------------------------------------------------------- training

@dataclass(frozen=True)
class RunParts:
    """What stays fixed for the whole run, as the step, eval and generation functions need it."""
    cfg: object
    rank: int
    world_size: int
    device: torch.device
    target: torch.nn.Module
    target_features: TargetFeatures  # this rank's features (and final hidden states), whatever the tp size
    objective: ObjectiveConfig
    attention: str


def micro_step(run: RunParts, engine, batch, step, micro, noise, timers):
    """Forward + backward of one micro batch; returns its metrics ([sum, count] tensors, on the device:
    nothing here waits for the device)."""
    input_ids = batch["input_ids"].to(run.device, non_blocking=True)
    loss_mask = batch["loss_mask"].to(run.device, non_blocking=True)
    drafter = engine.module
    timers.start()
    features, final_hidden = run.target_features(input_ids, drafter.target_layer_ids)
    features = add_feature_noise(features, noise, len(drafter.target_layer_ids),
                                 step_generator(run.cfg.run.seed, step, run.rank, 1 + micro, run.device))
    timers.lap("target")
    loss, metrics = training_step(drafter, run.target, features, input_ids, loss_mask, run.objective,
                                  step_generator(run.cfg.run.seed, step, run.rank, -1 - micro), run.attention,
                                  final_hidden)
    # A non-finite loss makes every gradient NaN, so the engine's global check skips the step on all ranks.
    loss = loss * torch.where(torch.isfinite(loss.detach()), 1.0, math.nan)
    engine.backward(loss)
    timers.lap("drafter")
    return {k: v.detach() for k, v in metrics.items()}


def local_drafter(engine, target):
    """The drafter for evaluation and generation: the engine's module, or, when the engine shards it
    (ZeRO-3, FSDP), a plain copy gathered from the shards. Ranks run different numbers of drafter
    forwards there (their rows hold different response lengths), which sharded forwards, each a
    collective, cannot do."""
    if not engine.sharded:
        return engine.module
    return drafter_from_state_dict(engine.module.config, engine.full_state_dict()).to(target.device, target.dtype)


@torch.no_grad()
def evaluate(run: RunParts, drafter, eval_set, eval_sampler):
    """Held-out loss, random-anchor metrics and replayed tau over up to eval_batches of this rank's
    share of the held-out rows, on clean features. Ranks hold different numbers of batches; the members
    of a tensor-parallel group run the target as often as the one with the most, passing None when out."""
    was_training = drafter.training
    drafter.eval()
    summed = defaultdict(lambda: 0)
    loader = make_loader(eval_set, eval_sampler, epoch=0, num_workers=0, prefetch_factor=2)
    with loader:
        batches = list(itertools.islice(loader, run.cfg.train.eval_batches))
    for i in range(run.target_features.most_in_group(len(batches))):
        batch = batches[i] if i < len(batches) else None
        input_ids = batch["input_ids"].to(run.device) if batch else None
        features, final_hidden = run.target_features(input_ids, drafter.target_layer_ids)
        if batch is None:
            continue
        loss_mask = batch["loss_mask"].to(run.device)
        _, metrics = training_step(drafter, run.target, features, input_ids, loss_mask, run.objective,
                                   step_generator(run.cfg.run.seed, i, run.rank, 7), run.attention, final_hidden)
        metrics.update(replayed_tau(drafter, run.target, features, input_ids, loss_mask,
                                    run.cfg.train.tau_budgets, run.attention,
                                    blocks_per_forward=run.objective.anchors_per_batch or 2048,
                                    chunk_bytes=run.objective.chunk_bytes))
        for k, v in metrics.items():
            summed[k] = summed[k] + v.float()
    drafter.train(was_training)
    if any_rank(not summed):  # a rank whose rows are all too long has nothing to add
        return {}
    summed = all_reduce_sum(dict(summed))
    return {**finalize_metrics(summed), "eval_responses": int(summed["tau_dflash"][1])}


class StopRequest:
    """SIGTERM / SIGINT (scancel, Ctrl-C) or SIGUSR1 (SLURM's --signal=USR1@N early warning):
    finish the current step, save, exit 0."""

    def __init__(self):
        self.requested = False
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame):
        self.requested = True


def main(argv=None):
    parser = argparse.ArgumentParser(description="Train a DFlash drafter (see the module docstring).")
    parser.add_argument("--cfg", required=True, help="OmegaConf YAML, e.g. configs/v3.yaml")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed
    parser.add_argument("overrides", nargs="*", help="key.sub=value")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.cfg, args.overrides)
    except (ConfigError, FileNotFoundError) as error:
        sys.exit(f"config error: {error}")
    try:
        rank, world_size, device = init_distributed(cfg.train.dist_timeout_minutes)
    except LaunchError as error:
        sys.exit(f"launch error: {error}")
    try:
        with hold_run_directory(cfg.run.out_dir) as lock:  # one live run per run.out_dir, until this exits
            if lock.note:
                print(lock.note, file=sys.stderr, flush=True)
            return train(cfg, rank, world_size, device)
    except USER_ERRORS as error:  # raised on every rank: say it once (or per rank when it differs)
        if rank == 0 or getattr(error, "per_rank", False):
            print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    finally:
        dist.destroy_process_group()
        if device.type == "cpu":
            remove_cpu_allreduce_buffer(rank)


def train(cfg, rank, world_size, device) -> int:
    if device.type == "cpu":
        set_cpu_threads(cfg)
    stop = StopRequest()
    dtype = training_dtype(cfg, device)
    if device.type == "cpu" and attention_kernel(cfg.objective.attention, device) != "dense":
        raise ConfigError(f"objective.attention={cfg.objective.attention}: flex_attention has no backward on "
                          "the CPU in this torch; train with dense there (auto)")
    model_config = target_model_config(cfg.target.path, cfg.target.random)
    text_config = model_config.get_text_config()
    check_tensor_parallel(model_config, cfg.target.tp_size, node_ranks(world_size), world_size)
    ds_config = engine_settings(cfg, world_size, device, dtype, text_config.hidden_size)

    train_set, eval_set = load_datasets(cfg.data, text_config.vocab_size, cfg.target.chat_template_kwargs)
    sampler = sampler_from_config(np.asarray(train_set["length"]), cfg.data, world_size, rank,
                                  steps_multiple=cfg.optim.grad_accum)
    eval_rows, eval_sampler = held_out_share(np.asarray(eval_set["length"]), cfg.data.max_length,
                                             cfg.data.tokens_per_batch, world_size, rank, cfg.data.seed)
    eval_share = eval_set.select(eval_rows)
    steps_per_epoch = len(sampler) // cfg.optim.grad_accum
    if steps_per_epoch == 0:
        left_out = "; ".join(plan_notes(sampler.stats(0)))
        raise DataError(f"{cfg.data.path}: {len(train_set)} samples make no optimizer step per epoch at "
                        f"{world_size} ranks x grad_accum {cfg.optim.grad_accum}: {left_out}")
    total_steps = cfg.train.epochs * steps_per_epoch
    if cfg.train.max_steps:
        total_steps = min(total_steps, cfg.train.max_steps)

    # Which run this is, decided before any model loads.
    identity, position = run_identity(cfg), data_position(cfg, sampler, world_size, ds_config)
    resume_from, saved = agree_on_checkpoint(cfg.train.resume, cfg.run.out_dir)
    notes = check_resumable(saved, identity, position, cfg.train.resume, resume_from) if saved else []
    if rank == 0:
        aside = set_aside_previous_run(cfg.run.out_dir) if saved is None else None
        if aside:
            notes.append(f"starting a new run: the previous run's files in {cfg.run.out_dir} were moved to {aside}")
        notes += [f"removed {p}, a save cut short" for p in remove_partial_saves(cfg.run.out_dir)]
    dist.barrier()

    check_memory_plan(cfg, model_config, world_size, device, dtype, ds_config, rank)
    tp_group = form_tp_group(cfg.target.tp_size)
    target, tokenizer = build_target_and_tokenizer(cfg, device, dtype, tp_group)
    drafter = build_drafter(cfg, target, tokenizer, (train_set, eval_set), rank)
    generate_prompts = generation_prompts(cfg, tokenizer, eval_set)
    # every rank probes (the same forwards: under tp each is a collective over the group)
    probe = probe_decoding(target) if generate_prompts else None
    if probe and (refusal := probe.cannot_decode or probe.cannot_verify):
        raise ConfigError(f"{refusal}: set train.generate_every=0 (the replayed tau of the eval steps needs "
                          "no decoding)")
    stops = stop_token_ids(target, tokenizer)
    attention = attention_kernel(cfg.objective.attention, device)
    objective = ObjectiveConfig.from_section(cfg.objective, drafter.block_size, drafter.mask_token_id,
                                             logit_softcap(target))
    engine = build_engine(cfg, drafter, device, dtype, ds_config)
    target_features = TargetFeatures(target, tp_group, device, final_hidden=objective.labels == "target")
    run = RunParts(cfg, rank, world_size, device, target, target_features, objective, attention)

    state = {"step": 0, "epoch": 0, "micro_step_in_epoch": 0, "skipped_steps": 0, "wandb_id": None,
             "elapsed_s": 0.0, "schedule_steps": cfg.train.schedule_steps or total_steps}
    if resume_from is not None:
        load_checkpoint(engine, resume_from)
        state = {key: saved[key] for key in state}
        notes.append(f"resumed from {resume_from} at step {state['step']} "
                     f"(epoch {state['epoch']}, micro step {state['micro_step_in_epoch']})")
        notes += schedule_notes(cfg, state, total_steps)
    state.update(identity=identity, data_position=position)
    log = RunLogger(cfg, is_main=rank == 0, resume_step=state["step"] if resume_from else None,
                    resume_id=state["wandb_id"])
    state["wandb_id"] = log.run_id
    stats = sampler.stats(0)
    for note in notes:
        log.print(note)
    log.print(f"run {cfg.run.name}: {world_size} ranks on {device.type}, {engine.description}, drafter "
              f"{engine.num_parameters / 1e6:.2f}M params, {total_steps} steps ({steps_per_epoch}/epoch), "
              f"attention={attention}")
    log.print(bucket_summary(stats))

    def save(step):
        elapsed = state["elapsed_s"] + time.time() - t_start
        save_checkpoint(engine, cfg, step, {**state, "elapsed_s": elapsed}, export_dtype=dtype)

    profile = cfg.train.profile_timing if cfg.train.profile_timing is not None else device.type == "cpu"
    t_start = time.time()
    window = Window(sampler.num_buckets, device, Timers(profile, device))
    bad_in_a_row, last_saved = 0, state["step"] if resume_from is not None else None
    accum = cfg.optim.grad_accum
    try:
        while state["step"] < total_steps and state["epoch"] < cfg.train.epochs:
            epoch_len = len(sampler.epoch_plan(state["epoch"]))  # whole optimizer steps, the same on every rank
            loader = make_loader(train_set, sampler, state["epoch"], state["micro_step_in_epoch"],
                                 cfg.data.num_workers, cfg.data.prefetch_factor,
                                 pin_memory=device.type == "cuda")
            with loader:
                while state["micro_step_in_epoch"] < epoch_len and state["step"] < total_steps:
                    step, t0 = state["step"], time.perf_counter()
                    noise = noise_std(cfg.noise, step)
                    for micro in range(accum):
                        t_wait = time.perf_counter()
                        batch = next(loader)
                        window.data_wait += time.perf_counter() - t_wait
                        window.queue.append(loader.queue_depth())
                        metrics = micro_step(run, engine, batch, step, micro, noise, window.timers)
                        window.add(metrics, batch)
                        state["micro_step_in_epoch"] += 1
                    window.timers.start()
                    lr = cfg.optim.lr * lr_factor(cfg.optim, step, state["schedule_steps"])
                    result = engine.step(lr)
                    window.timers.lap("optimizer")
                    state["step"] = step = step + 1
                    bad_in_a_row = 0 if result.applied else bad_in_a_row + 1
                    window.end_step(result, noise, lr, time.perf_counter() - t0)
                    if not result.applied:
                        state["skipped_steps"] += 1
                        log.print(f"step {step}: non-finite loss or gradient; the step was skipped on all "
                                  f"ranks ({bad_in_a_row} in a row)")
                        if bad_in_a_row >= cfg.train.max_bad_steps:
                            log.print(f"stopping: {bad_in_a_row} non-finite steps in a row; the last good "
                                      f"checkpoint (step {last_saved}) is left as it was")
                            return 1
                    last = step >= total_steps
                    if step % cfg.train.log_every == 0 or last:
                        record = window.summary(state, stats, total_steps, len(sampler),
                                                time.time() - t_start, objective.ddtree_budget)
                        log.log(record)
                        log.print(console_line(record))
                        window = Window(sampler.num_buckets, device, Timers(profile, device))
                    if any_rank(stop.requested):  # before evaluation: the launcher's grace period is short
                        log.print(f"stop requested: saving at step {step} and exiting")
                        save(step)
                        return 0
                    evaluating = len(eval_set) >= world_size and (step % cfg.train.eval_every == 0 or last)
                    generating = generate_prompts and (step % cfg.train.generate_every == 0 or last)
                    if evaluating or generating:  # one gather of a sharded drafter serves both
                        drafter_now = local_drafter(engine, target)
                        if evaluating:
                            run_eval(run, drafter_now, eval_share, eval_sampler, step, log)
                        if generating:
                            run_generation(run, drafter_now, generate_prompts, stops, step, log)
                    if step % cfg.train.save_every == 0:
                        save(step)
                        last_saved = step
            if state["micro_step_in_epoch"] >= epoch_len:
                state["epoch"], state["micro_step_in_epoch"] = state["epoch"] + 1, 0
        if last_saved != state["step"]:
            save(state["step"])
        log.print(f"done: {state['step']} steps, {state['skipped_steps']} skipped")
        return 0
    finally:
        log.close()


def run_eval(run: RunParts, drafter, eval_set, eval_sampler, step, log):
    metrics = evaluate(run, drafter, eval_set, eval_sampler)
    if not metrics:
        return
    log.log({"step": step, **metrics}, prefix="eval")
    log.print(eval_line({"step": step, **metrics}))


def generation_prompts(cfg, tokenizer, eval_set) -> list[list[int]] | None:
    """The fixed prompt set of the generation step (None when train.generate_every is 0)."""
    if not cfg.train.generate_every:
        return None
    if cfg.train.generate_prompts is None:
        return held_out_prompts(eval_set, cfg.train.generate_max_prompts, cfg.data.seed)
    if tokenizer is None:
        raise ConfigError("train.generate_prompts needs the target's tokenizer (set target.path), "
                          "or null for the held-out prompts")
    thinking = bool(cfg.target.chat_template_kwargs.get("enable_thinking", False))
    try:
        return bench_prompts(cfg.train.generate_prompts, tokenizer, thinking, cfg.train.generate_max_prompts)
    except ValueError as error:  # a missing or malformed prompt file, named with the row
        raise ConfigError(f"train.generate_prompts={cfg.train.generate_prompts}: {error}") from None


def run_generation(run: RunParts, drafter, prompts, stops, step, log):
    """The drafter as it is now, served on the fixed prompts (split over the ranks, or over the
    tensor-parallel groups, whose members decode together; time-bounded)."""
    cfg = run.cfg
    share = PromptShare.of(run.target_features.group, run.world_size)
    summed = all_reduce_sum(generation_tau(
        run.target, drafter, prompts, share, budgets=cfg.train.tau_budgets,
        max_new_tokens=cfg.train.generate_max_new_tokens, max_seconds=cfg.train.generate_max_seconds,
        stop_token_ids=stops))
    metrics = {"step": step, **finalize_metrics(summed), "gen_responses": int(summed["gen_tau_dflash"][1])}
    log.log(metrics, prefix="generate")
    log.print(eval_line(metrics, "generate"))


# ----------------------------------------------------------------------------- logging

class Window:
    """Sums over the steps between two log lines. Metrics stay on the device and are reduced over
    ranks only when summarised, so the training loop never waits for them."""

    def __init__(self, num_buckets: int, device: torch.device, timers: Timers):
        self.metrics = defaultdict(lambda: 0)
        self.per_bucket = torch.zeros(num_buckets, 3, 2, device=device)  # (loss, acc, anchor_streak) x [sum, count]
        self.tokens = torch.zeros(2, dtype=torch.float64)  # real, computed (padding included)
        self.timers, self.data_wait = timers, 0.0
        self.queue, self.grad_norms = [], []
        self.steps, self.seconds, self.noise, self.lr = 0, 0.0, 0.0, 0.0

    def add(self, metrics, batch):
        for k, v in metrics.items():
            self.metrics[k] = self.metrics[k] + v
        self.per_bucket[batch["bucket"]] += torch.stack([metrics["loss"], metrics["acc"], metrics["anchor_streak"]])
        self.tokens += torch.tensor([float(batch["lengths"].sum()), float(batch["input_ids"].numel())],
                                    dtype=torch.float64)

    def end_step(self, result, noise, lr, seconds):
        self.steps += 1
        self.seconds += seconds
        if result.applied and math.isfinite(result.grad_norm):
            self.grad_norms.append(result.grad_norm)
        self.noise, self.lr = noise, lr

    def summary(self, state, stats, total_steps, micro_per_epoch, elapsed, budget) -> dict:
        summed = all_reduce_sum({**self.metrics, "per_bucket": self.per_bucket, "tokens": self.tokens})
        per_bucket = summed.pop("per_bucket")
        real, computed = summed.pop("tokens").tolist()
        m = finalize_metrics(summed)
        queue_depths = [torch.zeros(1, device=comm_device()) for _ in range(dist.get_world_size())]
        dist.all_gather(queue_depths, torch.tensor([float(np.mean(self.queue or [0]))], device=comm_device()))
        steps, seconds = self.steps, max(self.seconds, 1e-9)
        timers = {"data_wait": self.data_wait, **self.timers.seconds}
        return {
            "step": state["step"], "epoch": state["epoch"], **m,
            "ddtree_budget": budget,
            "lr": self.lr, "noise": self.noise,
            "grad_norm": float(np.mean(self.grad_norms)) if self.grad_norms else math.nan,
            "skipped_steps": state["skipped_steps"],
            "pad_efficiency": real / computed,
            "tokens_per_s": real / seconds,
            "target_batches_per_s": steps / self.timers.seconds["target"] if "target" in self.timers.seconds else math.nan,
            "drafter_batches_per_s": steps / self.timers.seconds["drafter"] if "drafter" in self.timers.seconds else math.nan,
            "time_split_s": {k: v / steps for k, v in timers.items()},
            "prefetch_queue": [round(float(q), 1) for q in queue_depths],
            "per_bucket": {name: (per_bucket[:, i, 0] / per_bucket[:, i, 1]).tolist()
                           for i, name in enumerate(("loss", "acc", "anchor_streak"))},
            "bucket_batch_pct": [b["batch_pct"] for b in stats["buckets"]],
            "seq_len": {"min": stats["length_min"], "mean": stats["length_mean"], "max": stats["length_max"]},
            "epoch_progress": state["epoch"] + state["micro_step_in_epoch"] / max(1, micro_per_epoch),
            "eta_s": (total_steps - state["step"]) * seconds / steps,
            "elapsed_s": state["elapsed_s"] + elapsed,
        }


def bucket_summary(stats) -> str:
    return "\n".join([*bucket_table(stats),
                      f"padding efficiency {stats['pad_efficiency']:.3f}, longest same-bucket run "
                      f"{stats['max_same_bucket_run']}", *plan_notes(stats)])


if __name__ == "__main__":
    sys.exit(main())
