"""bench/gpu_check.py --tiny in CI, so that the GPU check cannot rot between GPU sessions."""
import json

import pytest

from bench import gpu_check
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
        "ddtree_step_syncs": "pass", "lossless": "pass", "flex_vs_dense_gradients": "skipped (no CUDA)",
        "cuda_sync_debug_mode": "skipped (no CUDA)"}
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


@pytest.mark.slow
def test_a_failed_check_makes_the_script_exit_nonzero(monkeypatch, capsys):
    dense_block_mask = blocks.dense_block_mask
    # the reference the compiled path is held to hides one context position too many
    monkeypatch.setattr(blocks, "dense_block_mask",
                        lambda anchors, *shape: dense_block_mask(anchors - 1, *shape))
    assert gpu_check.main(TINY) == 1
    report = last_json_line(capsys)
    assert report["checks"]["flex_vs_dense"].startswith("FAIL: logits_rel_error")
    assert report["checks"]["compile_bound"] == "pass"  # the other checks still ran
