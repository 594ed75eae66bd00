"""The engine that train.engine names, and what it is built from (checked before any model loads)."""
import torch
from torch import nn

from drafter.infra.deepspeed_engine import DeepSpeedEngine, deepspeed_config, deepspeed_op_problem
from drafter.infra.engine import EngineConfigError
from drafter.infra.fsdp_engine import FSDPEngine

ENGINES = ("deepspeed", "fsdp")


def engine_settings(cfg, world_size: int, device: torch.device, dtype: torch.dtype, hidden_size: int) -> dict | None:
    """What the engine of train.engine is built from, checked before any model loads: DeepSpeed's
    JSON with the YAML's values filled in (its contradictions with the YAML fail here); nothing for FSDP2."""
    if cfg.train.engine == "deepspeed":
        ds = deepspeed_config(cfg.train.ds_config, cfg, world_size, dtype == torch.bfloat16, hidden_size,
                              on_cpu=device.type == "cpu")
        if problem := deepspeed_op_problem(ds, device):
            raise EngineConfigError(f"train.ds_config={cfg.train.ds_config}: {problem}")
        return ds
    return None


def build_engine(cfg, drafter: nn.Module, device: torch.device, dtype: torch.dtype, ds_config: dict | None):
    """The engine of train.engine around `drafter` (moved to `device`)."""
    if cfg.train.engine == "deepspeed":
        return DeepSpeedEngine(drafter.to(device), ds_config, cfg.optim, device)
    return FSDPEngine(drafter.to(device), cfg, device, bf16=dtype == torch.bfloat16)
