"""bench/gpu_check.py --tiny in CI, so that the GPU check cannot rot between GPU sessions."""
import json
import time
from pathlib import Path

import pytest

from bench import gpu_check, preflight_runs
from drafter.models import blocks

TINY = ["--tiny", "--warmup", "1", "--steps", "2"]


def last_json_line(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.slow  # compiles flex_attention with inductor on the CPU, once per test process
def test_tiny_run_passes_and_reports_every_figure(capsys):
    assert gpu_check.main(TINY) == 0
    report = last_json_line(capsys)
    assert report["checks"] == {
        "flex_vs_dense": "pass", "compile_bound": "pass", "train_step": "pass", "train_step_syncs": "pass",
        "ddtree_step_syncs": "pass", "lossless": "pass", "ds_engines": "pass", "launches": "pass",
        "flex_vs_dense_gradients": "skipped (no CUDA)", "cuda_sync_debug_mode": "skipped (no CUDA)"}
    assert report["flex_vs_dense"]["logits_rel_error"] <= 1e-5
    assert len(report["compile_bound"]["batches"]) == 10 and report["compile_bound"]["graphs"] <= 2
    step = report["train_step"]
    assert step["tokens_per_s"] > 0 and 0 < step["mfu"] < 1 and step["peak_memory_gib"] > 0
    assert set(step["tflop_per_step"]) == {"target_forward", "drafter_linear", "drafter_attention", "lm_head"}
    assert report["train_step_syncs"]["training_step"] == 1 and report["train_step_syncs"]["target_forward"] == 0
    assert len(report["ddtree_step_syncs"]["committed_per_step"]) == 2
    assert report["lossless"]["near_tie_share"] <= 0.5
    for method in ("ddtree", "dflash"):
        assert report["lossless"][method]["verdict"] in ("yes", "ties-only")
        assert len(report["lossless"][method]["divergences"]) == 8 and report["lossless"][method]["tau"] > 1
    engines = report["ds_engines"]
    assert set(engines) == {"zero2.json", "zero3.json", "zero2_offload.json"}
    assert engines["zero2.json"]["description"] == "deepspeed ZeRO-2, torch AdamW" and engines["zero2.json"]["applied"]
    assert engines["zero3.json"]["description"] == "deepspeed ZeRO-3, torch AdamW" and engines["zero3.json"]["applied"]
    assert engines["zero2_offload.json"]["engine"].startswith("not built on the CPU")
    launches = report["launches"]
    assert all(launches[name]["rc"] == 0 for name in ("deepspeed", "torchrun", "kill_resume", "eval"))
    assert launches["deepspeed"]["last_step"] == launches["torchrun"]["last_step"] == 6
    assert launches["kill_resume"]["killed_rc"] == -9 and launches["kill_resume"]["last_step"] == 6
    assert launches["eval"]["public_check"]["verdict"] == "yes"


@pytest.mark.slow
def test_a_failed_check_makes_the_script_exit_nonzero(monkeypatch, capsys):
    dense_block_mask = blocks.dense_block_mask
    # the reference the compiled path is held to hides one context position too many
    monkeypatch.setattr(blocks, "dense_block_mask",
                        lambda anchors, *shape: dense_block_mask(anchors - 1, *shape))
    assert gpu_check.main(TINY + ["--checks", "flex_vs_dense,compile_bound"]) == 1
    report = last_json_line(capsys)
    assert report["checks"]["flex_vs_dense"].startswith("FAIL: logits_rel_error")
    assert report["checks"]["compile_bound"] == "pass"  # the other checks still ran


def test_a_check_past_its_budget_is_a_timeout_and_the_next_check_still_runs(capsys):
    def hangs():
        time.sleep(30)

    report = {"checks": {}}
    t0 = time.perf_counter()
    gpu_check.run_checks([("hangs", hangs), ("after", lambda: {"ran": True})], {"hangs": 1, "after": 5}, report)
    assert time.perf_counter() - t0 < 10
    assert report["checks"] == {"hangs": "FAIL: timeout after 1 s (hang?)", "after": "pass"}
    assert report["after"] == {"ran": True}


def test_a_sub_run_past_its_budget_is_killed_with_its_children(tmp_path):
    """The whole process tree goes, not only the launcher: its child (here `sleep`) too."""
    t0 = time.perf_counter()
    figures = preflight_runs.sub_run("sleeper", ["bash", "-c", "sleep 60 & echo $!; wait"], tmp_path / "s.log", 2)
    assert time.perf_counter() - t0 < 15
    assert figures["rc"] is None and figures["failure"] == "sleeper: timeout after 2 s (hang?)"
    child = int(figures["last_lines"][-1])
    time.sleep(0.5)  # reaped by init once its parent is gone
    assert not Path(f"/proc/{child}").exists() or "State:\tZ" in Path(f"/proc/{child}/status").read_text()
