"""A run's config: the schema (drafter/config.py) with each registered part's key checked against
its registry, read when the config is loaded (so that a part registered at run time, as a test
registers an architecture, is accepted).

    cfg = load_config("configs/v3.yaml", ["optim.lr=3e-4", "train.max_steps=100"])
"""
import sys
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from drafter.config import load_yaml_config
from drafter.errors import ConfigError
from drafter.infra.launch import LaunchError, init_distributed
from drafter.infra.engine import OPTIMIZER_SETTINGS, OPTIMIZERS
from drafter.infra.engine_choice import ENGINES
from drafter.infra.repo_paths import find_in_repo
from drafter.losses import (BLOCK_LOSSES, DIVERGENCES, LABELS, NORMALIZATIONS, OBJECTIVE_SETTINGS, POSITION_WEIGHTS,
                            TRUNCATIONS)
from drafter.models import ARCHITECTURES
from drafter.models.blocks import ANCHOR_CANDIDATES, ATTENTION_KERNELS
from drafter.target_model.calibration import FEATURE_CALIBRATIONS


def choices() -> dict[str, tuple]:
    """Each key's allowed values, read from the registry that implements them."""
    return {"objective.attention": ("auto", *ATTENTION_KERNELS),
            "objective.labels": LABELS,
            "objective.loss": (*DIVERGENCES, *BLOCK_LOSSES),
            "objective.position_weights": tuple(POSITION_WEIGHTS),
            "objective.truncate": tuple(TRUNCATIONS),
            "objective.normalize": tuple(NORMALIZATIONS),
            "objective.anchor_candidates": ANCHOR_CANDIDATES,
            "objective.feature_calibration": FEATURE_CALIBRATIONS,
            "drafter.arch": tuple(ARCHITECTURES),
            "train.engine": ENGINES,
            "data.features_missing": ("error", "generate"),
            "data.features_dtype": (None, "fp32", "bf16", "fp8"),
            "optim.name": OPTIMIZERS,
            "wandb.mode": (None, "online", "offline", "disabled")}


def settings() -> dict[str, dict[str, tuple[str, ...]]]:
    """The keys each registered part reads beyond its name, by the key that chooses it, as each
    registry declares them (an architecture: its `variant_keys`)."""
    return {**{f"objective.{key}": readers for key, readers in OBJECTIVE_SETTINGS.items()},
            "optim.name": OPTIMIZER_SETTINGS,
            "drafter.arch": {name: arch.variant_keys for name, arch in ARCHITECTURES.items()}}


def load_config(path: str, overrides: list[str] = ()) -> DictConfig:
    """YAML at `path` + `key.sub=value` overrides, validated against the schema and the registries;
    names the run. Raises ConfigError naming the file and every bad key.

    `path` and train.ds_config (when train.engine=deepspeed reads it) are found from any working
    directory (drafter/infra/repo_paths.py: as given, then under the repo's configs/ or ds_configs/,
    then the repo root), and the config holds ds_config's absolute path, so the run records the file it
    read. run.out_dir stays relative to the working directory: outputs go where the user runs."""
    cfg = load_yaml_config(str(find_in_repo(path, "configs", f"--cfg {path}")), overrides, choices(),
                           settings())
    if cfg.train.engine == "deepspeed":
        ds_config = cfg.train.ds_config
        cfg.train.ds_config = str(find_in_repo(ds_config, "ds_configs", f"train.ds_config={ds_config}"))
    return cfg


@dataclass(frozen=True)
class Launch:
    """The config and this process's place in the world its launcher formed: what every start-up step reads."""
    cfg: DictConfig
    rank: int
    world_size: int
    device: torch.device


def config_and_world(path: str, overrides: list[str] = ()) -> Launch:
    """The Launch of an entry point that trains or runs the target: the config, then the world its
    launcher formed. A config or a launch that cannot work exits with one line."""
    try:
        cfg = load_config(path, overrides)
    except (ConfigError, FileNotFoundError) as error:
        sys.exit(f"config error: {error}")
    try:
        return Launch(cfg, *init_distributed(cfg.train.dist_timeout_minutes))
    except LaunchError as error:
        sys.exit(f"launch error: {error}")
