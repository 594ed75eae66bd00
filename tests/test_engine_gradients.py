"""FSDP2's gradients against DeepSpeed ZeRO-2's, parameter by parameter, on two CPU ranks over gloo: on
the first batch, after one optimizer step, and after both engines saved, were rebuilt and loaded (a
resume). Also: the FSDP2-wrapped drafter's output is no view (torch warns that a view's in-place use
would drop FSDP2's pre-backward hook), and DeepSpeed steps with torch's AdamW under zero2.json."""
import warnings
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import make_drafter
from drafter.config import Config
from drafter.infra.deepspeed_engine import DeepSpeedEngine, deepspeed_config
from drafter.infra.fsdp_engine import FSDPEngine
from drafter.models.blocks import DraftingSetup, FeatureBatch
from drafter.target_model.model import context_features, random_qwen3
from drafter.training.objective import training_step
from runs import REPO, gloo_ranks

pytestmark = pytest.mark.slow
GRAD_RTOL = 1e-5  # two fp32 ranks: the engines differ only in where they divide by the world size


def batch(rank: int, step: int):
    generator = torch.Generator().manual_seed(100 * step + rank)
    input_ids = torch.randint(0, 250, (1, 48), generator=generator)
    loss_mask = torch.zeros_like(input_ids)
    loss_mask[:, 8:] = 1
    return input_ids, loss_mask


def backward(engine, target, cfg, rank: int, step: int) -> None:
    input_ids, loss_mask = batch(rank, step)
    features = context_features(target, input_ids, engine.module.target_layer_ids)
    loss, _ = training_step(DraftingSetup(engine.module, target, "dense"),
                            FeatureBatch(input_ids, loss_mask, features), cfg.objective,
                            torch.Generator().manual_seed(step))
    engine.backward(loss)


def full_grads(engine) -> dict[str, torch.Tensor]:
    if isinstance(engine, FSDPEngine):
        return {name: p.grad.full_tensor().clone() for name, p in engine.module.named_parameters()}
    from deepspeed.utils import safe_get_full_grad
    return {name: safe_get_full_grad(p).clone() for name, p in engine.module.named_parameters()}


def build(kind: str, target, cfg, ds: dict):
    drafter = make_drafter(target, num_layers=2, block_size=8).train()
    if kind == "fsdp":
        return FSDPEngine(drafter, cfg, torch.device("cpu"), bf16=False)
    return DeepSpeedEngine(drafter, ds, cfg.optim, torch.device("cpu"))


def rank_main(rank: int, tmp: Path) -> dict:
    cfg = OmegaConf.structured(Config)
    cfg.optim.lr, cfg.objective.num_anchors = 3e-2, 6
    ds = deepspeed_config(str(REPO / "ds_configs" / "zero2.json"), cfg, 2, False, 64, on_cpu=True)
    target = random_qwen3(vocab_size=256, num_hidden_layers=4)
    engines = {kind: build(kind, target, cfg, ds) for kind in ("fsdp", "deepspeed")}
    report = {"descriptions": {k: e.description for k, e in engines.items()}, "errors": [], "warnings": []}

    def compare(when: str, step: int):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for engine in engines.values():
                backward(engine, target, cfg, rank, step)
        report["warnings"] += [str(w.message) for w in caught if "FSDP2" in str(w.message)]
        grads = {kind: full_grads(engine) for kind, engine in engines.items()}
        for name, fsdp in grads["fsdp"].items():
            theirs = grads["deepspeed"][name]
            report["errors"].append([when, name, float((fsdp - theirs).norm() / theirs.norm().clamp_min(1e-30))])

    compare("first batch", 0)
    for engine in engines.values():
        engine.step(cfg.optim.lr)
    compare("after a step", 1)
    for kind, engine in engines.items():
        engine.step(cfg.optim.lr)
        engine.save(tmp / kind)
    engines = {kind: build(kind, target, cfg, ds) for kind in engines}
    for kind, engine in engines.items():
        engine.load(tmp / kind)
    compare("after a resume", 2)
    return report


def test_fsdp2_gradients_equal_deepspeed_s_parameter_by_parameter_before_and_after_a_resume(tmp_path):
    for report in gloo_ranks(rank_main, tmp_path):
        assert report["descriptions"]["deepspeed"].startswith("deepspeed ZeRO-2, torch AdamW"), report["descriptions"]
        assert report["warnings"] == []  # no view-tensor warning from the FSDP2 root
        whens = {when for when, _, _ in report["errors"]}
        assert whens == {"first batch", "after a step", "after a resume"}
        names = {name for _, name, _ in report["errors"]}
        assert len(names) >= 10 and any("layers.1" in n for n in names)
        worst = max(report["errors"], key=lambda e: e[2])
        assert worst[2] <= GRAD_RTOL, worst
