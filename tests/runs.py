"""Helpers for the tests that run train.py: a tiny prepared dataset and config, and the launchers
(deepspeed, torchrun, a SLURM-style pair of `srun` tasks, plain python) with two CPU ranks over gloo;
and `gloo_ranks`, a function run on two spawned ranks, for the tests that drive the engines directly."""
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import datasets
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from bench.preflight_runs import arithmetic_rows, descendants, free_port  # noqa: F401 (the tests' names)

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
FAULTS = Path(__file__).with_name("train_with_faults.py")


def gloo_ranks(body, tmp: Path, world_size: int = 2) -> list[dict]:
    """`body(rank, tmp) -> report` (a JSON-able dict) on `world_size` spawned processes in one gloo
    group, one thread each, as a launcher would start them; every rank's report, in rank order."""
    mp.spawn(_gloo_rank, args=(body, tmp, world_size, free_port()), nprocs=world_size, join=True)
    return [json.loads((tmp / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def _gloo_rank(rank: int, body, tmp: Path, world_size: int, port: int):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        report = body(rank, tmp)
    finally:
        dist.destroy_process_group()
    (tmp / f"rank{rank}.json").write_text(json.dumps(report))


TINY_VOCAB = 256
UNIFORM_LOSS = math.log(TINY_VOCAB)  # where a fresh drafter starts on write_run's target (models.new_drafter)


def write_run(tmp_path: Path, **train) -> Path:
    """A tiny prepared dataset (arithmetic sequences over 32 tokens) and a config for a random target."""
    if not (tmp_path / "data").exists():
        datasets.Dataset.from_dict(arithmetic_rows()).save_to_disk(str(tmp_path / "data"))
        settings = {"chat_template_kwargs": {"enable_thinking": False}}  # as data/prepare.py records it
        (tmp_path / "data" / "stats.json").write_text(json.dumps({"settings": settings}))
    cfg = {
        "run": {"out_dir": str(tmp_path / "run"), "seed": 0},
        "target": {"random": {"vocab_size": TINY_VOCAB, "hidden_size": 64, "num_hidden_layers": 4,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                              "intermediate_size": 128,
                              "initializer_range": 0.3}},  # a frozen LM head with room to learn through
        "drafter": {"num_layers": 1, "block_size": 8, "mask_token_id": 255},
        # anchors_per_batch: a few forwards per eval batch, a different number on each rank
        "objective": {"num_anchors": 16, "anchors_per_batch": 48, "ddtree_budget": 16, "ddtree_blocks": 4},
        "optim": {"lr": 3e-2, "warmup_ratio": 0.1},
        "noise": {"start": 0.0, "end": 0.01, "warmup_steps": 10},
        "data": {"path": str(tmp_path / "data"), "eval_fraction": 0.1, "max_length": 128, "num_buckets": 3,
                 "tokens_per_batch": 384, "num_workers": 1, "prefetch_factor": 2},
        "train": {"epochs": 3, "max_steps": 24, "log_every": 1, "save_every": 6, "eval_every": 12,
                  "eval_batches": 2, "threads_per_rank": 1, "tau_budgets": [4, 16], "generate_every": 1000,
                  "generate_max_prompts": 4, "generate_max_new_tokens": 8, "generate_max_seconds": 5, **train},
        "wandb": {"enabled": False},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith("SLURM_")}
    # this checkout's packages first: a script in tests/ would otherwise import the installed (editable) copy
    python_path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    # DeepSpeed's JIT-built CPU ops per checkout: checkouts sharing one build directory rebuild it in turn
    extensions = os.environ.get("TORCH_EXTENSIONS_DIR") or str(
        Path.home() / ".cache" / "torch_extensions" / hashlib.sha1(str(REPO).encode()).hexdigest()[:12])
    return {**env, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "PYTHONPATH": python_path,
            "TORCH_EXTENSIONS_DIR": extensions, "OMP_NUM_THREADS": "1", **(extra or {})}


def launch(cfg: Path, *overrides: str, launcher: str = "deepspeed", faults: dict | None = None) -> subprocess.Popen:
    """train.py (or train_with_faults.py when `faults` are given, as FAULT_* variables) on two CPU
    ranks through `launcher`: deepspeed | torchrun | slurm (two tasks as srun starts them) | python
    (one process). The processes form their own session, so the whole job can be signalled."""
    script = str(FAULTS if faults else REPO / "train.py")
    args = [script, "--cfg", str(cfg), *overrides]
    env = _env({f"FAULT_{k.upper()}": str(v) for k, v in (faults or {}).items()})
    port = str(free_port())
    if launcher == "deepspeed":
        cmd = [str(VENV_BIN / "deepspeed"), "--num_gpus", "2", "--master_port", port, *args]
    elif launcher == "torchrun":
        cmd = [str(VENV_BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", port, *args]
    elif launcher == "python":
        cmd = [sys.executable, *args]
    elif launcher == "slurm":
        env.update(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_NTASKS="2", SLURM_JOB_NODELIST="localhost",
                   SLURM_TASKS_PER_NODE="2", SLURM_NODEID="0", MASTER_PORT=port)
        task = " ".join(map(_quote, [sys.executable, *args]))
        cmd = ["bash", "-c", f"SLURM_PROCID=0 SLURM_LOCALID=0 {task} & SLURM_PROCID=1 SLURM_LOCALID=1 {task} & wait"]
    else:
        raise ValueError(launcher)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    proc.master_port = port
    return proc


def shm_buffers(proc: subprocess.Popen) -> list[Path]:
    """DeepSpeed's CPU all-reduce buffers of the job (one per rank, 66 MiB in /dev/shm, named by the
    master port) still there."""
    return sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{proc.master_port}_*"))


def remove_shm_buffers(proc: subprocess.Popen) -> None:
    """What a job could not remove itself (train.py removes its ranks' buffers on every exit it
    reaches; a SIGKILLed or hung one cannot). The ranks map theirs at start-up: once a job has
    logged a step or ended, its names can go."""
    for path in shm_buffers(proc):
        path.unlink(missing_ok=True)


def _quote(arg: str) -> str:
    return "'" + arg.replace("'", "'\\''") + "'"


def run_to_end(cfg: Path, *overrides: str, expect: int | None = 0, **kwargs) -> str:
    """The job's output once it ended with exit code `expect` (None: any failure)."""
    proc = launch(cfg, *overrides, **kwargs)
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        remove_shm_buffers(proc)
    assert proc.returncode == expect if expect is not None else proc.returncode != 0, out[-4000:]
    return out


def kill_job(proc: subprocess.Popen, signum: int, launcher: bool = True) -> None:
    """`signum` to every process the launcher started (and to the launcher itself unless told not
    to), as a scheduler signals a job. A job stopped by SIGTERM or SIGINT removes its own buffers."""
    for pid in [proc.pid] * launcher + descendants(proc.pid):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    if signum == signal.SIGKILL:
        remove_shm_buffers(proc)


def records(out_dir: Path, kind: str = "train") -> list[dict]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def train_losses(out_dir: Path) -> dict[int, float]:
    """step -> loss (a re-run step, if any were logged twice, keeps the last)."""
    return {r["step"]: r["loss"] for r in records(out_dir)}


def wait_for_step(out_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (out_dir / "metrics.jsonl").exists():
            try:
                if any(s >= step for s in train_losses(out_dir)):
                    return
            except ValueError:  # a line being written
                pass
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.02)
    raise TimeoutError(f"step {step} never logged")
