"""One live run per run directory (drafter/infra/run_lock.py): a second run into a held directory stops
naming the holder before any model loads, and a holder that was SIGKILLed blocks nothing."""
import os
import signal
import socket
import subprocess
import sys

import pytest

from drafter.infra.run_lock import RunDirectoryBusy, acquire
from runs import REPO, run_to_end, write_run

HOLDER = "import sys, time; from drafter.infra.run_lock import acquire; lock = acquire(sys.argv[1]); print('held', flush=True); time.sleep(600)"


def test_the_lock_is_exclusive_until_released(tmp_path):
    with acquire(str(tmp_path / "run")):
        with pytest.raises(RunDirectoryBusy, match=f"host {socket.gethostname()}, pid {os.getpid()}, job "):
            acquire(str(tmp_path / "run"))
    with acquire(str(tmp_path / "run")):
        pass


@pytest.mark.slow
def test_a_second_run_into_a_held_directory_stops_naming_the_holder_and_a_killed_holder_blocks_nothing(tmp_path):
    cfg = write_run(tmp_path)
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "SLURM_JOB_ID": "777"})
    try:
        assert holder.stdout.readline().strip() == "held"
        out = run_to_end(cfg, launcher="torchrun", expect=None)  # two ranks: rank 1 stops too
        assert f"is in use by another live run (host {socket.gethostname()}, pid {holder.pid}, job SLURM_JOB_ID=777" in out
        assert "M params" not in out and not (run / "metrics.jsonl").exists()  # stopped before any model loaded
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with acquire(str(run)):  # the kernel dropped the dead holder's lock; its file names the new holder
        assert f"pid {os.getpid()}," in (run / "run.lock").read_text()
