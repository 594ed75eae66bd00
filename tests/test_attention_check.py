"""The first-step attention check (drafter/training/attention_check.py), driven on the CPU by a stand-in
for flex_attention: SDPA under the block mask's own mask_mod, scaled by a factor that is 1 (a kernel that
agrees with dense) or not (one that differs on purpose). The real flex backward runs only on CUDA."""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask

from conftest import make_drafter
from drafter.config import ObjectiveConfig
from drafter.models import layers
from drafter.models.blocks import DraftingSetup, FeatureBatch
from drafter.target_model.model import context_features
from drafter.training.attention_check import (ATTENTION_TOLERANCE, AttentionMismatch, attention_verdict,
                                              compare_with_dense)


def stand_in_flex(scale: float, backward_only: bool):
    """SDPA under the block mask; its output (or only its gradient) scaled by `scale`."""
    def attention(q, k, v, block_mask, enable_gqa):
        mask = create_mask(block_mask.mask_mod, q.shape[0], None, q.shape[2], k.shape[2], device=q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)
        return out + (scale - 1) * (out - out.detach()) if backward_only else out * scale
    return attention


def comparison(target, monkeypatch, scale: float, backward_only: bool = False):
    monkeypatch.setattr(layers, "flex_attention", stand_in_flex(scale, backward_only))
    drafter = make_drafter(target, block_size=8).train()
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 250, (1, 64), generator=generator)
    loss_mask = torch.zeros_like(input_ids)
    loss_mask[:, 16:] = 1
    features = context_features(target, input_ids, drafter.target_layer_ids)
    return compare_with_dense(DraftingSetup(drafter, target, "flex"), FeatureBatch(input_ids, loss_mask, features),
                              ObjectiveConfig(num_anchors=6), ATTENTION_TOLERANCE[torch.float32])


def test_a_kernel_that_agrees_with_dense_is_kept(target, monkeypatch):
    result = comparison(target, monkeypatch, scale=1.0)
    assert result.passed and result.loss_rel_error < 1e-6 and result.grads_rel_error < 1e-5
    for setting in ("auto", "flex"):
        kernel, line = attention_verdict(setting, result)
        assert kernel == "flex" and line.startswith("attention check: flex against dense") and line.endswith("ok")


@pytest.mark.parametrize("backward_only", [False, True])
def test_a_kernel_that_differs_stops_the_run_or_falls_back_to_dense_under_auto(target, monkeypatch, backward_only):
    """Also a kernel whose forward is exact and whose backward is not: the gradients are compared too."""
    result = comparison(target, monkeypatch, scale=1.01, backward_only=backward_only)
    assert not result.passed and result.grads_rel_error > ATTENTION_TOLERANCE[torch.float32]
    assert (result.loss_rel_error == 0) == backward_only
    assert result.worst_parameter.startswith("layers.")  # the attention's own weights see it first
    with pytest.raises(AttentionMismatch, match=r"^objective.attention=flex_compiled: flex against dense on the "
                                                r"first batch: .*largest layers\.\S+ rel .*set objective.attention=dense"):
        attention_verdict("flex_compiled", result)
    kernel, line = attention_verdict("auto", result)
    assert kernel == "dense" and line.startswith("warning: attention check failed") and "trains on dense" in line


def test_a_kernel_that_raises_or_gives_nan_gradients_fails_the_check(target, monkeypatch):
    """The first flex backward on a GPU is as likely to raise (a compile error, too little shared memory)
    as to differ; and a NaN gradient must not pass because max() skips NaN."""
    def broken(q, k, v, block_mask, enable_gqa):
        raise RuntimeError("No valid triton configs\nmore detail")
    monkeypatch.setattr(layers, "flex_attention", broken)
    drafter = make_drafter(target, block_size=8).train()
    input_ids = torch.randint(0, 250, (1, 64), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.ones_like(input_ids)
    features = context_features(target, input_ids, drafter.target_layer_ids)
    result = compare_with_dense(DraftingSetup(drafter, target, "flex"), FeatureBatch(input_ids, loss_mask, features),
                                ObjectiveConfig(num_anchors=6), ATTENTION_TOLERANCE[torch.float32])
    assert not result.passed and result.error == "RuntimeError: No valid triton configs"
    assert attention_verdict("auto", result)[0] == "dense"
    with pytest.raises(AttentionMismatch, match="flex failed on the first batch: RuntimeError: No valid triton"):
        attention_verdict("flex_compiled", result)

    def nan_backward(q, k, v, block_mask, enable_gqa):
        out = stand_in_flex(1.0, backward_only=False)(q, k, v, block_mask, enable_gqa)
        out.register_hook(lambda grad: grad * float("nan"))  # the forward exact, its gradient NaN
        return out
    monkeypatch.setattr(layers, "flex_attention", nan_backward)
    result = compare_with_dense(DraftingSetup(drafter, target, "flex"), FeatureBatch(input_ids, loss_mask, features),
                                ObjectiveConfig(num_anchors=6), ATTENTION_TOLERANCE[torch.float32])
    assert result.loss_rel_error < 1e-6 and not result.passed and result.badness == float("inf")


def check_in_a_run(rank: int, cfg_path: str, out: str, scale: float, setting: str):
    """One process, as train.py sets a run up: train.checked_attention on the run's first batch with
    the stand-in as its kernel; what it returned (or raised) and logged goes to `out`."""
    import json
    from dataclasses import replace

    import torch.distributed as dist

    import train
    from drafter.errors import UserError
    from drafter.training.checkpoint import TrainerState
    from drafter.training.run_config import config_and_world
    from drafter.training.run_setup import build_run, load_run_data
    from drafter.training.tracking import RunLogger

    torch.set_num_threads(1)
    layers.flex_attention = stand_in_flex(scale, backward_only=False)
    train.CHECK_TOKENS = 40  # the rows are 24-99 tokens: most are cut to their last 40
    launch = config_and_world(cfg_path, ["train.engine=fsdp"])
    data, model_config, ds_config = load_run_data(launch)
    run = replace(build_run(launch, data, model_config, ds_config), attention="flex")
    cfg = launch.cfg
    cfg.objective.attention = setting  # the CPU refuses flex at load_run_data; the verdict reads the setting
    log = RunLogger(cfg, is_main=True)
    try:
        result = {"kernel": train.checked_attention(run, TrainerState(), log)}
    except UserError as error:
        result = {"error": str(error)}
    log.close()
    dist.destroy_process_group()
    Path(out).write_text(json.dumps(result))


@pytest.mark.parametrize("scale, setting, expected", [
    (1.0, "flex_compiled", {"kernel": "flex"}),
    (1.01, "auto", {"kernel": "dense"}),
    (1.01, "flex_compiled", {"error": "objective.attention=flex_compiled: flex against dense on the first batch"}),
])
def test_train_py_checks_its_kernel_on_its_first_batch(tmp_path, scale, setting, expected):
    """train.py's own glue (`checked_attention`): its first batch, features and drafter copy reach the
    comparison, and its verdict is logged to metrics.jsonl as an attention_check record."""
    import json

    import torch.multiprocessing as mp

    from runs import records, write_run
    cfg = write_run(tmp_path)
    mp.spawn(check_in_a_run, args=(str(cfg), str(tmp_path / "out.json"), scale, setting), nprocs=1, join=True)
    result = json.loads((tmp_path / "out.json").read_text())
    if "error" in expected:
        assert result["error"].startswith(expected["error"]), result
        return
    assert result == expected
    (logged,) = records(tmp_path / "run", kind="attention_check")
    assert logged["kernel"] == "flex" and logged["trains_with"] == expected["kernel"] and logged["worst_parameter"]
    assert (logged["loss_rel_error"] <= logged["tolerance"]) == (scale == 1.0)
