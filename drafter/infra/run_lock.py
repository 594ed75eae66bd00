"""One live run per run directory: rank 0 holds an exclusive lock on `<out_dir>/run.lock` for the
whole run, and a second run launched into the same directory stops, naming the holder, before any
model loads.

The lock is the kernel's (`fcntl.flock` on the open file), not the file's existence: it goes away
with the process that holds it, however that process ends (SIGKILL, a node's OOM killer), so a run
that crashed never blocks the next one. The file only says who holds it (host, pid, job, start time).

Filesystems: flock is exact on a local disk and on NFSv4 (Linux emulates it with NFS byte-range
locks, which the server arbitrates between clients). NFSv3 needs a running lock manager (lockd), and
Lustre needs the `flock` mount option; where the filesystem has no locks at all, the run goes on
unguarded and says so (a warning, not a refusal: such a cluster could otherwise not train at all).
"""
import errno
import fcntl
import os
import socket
import time
from pathlib import Path

import torch.distributed as dist

from drafter.errors import UserError

LOCK_NAME = "run.lock"
JOB_VARIABLES = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "LSB_JOBID", "PBS_JOBID")
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunDirectoryBusy(UserError, RuntimeError):
    pass


def holder_description() -> str:
    """Who this process is, as the next run that finds the directory busy will be told."""
    job = next((f"{name}={os.environ[name]}" for name in JOB_VARIABLES if os.environ.get(name)), "none")
    return (f"host {socket.gethostname()}, pid {os.getpid()}, job {job}, "
            f"started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")


class RunLock:
    """The held lock (rank 0), or nothing (other ranks, or a filesystem without locks)."""

    def __init__(self, handle=None, note: str | None = None):
        self._handle, self.note = handle, note

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        if self._handle is not None:
            self._handle.close()  # closing the last descriptor drops the flock
            self._handle = None


def acquire(out_dir: str) -> RunLock:
    """Take `<out_dir>/run.lock` without waiting; RunDirectoryBusy names the live holder."""
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    handle = open(directory / LOCK_NAME, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "a process that has not written its name yet"
        handle.close()
        raise RunDirectoryBusy(f"run.out_dir={out_dir} is in use by another live run ({holder}). Wait for it "
                               "to end, stop it, or give this run its own run.out_dir.") from None
    except OSError as error:
        if error.errno not in NO_LOCKS:
            raise
        handle.close()
        return RunLock(note=f"warning: the filesystem of {out_dir} has no file locks ({error.strerror}): "
                            "nothing stops a second run from writing into it")
    handle.seek(0)
    handle.truncate()
    handle.write(holder_description() + "\n")
    handle.flush()
    return RunLock(handle)


def hold_run_directory(out_dir: str) -> RunLock:
    """Collective: rank 0 takes the lock; if it cannot, every rank raises RunDirectoryBusy."""
    lock, outcome = RunLock(), [None]
    if dist.get_rank() == 0:
        try:
            lock = acquire(out_dir)
        except RunDirectoryBusy as error:
            outcome = [str(error)]
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0]:
        raise RunDirectoryBusy(outcome[0])
    return lock
