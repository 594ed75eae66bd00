"""The preflight's run checks of bench/gpu_check.py: DeepSpeed engines in this process, and train.py
and the eval as subprocesses on a tiny world (random weights, nothing downloaded).

  ds_engines   each ds_configs/*.json through deepspeed_config (a tiny YAML) and deepspeed_op_problem
               (its failure line when the JSON's optimizer op cannot be compiled here); the engine built
               around a 1-layer drafter in a 1-process world and stepped once, with the optimizer it
               steps with (its `description`). On the CPU not zero2_offload.json's engine: DeepSpeed's
               CPU Adam op needs a compiler build.
  launches     subprocesses on a tiny world (random target, 160 rows): train.py under `deepspeed
               --num_gpus 1` and `torchrun --nproc_per_node 1` (train.engine=fsdp) to max_steps (30;
               tiny: 6), a torchrun run SIGKILLed once a checkpoint is complete and rerun (its log must
               say `resumed from`), and eval/ddtree_accept.py --check-public 2 on the deepspeed run's
               checkpoint (--target: the world's shapes with the toy tokenizer; verdict "yes"); with 2+
               GPUs, `deepspeed --num_gpus 2` and `torchrun --nproc_per_node 2` to max_steps as well.

Each sub-run of `launches` has a time budget of its own (SUB_RUN_BUDGETS_S): past it its whole
process tree is killed (SIGKILL) and the sub-run is `<name>: timeout after N s (hang?)`, which catches
a hang inside one C call too (a kernel, a collective), where gpu_check's SIGALRM budgets cannot.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from bench.check_harness import CheckFailed, build_on, log, make_batch, require
from drafter.config import ObjectiveConfig
from drafter.infra.deepspeed_engine import deepspeed_config, deepspeed_op_problem
from drafter.infra.engine_choice import build_engine
from drafter.models import DFlashDraftModel
from drafter.models.blocks import DraftingSetup, FeatureBatch, attention_kernel
from drafter.models.configure import drafter_config
from drafter.target_model.model import context_features, random_qwen3
from drafter.training.objective import training_step
from drafter.training.run_config import load_config

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
# seconds per sub-run of `launches`: (CUDA, --tiny); past it the job's process tree is killed
SUB_RUN_BUDGETS_S = {"deepspeed": (900, 200), "torchrun": (900, 200), "kill_resume": (1200, 300),
                     "eval": (900, 200), "two_gpus": (900, 0)}
LAUNCH_STEPS = (30, 6)  # train.max_steps of the launches: (CUDA, --tiny)


# ----------------------------------------------------------------------------- the tiny world of the launches

def arithmetic_rows(count: int = 160, seed: int = 0) -> dict[str, list]:
    """Prepared rows (input_ids, loss_mask, length) of arithmetic sequences over 32 tokens, 24-99 long,
    the first 4 tokens unsupervised: the tiny world of these launches and of the tests' train.py runs."""
    rng = np.random.default_rng(seed)
    rows = {"input_ids": [], "loss_mask": [], "length": []}
    for _ in range(count):
        n, start, stride = int(rng.integers(24, 100)), int(rng.integers(0, 32)), int(rng.integers(1, 4))
        rows["input_ids"].append([(start + stride * t) % 32 for t in range(n)])
        rows["loss_mask"].append([0] * 4 + [1] * (n - 4))
        rows["length"].append(n)
    return rows


def write_world(directory: Path, max_steps: int) -> Path:
    """A tiny prepared dataset (`arithmetic_rows`, as datasets saves it, with stats.json) and a YAML for
    a random target: the shapes the tests' train.py runs use."""
    import datasets
    import yaml

    data = directory / "data"
    if not data.exists():
        datasets.Dataset.from_dict(arithmetic_rows()).save_to_disk(str(data))
        (data / "stats.json").write_text(json.dumps({"settings": {"chat_template_kwargs": {"enable_thinking": False}}}))
    cfg = {
        "run": {"out_dir": str(directory / "run"), "seed": 0},
        "target": {"random": WORLD_TARGET},
        "drafter": {"num_layers": 1, "block_size": 8, "mask_token_id": 255},
        "objective": {"num_anchors": 16, "anchors_per_batch": 48, "ddtree_budget": 16, "ddtree_blocks": 4},
        "optim": {"lr": 3e-2, "warmup_ratio": 0.1},
        "noise": {"start": 0.0, "end": 0.01, "warmup_steps": 10},
        "data": {"path": str(data), "eval_fraction": 0.1, "max_length": 128, "num_buckets": 3,
                 "tokens_per_batch": 384, "num_workers": 1, "prefetch_factor": 2},
        "train": {"epochs": 3, "max_steps": max_steps, "log_every": 1, "save_every": max_steps,
                  "eval_every": max_steps, "eval_batches": 2, "threads_per_rank": 1, "tau_budgets": [4, 16],
                  "generate_every": 1000, "generate_max_prompts": 4, "generate_max_new_tokens": 8,
                  "generate_max_seconds": 5},
        "wandb": {"enabled": False},
    }
    path = directory / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


WORLD_TARGET = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "initializer_range": 0.3}
EVAL_PROMPTS = [{"prompt": "What is the capital of France?"}, {"prompt": "def add(a, b):"}]


def write_eval_target(directory: Path) -> Path:
    """eval/ddtree_accept.py needs a target directory with a tokenizer, which a random target has not:
    the world's target shapes with a vocabulary of 384 and the toy tokenizer (320 tokens; 256 cannot
    hold its bytes and special tokens). The drafter's weights do not depend on the vocabulary."""
    from drafter.synthesis.toy_tokenizer import build_tokenizer

    corpus = ["The quick brown fox jumps over the lazy dog.", "What is the capital of France? Paris.",
              "def add(a, b):\n    return a + b", "Let me think step by step: 2 + 2 = 4."]
    build_tokenizer(corpus * 4, 320).save_pretrained(directory)
    random_qwen3(**{**WORLD_TARGET, "vocab_size": 384}).save_pretrained(directory)
    return directory


# ----------------------------------------------------------------------------- sub-runs

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env() -> dict:
    """This checkout's packages and the venv's launchers first; no launcher variables of a caller."""
    env = {k: v for k, v in os.environ.items() if k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    python_path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**env, "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}", "PYTHONPATH": python_path,
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")}


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun's workers run in sessions of their own, which a signal to
    the launcher's process group does not reach). The tests' launches use it too."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:  # the task ended
                continue
            found += children
            todo += children
    return found


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL to the job's process group and to every process below its launcher."""
    pids = [proc.pid, *descendants(proc.pid)]
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def start_job(cmd: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "w") as out:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stdout=out, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)


def wait_job(proc: subprocess.Popen, timeout_s: float) -> int | None:
    """The job's return code, or None when it ran past `timeout_s`; a job still running then (or when
    this wait is interrupted, e.g. by the check's own budget) is killed."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if proc.poll() is None:
            kill_job(proc)


def sub_run(name: str, cmd: list[str], log_path: Path, timeout_s: float) -> dict:
    """One command run to its end (or killed at its budget): return code, wall time, last log lines."""
    log(f"  {name}: {' '.join(map(str, cmd))}")
    t0 = time.perf_counter()
    rc = wait_job(start_job(cmd, log_path), timeout_s)
    return job_figures(name, log_path, t0, rc, timeout_s)


def job_figures(name: str, log_path: Path, t0: float, rc: int | None, timeout_s: float) -> dict:
    lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    figures = {"rc": rc, "wall_s": round(time.perf_counter() - t0, 1), "last_lines": lines[-6:],
               "log": str(log_path)}
    if rc is None:
        figures["failure"] = f"{name}: timeout after {timeout_s} s (hang?)"
    log(f"  {name}: rc {rc} in {figures['wall_s']} s")
    return figures


# ----------------------------------------------------------------------------- engines and launches

@contextmanager
def one_process_group(device: torch.device):
    """A world of this one process (gloo on the CPU, NCCL on CUDA), as a launcher would set it up."""
    port = free_port()
    variables = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    saved = {key: os.environ.get(key) for key in variables}
    os.environ.update(variables)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
        remove_shm_buffers(port)


def remove_shm_buffers(port: int) -> None:
    """DeepSpeed's CPU all-reduce buffers (66 MB each in /dev/shm) of the world at `port`."""
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        path.unlink(missing_ok=True)


def ds_engine_step(cfg, ds: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """The DeepSpeed engine of `ds` around a 1-layer drafter of the world's target; one optimizer step."""
    with build_on(device, dtype):
        target = random_qwen3(**WORLD_TARGET)
    torch.manual_seed(0)
    drafter = DFlashDraftModel(drafter_config(target.config, num_layers=1, block_size=8, mask_token_id=255))
    engine = build_engine(cfg, drafter, device, dtype, ds)
    before = engine.full_state_dict()
    input_ids, loss_mask = make_batch(WORLD_TARGET["vocab_size"], 2, 64, 8, device)
    features = context_features(target, input_ids, engine.module.target_layer_ids)
    loss, _ = training_step(DraftingSetup(engine.module, target, attention_kernel("auto", device)),
                            FeatureBatch(input_ids, loss_mask, features), ObjectiveConfig(num_anchors=8),
                            torch.Generator().manual_seed(0))
    engine.backward(loss)
    result = engine.step(cfg.optim.lr)
    after = engine.full_state_dict()
    changed = sum(not torch.equal(before[name], after[name]) for name in before)
    figures = {"description": engine.description, "loss": loss.item(), "grad_norm": result.grad_norm,
               "applied": result.applied, "tensors_changed": f"{changed}/{len(before)}"}
    require(result.applied and changed, f"the step changed {changed} of {len(before)} tensors "
                                        f"(applied={result.applied}, grad norm {result.grad_norm})")
    return figures


def ds_engine_figures(json_path: Path, cfg_path: Path, device: torch.device, dtype: torch.dtype) -> dict:
    cfg = load_config(str(cfg_path), [f"train.ds_config={json_path}"])
    ds = deepspeed_config(cfg.train.ds_config, cfg, 1, dtype == torch.bfloat16, WORLD_TARGET["hidden_size"],
                          on_cpu=device.type == "cpu")
    figures = {"zero_stage": ds["zero_optimization"]["stage"], "optimizer_block": "optimizer" in ds}
    if problem := deepspeed_op_problem(ds, device):
        raise CheckFailed(f"{json_path.name}: {problem}")
    if device.type == "cpu" and "optimizer" in ds:
        figures["engine"] = ("not built on the CPU: DeepSpeed's CPU Adam op of the optimizer block needs a "
                             "compiler build (checked on CUDA)")
        return figures
    try:
        return {**figures, **ds_engine_step(cfg, ds, device, dtype)}
    except CheckFailed as failure:
        raise CheckFailed(f"{json_path.name}: {failure}") from None


def check_ds_engines(device: torch.device, dtype: torch.dtype) -> dict:
    """Every ds_configs/*.json through deepspeed_config and deepspeed_op_problem; its engine built
    in a 1-process world and stepped once (on the CPU not the offload JSON's)."""
    figures = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_ds_") as tmp, one_process_group(device):
        cfg_path = write_world(Path(tmp), max_steps=1)
        for json_path in sorted((REPO / "ds_configs").glob("*.json")):
            log(f"  {json_path.name}")
            figures[json_path.name] = ds_engine_figures(json_path, cfg_path, device, dtype)
    require(figures, "no ds_configs/*.json")
    return figures


def train_command(launcher: str, cfg: Path, out_dir: Path, steps: int, *overrides: str, ranks: int = 1) -> list[str]:
    args = ["train.py", "--cfg", str(cfg), f"run.out_dir={out_dir}", f"train.max_steps={steps}", *overrides]
    port = str(free_port())
    if launcher == "deepspeed":
        return [str(VENV_BIN / "deepspeed"), "--num_gpus", str(ranks), "--master_port", port, *args]
    return [str(VENV_BIN / "torchrun"), "--nproc_per_node", str(ranks), "--master_port", port, *args,
            "train.engine=fsdp"]


def last_train_step(out_dir: Path) -> int | None:
    metrics = out_dir / "metrics.jsonl"
    if not metrics.exists():
        return None
    steps = [r["step"] for r in map(json.loads, metrics.read_text().splitlines()) if r.get("kind") == "train"]
    return max(steps, default=None)


def launch_failure(name: str, figures: dict, steps: int | None = None, expect: str | None = None) -> str | None:
    """Why the sub-run failed (naming it, with its last log line), or None."""
    last = next((line for line in reversed(figures["last_lines"]) if line.strip()), "(no output)")
    if "failure" in figures:
        return f"{figures['failure']}: {last}"
    if figures["rc"] != 0:
        return f"{name} exited with {figures['rc']}: {last}"
    if steps is not None and figures.get("last_step") != steps:
        return f"{name} ended at step {figures.get('last_step')}, not {steps}: {last}"
    if expect and expect not in Path(figures["log"]).read_text(errors="replace"):
        return f"{name}: its log never says {expect!r}: {last}"
    return None


def run_training(name: str, launcher: str, cfg: Path, out_dir: Path, steps: int, budget_s: float,
                 *overrides: str, ranks: int = 1) -> dict:
    figures = sub_run(name, train_command(launcher, cfg, out_dir, steps, *overrides, ranks=ranks),
                      out_dir.with_suffix(".log"), budget_s)
    figures["last_step"] = last_train_step(out_dir)
    return figures


def complete_checkpoint(out_dir: Path) -> Path | None:
    """A finished save: step_<N> (renamed from step_<N>.tmp once written) holding trainer_state.json."""
    return next((p for p in sorted((out_dir / "checkpoints").glob("step_*"))
                 if not p.name.endswith(".tmp") and (p / "trainer_state.json").exists()), None)


def kill_and_resume(cfg: Path, out_dir: Path, steps: int, budget_s: float) -> dict:
    """torchrun's run killed (SIGKILL to the whole job) once a checkpoint is complete, then rerun."""
    cmd = train_command("torchrun", cfg, out_dir, steps, "train.save_every=2")
    log_path = out_dir.with_suffix(".killed.log")
    log(f"  kill_resume: {' '.join(cmd)}")
    t0, proc = time.perf_counter(), start_job(cmd, log_path)
    try:
        while proc.poll() is None and complete_checkpoint(out_dir) is None and time.perf_counter() - t0 < budget_s / 2:
            time.sleep(0.05)
        saved, running = complete_checkpoint(out_dir), proc.poll() is None
    finally:
        if proc.poll() is None:
            kill_job(proc)
    killed = job_figures("kill_resume (first run)", log_path, t0, proc.returncode, budget_s / 2)
    killed.pop("failure", None)  # killed on purpose
    if saved is None or not running:
        last = killed["last_lines"][-1] if killed["last_lines"] else "(no output)"
        why = "ended" if not running else "saved nothing"
        return {**killed, "failure": f"kill_resume: the first run {why} before a complete checkpoint: {last}"}
    resumed = run_training("kill_resume", "torchrun", cfg, out_dir, steps, budget_s / 2, "train.save_every=2")
    return {**resumed, "killed_after": saved.name, "killed_rc": killed["rc"], "killed_wall_s": killed["wall_s"]}


def run_eval(tmp: Path, ckpt: Path, budget_s: float, cuda: bool) -> dict:
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in EVAL_PROMPTS))
    target = write_eval_target(tmp / "eval_target")
    out = tmp / "eval.json"
    cmd = [sys.executable, "eval/ddtree_accept.py", "--ckpt", str(ckpt), "--target", str(target),
           "--bench", str(prompts), "--budgets", "4", "--max-new-tokens", "32" if cuda else "8",
           "--out", str(out), "--check-public", "2"]
    figures = sub_run("eval", cmd, tmp / "eval.log", budget_s)
    if figures["rc"] == 0:
        check = json.loads(out.read_text())["benchmarks"]["prompts"].get("public_check") or {}
        figures["public_check"] = {k: check.get(k) for k in ("prompts", "identical", "verdict", "tau")}
    return figures


def check_launches(device: torch.device, tiny: bool) -> dict:
    """train.py under deepspeed and torchrun (FSDP2), a SIGKILLed run resumed, and eval/ddtree_accept.py
    on the deepspeed run's checkpoint: each a subprocess with its own budget, all on the tiny world."""
    size = 1 if tiny else 0
    steps, budgets = LAUNCH_STEPS[size], {name: both[size] for name, both in SUB_RUN_BUDGETS_S.items()}
    cuda = device.type == "cuda"
    figures, failures = {}, []
    with tempfile.TemporaryDirectory(prefix="gpu_check_launches_") as tmp:
        tmp = Path(tmp)
        cfg = write_world(tmp, steps)
        figures["deepspeed"] = run_training("deepspeed", "deepspeed", cfg, tmp / "a", steps, budgets["deepspeed"])
        failures.append(launch_failure("deepspeed", figures["deepspeed"], steps))
        figures["torchrun"] = run_training("torchrun", "torchrun", cfg, tmp / "b", steps, budgets["torchrun"])
        failures.append(launch_failure("torchrun", figures["torchrun"], steps))
        figures["kill_resume"] = kill_and_resume(cfg, tmp / "c", steps, budgets["kill_resume"])
        failures.append(launch_failure("kill_resume", figures["kill_resume"], steps, expect="resumed from"))
        if failures[0] is None:
            figures["eval"] = run_eval(tmp, tmp / "a" / "checkpoints" / "latest", budgets["eval"], cuda)
            failures.append(launch_failure("eval", figures["eval"]))
            verdict = figures["eval"].get("public_check", {}).get("verdict")
            if failures[-1] is None and verdict != "yes":
                failures.append(f"eval: --check-public 2 verdict {verdict!r}, not 'yes'")
        else:
            figures["eval"] = "skipped (the deepspeed run made no checkpoint)"
        if cuda and torch.cuda.device_count() >= 2:  # NCCL between ranks: a one-GPU check never forms it
            for launcher in ("deepspeed", "torchrun"):
                name = f"{launcher}_2gpus"
                figures[name] = run_training(name, launcher, cfg, tmp / name, steps, budgets["two_gpus"], ranks=2)
                failures.append(launch_failure(name, figures[name], steps))
    failures = [f for f in failures if f]
    require(not failures, "; ".join(failures))
    return figures
