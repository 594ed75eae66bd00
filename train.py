"""Train a DFlash drafter against a frozen target, with DeepSpeed ZeRO or torch FSDP2.

    deepspeed --num_gpus 8 train.py --cfg configs/v3.yaml [key.sub=value ...]
    torchrun --nproc_per_node 8 train.py --cfg configs/v3.yaml [train.engine=fsdp]
    srun python train.py --cfg configs/v3.yaml           # SLURM, one task per GPU
    torchrun --nproc_per_node 8 train.py --cfg ... target.tp_size=8   # a target larger than one GPU
    python train.py --cfg configs/toy.yaml               # one process; CPU + gloo without a GPU

main: config -> distributed world -> the run directory's lock -> train: data, with every check that
needs no weights -> resume decision -> memory plan -> target -> drafter -> engine (the setup:
drafter/training/run_setup.py) -> the resumed state -> loop (evaluation, generation, checkpoints) ->
the last checkpoint. Every rank holds a frozen copy of the target (or, at target.tp_size G, its share
of a copy that G consecutive ranks hold together: drafter/target_model/tensor_parallel.py) and gets its own
batch's features; only the drafter is trained, through the engine interface of drafter/infra/engine.py.
With data.features (a store written by data/features.py) the features are read from the store
instead, and of the target only its embedding and LM head load (docs/features.md).
"""
import argparse
import hashlib
import itertools
import math
import signal
import sys
import time
from collections import defaultdict
from dataclasses import asdict, replace

import torch
import torch.distributed as dist

from drafter.pipeline.feature_store import StoreFeatures
from drafter.pipeline.loader import collate, make_loader
from drafter.errors import UserError
from drafter.infra.collectives import all_reduce_sum, any_rank
from drafter.infra.launch import remove_cpu_allreduce_buffer, set_cpu_threads
from drafter.infra.progress import StageTimer
from drafter.infra.run_lock import hold_run_directory
from drafter.metric_sums import finalize_metrics
from drafter.models import drafter_from_state_dict
from drafter.models.blocks import FeatureBatch, blocks_drawn
from drafter.serving.served import PromptShare, generation_tau, replayed_tau
from drafter.target_model.calibration import calibrated_features
from drafter.training.attention_check import ATTENTION_TOLERANCE, attention_verdict, compare_with_dense, worst_over_ranks
from drafter.training.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from drafter.training.objective import training_step
from drafter.training.run_config import Launch, config_and_world
from drafter.training.run_setup import RunParts, build_run, decide_resume, load_run_data
from drafter.training.schedules import lr_factor, noise_std
from drafter.training.tracking import RunLogger, Window, bucket_summary, console_line, eval_line

# step_generator's streams of (seed, step, rank): each draw of a step has its own, so that resume
# replays it and one draw never shifts another
NOISE_STREAM = 1     # + the micro step: the feature noise
ANCHOR_STREAM = -1   # - the micro step: the training anchors
EVAL_STREAM = 7      # the held-out batches' anchors (step: the batch's index)
CHECK_TOKENS, CHECK_ANCHORS = 1024, 64  # the attention check's slice of the first batch: its last tokens


def main(argv=None):
    parser = argparse.ArgumentParser(description="Train a DFlash drafter (see the module docstring).")
    parser.add_argument("--cfg", required=True, help="OmegaConf YAML: a path, else a name under the repo's "
                        "configs/ or its root, e.g. v3.yaml (found from any working directory)")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed
    parser.add_argument("overrides", nargs="*", help="key.sub=value")
    args = parser.parse_args(argv)
    launch = config_and_world(args.cfg, args.overrides)
    try:
        with hold_run_directory(launch.cfg.run.out_dir) as lock:  # one live run per run.out_dir, until this exits
            if lock.note:
                print(lock.note, file=sys.stderr, flush=True)
            return train(launch)
    except UserError as error:  # raised on every rank: say it once (or per rank when it differs)
        if launch.rank == 0 or getattr(error, "per_rank", False):
            print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    finally:
        dist.destroy_process_group()
        if launch.device.type == "cpu":
            remove_cpu_allreduce_buffer(launch.rank)


def train(launch: Launch) -> int:
    cfg, rank = launch.cfg, launch.rank
    if launch.device.type == "cpu":
        set_cpu_threads(cfg.train.threads_per_rank, launch.world_size)
    stop = StopRequest()
    data, model_config, ds_config = load_run_data(launch)
    resume_from, saved, notes = decide_resume(cfg, rank, data.identity, data.position)  # before any model loads
    run = build_run(launch, data, model_config, ds_config)
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
        if run.attention != "dense":  # flex's backward has never run in CI: check it on this run's data
            run = replace(run, attention=checked_attention(run, state, log))
        return train_loop(run, state, log, stop, last_saved=state.step if resume_from is not None else None)
    finally:
        log.close()


# ----------------------------------------------------------------------------- setup

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
        anchors = step_generator(run.cfg.run.seed, step, run.rank, ANCHOR_STREAM - micro)
        loss, metrics = training_step(run.drafting(drafter), FeatureBatch(input_ids, loss_mask, features, final_hidden),
                                      run.objective, anchors)
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
    """Anchors and noise for (step, rank) come from their own seed: resume replays them exactly. The seed
    is a digest of the four ints, so it holds across Python versions (the tuple hash may change)."""
    digest = hashlib.blake2b(b"".join(v.to_bytes(8, "little", signed=True) for v in (seed, step, rank, stream)),
                             digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") % 2**63)


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

def checked_attention(run: RunParts, state: TrainerState, log) -> str:
    """The kernel to train with: run.attention where its loss and gradients match dense on one row of
    this rank's next batch, else dense or a stop (drafter/training/attention_check.py)."""
    planned = next(run.data.sampler.batches_for_rank(state.epoch, state.micro_step_in_epoch), None)
    if planned is None:  # resumed at the end of an epoch: the next one's first batch
        planned = next(run.data.sampler.batches_for_rank(state.epoch + 1, 0), None)
    if planned is None:
        log.print(f"attention check: no batch to check {run.attention} on; training with it unchecked")
        return run.attention
    batch = collate([run.data.train_set[int(planned.indices[0])]], planned.bucket, run.cfg.data.max_length)
    input_ids, loss_mask = batch["input_ids"].to(run.device), batch["loss_mask"].to(run.device)
    drafter = drafter_from_state_dict(run.engine.module.config, run.engine.full_state_dict()).to(
        run.target.device, run.dtype)
    features, final_hidden = run.target_features(input_ids, drafter.target_layer_ids, batch["lengths"])
    features = calibrated_features(features, run.objective.feature_calibration)
    # the row's last positions: the dense reference materialises [heads, queries, keys] scores, which a
    # full-length row with every anchor would not fit beside the run (features are causal: a suffix's
    # are its own, with the row before it as context)
    end = int(batch["lengths"][0])
    window = slice(max(0, end - CHECK_TOKENS), end)
    checked = FeatureBatch(input_ids, loss_mask, features, final_hidden).cut_to(window)
    objective = replace(run.objective, num_anchors=min(run.objective.num_anchors, CHECK_ANCHORS))
    comparison = worst_over_ranks(compare_with_dense(run.drafting(drafter), checked, objective,
                                                     ATTENTION_TOLERANCE[run.dtype]))
    del drafter, features, final_hidden, checked
    if run.device.type == "cuda":  # the copy and its gradients: give the run its memory back
        torch.cuda.empty_cache()
    kernel, line = attention_verdict(run.cfg.objective.attention, comparison)
    log.print(line)
    log.log({"step": state.step, **asdict(comparison), "trains_with": kernel}, prefix="attention_check")
    return kernel


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
        held_out = FeatureBatch(input_ids, batch["loss_mask"].to(run.device), features, final_hidden)
        for k, v in eval_metrics(run, drafter, held_out, i).items():
            summed[k] = summed[k] + v.float()
    drafter.train(was_training)
    if any_rank(not summed):  # a rank whose rows are all too long has nothing to add
        return {}
    summed = all_reduce_sum(dict(summed))
    return {**finalize_metrics(summed), "eval_responses": int(summed["tau_dflash"][1])}


def eval_metrics(run: RunParts, drafter, batch: FeatureBatch, index: int) -> dict:
    """One held-out batch: the training step's metrics on clean features, and its replayed tau."""
    setup = run.drafting(drafter)
    _, metrics = training_step(setup, batch, run.objective,
                               step_generator(run.cfg.run.seed, index, run.rank, EVAL_STREAM))
    metrics.update(replayed_tau(setup, batch))
    return metrics


def run_generation(run: RunParts, drafter, step, log):
    """The drafter as it is now, served on the fixed prompts (split over the ranks, or over the
    tensor-parallel groups, whose members decode together; time-bounded)."""
    cfg = run.cfg
    share = PromptShare.of(run.target_features.group, run.world_size)
    summed = all_reduce_sum(generation_tau(
        run.drafting(drafter), run.generate_prompts, share, max_new_tokens=cfg.train.generate_max_new_tokens,
        max_seconds=cfg.train.generate_max_seconds, stop_token_ids=run.stops))
    metrics = {"step": step, **finalize_metrics(summed), "gen_responses": int(summed["gen_tau_dflash"][1])}
    log.log(metrics, prefix="generate")
    log.print(eval_line(metrics, "generate"))


if __name__ == "__main__":
    sys.exit(main())
