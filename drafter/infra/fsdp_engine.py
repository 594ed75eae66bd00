"""The FSDP2 engine (drafter/infra/engine.py's interface): torch's `fully_shard` per shard unit, its
optimizers, and `torch.distributed.checkpoint` for save and load."""
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from drafter.infra.engine import EngineConfigError, StepResult, build_optimizers, trainable


class FSDPEngine:
    """`fully_shard` on each of the drafter's `shard_units` (its decoder layers, and DFlash2's
    selector), then the root (fc, hidden_norm, norm); AdamW, or Muon and AdamW (`build_optimizers`); gradients reduced once per optimizer step;
    bf16 compute with fp32 reduction when training in bf16."""

    def __init__(self, drafter: nn.Module, cfg, device: torch.device, bf16: bool):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        if cfg.fsdp.cpu_offload and device.type != "cuda":
            raise EngineConfigError("fsdp.cpu_offload needs GPUs (it moves state from the GPU to the CPU)")
        self.num_parameters = sum(p.numel() for p in drafter.parameters())
        self.description = (f"fsdp2 ({'bf16 compute, fp32 reduce' if bf16 else 'fp32'}, reshard_after_forward="
                            f"{cfg.fsdp.reshard_after_forward}, cpu_offload={cfg.fsdp.cpu_offload})")
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        shard = dict(
            mesh=mesh, reshard_after_forward=cfg.fsdp.reshard_after_forward,
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if bf16 else MixedPrecisionPolicy(),
            offload_policy=CPUOffloadPolicy() if cfg.fsdp.cpu_offload else OffloadPolicy())
        for unit in drafter.shard_units():
            fully_shard(unit, **shard)
        fully_shard(drafter, **shard)
        self.module = drafter
        self.sharded = True
        self.optimizers = build_optimizers(trainable(drafter), cfg.optim, device)
        self.muon_lr_ratio = cfg.optim.muon_lr / cfg.optim.lr
        self.grad_clip, self.accum, self.micro = cfg.optim.grad_clip, cfg.optim.grad_accum, 0

    def backward(self, loss: torch.Tensor) -> None:
        last = self.micro == self.accum - 1
        self.module.set_requires_gradient_sync(last)  # reduce-scatter once, after the last micro batch
        (loss / self.accum).backward()
        self.micro = 0 if last else self.micro + 1

    def step(self, lr: float) -> StepResult:
        from torch.distributed.tensor import DTensor

        params = trainable(self.module)
        max_norm = self.grad_clip if self.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # the global norm, same on every rank
        applied = math.isfinite(norm)
        for optimizer in self.optimizers:
            if applied:
                ratio = self.muon_lr_ratio if isinstance(optimizer, torch.optim.Muon) else 1.0
                for group in optimizer.param_groups:
                    group["lr"] = lr * ratio
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return StepResult(applied, norm)

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.module, self.optimizers)
        return {"model": model, "optimizer": optimizer}

    def save(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(), checkpoint_id=str(directory / "fsdp"))

    def load(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state()
        dcp.load(state, checkpoint_id=str(directory / "fsdp"))
        set_state_dict(self.module, self.optimizers, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))
        return {name: tensor.detach().cpu() for name, tensor in full.items()}
