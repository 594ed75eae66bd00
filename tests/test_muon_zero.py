"""optim.name=muon under train.engine=deepspeed (DeepSpeed's ZeRO Muon, `deepspeed_muon`) on two CPU ranks
over gloo, two micro batches per step (one under ZeRO-3 with offload), weight decay on, the lr changing
every step:

- one step's update, under ZeRO-1, 2 and 3, without and (2, 3) with optimizer offload, equals a single-process
  reference on the full weights, parameter by parameter: DeepSpeed's own `muon_update` on each matrix's
  gradient averaged over both ranks' micro batches, at optim.muon_lr; torch's AdamW on the rest at
  optim.lr; unclipped (optim.grad_clip > 0 is refused with Muon under DeepSpeed: docs/training.md). The gradient each matrix's `muon_update` received in the ranks is checked against
  the reference's own to rel 1e-6 and then used as the reference's input: summed in another order (ZeRO-2
  averages the ranks per micro batch, ZeRO-1 after them) or through ZeRO-3's linear it differs in the last
  fp32 bits, which fp16 Newton-Schulz turns into up to 0.2% of a matrix's update;
- 4 steps straight log the same losses, bit for bit, as 2 steps, a save, a rebuilt engine, a load and 2
  more steps, under the same five settings, and end on the same weights.

torch.compile is off in the ranks: DeepSpeed compiles `muon_update`, which costs 10-30 s on the CPU, and
the kernel it picks for a shape depends on which shapes it saw first, so that the compiled reference
could round differently from the compiled step; eager, the reference runs DeepSpeed's very function.
"""
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from conftest import make_drafter
from drafter.config import Config
from drafter.infra.deepspeed_engine import MUON_NS_METHOD, DeepSpeedEngine, deepspeed_config
from drafter.infra.engine import uses_muon
from drafter.models.blocks import DraftingSetup, FeatureBatch
from drafter.target_model.model import context_features, random_qwen3
from drafter.training.objective import training_step
from runs import REPO, gloo_ranks

pytestmark = pytest.mark.slow
UPDATE_RTOL = 1e-5  # fp32, the same Muon input: only AdamW's, the clip's and ZeRO's rounding
GRAD_RTOL = 1e-6   # the gradient Muon saw against the reference's: summed in another order
SETTINGS = {  # name -> (JSON, stage, offload, micro batches per step)
    "zero1": ("zero2.json", 1, False, 2), "zero2": ("zero2.json", 2, False, 2), "zero3": ("zero3.json", 3, False, 2),
    "zero2-offload": ("zero2.json", 2, True, 2),
    "zero3-offload": ("zero3.json", 3, True, 1)}  # with 2, deepspeed_config refuses it (see there)
LR_FACTORS = (1.0, 0.5, 0.75, 0.25)  # the caller's schedule, one factor a step


def config(name: str):
    cfg = OmegaConf.structured(Config)
    cfg.optim.name, cfg.optim.lr, cfg.optim.muon_lr, cfg.optim.grad_accum = "muon", 3e-2, 0.02, SETTINGS[name][3]
    cfg.optim.weight_decay, cfg.optim.grad_clip, cfg.objective.num_anchors = 0.1, 0.0, 6  # clipping is refused
    return cfg


def ds_settings(cfg, name: str, tmp: Path) -> dict:
    """The JSON of `name` as deepspeed_config checks and fills it (with Muon: offload without an
    `optimizer` block)."""
    json_name, stage, offload, _ = SETTINGS[name]
    ds = json.loads((REPO / "ds_configs" / json_name).read_text())
    ds["zero_optimization"]["stage"] = stage
    if offload:
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    path = tmp / f"{name}-rank{dist.get_rank()}.json"
    path.write_text(json.dumps(ds))
    return deepspeed_config(str(path), cfg, 2, False, 64, on_cpu=True)


def micro_loss(module, target, cfg, rank: int, step: int, micro: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    input_ids = torch.randint(0, 250, (1, 48), generator=generator)
    loss_mask = torch.zeros_like(input_ids)
    loss_mask[:, 8:] = 1
    batch = FeatureBatch(input_ids, loss_mask, context_features(target, input_ids, module.target_layer_ids))
    loss, _ = training_step(DraftingSetup(module, target), batch, cfg.objective, torch.Generator().manual_seed(step))
    return loss


def train_step(engine, target, cfg, rank: int, step: int) -> tuple[list[float], object]:
    losses = []
    for micro in range(cfg.optim.grad_accum):
        loss = micro_loss(engine.module, target, cfg, rank, step, micro)
        engine.backward(loss)
        losses.append(loss.item())
    return losses, engine.step(cfg.optim.lr * LR_FACTORS[step])


def record_muon_inputs() -> list:
    """From now on, every gradient (a full matrix) that DeepSpeed's ZeRO hands `muon_update` in this
    process is appended to the list returned (ZeRO imports the function at each call: it gets this one)."""
    import deepspeed.runtime.zero.muon.original_muon as original

    recorded, muon_update = [], original.muon_update

    def recording(grad, *args, **kwargs):
        recorded.append(grad.detach().clone())
        return muon_update(grad, *args, **kwargs)

    original.muon_update = recording
    return recorded


def reference_step(target, cfg, muon_inputs: list[torch.Tensor]) -> tuple[dict, float, dict[str, float]]:
    """One step on one process, from the drafter every engine starts from: the full weights after it,
    the global norm that clipped it, and per matrix how far the gradient that the ranks' `muon_update`
    received (of `muon_inputs`, the closest of its shape, which then stands in for it) is from this one."""
    from deepspeed.runtime.zero.muon.original_muon import muon_update

    drafter = make_drafter(target, num_layers=1).train()
    params = dict(drafter.named_parameters())
    grads = {name: torch.zeros_like(p) for name, p in params.items()}
    for rank in range(2):  # each rank's micro batches accumulate, then the ranks average
        drafter.zero_grad()
        for micro in range(cfg.optim.grad_accum):
            (micro_loss(drafter, target, cfg, rank, 0, micro) / cfg.optim.grad_accum).backward()
        for name, p in params.items():
            grads[name] += p.grad
    grads = {name: grad / 2 for name, grad in grads.items()}
    distance, updates = {}, {}
    for name, p in params.items():
        if not uses_muon(p):
            updates[name] = grads[name]
            continue
        seen = [g for g in muon_inputs if g.shape == p.shape] or [torch.full_like(p, math.inf)]
        gaps = [float((g - grads[name]).norm() / grads[name].norm()) for g in seen]
        distance[name] = min(gaps)
        updates[name] = muon_update(seen[gaps.index(distance[name])].clone(), torch.zeros_like(p),
                                    cfg.optim.muon_momentum, ns_method=MUON_NS_METHOD)
    norm = float(torch.linalg.vector_norm(torch.stack([u.double().norm() for u in updates.values()])))
    clip = max(1.0, (norm + 1e-6) / cfg.optim.grad_clip) if cfg.optim.grad_clip > 0 else 1.0  # DeepSpeed's unscale_and_clip_grads
    lr = cfg.optim.lr * LR_FACTORS[0]
    muon_lr = lr * (cfg.optim.muon_lr / cfg.optim.lr)
    others = [p for p in params.values() if not uses_muon(p)]
    adamw = torch.optim.AdamW(others, lr=lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps,
                              weight_decay=cfg.optim.weight_decay)
    with torch.no_grad():
        for name, p in params.items():
            if uses_muon(p):
                p.mul_(1 - muon_lr * cfg.optim.weight_decay).add_(updates[name] / clip, alpha=-muon_lr)
            else:
                p.grad = updates[name] / clip
    adamw.step()
    return {name: p.detach().clone() for name, p in params.items()}, norm, distance


def rank_main(rank: int, tmp: Path) -> dict:
    torch._dynamo.config.disable = True
    target = random_qwen3(vocab_size=256, num_hidden_layers=4)
    cpu = torch.device("cpu")

    def build(name: str) -> DeepSpeedEngine:
        return DeepSpeedEngine(make_drafter(target, num_layers=1).train(), ds_settings(config(name), name, tmp),
                               config(name).optim, cpu)

    before = dict(make_drafter(target, num_layers=1).named_parameters())
    recorded = record_muon_inputs()
    report = {"update": {}, "grad_norm": {}, "muon_input": {}, "losses": {}, "weights_equal": {},
              "descriptions": {}, "muon_group_lr": {}}
    for name in SETTINGS:
        cfg = config(name)
        engine = build(name)
        report["descriptions"][name] = engine.description
        recorded.clear()
        first_losses, result = train_step(engine, target, cfg, rank, 0)
        report["muon_group_lr"][name] = sorted((bool(g.get("use_muon")), g["lr"])
                                               for g in engine.engine.optimizer.param_groups)
        every_rank = [None, None]  # each rank orthogonalises the matrices of its partition or its turn
        dist.all_gather_object(every_rank, recorded)
        reference, reference_norm, report["muon_input"][name] = reference_step(
            target, cfg, [grad for grads in every_rank for grad in grads])
        report["grad_norm"][name] = [result.grad_norm, reference_norm]
        after = engine.full_state_dict()
        report["update"][name] = {
            key: float(((after[key] - before[key]) - (reference[key] - before[key])).norm()
                       / (reference[key] - before[key]).norm()) for key in reference}

        straight, resumed = engine, build(name)  # the engine above goes on straight
        losses = {"straight": first_losses, "resumed": []}
        for step in range(1, len(LR_FACTORS)):
            losses["straight"] += train_step(straight, target, cfg, rank, step)[0]
        for step in range(2):
            losses["resumed"] += train_step(resumed, target, cfg, rank, step)[0]
        resumed.save(tmp / name / "step_2")
        resumed = build(name)
        resumed.load(tmp / name / "step_2")
        for step in range(2, len(LR_FACTORS)):
            losses["resumed"] += train_step(resumed, target, cfg, rank, step)[0]
        report["losses"][name] = losses
        ends = straight.full_state_dict(), resumed.full_state_dict()
        report["weights_equal"][name] = all(torch.equal(ends[0][key], ends[1][key]) for key in ends[0])
    return report


def test_deepspeed_muon_steps_like_the_reference_and_resumes_exactly_under_every_zero_stage(tmp_path):
    for report in gloo_ranks(rank_main, tmp_path):
        for name in SETTINGS:
            assert "DeepSpeed Muon on the matrices, torch AdamW on the rest" in report["descriptions"][name]
            assert report["muon_group_lr"][name] == [[False, 3e-2], [True, pytest.approx(0.02)]], name
            assert len(report["muon_input"][name]) == 8, name  # q, k, v, o, gate, up, down, fc
            worst = max(report["muon_input"][name].items(), key=lambda item: item[1])
            assert worst[1] <= GRAD_RTOL, (name, worst)  # the step's gradient: both ranks, both micro batches
            errors = report["update"][name]
            assert len(errors) >= 10 and any(key.endswith("norm.weight") for key in errors)
            worst = max(errors.items(), key=lambda item: item[1])
            assert worst[1] <= UPDATE_RTOL, (name, worst)
            grad_norm, reference_norm = report["grad_norm"][name]
            assert grad_norm == pytest.approx(reference_norm, rel=1e-5) and grad_norm > 2, name  # the norm of Muon's update
            losses = report["losses"][name]
            assert len(losses["straight"]) == SETTINGS[name][3] * len(LR_FACTORS)
            assert losses["resumed"] == losses["straight"], name  # bit for bit
            assert report["weights_equal"][name], name
