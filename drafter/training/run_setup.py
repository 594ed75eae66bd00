"""A training run's setup, as train.py's `train` calls it: the data and every check that needs no
weights (load_run_data), the resume decision (decide_resume), then the memory plan, the target, the
drafter, its engine and what the steps read their features from (build_run), held for the whole run
in RunParts."""
import hashlib
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from drafter.config import ObjectiveConfig
from drafter.pipeline.datasets import DataError, content_fingerprint, load_datasets, supervised_token_counts
from drafter.pipeline.feature_store import FeatureStore, StoreCache, StoreFeatures, load_stored_head, store_model_config
from drafter.pipeline.feature_store_format import labels_refusal, store_refusal
from drafter.pipeline.sampler import held_out_share, plan_notes, sampler_from_config
from drafter.errors import ConfigError
from drafter.infra.engine_choice import build_engine, engine_settings
from drafter.infra.launch import local_world_size
from drafter.losses.divergences import labels_needed
from drafter.losses.lm_head import chunk_rows_for, logit_softcap, target_next_tokens
from drafter.models import load_drafter, new_drafter
from drafter.models.blocks import DraftingSetup, attention_kernel
from drafter.models.configure import drafter_config
from drafter.models.draft_vocab import answer_vocab
from drafter.models.from_target import start_layers_from_target
from drafter.models.mask_token import check_given_mask_token, choose_mask_token
from drafter.serving.decode import stop_token_ids
from drafter.serving.served import bench_prompts, held_out_prompts
from drafter.serving.path_memory import check_path_batch_fits
from drafter.target_model.cache import TargetCache, probe_decoding
from drafter.target_model.model import compute_dtype, fetch_target, input_embedding_scale, random_qwen3
from drafter.target_model.tensor_parallel import (TargetFeatures, check_tensor_parallel, feature_code_version,
                                                  form_tp_group, load_tp_target, shard_target)
from drafter.training.checkpoint import (agree_on_checkpoint, check_resumable, remove_partial_saves, run_identity,
                                         set_aside_previous_run)
from drafter.training.memory_plan import check_fits, check_host_fits, plan_inputs, plan_memory, target_model_config
from drafter.training.run_config import Launch
from drafter.training.tracking import TrainedOn


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
    target_files: str | None = None  # where the target's files are read: target.path, or its hub snapshot


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

    def drafting(self, drafter) -> DraftingSetup:
        """`drafter` (the engine's module, or a plain copy of it) against the run's target, as the training
        step, the eval's replay (the objective's anchors per forward and chunks) and generation run it."""
        return DraftingSetup(drafter, self.target, self.attention, tuple(self.cfg.train.tau_budgets),
                             blocks_per_forward=self.objective.anchors_per_batch or 2048,
                             chunk_bytes=self.objective.chunk_bytes)


def load_run_data(launch: Launch):
    """(RunData, the target's model config, the engine's settings): everything checked before a model
    loads, so that a bad config, launch or dataset fails in seconds."""
    cfg, rank, world_size, device = launch.cfg, launch.rank, launch.world_size, launch.device
    if device.type == "cpu" and attention_kernel(cfg.objective.attention, device) != "dense":
        raise ConfigError(f"objective.attention={cfg.objective.attention}: flex_attention has no backward on "
                          "the CPU in this torch; train with dense there (auto)")
    check_store_settings(cfg)
    # a hub target is fetched once per node, before its config, tokenizer or weights are read
    target_files = (cfg.target.path if cfg.data.features and cfg.data.features_missing == "error"
                    else fetch_target(cfg.target.path))
    model_config = (store_model_config(cfg.data.features) if cfg.data.features
                    else target_model_config(target_files, cfg.target.random))
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
                   content_fingerprint(eval_set), target_files)
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
                          "(data/features.py --data <data.eval_path>)")
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


def build_run(launch: Launch, data: RunData, model_config, ds_config) -> RunParts:
    """The memory plan, then the target, the drafter and its engine, and what generation needs."""
    cfg, rank, device = launch.cfg, launch.rank, launch.device
    dtype = compute_dtype(cfg.target.dtype, device)
    plan = check_memory_plan(launch, model_config, dtype, ds_config)
    tp_group = form_tp_group(cfg.target.tp_size)
    stores = {key: FeatureStore(OmegaConf.select(cfg, key)) for key in ("data.features", "data.eval_features")
              if OmegaConf.select(cfg, key)}
    target, tokenizer = build_target_and_tokenizer(cfg, device, dtype, tp_group, data.target_files)
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
    target_features = run_features(launch, target, tp_group, dtype, list(stores.values()), drafter)
    return RunParts(cfg, rank, launch.world_size, device, dtype, data, target, target_features, engine, objective,
                    attention, generate_prompts, stops, TrainedOn())


def run_features(launch: Launch, target, tp_group, dtype, stores, drafter):
    """What the steps read their features (and the target's labels) from: the target's forward, or the
    stores, with the target computing the rows they lack (data.features_missing=generate) and those rows
    appended to the first store (data.features_cache)."""
    cfg = launch.cfg
    cache = StoreCache(stores[0]) if cfg.data.features_cache else None
    # the target's labels are computed where the objective reads them, or the store a row is appended to holds them
    final_hidden = cfg.objective.labels == "target" or (cache is not None and stores[0].target_labels != "none")
    online = TargetFeatures(target, tp_group, launch.device, final_hidden=final_hidden)
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


def check_memory_plan(launch: Launch, model_config, dtype, ds_config):
    """Printed before any weights load; on a GPU, a plan that cannot fit the device stops the run."""
    device = launch.device
    plan = plan_memory(plan_inputs(launch.cfg, model_config, launch.world_size, ds_config, dtype.itemsize, device.type))
    gpu_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    if launch.rank == 0:
        print("\n".join(plan.lines(gpu_bytes)), flush=True)
    check_host_fits(plan, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    if gpu_bytes:
        check_fits(plan, gpu_bytes, local_world_size(launch.world_size))
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


def build_target_and_tokenizer(cfg, device, dtype, tp_group, target_files):
    """The frozen target, from `target_files` (`fetch_target`): whole, or this rank's share of its
    tensor-parallel group's copy; with data.features, only what the drafter reads of it (embedding,
    LM head, config, tokenizer) from the store."""
    if cfg.data.features and cfg.data.features_missing == "error":
        return load_stored_head(cfg.data.features, device, dtype), stored_tokenizer(cfg.data.features)
    if cfg.target.path is None:
        return shard_target(random_qwen3(**cfg.target.random).to(dtype), tp_group).to(device), None
    tokenizer = AutoTokenizer.from_pretrained(target_files)
    return load_tp_target(target_files, tp_group, device, dtype), tokenizer


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
