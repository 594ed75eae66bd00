"""One distributed world from whichever launcher started the processes.

    deepspeed / torchrun     set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT themselves
    srun python train.py     one task per GPU: the SLURM variables give rank, world size and local
                             rank; the job's first node is the master (srun sets SLURM_STEP_ID; the
                             batch script itself, without srun, stays a world of one)
    python train.py          none of them: a world of one on a free local port

The first launcher found wins, in that order, so `srun torchrun ...` (one torchrun per node) works too.
A launched rank exits when its launcher dies (drafter/infra/launcher_watch.py).
"""
import datetime
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import torch
import torch.distributed as dist

from drafter.errors import UserError
from drafter.infra.launcher_watch import exit_with_launcher


class LaunchError(UserError, RuntimeError):
    pass


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compressed host list ("gpu[01-03,07],login1") as host names, in order."""
    hosts = []
    for prefix, ranges, suffix in re.findall(r"([^,\[]*)(?:\[([^\]]*)\])?([^,\[]*)(?:,|$)", hostlist):
        if not (prefix or ranges or suffix):
            continue
        if not ranges:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            for number in range(int(low), int(high or low) + 1):
                hosts.append(f"{prefix}{number:0{len(low)}d}{suffix}")
    return hosts


def first_host(hostlist: str) -> str:
    """The first node of a SLURM host list (`scontrol show hostnames` when it exists)."""
    if shutil.which("scontrol"):
        shown = subprocess.run(["scontrol", "show", "hostnames", hostlist], capture_output=True, text=True)
        if shown.returncode == 0 and shown.stdout.split():
            return shown.stdout.split()[0]
    hosts = expand_hostlist(hostlist)
    if not hosts:
        raise LaunchError(f"cannot read a host name from SLURM's node list {hostlist!r}")
    return hosts[0]


def tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """This node's task count from SLURM's "4(x2),3" notation."""
    counts = []
    for count, repeat in re.findall(r"(\d+)(?:\(x(\d+)\))?", tasks_per_node):
        counts += [int(count)] * int(repeat or 1)
    return counts[node_id] if node_id < len(counts) else 1


def slurm_environment(env) -> dict[str, str]:
    """torch.distributed's variables from a SLURM task's environment."""
    try:
        world_size = env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"]
        nodelist = env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]
        local = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": world_size, "LOCAL_RANK": env["SLURM_LOCALID"]}
    except KeyError as missing:
        raise LaunchError(f"SLURM task without {missing.args[0]}: launch with `srun` (one task per GPU)") from None
    tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1"
    local["LOCAL_WORLD_SIZE"] = str(tasks_on_node(tasks_per_node, int(env.get("SLURM_NODEID", "0"))))
    local["MASTER_ADDR"] = env.get("MASTER_ADDR") or first_host(nodelist)
    # one port per job, so two jobs sharing a node do not collide
    local["MASTER_PORT"] = env.get("MASTER_PORT") or str(15000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
    return local


# The batch script and an salloc shell are SLURM steps too, but not srun's: a process started there
# alone is a world of one (SLURM_STEP_ID is unset, "batch", or the batch step's 0xfffffffe).
SLURM_NON_SRUN_STEPS = {"batch", "extern", "interactive", "4294967294", "4294967295"}


def launcher_environment(env=os.environ) -> tuple[str, dict[str, str]]:
    """(launcher name, the variables to set) for this process."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return "torchrun/deepspeed", {}
    if "SLURM_PROCID" in env and env.get("SLURM_STEP_ID", "batch") not in SLURM_NON_SRUN_STEPS:
        return "srun", slurm_environment(env)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return "single process", {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def local_device() -> torch.device:
    """This rank's device: its node-local GPU (made current), or the CPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if torch.cuda.device_count() == 1:  # one GPU bound to this task (srun --gpus-per-task=1): it is cuda:0
        local_rank = 0
    elif local_rank >= torch.cuda.device_count():
        raise LaunchError(f"local rank {local_rank} but only {torch.cuda.device_count()} GPUs on this node: "
                          "start one task per GPU")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def launched_world_size() -> int:
    """The world size the launcher (deepspeed, torchrun, srun, or none: 1) started this process in;
    sets torch.distributed's variables from SLURM's where srun launched it."""
    launcher, variables = launcher_environment()
    os.environ.update(variables)
    return int(os.environ["WORLD_SIZE"])


def local_world_size(world_size: int) -> int:
    """The ranks on this node: LOCAL_WORLD_SIZE as torchrun and srun (here) set it, LOCAL_SIZE as
    deepspeed's launcher does, else `world_size` (one node)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or world_size)


def set_cpu_threads(threads_per_rank: int | None, world_size: int) -> None:
    """Torch's CPU threads for this rank: `threads_per_rank`, or the cores shared by the node's ranks."""
    torch.set_num_threads(threads_per_rank or cores_per_rank(world_size))


def cores_per_rank(world_size: int) -> int:
    """This rank's share of the cores it may run on, among the node's ranks (at least one)."""
    return max(1, usable_cores() // local_world_size(world_size))


def usable_cores() -> int:
    """The cores this process may run on (a SLURM or container CPU set), not the node's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def init_distributed(timeout_minutes: float = 30.0, backend: str | None = None) -> tuple[int, int, torch.device]:
    """(rank, world size, device) after forming the world of whichever launcher started this process;
    `backend` None: NCCL on GPUs, gloo on CPUs (a CPU-only group, gloo, on any device)."""
    launcher, variables = launcher_environment()
    if launcher != "single process":
        exit_with_launcher()  # before anything that can wait on other ranks
    os.environ.update(variables)
    device = local_device()
    world_size = int(os.environ["WORLD_SIZE"])
    try:
        dist.init_process_group(backend or ("nccl" if device.type == "cuda" else "gloo"),
                                timeout=datetime.timedelta(minutes=timeout_minutes))
    except Exception as error:
        raise LaunchError(
            f"could not form a world of {world_size} ranks ({launcher}: rank {os.environ['RANK']}, master "
            f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}): {error}. Every rank must be started "
            "(srun: one task per GPU, e.g. --ntasks-per-node=8) and reach the master's port.") from error
    return dist.get_rank(), dist.get_world_size(), device


def remove_cpu_allreduce_buffer(rank: int) -> None:
    """DeepSpeed's CPU all-reduce (its shm op) leaves each rank's shared-memory buffer, about 66 MB,
    in /dev/shm when the process ends, so every CPU launch kept 132 MB of RAM until a reboot. Once the
    world is gone, remove this rank's own buffer, named as DeepSpeed names it (user, master address and
    port, rank); nothing else."""
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_"
            f"{os.environ.get('MASTER_PORT')}_{rank}")
    Path("/dev/shm", name).unlink(missing_ok=True)
