"""The memory plan (drafter/training/memory_plan.py) against independent counts: the target's bytes from a model
actually built, divided by the tp size; the drafter's state from an actually built drafter, sharded
as each engine and ZeRO stage shards it; the optimizer state that torch's AdamW and Muon actually hold;
distillation's tensors by hand from their shapes; the loss chunk's logits against the peak resident
memory of the loss actually run; the fit check names the changes that would fit."""
import ctypes
import math
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from drafter.models import DFlashDraftModel, drafter_class
from drafter.models.configure import drafter_config
from drafter.target_model.model import random_qwen3
from drafter.infra.memory import GiB, MemoryPlanError, size_text
from drafter.training.memory_plan import check_fits, check_host_fits, plan_inputs, plan_memory, target_model_config
from drafter.training.run_config import load_config
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


DFLASH2 = ["drafter.arch=dflash2", "drafter.selector_rank=8", "drafter.selector_top_k=4"]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_optimizer_state_is_what_torch_optimizers_hold_after_a_step(optimizer):
    """A DFlash2 drafter (3-D convolution kernels, which Muon leaves to AdamW, and 2-D selector
    codebooks) under FSDP2 on 4 ranks: the plan's optimizer state is a quarter of the bytes the
    optimizers of `build_optimizers` hold after one step (Muon: one momentum buffer per matrix)."""
    from drafter.infra.engine import build_optimizers
    cfg = config("train.engine=fsdp", f"optim.name={optimizer}", *DFLASH2)
    draft = drafter_config(random_qwen3(**RANDOM).config, num_layers=2, block_size=16, mask_token_id=0,
                           target_layer_ids=[1, 3], variant=OmegaConf.to_object(cfg.drafter))
    drafter = drafter_class(draft)(draft)
    gen = torch.Generator().manual_seed(0)
    for param in drafter.parameters():
        param.grad = torch.randn(param.shape, generator=gen)
    optimizers = build_optimizers(list(drafter.parameters()), cfg.optim)
    for step in optimizers:
        step.step()
    held = sum(value.numel() * value.element_size() for step in optimizers for state in step.state.values()
               for value in state.values() if value.dim() > 0)  # not the 0-d step counters
    assert plan(cfg, 4, None).gpu["optimizer state"] == math.ceil(held / 4)
    matrices = sum(p.numel() for p in drafter.parameters() if p.dim() == 2)
    assert 0 < matrices < built_bytes(drafter, 1)
    assert plan(cfg, 4, None).inputs.muon_params == (matrices if optimizer == "muon" else 0)


def test_distillation_adds_the_final_hidden_states_and_their_block_rows():
    """objective.labels=target keeps the target's final hidden states [tokens, H] and gathers them for
    every block slot [anchors x block, H] (bf16 here); its logit chunks are another figure (below)."""
    data = plan(config(), 8, zero(2))
    distilled = plan(config("objective.labels=target", "objective.loss=kl"), 8, zero(2))
    cfg = config()
    tokens, rows, width = cfg.data.tokens_per_batch, cfg.objective.anchors_per_batch * 16, RANDOM["hidden_size"] * 2
    chunks = distilled.inputs.loss_chunk_peak - data.inputs.loss_chunk_peak
    assert (distilled.gpu["activations (est.)"] - data.gpu["activations (est.)"]
            == tokens * width + rows * width + chunks)
    assert {k: v for k, v in distilled.gpu.items() if k != "activations (est.)"} == {
        k: v for k, v in data.gpu.items() if k != "activations (est.)"}


def resident_bytes(field: str) -> int:
    """VmRSS or VmHWM (the peak since the last reset) of this process."""
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith(field + ":")).split()[1]) * 1024


@pytest.mark.parametrize("objective", [{}, {"position_weights": "dpace"}, {"labels": "target"},
                                       {"labels": "target", "loss": "kl"}, {"labels": "target", "loss": "tv"}])
def test_the_loss_chunk_figure_is_the_peak_memory_of_the_loss(objective):
    """The loss over two chunks' rows at a vocabulary of 32k, measured as the rise of the process's
    peak resident memory (VmHWM, reset through /proc/self/clear_refs): its logit buffers are 64 MiB or
    more, which malloc maps and unmaps whole, so the resident peak is what the tensors hold. Measured
    here 1.0-1.35 times the plan's figure (what the count misses, up to about one buffer, was not traced),
    so it must lie in 0.9-1.5."""
    from drafter.config import ObjectiveConfig
    from drafter.losses import loss_chunk_peak_bytes, one_pass_loss, row_loss_spec
    from drafter.losses.lm_head import ChunkedLMHeadLoss, chunk_rows_for, weighted_data_ce
    cfg = ObjectiveConfig(chunk_bytes=128 * 2**20, **objective)
    vocab, width = 32768, 32
    rows = 2 * chunk_rows_for(vocab, cfg.chunk_bytes)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, width, generator=gen).requires_grad_(True)
    head, teacher = torch.randn(vocab, width, generator=gen), torch.randn(rows, width, generator=gen)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    ctypes.CDLL(None).malloc_trim(0)  # what earlier tests freed goes back: it would hide part of the rise
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
    except OSError:
        pytest.skip("this kernel does not let a process reset its peak resident size")
    before = resident_bytes("VmRSS")
    if one_pass_loss(cfg):
        weighted_data_ce(hidden, head, labels, torch.ones(rows), chunk_rows_for(vocab, cfg.chunk_bytes))
    else:
        spec = row_loss_spec(cfg, chunk_rows_for(vocab, cfg.chunk_bytes))
        ChunkedLMHeadLoss.apply(hidden, head, labels, teacher if cfg.labels == "target" else None, spec)
    measured = resident_bytes("VmHWM") - before
    planned = loss_chunk_peak_bytes(cfg, vocab, rows)
    assert 0.9 * planned <= measured <= 1.5 * planned, (measured, planned)


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



def test_host_memory_per_node_while_the_target_loads(monkeypatch):
    """None where each rank reads the target straight onto its GPU; the node's ranks x the whole target
    where each loads it on the host: on the CPU, under tensor parallelism (sharded there), and a
    random target (built in fp32)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # 8 ranks on two nodes
    target_bytes = built_bytes(random_qwen3(**RANDOM), 2)

    def host(*overrides, device="cuda"):
        cfg = config(*overrides)
        return plan_memory(plan_inputs(cfg, target_model_config(None, cfg.target.random), 8, zero(2), 2, device))
    hub = "target.path=someone/model"
    assert host(hub).target_load_host == 0
    assert "  host memory per node loading the target: none (each rank reads it straight onto its GPU)" \
        in host(hub).lines()
    assert host(hub, device="cpu").target_load_host == 4 * target_bytes
    assert host(hub, "target.tp_size=2").target_load_host == 4 * target_bytes
    assert f"  host memory per node loading the target: 4 ranks x {size_text(target_bytes)} = " \
           f"{size_text(4 * target_bytes)}" in host(hub, device="cpu").lines()
    assert host().target_load_host == 4 * 2 * target_bytes  # a random target: fp32
    loading = host(hub, device="cpu")
    check_host_fits(loading, loading.target_load_host)  # fits exactly: no error
    with pytest.raises(MemoryPlanError, match=rf"4 ranks x {re.escape(size_text(target_bytes))} = .* > this node's"):
        check_host_fits(loading, loading.target_load_host - 1)


@pytest.mark.parametrize("run", [["target.tp_size=2"],
                                 ["objective.labels=target", "optim.name=muon", "train.engine=fsdp"]])
def test_data_plan_prints_the_start_up_plan_for_a_given_gpu(capsys, run):
    """The start-up plan, with the lines that name distillation's tensors and Muon's share."""
    from data.plan import main
    overrides = ["target.path=null", *[f"target.random.{k}={v}" for k, v in RANDOM.items()],
                 "drafter.num_layers=2", "drafter.target_layer_ids=[1,3]", *run]
    result = main(["--cfg", str(REPO / "configs" / "v3.yaml"), "--world-size", "8", "--gpu-memory", "80GB",
                   "--memory-only", *overrides])
    deepspeed = "train.engine=fsdp" not in run
    expected = plan(config(*run), 8, zero(2) if deepspeed else None)
    assert result["memory"]["gpu"] == expected.gpu and result["memory"]["gpu_memory"] == 80 * GiB
    printed = capsys.readouterr().out
    assert "\n".join(expected.lines(80 * GiB)) in printed and "does not fit" not in printed
    assert ("target final hidden states" in printed) == ("Muon momentum on" in printed) == (not deepspeed)


def test_data_plan_refuses_what_train_py_refuses_by_name(capsys):
    from data.plan import main
    with pytest.raises(SystemExit):
        main(["--cfg", str(REPO / "configs" / "v3.yaml"), "--gpu-memory", "80GB", "--memory-only", "target.path=null",
              "optim.name=muon", "train.ds_config=ds_configs/zero2_offload.json"])
    assert "optimizer.type='AdamW' in the JSON contradicts optim.name = 'muon'" in capsys.readouterr().err


def test_a_missing_local_target_directory_is_named_as_one_not_as_a_malformed_hub_id(tmp_path):
    from drafter.errors import ConfigError
    for path in [str(tmp_path / "world" / "target"), "artifacts/no_world/target", "./target"]:
        with pytest.raises(ConfigError, match=rf"target.path={re.escape(path)}: no such directory$"):
            target_model_config(path, None)


def test_data_plan_names_a_config_or_dataset_it_cannot_read_in_one_line(capsys, tmp_path):
    from data.plan import main
    (tmp_path / "lengths.txt").write_text("12\nabc\n")
    (tmp_path / "broken.yaml").write_text("data: [1\n")
    cfg = str(REPO / "configs" / "smollm2.yaml")
    for argv, message in [(["--cfg", str(tmp_path / "none.yaml")], f"none.yaml: not found; tried {tmp_path}/none.yaml"),
                          (["--cfg", "none.yaml"], f"tried {Path.cwd()}/none.yaml, {REPO}/configs/none.yaml"),
                          (["--cfg", str(tmp_path / "broken.yaml")], "broken.yaml: not valid YAML: while parsing"),
                          (["--cfg", cfg, f"data.path={tmp_path}/none"], f"Directory {tmp_path}/none not found"),
                          (["--cfg", cfg, "--dataset", str(tmp_path)], "neither a `Dataset` directory"),
                          (["--cfg", cfg, "--lengths", str(tmp_path / "lengths.txt")], "line 2: 'abc' is not")]:
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err, argv
