"""Checkpoints: engine state + trainer state + RNG + the exported drafter, written atomically, and the
rules that keep a run directory to one run.

    <out_dir>/checkpoints/step_<N>/          complete checkpoint (renamed from step_<N>.tmp when done)
        <engine files>                       DeepSpeed's partitions, or fsdp/ (torch.distributed.checkpoint)
        drafter/                             export loadable by dflash.model.DFlashDraftModel
        trainer_state.json                   TrainerState: step, epoch, position in the epoch, counters,
                                             run identity (format TRAINER_STATE_FORMAT, versioned)
        rng_rank<r>.safetensors              torch RNG states of rank r
        config.yaml                          the resolved run config
    <out_dir>/checkpoints/latest -> step_<N>  symlink, replaced atomically, written last

Every file is fsynced before the rename, so a crash leaves either a complete step_<N> or a
step_<N>.tmp that resume ignores and the next run removes.

Resume (`train.resume`): `auto` continues from the newest complete checkpoint if its run identity (the
config minus RESUMABLE_KEYS) equals this run's, and refuses otherwise; `force` continues despite a
different identity; a path continues from that checkpoint (identity checked); `never` starts over,
setting the previous run's files aside. What the saved data position depends on (DATA_POSITION:
world size, batch shape, buckets, the data) must match even with force. Rank 0 decides and
broadcasts; every rank checks that its own files are there.
"""
import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from transformers.utils import logging as transformers_logging

from drafter.errors import UserError
from drafter.infra.collectives import every_rank
from drafter.models import ARCHITECTURES, drafter_from_state_dict, is_drafter_config
from drafter.nested import flatten

STEP_DIR = re.compile(r"^step_(\d+)$")
# Keys that may change when a run is resumed: how long it runs, logging, saving, evaluation, where
# things live, per-cluster tuning (target.tp_size too: the features, and so the data position and the
# trajectory, are those of tp 1; data.features too: a store gives the features the target would). Every
# other key defines the run.
RESUMABLE_KEYS = ("run.name", "run.out_dir", "target.tp_size", "objective.chunk_bytes", "train.epochs", "train.max_steps", "train.schedule_steps", "train.log_every",
                  "train.save_every", "train.eval_every", "train.eval_batches", "train.keep_last",
                  "train.resume", "train.max_bad_steps", "train.threads_per_rank", "train.profile_timing",
                  "train.dist_timeout_minutes", "train.ds_config", "train.tau_budgets", "train.generate_every",
                  "train.generate_prompts", "train.generate_max_prompts", "train.generate_max_new_tokens",
                  "train.generate_max_seconds", "data.num_workers", "data.prefetch_factor", "data.features", "fsdp",
                  "data.features_cache", "wandb")
RUN_FILES = ("checkpoints", "metrics.jsonl", "config.yaml", "wandb")  # what a run writes in out_dir


class ResumeError(UserError, RuntimeError):
    def __init__(self, message: str, per_rank: bool = False):
        super().__init__(message)
        self.per_rank = per_rank  # the message differs between ranks


# trainer_state.json: version 1 is the unversioned file of the first trainers (the same fields, no
# "format" key); version 2 names its format; version 3 adds what the drafter has trained on
# (COUNTED_SINCE_V3, read as 0 from older states). A newer version than this code knows is refused by name.
TRAINER_STATE_FORMAT, TRAINER_STATE_VERSION = "dflash-ddtree/trainer-state", 3
COUNTED_SINCE_V3 = ("supervised_tokens", "blocks_trained")


@dataclass
class TrainerState:
    """Where a run stands, saved in every checkpoint as trainer_state.json and read back on resume:
    the optimizer steps taken, the data position (epoch, micro step in it), counters, the lr schedule's
    length, the W&B run, and what identifies the run (`run_identity`) and its data position."""
    step: int = 0
    epoch: int = 0
    micro_step_in_epoch: int = 0
    skipped_steps: int = 0
    wandb_id: str | None = None
    elapsed_s: float = 0.0
    schedule_steps: int = 0
    supervised_tokens: int = 0   # answer tokens of the training batches so far, all ranks (the curve's x)
    blocks_trained: int = 0      # blocks (valid anchors) trained so far, all ranks
    identity: dict = field(default_factory=dict)
    data_position: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"format": TRAINER_STATE_FORMAT, "version": TRAINER_STATE_VERSION, **asdict(self)},
                          indent=1)

    @classmethod
    def read(cls, path: Path) -> "TrainerState":
        """The state in `path`, of any version this code reads; a ResumeError naming the file otherwise."""
        try:
            saved = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ResumeError(f"{path}: not a readable trainer state ({error})") from None
        if not isinstance(saved, dict):
            raise ResumeError(f"{path}: not a trainer state (a JSON object)")
        written_as = (saved.pop("format", None), saved.pop("version", None))
        known = written_as == (None, None) or (written_as[0] == TRAINER_STATE_FORMAT and written_as[1] in
                                               range(1, TRAINER_STATE_VERSION + 1))
        if not known:
            raise ResumeError(f"{path}: trainer state written as {written_as[0]!r} version {written_as[1]!r}; this "
                              f"trainer reads {TRAINER_STATE_FORMAT} versions 1-{TRAINER_STATE_VERSION} "
                              "(version 1: no format key)")
        if "identity" not in saved:
            raise ResumeError(f"{path.parent} predates run identities: its run cannot be checked against this "
                              "one. Start a new run (a new run.out_dir, or train.resume=never).")
        names = {f.name for f in fields(cls)}
        if written_as[1] is None or written_as[1] < 3:  # counted from version 3 on
            saved.update({name: 0 for name in COUNTED_SINCE_V3 if name not in saved})
        missing = sorted(names - saved.keys())
        if missing:
            raise ResumeError(f"{path}: trainer state without {', '.join(missing)}")
        return cls(**{name: saved[name] for name in names})


def checkpoint_root(out_dir: str) -> Path:
    return Path(out_dir) / "checkpoints"


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first. A `.tmp` dir (a save cut short) is never one."""
    found = [p for p in root.glob("step_*") if STEP_DIR.match(p.name) and (p / "trainer_state.json").exists()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def run_identity(cfg) -> dict:
    """The run-defining config: every key but RESUMABLE_KEYS (and their sub-keys), flattened."""
    flat = flatten(OmegaConf.to_container(cfg, resolve=True))
    return {key: value for key, value in flat.items()
            if not any(key == k or key.startswith(k + ".") for k in RESUMABLE_KEYS)}


# ---------------------------------------------------------------------------------------------
# Choosing the checkpoint to resume
# ---------------------------------------------------------------------------------------------

def _choose(resume: str, out_dir: str) -> Path | None:
    if resume == "never":
        return None
    if resume in ("auto", "force"):
        found = complete_checkpoints(checkpoint_root(out_dir))
        return found[-1].resolve() if found else None
    path = Path(resume).resolve()
    if not (path / "trainer_state.json").exists():
        raise ResumeError(f"train.resume={resume}: not a complete checkpoint (no trainer_state.json)")
    return path


def agree_on_checkpoint(resume: str, out_dir: str) -> tuple[Path | None, dict | None]:
    """Collective: the checkpoint every rank resumes from (rank 0 chooses) and its trainer state.

    Each rank checks that the checkpoint and its own files are visible to it; if one rank cannot see
    them, every rank raises (instead of some ranks hanging in the engine's load)."""
    choice = [None]
    if dist.get_rank() == 0:
        try:
            chosen = _choose(resume, out_dir)
            choice = [(str(chosen) if chosen else None, None)]
        except ResumeError as error:
            choice = [(None, str(error))]
    dist.broadcast_object_list(choice, src=0)
    path, error = choice[0]
    if error:
        raise ResumeError(error)
    if path is None:
        return None, None
    path = Path(path)
    own = [path / "trainer_state.json", path / f"rng_rank{dist.get_rank()}.safetensors"]
    missing = [str(p) for p in own if not p.exists()]
    if not every_rank(not missing):
        raise ResumeError(
            f"rank {dist.get_rank()}: cannot resume from {path}: "
            + (f"missing {', '.join(missing)}. " if missing else "another rank cannot see its files. ")
            + "run.out_dir must be on a filesystem every node shares (and the world size the one saved).",
            per_rank=True)
    try:
        state, problem = TrainerState.read(path / "trainer_state.json"), None
    except ResumeError as error:
        state, problem = None, str(error)
    if not every_rank(problem is None):  # a rank that cannot read it must not leave the others waiting
        raise ResumeError(problem or f"rank {dist.get_rank()}: another rank cannot read {path}/trainer_state.json",
                          per_rank=True)
    return path, state


def check_resumable(saved: "TrainerState", identity: dict, data_position: dict, resume: str, path: Path) -> list[str]:
    """Raise ResumeError when `saved` belongs to another run; return notes."""
    moved = {key: (saved.data_position.get(key), value) for key, value in data_position.items()
             if saved.data_position.get(key) != value}
    if moved:
        changes = "; ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in moved.items())
        raise ResumeError(
            f"cannot resume {path}: its data position (epoch {saved.epoch}, micro step "
            f"{saved.micro_step_in_epoch}) has no meaning under a different {changes}. Keep these as "
            "saved, or start a new run (a new run.out_dir, or train.resume=never).")
    keys = sorted(identity.keys() | saved.identity.keys())
    differing = [f"{key}: {saved.identity.get(key)!r} -> {identity.get(key)!r}"
                 for key in keys if saved.identity.get(key) != identity.get(key)]
    if differing and resume != "force":
        raise ResumeError(
            f"{path} was written by a different run ({'; '.join(differing)}). Use a new run.out_dir for a "
            "new experiment, train.resume=never to start over here (the old run's files are set aside), or "
            "train.resume=force to continue this checkpoint with the new settings.")
    return [f"train.resume=force: continuing despite {'; '.join(differing)}"] if differing else []


def set_aside_previous_run(out_dir: str) -> Path | None:
    """Rank 0, on a fresh start: move an earlier run's files out of the way (nothing is deleted)."""
    out = Path(out_dir)
    present = [name for name in RUN_FILES if (out / name).exists() or (out / name).is_symlink()]
    if not present:
        return None
    aside = out / "previous" / time.strftime("%Y%m%d-%H%M%S")
    aside.mkdir(parents=True, exist_ok=False)
    for name in present:
        os.replace(out / name, aside / name)
    return aside


def remove_partial_saves(out_dir: str) -> list[Path]:
    """Rank 0: delete `step_<N>.tmp` dirs and a `latest.tmp` link, the leftovers of saves cut short."""
    root = checkpoint_root(out_dir)
    stale = [p for p in root.glob("step_*.tmp") if STEP_DIR.match(p.name[:-4])]
    for path in stale:
        shutil.rmtree(path)
    if (root / "latest.tmp").is_symlink():
        (root / "latest.tmp").unlink()
    return stale


# ---------------------------------------------------------------------------------------------
# Saving and loading
# ---------------------------------------------------------------------------------------------

def _rng_state() -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(directory: Path) -> None:
    """Flush every file and directory under `directory` (and itself) to stable storage."""
    for path in directory.rglob("*"):
        if path.is_file() or path.is_dir():
            _fsync(path)
    _fsync(directory)


def read_config_json(path: Path) -> dict:
    """A config.json as a dict, or a ValueError that names the file."""
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{path}: not a JSON config ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON config (a {type(config).__name__}, not an object)")
    return config


def drafter_dir(ckpt: str) -> Path:
    """`ckpt` itself when it is an exported drafter dir, else its `drafter/` subdir (a run checkpoint,
    as `save_checkpoint` lays it out)."""
    for candidate in (Path(ckpt), Path(ckpt) / "drafter"):
        config = candidate / "config.json"
        if config.is_file() and is_drafter_config(read_config_json(config)):
            return candidate
    names = " or ".join(cls.__name__ for cls in ARCHITECTURES.values())
    raise FileNotFoundError(f"{ckpt}: no {names} config.json here or in {ckpt}/drafter")


def export_drafter(state_dict: dict[str, torch.Tensor], config, directory: Path, dtype: torch.dtype) -> None:
    """The dflash export (config.json + safetensors) of full weights `state_dict`."""
    transformers_logging.disable_progress_bar()
    drafter_from_state_dict(config, state_dict).to(dtype).save_pretrained(directory)


def save_checkpoint(engine, cfg, step: int, trainer_state: TrainerState, export_dtype: torch.dtype) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint dir."""
    root = checkpoint_root(cfg.run.out_dir)
    rank, is_main = dist.get_rank(), dist.get_rank() == 0
    tmp, final = root / f"step_{step}.tmp", root / f"step_{step}"
    if is_main and tmp.exists():
        shutil.rmtree(tmp)  # left by a save that was cut short
    dist.barrier()
    engine.save(tmp)
    save_file(_rng_state(), str(tmp / f"rng_rank{rank}.safetensors"))
    weights = engine.full_state_dict()  # collective
    if is_main:
        export_drafter(weights, engine.module.config, tmp / "drafter", export_dtype)
        OmegaConf.save(cfg, tmp / "config.yaml", resolve=True)
        (tmp / "trainer_state.json").write_text(trainer_state.to_json())
    del weights
    dist.barrier()
    _fsync_tree(tmp)  # every rank flushes what it wrote (on NFS only the writer's flush counts)
    dist.barrier()
    if is_main:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _point_latest(root, final.name)
        _fsync(root)
        _prune(root, cfg.train.keep_last)
    dist.barrier()
    return final


def _point_latest(root: Path, name: str):
    link = root / "latest.tmp"
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(name, link)
    os.replace(link, root / "latest")


def _prune(root: Path, keep_last: int):
    for old in complete_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old)


def load_checkpoint(engine, path: Path) -> None:
    """Restore the engine (weights, optimizer state) and this rank's RNG."""
    engine.load(path)
    rng = load_file(str(path / f"rng_rank{dist.get_rank()}.safetensors"))
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
