"""Checkpoints: DeepSpeed engine state + trainer state + RNG + the exported drafter, written atomically.

    <out_dir>/checkpoints/step_<N>/          complete checkpoint (renamed from step_<N>.tmp when done)
        <deepspeed engine files>             optimizer partitions, lr scheduler, module weights
        drafter/                             export loadable by dflash.model.DFlashDraftModel
        trainer_state.json                   step, epoch, position in the epoch, counters
        rng_rank<r>.safetensors              torch RNG states of rank r
        config.yaml                          the resolved run config
    <out_dir>/checkpoints/latest -> step_<N>  symlink, replaced atomically, written last
"""
import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_root(out_dir: str) -> Path:
    return Path(out_dir) / "checkpoints"


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first. A `.tmp` dir (a save cut short) is never one."""
    found = [p for p in root.glob("step_*") if STEP_DIR.match(p.name) and (p / "trainer_state.json").exists()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def find_resume_checkpoint(resume: str, out_dir: str) -> Path | None:
    """`never` -> None; `auto` -> the newest complete checkpoint of this run (or None); else a path."""
    if resume == "never":
        return None
    if resume == "auto":
        found = complete_checkpoints(checkpoint_root(out_dir))
        return found[-1] if found else None
    path = Path(resume).resolve()
    if not (path / "trainer_state.json").exists():
        raise FileNotFoundError(f"train.resume={resume}: not a complete checkpoint (no trainer_state.json)")
    return path


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save_checkpoint(engine, cfg, step: int, trainer_state: dict, export_drafter) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint dir."""
    root = checkpoint_root(cfg.run.out_dir)
    rank, is_main = dist.get_rank(), dist.get_rank() == 0
    tmp, final = root / f"step_{step}.tmp", root / f"step_{step}"
    if is_main and tmp.exists():
        shutil.rmtree(tmp)  # left by a save that was cut short
    dist.barrier()
    engine.save_checkpoint(str(root), tag=tmp.name, save_latest=False)
    save_file(_rng_state(), str(tmp / f"rng_rank{rank}.safetensors"))
    dist.barrier()
    if is_main:
        export_drafter(tmp / "drafter")
        OmegaConf.save(cfg, tmp / "config.yaml", resolve=True)
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _point_latest(root, final.name)
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


def load_checkpoint(engine, path: Path) -> dict:
    """Restore engine (weights, optimizer, scheduler) and this rank's RNG; return the trainer state."""
    load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint at {path}")
    rng_file = path / f"rng_rank{dist.get_rank()}.safetensors"
    if rng_file.exists():  # absent when resuming with more ranks than were saved
        rng = load_file(str(rng_file))
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return json.loads((path / "trainer_state.json").read_text())
