"""bench/variants.py's summary over seeds."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import variants  # noqa: E402


def test_the_summary_reads_the_final_replays_from_the_last_record_and_the_evals_from_every_one():
    """--also-eval adds its replayed taus to each run's last eval record only: the summary takes them at
    that step and every training eval at its own steps (it once stopped with a KeyError on the first
    record without them)."""
    def records(seed):
        return [{"step": 100, "tau_dflash": 1.1 + seed}, {"step": 200, "tau_dflash": 1.3 + seed, "code:tau_dflash": 1.5 + seed}]
    summary = variants.summarise({"default": {0: records(0), 1: records(1)}}, ["tau_dflash", "code:tau_dflash"])
    chat, code = summary["default"]["tau_dflash"], summary["default"]["code:tau_dflash"]
    assert chat["steps"] == [100, 200] and chat["mean"] == pytest.approx([1.6, 1.8])
    assert code["steps"] == [200] and code["mean"] == pytest.approx([2.0]) and code["last"] == [1.5, 2.5]
    assert code["se"] == pytest.approx([0.5])
