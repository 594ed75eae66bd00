"""Ranks end within seconds when their launcher alone is SIGKILLed (drafter/infra/launcher_watch.py):
two CPU ranks of train.py through torchrun (whose ranks live in sessions of their own), deepspeed
(the runner above its per-node launch.py) and a SLURM-style pair of tasks."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from drafter.infra.launcher_watch import launcher_chain, start_time
from runs import descendants, launch, remove_shm_buffers, wait_for_step, write_run


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its reaper."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed", "slurm"])
def test_ranks_exit_when_their_launcher_is_killed_alone(tmp_path, launcher):
    cfg = write_run(tmp_path)
    out_dir = tmp_path / "run"
    proc = launch(cfg, f"run.out_dir={out_dir}", "train.max_steps=10000", "train.epochs=1000", "train.save_every=10000",
                  "train.eval_every=10000", "data.num_workers=0", launcher=launcher)
    try:
        wait_for_step(out_dir, 1, proc)
        below = descendants(proc.pid)
        assert len(below) >= 2
        proc.send_signal(signal.SIGKILL)  # the launcher only: not its process group, not its children
        proc.wait()
        deadline = time.time() + 10
        while any(map(alive, below)) and time.time() < deadline:
            time.sleep(0.1)
        left = [pid for pid in below if alive(pid)]
    finally:
        kill_all([pid for pid in below if alive(pid)])
        remove_shm_buffers(proc)
    assert not left, f"{launcher}: ranks {left} still running 10 s after their launcher was killed"


def test_the_watched_chain_climbs_above_a_wrapped_launcher():
    """Above a process whose command line names a wrapped launcher, its own parent is watched too."""
    wrapper = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                                "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
                                "time.sleep(30)", "deepspeed.launcher.launch"])
    try:
        deadline = time.time() + 10
        while not descendants(wrapper.pid) and time.time() < deadline:
            time.sleep(0.05)
        (child,) = descendants(wrapper.pid)
        assert launcher_chain(wrapper.pid) == [wrapper.pid, os.getpid()]
        assert launcher_chain(child) == [child]
        assert start_time(wrapper.pid) is not None
    finally:
        kill_all(descendants(wrapper.pid) + [wrapper.pid])
        wrapper.wait()


def test_a_launcher_whose_proc_entry_is_hidden_is_not_taken_for_dead():
    """/proc mounted with hidepid shows no stat of another user's process (srun's step daemon runs as
    root): the rank must keep running under it, and still exit when its parent really is gone."""
    code = ("import os, time, drafter.infra.launcher_watch as w\n"
            "hidden = os.getppid()\n"
            "real = w.start_time\n"
            "w.start_time = lambda pid: None if pid == hidden else real(pid)\n"
            "print('watching', w.exit_with_launcher(), flush=True)\n"
            "time.sleep(1.5)\n"
            "print('alive', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["watching []", "alive"]


def kill_all(pids: list[int]):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
