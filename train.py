"""Train a DFlash drafter against a frozen target with DeepSpeed ZeRO-2.

    deepspeed --num_gpus 8 train.py --cfg configs/v3.yaml [key.sub=value ...]
    torchrun --nproc_per_node 8 train.py --cfg configs/v3.yaml
    python train.py --cfg configs/toy.yaml            # one process; CPU + gloo without a GPU

config -> distributed init -> target -> drafter -> data -> loop -> checkpoints. Every rank holds a
frozen copy of the target and computes its own batch's features; only the drafter is trained.
"""
import argparse
import math
import os
import signal
import socket
import sys
import time
from collections import defaultdict

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from drafter.checkpoint import find_resume_checkpoint, load_checkpoint, save_checkpoint
from drafter.config import ConfigError, deepspeed_config, load_config, lr_factor, noise_std
from drafter.data import load_datasets
from drafter.model import DFlashDraftModel, drafter_config, resolve_mask_token_id
from drafter.objective import ObjectiveConfig, finalize_metrics, training_step
from drafter.sampler import BucketSampler, bucket_table, make_loader, sampler_from_config
from drafter.target import context_features, load_target, random_qwen3
from drafter.tracking import RunLogger, console_line


# ----------------------------------------------------------------------------- setup

def init_distributed():
    """Works under deepspeed, torchrun and plain python (a world of one)."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo",
                               auto_mpi_discovery=False)
    return dist.get_rank(), dist.get_world_size(), device


def set_cpu_threads(cfg):
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    threads = cfg.train.threads_per_rank or max(1, (os.cpu_count() or 1) // local_ranks)
    torch.set_num_threads(threads)


def build_target_and_tokenizer(cfg, device):
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "bf16": torch.bfloat16, "fp32": torch.float32}[cfg.target.dtype]
    if cfg.target.path is None:
        return random_qwen3(**cfg.target.random).to(device, dtype), None
    tokenizer = AutoTokenizer.from_pretrained(cfg.target.path)
    return load_target(cfg.target.path, device, dtype), tokenizer


def build_drafter(cfg, target, tokenizer, dtype):
    if cfg.drafter.init_from:
        return DFlashDraftModel.from_pretrained(cfg.drafter.init_from, dtype=dtype)
    mask_token_id = cfg.drafter.mask_token_id
    if mask_token_id is None:
        if tokenizer is None:
            raise ConfigError("drafter.mask_token_id is required for a random target")
        mask_token_id = resolve_mask_token_id(tokenizer, target.config.vocab_size)
    config = drafter_config(target.config, num_layers=cfg.drafter.num_layers,
                            block_size=cfg.drafter.block_size, mask_token_id=mask_token_id,
                            target_layer_ids=cfg.drafter.target_layer_ids, target_path=cfg.target.path,
                            chat_template_kwargs=dict(cfg.target.chat_template_kwargs))
    torch.manual_seed(cfg.run.seed)  # same initial weights on every rank
    return DFlashDraftModel(config).to(dtype)


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


def sync_time(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def comm_device() -> torch.device:
    """Where collective tensors live: NCCL only moves GPU tensors."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_sum(metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    names = sorted(metrics)
    flat = torch.cat([metrics[n].reshape(-1).double() for n in names]).to(comm_device())
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


# ----------------------------------------------------------------------------- training

def micro_step(engine, target, batch, objective, cfg, step, micro, rank, noise, device, use_flex, timers):
    """Forward + backward of one micro batch; returns its metrics ([sum, count] tensors)."""
    input_ids = batch["input_ids"].to(device, non_blocking=True)
    loss_mask = batch["loss_mask"].to(device, non_blocking=True)
    t0 = sync_time(device)
    features = context_features(target, input_ids, engine.module.target_layer_ids)
    features = add_feature_noise(features, noise, len(engine.module.target_layer_ids),
                                 step_generator(cfg.run.seed, step, rank, 1 + micro, device))
    t1 = sync_time(device)
    loss, metrics = training_step(engine.module, target, features, input_ids, loss_mask, objective,
                                  step_generator(cfg.run.seed, step, rank, -1 - micro), use_flex)
    if not torch.isfinite(loss):
        loss = loss * float("nan")  # NaN gradients: DeepSpeed's global overflow check skips the step
    engine.backward(loss)
    t2 = sync_time(device)
    timers["target"] += t1 - t0
    timers["drafter"] += t2 - t1
    metrics = {k: v.detach().float().cpu() for k, v in metrics.items()}
    metrics["real_tokens"] = torch.tensor([float(batch["lengths"].sum()), 1.0])
    metrics["computed_tokens"] = torch.tensor([float(input_ids.numel()), 1.0])
    return metrics


@torch.no_grad()
def evaluate(engine, target, eval_set, eval_sampler, objective, cfg, rank, device, use_flex):
    """Held-out loss, accuracies and DDTree acceptance over up to eval_batches per rank."""
    engine.module.eval()
    summed = defaultdict(lambda: 0)
    loader = make_loader(eval_set, eval_sampler, epoch=0, num_workers=0, prefetch_factor=2)
    with loader:
        for i, batch in zip(range(cfg.train.eval_batches), loader):
            input_ids, loss_mask = batch["input_ids"].to(device), batch["loss_mask"].to(device)
            features = context_features(target, input_ids, engine.module.target_layer_ids)
            _, metrics = training_step(engine.module, target, features, input_ids, loss_mask, objective,
                                       step_generator(cfg.run.seed, i, rank, 7), use_flex)
            for k, v in metrics.items():
                summed[k] = summed[k] + v.float().cpu()
    engine.module.train()
    return finalize_metrics(all_reduce_sum(dict(summed))) if summed else {}


class StopRequest:
    """SIGTERM / SIGINT: finish the current step, save, exit 0."""

    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

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

    rank, world_size, device = init_distributed()
    try:
        return train(cfg, rank, world_size, device)
    finally:
        dist.destroy_process_group()


def train(cfg, rank, world_size, device) -> int:
    if device.type == "cpu":
        set_cpu_threads(cfg)
    stop = StopRequest()
    resume_from = find_resume_checkpoint(cfg.train.resume, cfg.run.out_dir)

    target, tokenizer = build_target_and_tokenizer(cfg, device)
    drafter = build_drafter(cfg, target, tokenizer, torch.float32)
    use_flex = cfg.objective.attention == "flex" or (cfg.objective.attention == "auto" and device.type == "cuda")
    objective = ObjectiveConfig(block_size=drafter.block_size, mask_token_id=drafter.mask_token_id,
                                num_anchors=cfg.objective.num_anchors, gamma=cfg.objective.gamma,
                                ddtree_budget=cfg.objective.ddtree_budget,
                                ddtree_blocks=cfg.objective.ddtree_blocks,
                                anchors_per_batch=cfg.objective.anchors_per_batch)

    train_set, eval_set = load_datasets(cfg.data, target.config.vocab_size)
    sampler = sampler_from_config(np.asarray(train_set["length"]), cfg.data, world_size, rank)
    # one bucket for the held-out split: small splits would lose most batches to per-bucket remainders
    eval_sampler = BucketSampler(np.asarray(eval_set["length"]), [cfg.data.max_length], cfg.data.tokens_per_batch,
                                 world_size, rank, cfg.data.seed) if len(eval_set) >= world_size else None
    steps_per_epoch = len(sampler) // cfg.optim.grad_accum
    if steps_per_epoch == 0:
        raise ValueError(f"{cfg.data.path}: {len(train_set)} samples make no optimizer step per epoch at "
                         f"{world_size} ranks x grad_accum {cfg.optim.grad_accum}: {sampler.stats(0)}")
    total_steps = cfg.train.epochs * steps_per_epoch
    if cfg.train.max_steps:
        total_steps = min(total_steps, cfg.train.max_steps)

    notes = []
    ds_config = deepspeed_config(cfg.train.ds_config, cfg, world_size, bf16=target.dtype == torch.bfloat16,
                                 log=notes.append)
    if device.type == "cpu" and "optimizer" in ds_config:
        ds_config["optimizer"].setdefault("params", {}).setdefault("torch_adam", True)
    engine, _, _, _ = deepspeed.initialize(
        model=drafter, model_parameters=[p for p in drafter.parameters() if p.requires_grad],
        config=ds_config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_factor(cfg.optim, s, total_steps)))

    state = {"step": 0, "epoch": 0, "micro_step_in_epoch": 0, "skipped_steps": 0, "wandb_id": None,
             "elapsed_s": 0.0}
    if resume_from is not None:
        state = load_checkpoint(engine, resume_from)
        notes.append(f"resumed from {resume_from} at step {state['step']} "
                     f"(epoch {state['epoch']}, micro step {state['micro_step_in_epoch']})")
    log = RunLogger(cfg, is_main=rank == 0, resume_id=state["wandb_id"])
    state["wandb_id"] = log.run_id
    stats = sampler.stats(0)
    for note in notes:
        log.print(note)
    log.print(f"run {cfg.run.name}: {world_size} ranks on {device.type}, drafter "
              f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M params, {total_steps} steps "
              f"({steps_per_epoch}/epoch), attention={'flex' if use_flex else 'dense'}")
    log.print(bucket_summary(stats))

    def save(step):
        elapsed = state["elapsed_s"] + time.time() - t_start
        save_checkpoint(engine, cfg, step, {**state, "elapsed_s": elapsed}, engine.module.save_pretrained)

    t_start = time.time()
    window = Window(sampler.num_buckets)
    bad_in_a_row, last_saved = 0, state["step"] if resume_from is not None else None
    accum = cfg.optim.grad_accum
    try:
        while state["step"] < total_steps and state["epoch"] < cfg.train.epochs:
            epoch_len = len(sampler.epoch_plan(state["epoch"]))
            usable = epoch_len - epoch_len % accum  # every rank plans the same count: all stop together
            loader = make_loader(train_set, sampler, state["epoch"], state["micro_step_in_epoch"],
                                 cfg.data.num_workers, cfg.data.prefetch_factor,
                                 pin_memory=device.type == "cuda")
            with loader:
                while state["micro_step_in_epoch"] < usable and state["step"] < total_steps:
                    step, t0 = state["step"], time.perf_counter()
                    noise = noise_std(cfg.noise, step)
                    for micro in range(accum):
                        t_wait = time.perf_counter()
                        batch = next(loader)
                        window.timers["data_wait"] += time.perf_counter() - t_wait
                        window.queue.append(loader.queue_depth())
                        metrics = micro_step(engine, target, batch, objective, cfg, step, micro, rank, noise,
                                             device, use_flex, window.timers)
                        window.add(metrics, batch["bucket"])
                        state["micro_step_in_epoch"] += 1
                    t_opt = sync_time(device)
                    engine.step()
                    window.timers["optimizer"] += sync_time(device) - t_opt
                    state["step"] = step = step + 1
                    applied = engine.was_step_applied()
                    bad_in_a_row = 0 if applied else bad_in_a_row + 1
                    window.end_step(applied, engine.get_global_grad_norm(), noise, engine.get_lr()[0],
                                    time.perf_counter() - t0)
                    if not applied:
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
                        window = Window(sampler.num_buckets)
                    if eval_sampler is not None and (step % cfg.train.eval_every == 0 or last):
                        run_eval(engine, target, eval_set, eval_sampler, objective, cfg, rank, device,
                                 use_flex, step, log)
                    if any_rank(stop.requested):
                        log.print(f"stop requested: saving at step {step} and exiting")
                        save(step)
                        return 0
                    if step % cfg.train.save_every == 0:
                        save(step)
                        last_saved = step
            if state["micro_step_in_epoch"] >= usable:
                state["epoch"], state["micro_step_in_epoch"] = state["epoch"] + 1, 0
        if last_saved != state["step"]:
            save(state["step"])
        log.print(f"done: {state['step']} steps, {state['skipped_steps']} skipped")
        return 0
    finally:
        log.close()


def run_eval(engine, target, eval_set, eval_sampler, objective, cfg, rank, device, use_flex, step, log):
    metrics = evaluate(engine, target, eval_set, eval_sampler, objective, cfg, rank, device, use_flex)
    if not metrics:
        return
    log.log({"step": step, **metrics}, prefix="eval")
    budget = objective.ddtree_budget
    log.print(f"eval step={step} loss={metrics['loss']:.4f} acc={metrics['acc']:.3f} "
              f"streak={metrics['streak']:.2f} ddtree@{budget}={metrics[f'ddtree_accept@{budget}']:.2f}")


# ----------------------------------------------------------------------------- logging

class Window:
    """Sums over the steps between two log lines; reduced over ranks only when summarised."""

    def __init__(self, num_buckets: int):
        self.metrics = defaultdict(lambda: 0)
        self.per_bucket = torch.zeros(num_buckets, 3, 2)  # (loss, acc, streak) x [sum, count]
        self.timers = defaultdict(float)
        self.queue, self.grad_norms = [], []
        self.steps, self.seconds, self.noise, self.lr = 0, 0.0, 0.0, 0.0

    def add(self, metrics, bucket: int):
        for k, v in metrics.items():
            self.metrics[k] = self.metrics[k] + v
        self.per_bucket[bucket] += torch.stack([metrics["loss"], metrics["acc"], metrics["streak"]])

    def end_step(self, applied, grad_norm, noise, lr, seconds):
        self.steps += 1
        self.seconds += seconds
        if applied and grad_norm is not None:
            self.grad_norms.append(float(grad_norm))
        self.noise, self.lr = noise, lr

    def summary(self, state, stats, total_steps, micro_per_epoch, elapsed, budget) -> dict:
        summed = all_reduce_sum({**self.metrics, "per_bucket": self.per_bucket})
        per_bucket = summed.pop("per_bucket")
        real, computed = summed.pop("real_tokens")[0], summed.pop("computed_tokens")[0]
        m = finalize_metrics(summed)
        queue_depths = [torch.zeros(1, device=comm_device()) for _ in range(dist.get_world_size())]
        dist.all_gather(queue_depths, torch.tensor([float(np.mean(self.queue or [0]))], device=comm_device()))
        steps, seconds = self.steps, max(self.seconds, 1e-9)
        return {
            "step": state["step"], "epoch": state["epoch"], **m,
            "ddtree_accept": m[f"ddtree_accept@{budget}"], "ddtree_budget": budget,
            "lr": self.lr, "noise": self.noise,
            "grad_norm": float(np.mean(self.grad_norms)) if self.grad_norms else math.nan,
            "skipped_steps": state["skipped_steps"],
            "pad_efficiency": float(real / computed),
            "tokens_per_s": float(real) / seconds,
            "target_batches_per_s": steps / max(self.timers["target"], 1e-9),
            "drafter_batches_per_s": steps / max(self.timers["drafter"], 1e-9),
            "time_split_s": {k: v / steps for k, v in self.timers.items()},
            "prefetch_queue": [round(float(q), 1) for q in queue_depths],
            "per_bucket": {name: (per_bucket[:, i, 0] / per_bucket[:, i, 1]).tolist()
                           for i, name in enumerate(("loss", "acc", "streak"))},
            "bucket_batch_pct": [b["batch_pct"] for b in stats["buckets"]],
            "seq_len": {"min": stats["length_min"], "mean": stats["length_mean"], "max": stats["length_max"]},
            "epoch_progress": state["epoch"] + state["micro_step_in_epoch"] / max(1, micro_per_epoch),
            "eta_s": (total_steps - state["step"]) * seconds / steps,
            "elapsed_s": state["elapsed_s"] + elapsed,
        }


def bucket_summary(stats) -> str:
    return "\n".join([*bucket_table(stats),
                      f"padding efficiency {stats['pad_efficiency']:.3f}, longest same-bucket run "
                      f"{stats['max_same_bucket_run']}, {stats['dropped_samples']} samples dropped to even "
                      f"out ranks"])


if __name__ == "__main__":
    sys.exit(main())
