"""Training engines behind one small interface: DeepSpeed (ZeRO 1-3, offload, configured by the JSON)
in deepspeed_engine.py, and torch FSDP2 (`fully_shard`, `torch.distributed.checkpoint`) in fsdp_engine.py;
engine_choice.py builds the one train.engine names. The training loop only uses:

    engine.module                 the drafter to run forward (possibly sharded)
    engine.backward(loss)         one micro batch; the engine counts micro batches to the step
    engine.step(lr)               -> StepResult: clip to the global norm, skip a non-finite step on
                                  every rank, else update with this step's learning rate
    engine.save(dir) / load(dir)  collective: weights and optimizer state, in the engine's format
    engine.full_state_dict()      collective: every rank gets the full weights (CPU tensors)
    engine.sharded                whether engine.module holds only a shard of the weights (its forward
                                  is then a collective: every rank must call it the same number of times)
    engine.num_parameters, engine.description

The learning rate is set by the caller at every step (drafter.training.schedules.lr_factor of the trainer's
step), so both engines follow the same schedule whatever steps were skipped. With optim.name=muon
the 2-D weight matrices (`uses_muon`) step with Muon at optim.muon_lr (the same schedule: the caller's
lr times muon_lr / lr) and everything else with AdamW: under FSDP2 torch.optim.Muon (Newton-Schulz on
the full matrix through DTensor ops), under DeepSpeed (ZeRO 1-3, optimizer offload too) DeepSpeed's
own ZeRO Muon (`deepspeed_muon`), which differs in three ways that `DeepSpeedEngine` names.
"""
from dataclasses import dataclass

import torch
from torch import nn

from drafter.errors import ConfigError


@dataclass
class StepResult:
    applied: bool      # False: a non-finite gradient norm skipped the update on every rank
    grad_norm: float   # global norm before clipping (inf or nan when skipped)


class EngineConfigError(ConfigError):
    """A train.ds_config / engine setting this trainer refuses (a ConfigError: train.py and
    data/plan.py report it as such)."""


def trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def uses_muon(param: nn.Parameter) -> bool:
    """Muon's share of the drafter: its weight matrices (the drafter owns no embedding or LM head);
    the norms' vectors step with AdamW."""
    return param.dim() == 2


OPTIMIZERS = ("adamw", "muon")
OPTIMIZER_SETTINGS = {"muon": ("muon_lr", "muon_momentum")}  # the optim.* keys only that optimizer reads


def build_optimizers(params: list[nn.Parameter], optim, device: torch.device | None = None
                     ) -> list[torch.optim.Optimizer]:
    """torch's AdamW over `params` (its fused kernel on CUDA: no compiled ops to build), or Muon over
    the matrices and AdamW over the rest (optim.name)."""
    adamw = dict(lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, weight_decay=optim.weight_decay)
    if device is not None and device.type == "cuda":
        adamw["fused"] = True
    if optim.name == "adamw":
        return [torch.optim.AdamW(params, **adamw)]
    matrices, others = [p for p in params if uses_muon(p)], [p for p in params if not uses_muon(p)]
    return [torch.optim.Muon(matrices, lr=optim.muon_lr, momentum=optim.muon_momentum, nesterov=True,
                             weight_decay=optim.weight_decay, adjust_lr_fn="original"),
            torch.optim.AdamW(others, **adamw)]
