"""The memory plan (drafter/memory_plan.py) against independent counts: the target's bytes from a model
actually built, divided by the tp size; the drafter's state from an actually built drafter, sharded
as each engine and ZeRO stage shards it; the fit check names the changes that would fit."""
import pytest

from drafter.config import load_config
from drafter.memory_plan import (GiB, MemoryPlanError, check_fits, plan_inputs, plan_memory, size_text,
                                 target_model_config)
from drafter.draft_config import drafter_config
from drafter.model import DFlashDraftModel
from drafter.target import random_qwen3
from runs import REPO

RANDOM = {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128}


def config(*overrides):
    shape = [f"target.random.{key}={value}" for key, value in RANDOM.items()]
    return load_config(str(REPO / "configs" / "v3.yaml"),
                       ["data.path=/x", "target.path=null", *shape, "drafter.num_layers=2", "train.generate_every=0",
                        "drafter.target_layer_ids=[1,3]", *overrides])


def zero(stage, **offload):
    return {"zero_optimization": {"stage": stage, **{k: {"device": v} for k, v in offload.items()}}}


def plan(cfg, world_size, ds, dtype_bytes=2):
    return plan_memory(plan_inputs(cfg, target_model_config(None, cfg.target.random), world_size, ds, dtype_bytes))


def built_bytes(module, dtype_bytes):
    return sum(p.numel() for p in module.parameters()) * dtype_bytes


def test_target_bytes_are_the_built_models_with_its_projections_divided_by_the_tp_size():
    """Qwen3's plan splits the attention and MLP projections; the embedding, LM head and norms stay
    whole on every rank (the drafter reads them)."""
    target = random_qwen3(**RANDOM)
    split = sum(p.numel() * 4 for name, p in target.named_parameters() if name.endswith("proj.weight"))
    whole = sum(p.numel() * 4 for name, p in target.named_parameters()) - split
    assert split > whole > 0
    for tp in (1, 2, 4):
        planned = plan(config(f"target.tp_size={tp}"), 8, zero(2), dtype_bytes=4).gpu["target weights"]
        assert planned == whole + split / tp
    assert plan(config(), 8, zero(2), dtype_bytes=2).gpu["target weights"] == (whole + split) / 2  # bf16


def test_drafter_state_is_sharded_as_each_engine_and_stage_shards_it():
    cfg = config()
    drafter = DFlashDraftModel(drafter_config(random_qwen3(**RANDOM).config, num_layers=2, block_size=16,
                                              mask_token_id=0, target_layer_ids=[1, 3]))
    bf16, fp32 = built_bytes(drafter, 2), built_bytes(drafter, 4)
    state = lambda p: (p.gpu.get("drafter weights"), p.gpu.get("drafter gradients"), p.gpu.get("optimizer state"))  # noqa: E731
    # DeepSpeed: bf16 weights and gradients; fp32 master + Adam m, v (12 bytes) sharded at every stage
    assert state(plan(cfg, 4, zero(1))) == (bf16, bf16, 3 * fp32 / 4)
    assert state(plan(cfg, 4, zero(2))) == (bf16, bf16 / 4, 3 * fp32 / 4)
    assert state(plan(cfg, 4, zero(3))) == (bf16 / 4, bf16 / 4, 3 * fp32 / 4)
    assert state(plan(cfg, 1, zero(2))) == (bf16, bf16, 3 * fp32)
    offloaded = plan(cfg, 4, zero(2, offload_optimizer="cpu"))
    assert state(offloaded) == (bf16, bf16 / 4, None) and offloaded.host == {"optimizer state": 3 * fp32 / 4}
    # FSDP2: fp32 shards of weights and gradients, Adam m, v of the shard
    fsdp = config("train.engine=fsdp")
    assert state(plan(fsdp, 4, None)) == (fp32 / 4, fp32 / 4, 2 * fp32 / 4)
    assert plan(config("train.engine=fsdp", "fsdp.cpu_offload=true"), 4, None).host == {
        "drafter weights": fp32 / 4, "drafter gradients": fp32 / 4, "optimizer state": 2 * fp32 / 4}


def test_activations_grow_with_the_batch_and_the_anchors():
    base = plan(config(), 8, zero(2)).gpu["activations (est.)"]
    assert plan(config("data.tokens_per_batch=32768"), 8, zero(2)).gpu["activations (est.)"] > base
    assert plan(config("objective.anchors_per_batch=4096"), 8, zero(2)).gpu["activations (est.)"] > base
    assert plan(config("objective.anchors_per_batch=1024"), 8, zero(2)).gpu["activations (est.)"] < base


def test_a_plan_that_cannot_fit_stops_with_its_numbers_and_the_changes_that_fit():
    big = plan(config(), 8, zero(2))
    # a GPU that the target at tp 1 overflows by less than half of its weights: tp 2 fits
    gpu = big.total - big.gpu["target weights"] // 4
    with pytest.raises(MemoryPlanError) as stopped:
        check_fits(big, gpu, node_ranks=8)
    message = " ".join(str(stopped.value).split())
    assert f"target weights {size_text(big.gpu['target weights'])}" in message
    assert f"total {size_text(big.total)} of {size_text(gpu)}" in message
    assert "target.tp_size=2" in message and "target.tp_size=4" in message
    assert "target.tp_size=16" not in message  # not beyond the node
    check_fits(big, big.total, node_ranks=8)  # fits exactly: no error


def test_data_plan_prints_the_start_up_plan_for_a_given_gpu(capsys):
    from data.plan import main
    overrides = ["target.path=null", "target.tp_size=2", *[f"target.random.{k}={v}" for k, v in RANDOM.items()],
                 "drafter.num_layers=2", "drafter.target_layer_ids=[1,3]"]
    result = main(["--cfg", str(REPO / "configs" / "v3.yaml"), "--world-size", "8", "--gpu-memory", "80GB",
                   "--memory-only", *overrides])
    expected = plan(config("target.tp_size=2"), 8, zero(2))
    assert result["memory"]["gpu"] == expected.gpu and result["memory"]["gpu_memory"] == 80 * GiB
    printed = capsys.readouterr().out
    assert "\n".join(expected.lines(80 * GiB)) in printed and "does not fit" not in printed
