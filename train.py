"""Train a DFlash drafter against a frozen target, with DeepSpeed ZeRO or torch FSDP2.

    deepspeed --num_gpus 8 train.py --cfg configs/v3.yaml [key.sub=value ...]
    torchrun --nproc_per_node 8 train.py --cfg configs/v3.yaml [train.engine=fsdp]
    srun python train.py --cfg configs/v3.yaml           # SLURM, one task per GPU
    torchrun --nproc_per_node 8 train.py --cfg ... target.tp_size=8   # a target larger than one GPU
    python train.py --cfg configs/toy.yaml               # one process; CPU + gloo without a GPU

main: config -> distributed world -> the run directory's lock -> train: data, with every check that
needs no weights -> resume decision -> memory plan -> target -> drafter -> engine -> the resumed
state -> loop (evaluation, generation, checkpoints) -> the last checkpoint. Every rank holds a frozen
copy of the target (or, at target.tp_size G, its share of a copy that G consecutive ranks hold
together: drafter/target/tensor_parallel.py) and gets its own batch's features; only the drafter is
trained, through the engine interface of drafter/infra/engine.py. With data.features (a store written
by data_tools/features.py) the features are read from the store instead, and of the target only its
embedding and LM head load (docs/features.md).
"""
import argparse
import hashlib
import itertools
import math
import signal
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from drafter.config import ObjectiveConfig, lr_factor, noise_std
from drafter.data.datasets import DataError, content_fingerprint, load_datasets, supervised_token_counts
from drafter.data.feature_store import (FeatureStore, StoreCache, StoreFeatures, labels_refusal, load_stored_head,
                                        store_model_config, store_refusal)
from drafter.data.loader import make_loader
from drafter.data.sampler import held_out_share, plan_notes, sampler_from_config
from drafter.errors import ConfigError, UserError
from drafter.infra.collectives import all_reduce_sum, any_rank
from drafter.infra.engine import build_engine, engine_settings
from drafter.infra.launch import local_world_size, remove_cpu_allreduce_buffer, set_cpu_threads
from drafter.infra.progress import StageTimer
from drafter.infra.run_lock import hold_run_directory
from drafter.losses.divergences import labels_needed
from drafter.losses.lm_head import chunk_rows_for, logit_softcap, target_next_tokens
from drafter.metric_sums import finalize_metrics
from drafter.models import drafter_from_state_dict, load_drafter, new_drafter
from drafter.models.blocks import attention_kernel, blocks_drawn
from drafter.models.configure import drafter_config
from drafter.models.draft_vocab import answer_vocab
from drafter.models.from_target import start_layers_from_target
from drafter.models.mask_token import check_given_mask_token, choose_mask_token
from drafter.serving.decode import stop_token_ids
from drafter.serving.served import PromptShare, bench_prompts, generation_tau, held_out_prompts, replayed_tau
from drafter.serving.path_memory import check_path_batch_fits
from drafter.target.cache import TargetCache, probe_decoding
from drafter.target.calibration import calibrated_features
from drafter.target.model import compute_dtype, input_embedding_scale, random_qwen3
from drafter.target.tensor_parallel import (TargetFeatures, check_tensor_parallel, feature_code_version, form_tp_group,
                                            load_tp_target, shard_target)
from drafter.training.checkpoint import (TrainerState, agree_on_checkpoint, check_resumable, load_checkpoint,
                                         remove_partial_saves, run_identity, save_checkpoint, set_aside_previous_run)
from drafter.training.memory_plan import check_fits, plan_inputs, plan_memory, target_model_config
from drafter.training.objective import training_step
from drafter.training.run_config import config_and_world
from drafter.training.tracking import RunLogger, TrainedOn, Window, bucket_summary, console_line, eval_line

# step_generator's streams of (seed, step, rank): each draw of a step has its own, so that resume
# replays it and one draw never shifts another
NOISE_STREAM = 1     # + the micro step: the feature noise
ANCHOR_STREAM = -1   # - the micro step: the training anchors
EVAL_STREAM = 7      # the held-out batches' anchors (step: the batch's index)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Train a DFlash drafter (see the module docstring).")
    parser.add_argument("--cfg", required=True, help="OmegaConf YAML, e.g. configs/v3.yaml")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed
    parser.add_argument("overrides", nargs="*", help="key.sub=value")
    args = parser.parse_args(argv)
    cfg, rank, world_size, device = config_and_world(args.cfg, args.overrides)
    try:
        with hold_run_directory(cfg.run.out_dir) as lock:  # one live run per run.out_dir, until this exits
            if lock.note:
                print(lock.note, file=sys.stderr, flush=True)
            return train(cfg, rank, world_size, device)
    except UserError as error:  # raised on every rank: say it once (or per rank when it differs)
        if rank == 0 or getattr(error, "per_rank", False):
            print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    finally:
        dist.destroy_process_group()
        if device.type == "cpu":
            remove_cpu_allreduce_buffer(rank)


def train(cfg, rank, world_size, device) -> int:
    if device.type == "cpu":
        set_cpu_threads(cfg.train.threads_per_rank, world_size)
    stop = StopRequest()
    data, model_config, ds_config = prepare_data(cfg, rank, world_size, device)
    resume_from, saved, notes = decide_resume(cfg, rank, data.identity, data.position)  # before any model loads
    run = build_run(cfg, rank, world_size, device, data, model_config, ds_config)
    state = TrainerState(schedule_steps=cfg.train.schedule_steps or data.total_steps, identity=data.identity,
                         data_position=data.position)
    if resume_from is not None:
        load_checkpoint(run.engine, resume_from)
        state = replace(saved, identity=data.identity, data_position=data.position,
                        schedule_steps=cfg.train.schedule_steps or saved.schedule_steps)
        notes.append(f"resumed from {resume_from} at step {state.step} "
                     f"(epoch {state.epoch}, micro step {state.micro_step_in_epoch})")
        notes += schedule_notes(cfg, saved, data.total_steps)
    log = RunLogger(cfg, is_main=rank == 0, resume_step=state.step if resume_from else None,
                    resume_id=state.wandb_id)
    state.wandb_id = log.run_id
    try:
        announce(run, log, notes)
        return train_loop(run, state, log, stop, last_saved=state.step if resume_from is not None else None)
    finally:
        log.close()


# ----------------------------------------------------------------------------- setup

@dataclass(frozen=True)
class RunData:
    """This rank's data for the whole run: the training set and its sampler, its share of the held-out
    rows, the run's length, and what identifies the run and its data position (checkpoint.py)."""
    train_set: object
    sampler: object
    eval_set: object        # every held-out row (generation prompts, the mask token's scan)
    eval_share: object      # this rank's share of them, batched by eval_sampler
    eval_sampler: object
    stats: dict             # the sampler's plan of epoch 0 (the log lines' bucket and length figures)
    steps_per_epoch: int
    total_steps: int
    identity: dict
    position: dict
    held_out_set: str       # content_fingerprint of eval_set: curves of different held-out sets never mix


@dataclass(frozen=True)
class RunParts:
    """What stays fixed for the whole run, as the loop, eval and generation need it."""
    cfg: object
    rank: int
    world_size: int
    device: torch.device
    dtype: torch.dtype
    data: RunData
    target: torch.nn.Module
    target_features: TargetFeatures  # this rank's features (and final hidden states), whatever the tp size
    engine: object                   # drafter/infra/engine.py's interface around the drafter
    objective: ObjectiveConfig
    attention: str
    generate_prompts: list[list[int]] | None
    stops: list[int]
    trained_on: TrainedOn            # this rank's supervised tokens and blocks since they were last counted


def prepare_data(cfg, rank, world_size, device):
    """(RunData, the target's model config, the engine's settings): everything checked before a model
    loads, so that a bad config, launch or dataset fails in seconds."""
    if device.type == "cpu" and attention_kernel(cfg.objective.attention, device) != "dense":
        raise ConfigError(f"objective.attention={cfg.objective.attention}: flex_attention has no backward on "
                          "the CPU in this torch; train with dense there (auto)")
    check_store_settings(cfg)
    model_config = (store_model_config(cfg.data.features) if cfg.data.features
                    else target_model_config(cfg.target.path, cfg.target.random))
    text_config = model_config.get_text_config()
    check_tensor_parallel(model_config, cfg.target.tp_size, local_world_size(world_size), world_size)
    ds_config = engine_settings(cfg, world_size, device, compute_dtype(cfg.target.dtype, device),
                                text_config.hidden_size)
    train_set, eval_set = load_datasets(cfg.data, text_config.vocab_size, cfg.target.chat_template_kwargs)
    sampler = sampler_from_config(np.asarray(train_set["length"]), cfg.data, world_size, rank,
                                  steps_multiple=cfg.optim.grad_accum)
    eval_rows, eval_sampler = held_out_share(np.asarray(eval_set["length"]), cfg.data.max_length,
                                             cfg.data.tokens_per_batch, world_size, rank, cfg.data.seed)
    steps_per_epoch = len(sampler) // cfg.optim.grad_accum
    if steps_per_epoch == 0:
        left_out = "; ".join(plan_notes(sampler.stats(0)))
        raise DataError(f"{cfg.data.path}: {len(train_set)} samples make no optimizer step per epoch at "
                        f"{world_size} ranks x grad_accum {cfg.optim.grad_accum}: {left_out}")
    total_steps = cfg.train.epochs * steps_per_epoch
    if cfg.train.max_steps:
        total_steps = min(total_steps, cfg.train.max_steps)
    data = RunData(train_set, sampler, eval_set, eval_set.select(eval_rows), eval_sampler, sampler.stats(0),
                   steps_per_epoch, total_steps, run_identity(cfg), data_position(cfg, sampler, world_size, ds_config),
                   content_fingerprint(eval_set))
    return data, model_config, ds_config


def check_store_settings(cfg):
    """What a run from a feature store cannot do, refused before anything loads: without the target's
    weights (data.features_missing=error), whatever needs the target itself."""
    if not cfg.data.features:
        for key in ("data.eval_features", "data.features_dtype", "data.features_cache"):
            if OmegaConf.select(cfg, key):
                raise ConfigError(f"{key} is read only with data.features")
        return
    generate = cfg.data.features_missing == "generate"
    if cfg.data.eval_features and not cfg.data.eval_path:
        raise ConfigError(f"data.eval_features={cfg.data.eval_features} without data.eval_path: the held-out "
                          "rows of data.path are in data.features")
    if cfg.data.eval_path and not cfg.data.eval_features and not generate:
        raise ConfigError(f"data.eval_path={cfg.data.eval_path} needs its own store: data.eval_features=DIR "
                          "(data_tools/features.py --data <data.eval_path>)")
    if generate and cfg.target.tp_size > 1:
        raise ConfigError("data.features_missing=generate computes a rank's missing rows alone: use target.tp_size=1")
    if cfg.drafter.layers_from_target is not None and not generate:
        raise ConfigError(f"drafter.layers_from_target={list(cfg.drafter.layers_from_target)} copies the target's "
                          "layers, and a run from data.features loads only its embedding and LM head: set "
                          "data.features_missing=generate (the whole target loads) or drafter.layers_from_target=null")
    if cfg.data.features_cache and not generate:
        raise ConfigError("data.features_cache=true appends the rows the target computes to the store: it needs "
                          "data.features_missing=generate")
    if cfg.train.generate_every and not generate:
        raise ConfigError(f"train.generate_every={cfg.train.generate_every}: generation runs the target, which "
                          "is not loaded with data.features; set train.generate_every=0 (the eval steps' "
                          "replayed tau reads the store)")


def data_position(cfg, sampler, world_size, ds_config) -> dict:
    """What the saved (epoch, micro step) position means: a resume must keep all of it."""
    stage = ds_config["zero_optimization"]["stage"] if ds_config else None
    return {"world_size": world_size, "optim.grad_accum": cfg.optim.grad_accum,
            "data.tokens_per_batch": cfg.data.tokens_per_batch, "buckets": sampler.boundaries.tolist(),
            "data.max_run": cfg.data.max_run, "data.seed": cfg.data.seed,
            "train_lengths_sha256": hashlib.sha256(sampler.lengths.tobytes()).hexdigest()[:16],
            "engine": cfg.train.engine + (f" zero-{stage}" if stage else "")}


def decide_resume(cfg, rank, identity, position):
    """(checkpoint to resume or None, its TrainerState, notes): rank 0 decides for every rank; a fresh
    start sets an earlier run's files aside, and saves cut short are removed."""
    resume_from, saved = agree_on_checkpoint(cfg.train.resume, cfg.run.out_dir)
    notes = check_resumable(saved, identity, position, cfg.train.resume, resume_from) if saved else []
    if rank == 0:
        aside = set_aside_previous_run(cfg.run.out_dir) if saved is None else None
        if aside:
            notes.append(f"starting a new run: the previous run's files in {cfg.run.out_dir} were moved to {aside}")
        notes += [f"removed {p}, a save cut short" for p in remove_partial_saves(cfg.run.out_dir)]
    dist.barrier()
    return resume_from, saved, notes


def build_run(cfg, rank, world_size, device, data: RunData, model_config, ds_config) -> RunParts:
    """The memory plan, then the target, the drafter and its engine, and what generation needs."""
    dtype = compute_dtype(cfg.target.dtype, device)
    plan = check_memory_plan(cfg, model_config, world_size, device, dtype, ds_config, rank)
    tp_group = form_tp_group(cfg.target.tp_size)
    stores = {key: FeatureStore(OmegaConf.select(cfg, key)) for key in ("data.features", "data.eval_features")
              if OmegaConf.select(cfg, key)}
    target, tokenizer = build_target_and_tokenizer(cfg, device, dtype, tp_group)
    drafter = build_drafter(cfg, target, tokenizer, (data.train_set, data.eval_set), rank)
    for key, store in stores.items():
        data_key = "data.eval_path" if key == "data.eval_features" else "data.path"
        needed = labels_needed(cfg.objective, drafter.draft_vocab is not None)
        if refusal := (store_refusal(store, cfg, drafter.target_layer_ids, dtype, feature_code_version(), data_key)
                       or labels_refusal(store, cfg, needed, key)):
            raise DataError(refusal)
    generate_prompts = generation_prompts(cfg, tokenizer, data.eval_set)
    # every rank probes (the same forwards: under tp each is a collective over the group)
    probe = probe_decoding(target) if generate_prompts else None
    if probe and (refusal := probe.cannot_decode or probe.cannot_verify):
        raise ConfigError(f"{refusal}: set train.generate_every=0 (the replayed tau of the eval steps needs "
                          "no decoding)")
    if generate_prompts and TargetCache(target).tree_form() == "paths":  # trees as batches of paths
        check_generation_memory(cfg, target, drafter.block_size, plan, device, rank)
    stops = stop_token_ids(target, tokenizer)
    attention = attention_kernel(cfg.objective.attention, device)
    objective = OmegaConf.to_object(cfg.objective)
    engine = build_engine(cfg, drafter, device, dtype, ds_config)
    target_features = run_features(cfg, target, tp_group, device, dtype, list(stores.values()), drafter)
    return RunParts(cfg, rank, world_size, device, dtype, data, target, target_features, engine, objective,
                    attention, generate_prompts, stops, TrainedOn())


def run_features(cfg, target, tp_group, device, dtype, stores, drafter):
    """What the steps read their features (and the target's labels) from: the target's forward, or the
    stores, with the target computing the rows they lack (data.features_missing=generate) and those rows
    appended to the first store (data.features_cache)."""
    cache = StoreCache(stores[0]) if cfg.data.features_cache else None
    # the target's labels are computed where the objective reads them, or the store a row is appended to holds them
    final_hidden = cfg.objective.labels == "target" or (cache is not None and stores[0].target_labels != "none")
    online = TargetFeatures(target, tp_group, device, final_hidden=final_hidden)
    if not stores:
        return online
    needed = labels_needed(cfg.objective, drafter.draft_vocab is not None)
    # a run of the hard labels reads the final states where every store holds them: the kernel's own argmax
    labels = "full" if needed != "none" and all(s.target_labels == "full" for s in stores) else needed
    head = target.get_output_embeddings().weight
    chunk_rows = chunk_rows_for(head.shape[0], cfg.objective.chunk_bytes)
    next_tokens = partial(target_next_tokens, head_weight=head, softcap=logit_softcap(target), chunk_rows=chunk_rows)
    generate = online if cfg.data.features_missing == "generate" else None  # rows no store holds
    return StoreFeatures(stores, dtype, labels, generate, next_tokens, cache)


def check_memory_plan(cfg, model_config, world_size, device, dtype, ds_config, rank):
    """Printed before any weights load; on a GPU, a plan that cannot fit the device stops the run."""
    plan = plan_memory(plan_inputs(cfg, model_config, world_size, ds_config, dtype.itemsize))
    gpu_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    if rank == 0:
        print("\n".join(plan.lines(gpu_bytes)), flush=True)
    if gpu_bytes:
        check_fits(plan, gpu_bytes, local_world_size(world_size))
    return plan


def check_generation_memory(cfg, target, block_size, plan, device, rank):
    """Training's generation verifies DDTree as a batch of paths on this target: printed at the largest
    of train.tau_budgets, and on a GPU stopped when it cannot fit beside the training plan."""
    gpu_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    free = gpu_bytes - plan.total if gpu_bytes else 2**62
    path_plan = check_path_batch_fits(target, max(cfg.train.tau_budgets), block_size,
                                      cfg.data.max_length + cfg.train.generate_max_new_tokens, free)
    if rank == 0:
        print(path_plan.line(), flush=True)


def build_target_and_tokenizer(cfg, device, dtype, tp_group):
    """The frozen target: whole, or this rank's share of its tensor-parallel group's copy; with
    data.features, only what the drafter reads of it (embedding, LM head, config, tokenizer) from the store."""
    if cfg.data.features and cfg.data.features_missing == "error":
        return load_stored_head(cfg.data.features, device, dtype), stored_tokenizer(cfg.data.features)
    if cfg.target.path is None:
        return shard_target(random_qwen3(**cfg.target.random).to(dtype), tp_group).to(device), None
    tokenizer = AutoTokenizer.from_pretrained(cfg.target.path)
    return load_tp_target(cfg.target.path, tp_group, device, dtype), tokenizer


def stored_tokenizer(directory: str):
    """The target's tokenizer as the feature dump saved it (None for a random target)."""
    path = Path(directory) / "target"
    return AutoTokenizer.from_pretrained(str(path)) if (path / "tokenizer_config.json").is_file() else None


def build_drafter(cfg, target, tokenizer, data, rank):
    """fp32 weights (the engines keep fp32 masters and compute in the training dtype). Without
    drafter.mask_token_id the mask token is chosen from the tokenizer and the training `data`
    (drafter/models/mask_token.py) and recorded in the export's dflash_config; one given is checked against
    the data. With drafter.draft_vocab_size the head is cut to the K commonest supervised tokens of the
    training split (drafter/models/draft_vocab.py), whose rows also set the final norm's scale."""
    if cfg.drafter.init_from:
        if not (Path(cfg.drafter.init_from) / "config.json").is_file():
            raise ConfigError(f"drafter.init_from={cfg.drafter.init_from}: no exported drafter there (no config.json)")
        drafter = load_drafter(cfg.drafter.init_from, dtype=torch.float32)
        if cfg.drafter.draft_vocab_size not in (None, getattr(drafter.config, "draft_vocab_size", None)):
            raise ConfigError(f"drafter.draft_vocab_size={cfg.drafter.draft_vocab_size}: the drafter of "
                              f"drafter.init_from={cfg.drafter.init_from} has another (set it to null to keep its own)")
        return drafter
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
                            variant=OmegaConf.to_object(cfg.drafter),
                            input_embedding_scale=input_embedding_scale(target), target_path=cfg.target.path,
                            chat_template_kwargs=dict(cfg.target.chat_template_kwargs),
                            draft_vocab_size=cfg.drafter.draft_vocab_size)
    draft_vocab = None
    if cfg.drafter.draft_vocab_size:  # the same table on every rank: the same training answers
        counts = supervised_token_counts(data[:1], config.vocab_size)
        draft_vocab, line = answer_vocab(counts, cfg.drafter.draft_vocab_size)
        if rank == 0:
            print(line, flush=True)
    drafter = new_drafter(config, target.get_output_embeddings().weight, cfg.run.seed, draft_vocab)
    if cfg.drafter.layers_from_target is not None:
        line = start_layers_from_target(drafter, target, list(cfg.drafter.layers_from_target))
        if rank == 0:
            print(line, flush=True)
    return drafter


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


def schedule_notes(cfg, saved: TrainerState, total_steps) -> list[str]:
    """What a resume from `saved` does to the lr schedule: it keeps the length it started with, unless
    train.schedule_steps says otherwise (then the learning rate moves at once, as asked)."""
    if cfg.train.schedule_steps and cfg.train.schedule_steps != saved.schedule_steps:
        before = lr_factor(cfg.optim, saved.step, saved.schedule_steps)
        after = lr_factor(cfg.optim, saved.step, cfg.train.schedule_steps)
        return [f"train.schedule_steps={cfg.train.schedule_steps}: the lr factor moves from {before:.3g} "
                f"to {after:.3g} at step {saved.step}"]
    if total_steps != saved.schedule_steps:
        return [f"this run stops at step {total_steps}; the lr schedule keeps its {saved.schedule_steps} "
                "steps (no jump; set train.schedule_steps to change it)"]
    return []


def announce(run: RunParts, log, notes):
    data, engine = run.data, run.engine
    for note in notes:
        log.print(note)
    log.print(f"run {run.cfg.run.name}: {run.world_size} ranks on {run.device.type}, {engine.description}, "
              f"drafter {engine.num_parameters / 1e6:.2f}M params, {data.total_steps} steps "
              f"({data.steps_per_epoch}/epoch), attention={run.attention}")
    log.print(bucket_summary(data.stats))


# ----------------------------------------------------------------------------- the loop

class StopRequest:
    """SIGTERM / SIGINT (scancel, Ctrl-C) or SIGUSR1 (SLURM's --signal=USR1@N early warning):
    finish the current step, save, exit 0."""

    def __init__(self):
        self.requested = False
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame):
        self.requested = True


class Checkpointer:
    """Saves the run at a step (a collective), with the wall time spent so far added to the state."""

    def __init__(self, run: RunParts, state: TrainerState, last_saved: int | None):
        self.run, self.state, self.last_saved = run, state, last_saved
        self.started = time.time()

    def save(self, step: int):
        if isinstance(self.run.target_features, StoreFeatures):  # the rows a hybrid run computed, appended
            self.run.target_features.flush()
        self.run.trained_on.count_into(self.state)
        elapsed = self.state.elapsed_s + time.time() - self.started
        save_checkpoint(self.run.engine, self.run.cfg, step, replace(self.state, elapsed_s=elapsed),
                        export_dtype=self.run.dtype)
        self.last_saved = step


def train_loop(run: RunParts, state: TrainerState, log, stop: StopRequest, last_saved: int | None) -> int:
    """Epochs of optimizer steps until the run's length; 0 when done or stopped on request, 1 after
    too many non-finite steps in a row."""
    cfg, data = run.cfg, run.data
    checkpoints = Checkpointer(run, state, last_saved)
    window, bad_in_a_row = new_window(run), 0
    while state.step < data.total_steps and state.epoch < cfg.train.epochs:
        epoch_len = len(data.sampler.epoch_plan(state.epoch))  # whole optimizer steps, the same on every rank
        loader = make_loader(data.train_set, data.sampler, state.epoch, state.micro_step_in_epoch,
                             cfg.data.num_workers, cfg.data.prefetch_factor, pin_memory=run.device.type == "cuda")
        with loader:
            while state.micro_step_in_epoch < epoch_len and state.step < data.total_steps:
                applied = optimizer_step(run, state, loader, window)
                bad_in_a_row = 0 if applied else bad_in_a_row + 1
                if not applied and too_many_bad_steps(run, state, bad_in_a_row, log, checkpoints.last_saved):
                    return 1
                if state.step % cfg.train.log_every == 0 or state.step >= data.total_steps:
                    window = write_log_line(run, state, window, log, checkpoints.started)
                exit_code = after_step(run, state, log, stop, checkpoints)
                if exit_code is not None:
                    return exit_code
        if state.micro_step_in_epoch >= epoch_len:
            state.epoch, state.micro_step_in_epoch = state.epoch + 1, 0
    if checkpoints.last_saved != state.step:
        checkpoints.save(state.step)
    log.print(f"done: {state.step} steps, {state.skipped_steps} skipped")
    return 0


def new_window(run: RunParts) -> Window:
    profile = run.cfg.train.profile_timing
    profile = profile if profile is not None else run.device.type == "cpu"
    return Window(run.data.sampler.num_buckets, run.device,
                  StageTimer(run.device, synchronize=True, enabled=profile))


def optimizer_step(run: RunParts, state: TrainerState, loader, window: Window) -> bool:
    """grad_accum micro batches and one engine step, summed into `window`: whether the update was
    applied (a non-finite gradient skips it on every rank)."""
    cfg, step, t0 = run.cfg, state.step, time.perf_counter()
    noise = noise_std(cfg.noise, step)
    for micro in range(cfg.optim.grad_accum):
        t_wait = time.perf_counter()
        batch = next(loader)
        window.data_wait += time.perf_counter() - t_wait
        window.queue.append(loader.queue_depth())
        window.add(micro_step(run, batch, step, micro, noise, window.timers), batch)
        state.micro_step_in_epoch += 1
    lr = cfg.optim.lr * lr_factor(cfg.optim, step, state.schedule_steps)
    with window.timers("optimizer"):
        result = run.engine.step(lr)
    state.step = step + 1
    if not result.applied:
        state.skipped_steps += 1
    window.end_step(result, noise, lr, time.perf_counter() - t0)
    return result.applied


def too_many_bad_steps(run: RunParts, state: TrainerState, bad_in_a_row: int, log, last_saved) -> bool:
    log.print(f"step {state.step}: non-finite loss or gradient; the step was skipped on all ranks "
              f"({bad_in_a_row} in a row)")
    if bad_in_a_row < run.cfg.train.max_bad_steps:
        return False
    log.print(f"stopping: {bad_in_a_row} non-finite steps in a row; the last good checkpoint (step "
              f"{last_saved}) is left as it was")
    return True


def write_log_line(run: RunParts, state: TrainerState, window: Window, log, started: float) -> Window:
    """The window's summary to metrics.jsonl, W&B and the console; a new window for the next steps."""
    record = window.summary(state, run.data.stats, run.data.total_steps, len(run.data.sampler),
                            time.time() - started, run.objective.ddtree_budget)
    record.update(run.trained_on.count_into(state))
    log.log(record)
    log.print(console_line(record))
    return new_window(run)


def micro_step(run: RunParts, batch, step, micro, noise, timers: StageTimer):
    """Forward + backward of one micro batch; returns its metrics ([sum, count] tensors, on the device:
    nothing here waits for the device)."""
    run.trained_on.add(int(batch["loss_mask"].sum()), blocks_drawn(batch["loss_mask"], run.objective))
    input_ids = batch["input_ids"].to(run.device, non_blocking=True)
    loss_mask = batch["loss_mask"].to(run.device, non_blocking=True)
    drafter = run.engine.module
    with timers("target"):
        features, final_hidden = run.target_features(input_ids, drafter.target_layer_ids, batch["lengths"])
        features = calibrated_features(features, run.objective.feature_calibration)
        features = add_feature_noise(features, noise, len(drafter.target_layer_ids),
                                     step_generator(run.cfg.run.seed, step, run.rank, NOISE_STREAM + micro, run.device))
    with timers("drafter"):
        loss, metrics = training_step(drafter, run.target, features, input_ids, loss_mask, run.objective,
                                      step_generator(run.cfg.run.seed, step, run.rank, ANCHOR_STREAM - micro), run.attention,
                                      final_hidden)
        # A non-finite loss makes every gradient NaN, so the engine's global check skips the step on all ranks.
        loss = loss * torch.where(torch.isfinite(loss.detach()), 1.0, math.nan)
        run.engine.backward(loss)
    return {k: v.detach() for k, v in metrics.items()}


def after_step(run: RunParts, state: TrainerState, log, stop: StopRequest, checkpoints: Checkpointer) -> int | None:
    """What follows a logged optimizer step: a requested stop, evaluation, generation and saving. An
    exit code (0: stopped on request) ends the run; None goes on."""
    cfg, step = run.cfg, state.step
    if any_rank(stop.requested):  # before evaluation: the launcher's grace period is short
        log.print(f"stop requested: saving at step {step} and exiting")
        checkpoints.save(step)
        return 0
    last = step >= run.data.total_steps
    evaluating = len(run.data.eval_set) >= run.world_size and (step % cfg.train.eval_every == 0 or last)
    generating = run.generate_prompts and (step % cfg.train.generate_every == 0 or last)
    if evaluating or generating:  # one gather of a sharded drafter serves both
        drafter = local_drafter(run.engine, run.target)
        if evaluating:
            run_eval(run, state, drafter, log)
        if generating:
            run_generation(run, drafter, step, log)
    if step % cfg.train.save_every == 0:
        checkpoints.save(step)
    return None


# ----------------------------------------------------------------------------- features

def step_generator(seed: int, step: int, rank: int, stream: int = 0, device="cpu") -> torch.Generator:
    """Anchors and noise for (step, rank) come from their own seed: resume replays them exactly."""
    return torch.Generator(device=device).manual_seed(hash((seed, step, rank, stream)) % 2**63)


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


# ----------------------------------------------------------------------------- evaluation and generation

def local_drafter(engine, target):
    """The drafter for evaluation and generation: the engine's module, or, when the engine shards it
    (ZeRO-3, FSDP), a plain copy gathered from the shards. Ranks run different numbers of drafter
    forwards there (their rows hold different response lengths), which sharded forwards, each a
    collective, cannot do."""
    if not engine.sharded:
        return engine.module
    return drafter_from_state_dict(engine.module.config, engine.full_state_dict()).to(target.device, target.dtype)


def run_eval(run: RunParts, state: TrainerState, drafter, log):
    trained_on = run.trained_on.count_into(state)
    metrics = evaluate(run, drafter)
    if not metrics:
        return
    log.log({"step": state.step, **trained_on, "held_out_set": run.data.held_out_set, **metrics}, prefix="eval")
    log.print(eval_line({"step": state.step, **metrics}))


@torch.no_grad()
def evaluate(run: RunParts, drafter):
    """Held-out loss, random-anchor metrics and replayed tau over up to eval_batches of this rank's
    share of the held-out rows, on clean features. Ranks hold different numbers of batches; the members
    of a tensor-parallel group run the target as often as the one with the most, passing None when out."""
    was_training = drafter.training
    drafter.eval()
    summed = defaultdict(lambda: 0)
    loader = make_loader(run.data.eval_share, run.data.eval_sampler, epoch=0, num_workers=0, prefetch_factor=2)
    with loader:
        batches = list(itertools.islice(loader, run.cfg.train.eval_batches))
    for i in range(run.target_features.most_in_group(len(batches))):
        batch = batches[i] if i < len(batches) else None
        input_ids = batch["input_ids"].to(run.device) if batch else None
        features, final_hidden = run.target_features(input_ids, drafter.target_layer_ids,
                                                     batch["lengths"] if batch else None)
        if batch is None:
            continue
        features = calibrated_features(features, run.objective.feature_calibration)
        for k, v in eval_metrics(run, drafter, features, final_hidden, batch, i).items():
            summed[k] = summed[k] + v.float()
    drafter.train(was_training)
    if any_rank(not summed):  # a rank whose rows are all too long has nothing to add
        return {}
    summed = all_reduce_sum(dict(summed))
    return {**finalize_metrics(summed), "eval_responses": int(summed["tau_dflash"][1])}


def eval_metrics(run: RunParts, drafter, features, final_hidden, batch, index: int) -> dict:
    """One held-out batch: the training step's metrics on clean features, and its replayed tau."""
    input_ids, loss_mask = batch["input_ids"].to(run.device), batch["loss_mask"].to(run.device)
    _, metrics = training_step(drafter, run.target, features, input_ids, loss_mask, run.objective,
                               step_generator(run.cfg.run.seed, index, run.rank, EVAL_STREAM), run.attention, final_hidden)
    metrics.update(replayed_tau(drafter, run.target, features, input_ids, loss_mask, run.cfg.train.tau_budgets,
                                run.attention, blocks_per_forward=run.objective.anchors_per_batch or 2048,
                                chunk_bytes=run.objective.chunk_bytes))
    return metrics


def run_generation(run: RunParts, drafter, step, log):
    """The drafter as it is now, served on the fixed prompts (split over the ranks, or over the
    tensor-parallel groups, whose members decode together; time-bounded)."""
    cfg = run.cfg
    share = PromptShare.of(run.target_features.group, run.world_size)
    summed = all_reduce_sum(generation_tau(
        run.target, drafter, run.generate_prompts, share, budgets=cfg.train.tau_budgets,
        max_new_tokens=cfg.train.generate_max_new_tokens, max_seconds=cfg.train.generate_max_seconds,
        stop_token_ids=run.stops))
    metrics = {"step": step, **finalize_metrics(summed), "gen_responses": int(summed["gen_tau_dflash"][1])}
    log.log(metrics, prefix="generate")
    log.print(eval_line(metrics, "generate"))


if __name__ == "__main__":
    sys.exit(main())
