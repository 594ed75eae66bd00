"""Run logging: one console line per log step, the same numbers (and more) in metrics.jsonl and W&B."""
import json
import math
import os
import re
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from drafter.pipeline.sampler import bucket_table, plan_notes
from drafter.infra.collectives import all_reduce_sum, comm_device
from drafter.metric_sums import finalize_metrics
from drafter.nested import flatten


def human_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def console_line(m: dict) -> str:
    """`[3m] step=31 loss=4.0696 acc=0.000 anchor_streak=1.00 anchor_ddtree@32=1.00 lr=6.85e-06
    noise=0.1000 gnorm=1.23 | tgt=0.63b/s dft=0.62b/s (24.6Ktok/s) | q_pre=[50, 50] | epoch~0.01 ETA=5.2d`"""
    anchor_ddtree = f"anchor_ddtree@{m['ddtree_budget']}"
    return (f"[{human_duration(m['elapsed_s'])}] step={m['step']} loss={m['loss']:.4f} acc={m['acc']:.3f} "
            f"anchor_streak={m['anchor_streak']:.2f} {anchor_ddtree}={m[anchor_ddtree]:.2f} "
            f"lr={m['lr']:.2e} noise={m['noise']:.4f} gnorm={m['grad_norm']:.2f} | "
            f"tgt={m['target_batches_per_s']:.2f}b/s dft={m['drafter_batches_per_s']:.2f}b/s "
            f"({m['tokens_per_s'] / 1000:.1f}Ktok/s) | q_pre={m['prefetch_queue']} | "
            f"epoch~{m['epoch_progress']:.2f} ETA={human_duration(m['eta_s'])}"
            + (f" | skipped={m['skipped_steps']}" if m["skipped_steps"] else ""))


def eval_line(m: dict, title: str = "eval") -> str:
    """The console line of an eval or generation record: each group of numbers the record holds,
    e.g. `eval step=300 | held-out loss=2.103 acc=0.4512 anchor_streak=4.52 anchor_ddtree@32=5.83 |
    replayed tau_dflash=1.623 tau_ddtree@32=2.41 | generated gen_tau_dflash=1.6 gen_seconds=4.1`"""
    groups = {"held-out": [k for k in ("loss", "acc") if k in m] + [k for k in m if k.startswith("anchor_")],
              "replayed": [k for k in m if k.startswith("tau_")],
              "generated": [k for k in m if k.startswith("gen_")]}
    return " | ".join([f"{title} step={m['step']}"] + [name + " " + " ".join(f"{k}={m[k]:.4g}" for k in keys)
                                                     for name, keys in groups.items() if keys])


class RunLogger:
    """Rank 0 writes; other ranks hold a logger that does nothing.

    Exactly once: resuming at step N drops the records past N from metrics.jsonl (the resumed run logs
    those steps again), and nothing up to the last step W&B already holds is sent to W&B again.
    """

    def __init__(self, cfg, is_main: bool, resume_step: int | None = None, resume_id: str | None = None):
        self.is_main = is_main
        self.out_dir = Path(cfg.run.out_dir)
        self.wandb = None
        self.start = time.time()
        if not is_main:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, self.out_dir / "config.yaml", resolve=True)
        metrics_path = self.out_dir / "metrics.jsonl"
        self.wandb_holds_until = truncate_metrics(metrics_path, resume_step) if resume_step is not None else -1
        self.metrics_file = open(metrics_path, "a")
        if cfg.wandb.enabled:
            import wandb
            mode = cfg.wandb.mode or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
            self.wandb = wandb.init(project=cfg.wandb.project, entity=cfg.wandb.entity, name=cfg.run.name,
                                    dir=str(self.out_dir), mode=mode, id=resume_id, resume="allow",
                                    config=OmegaConf.to_container(cfg, resolve=True))

    @property
    def run_id(self) -> str | None:
        return self.wandb.id if self.wandb else None

    def print(self, text: str):
        if self.is_main:
            print(text, flush=True)

    def log(self, metrics: dict, prefix: str = ""):
        """One JSON object per call in metrics.jsonl (`prefix` names eval records), and W&B."""
        if not self.is_main:
            return
        record = {"kind": prefix or "train", **metrics}
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()
        if self.wandb and metrics["step"] > self.wandb_holds_until:
            self.wandb.log({f"{prefix or 'train'}/{k}": v for k, v in _flatten(metrics).items()},
                           step=metrics["step"])

    def close(self):
        if self.is_main:
            self.metrics_file.close()
            if self.wandb:
                self.wandb.finish()


def truncate_metrics(path: Path, step: int) -> int:
    """Keep the records of steps <= `step` (and no partial last line); return the last step the file
    held before, which is where the earlier run's W&B log got to."""
    if not path.exists():
        return -1
    kept, last = [], -1
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by a kill
            continue
        last = max(last, record.get("step", -1))
        if record.get("step", -1) <= step:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)
    return last


def _flatten(metrics: dict) -> dict:
    """Lists become `name/<i>` scalars and dicts `name/<key>` (W&B charts scalars)."""
    flat = {}
    for key, value in flatten(metrics, sep="/").items():
        if isinstance(value, list):
            flat.update({f"{key}/{i}": v for i, v in enumerate(value) if isinstance(v, (int, float))})
        elif isinstance(value, (int, float)):
            flat[key] = value
    return flat


class Window:
    """Sums over the steps between two log lines. Metrics stay on the device and are reduced over
    ranks only when summarised, so the training loop never waits for them."""

    def __init__(self, num_buckets: int, device: torch.device, timers):
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
            "step": state.step, "epoch": state.epoch, **m,
            "ddtree_budget": budget,
            "lr": self.lr, "noise": self.noise,
            "grad_norm": float(np.mean(self.grad_norms)) if self.grad_norms else math.nan,
            "skipped_steps": state.skipped_steps,
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
            "epoch_progress": state.epoch + state.micro_step_in_epoch / max(1, micro_per_epoch),
            "eta_s": (total_steps - state.step) * seconds / steps,
            "elapsed_s": state.elapsed_s + elapsed,
        }


class TrainedOn:
    """What the drafter has trained on, the learning curve's x axes: supervised (answer) tokens and
    blocks. Each rank adds its own micro batches on the host (from the CPU batch: no device wait);
    `count_into` adds what every rank added since its last call into the TrainerState's totals. It is
    a collective, called by every rank at the same steps (each log line, eval and save), so the saved
    totals are exact and a resumed run goes on counting from them."""

    def __init__(self):
        self.pending = torch.zeros(2, dtype=torch.float64)

    def add(self, supervised_tokens: int, blocks: int):
        self.pending += torch.tensor([supervised_tokens, blocks], dtype=torch.float64)

    def count_into(self, state) -> dict:
        """Adds the ranks' pending counts to `state`; the totals as the log records name them."""
        tokens, blocks = all_reduce_sum({"trained_on": self.pending})["trained_on"].tolist()
        state.supervised_tokens += int(tokens)
        state.blocks_trained += int(blocks)
        self.pending.zero_()
        return {"supervised_tokens": state.supervised_tokens, "blocks_trained": state.blocks_trained}


def bucket_summary(stats) -> str:
    return "\n".join([*bucket_table(stats),
                      f"padding efficiency {stats['pad_efficiency']:.3f}, longest same-bucket run "
                      f"{stats['max_same_bucket_run']}", *plan_notes(stats)])


# ----------------------------------------------------------------------------- reading a run's log back

RENAMED = {"streak": "anchor_streak", "ddtree_streak4": "anchor_top4_streak",
           "ddtree_streak8": "anchor_top8_streak"}
RENAMED_PATTERN = re.compile(r"^ddtree_accept@(\d+)$")


def new_name(key: str) -> str:
    if key in RENAMED:
        return RENAMED[key]
    match = RENAMED_PATTERN.match(key)
    return f"anchor_ddtree@{match.group(1)}" if match else key


def read_metrics(path: Path) -> tuple[dict[str, list[dict]], list[str]]:
    """A run's metrics.jsonl read back: ({kind: records in step order, one per step}, problems met).
    A truncated last line (a kill mid-write) is ignored, any other unreadable line skipped and named;
    where a step was logged twice (a resume re-logs the steps after its checkpoint) the later record
    counts; names from before a renaming are read as their new ones."""
    lines = path.read_bytes().splitlines()
    by_step, problems = {}, []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            problems.append(f"{path}:{number}: " + ("truncated last line, ignored" if number == len(lines)
                                                     else "not valid JSON, skipped"))
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), (int, float)):
            problems.append(f"{path}:{number}: not a record with a step, skipped")
            continue
        kind = str(record.get("kind", "train"))
        by_step.setdefault(kind, {})[record["step"]] = {new_name(k): v for k, v in record.items()}
    return {kind: [steps[s] for s in sorted(steps)] for kind, steps in by_step.items()}, problems
