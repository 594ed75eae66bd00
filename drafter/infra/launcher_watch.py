"""A rank ends within a second or two of its launcher's death, however the launcher died.

torchrun starts its ranks in sessions of their own, so a SIGKILL of the launcher (a node agent, an
OOM killer, `kill -9` of the job's leader) reaches no rank: they would train on, holding the run lock
and their GPUs, and collide with the resume launched beside them. Two guards, set up by every rank
before it forms the world (`exit_with_launcher`, called by `init_distributed`):

- the kernel's parent-death signal (prctl PR_SET_PDEATHSIG, Linux): SIGKILL when the parent dies. It
  fires on the death of the parent *thread* that started the rank, not of the parent process, and
  covers only the direct parent;
- a daemon thread that checks every half second that the launcher processes it recorded at start-up
  are still the same processes (pid and start time), and kills this rank when one is gone. The
  launchers are the direct parent (torchrun's elastic agent, deepspeed's per-node launch.py, srun's
  step daemon) and, above a wrapper that runs under another launcher (deepspeed's launch.py under
  the `deepspeed` runner), that one too.

A process started without a launcher (`python train.py`) watches nothing: its parent is a shell, and a
run under nohup must outlive the shell.
"""
import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
CHECK_EVERY_S = 0.5
# a launcher that is itself started by another launcher: the one above it is watched too
WRAPPED_LAUNCHERS = ("deepspeed.launcher.launch",)


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), or None when
    there is no such process: with the pid, it names one process (pids are reused)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields after the command name start at field 3


def exists(pid: int) -> bool:
    """Whether there is a process `pid`, whoever owns it and whatever /proc shows of it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def launcher_chain(parent: int) -> list[int]:
    """The launcher processes this rank depends on: its parent, and above each wrapper its launcher."""
    chain = [parent]
    while any(name in command_line(chain[-1]) for name in WRAPPED_LAUNCHERS):
        above = parent_of(chain[-1])
        if not above or above == 1:
            break
        chain.append(above)
    return chain


def set_parent_death_signal(signum: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `signum` to this process when its parent (thread) dies: False where
    there is no prctl (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0


def exit_with_launcher() -> list[int]:
    """Both guards for this process (idempotent): the launcher pids it now watches."""
    global _watched
    if _watched is not None:
        return _watched
    parent = os.getppid()
    set_parent_death_signal()
    watched = {pid: start_time(pid) for pid in launcher_chain(parent)}
    # a launcher of another user behind /proc's hidepid (srun's root step daemon) has no readable stat
    # but exists: it is not watched (the parent stays covered by the death signal and getppid)
    watched = {pid: started for pid, started in watched.items() if started is not None or not exists(pid)}
    if os.getppid() != parent or None in watched.values():  # died before the guards were up
        _exit_orphaned(parent)
    threading.Thread(target=_watch, args=(parent, watched), name="launcher-watch", daemon=True).start()
    _watched = list(watched)
    return _watched


_watched: list[int] | None = None


def _watch(parent: int, watched: dict[int, str]):
    while True:
        time.sleep(CHECK_EVERY_S)
        gone = [pid for pid, started in watched.items() if start_time(pid) != started]
        if gone or os.getppid() != parent:
            _exit_orphaned(gone[0] if gone else parent)


def _exit_orphaned(pid: int):
    print(f"rank pid {os.getpid()}: its launcher (pid {pid}) is gone; exiting", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
