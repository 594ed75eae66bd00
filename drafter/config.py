"""The training config: a typed OmegaConf schema, YAML + dotlist overrides, and the DeepSpeed JSON.

    cfg = load_config("configs/v3.yaml", ["optim.lr=3e-4", "train.max_steps=100"])

Unknown keys and wrong types fail here, before any model loads, with the full key path.
"""
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


@dataclass
class RunConfig:
    name: Optional[str] = None     # default: config name + what distinguishes runs, e.g. v3-g10-b95
    out_dir: Optional[str] = None  # default: runs/<config name>
    seed: int = 0


@dataclass
class TargetConfig:
    path: Optional[str] = None     # HF hub id or local dir; null -> a random Qwen3 of `random` shape
    random: Optional[dict] = None  # drafter.target.random_qwen3 kwargs (tests, GPU check)
    dtype: str = "auto"            # auto: bf16 on GPU, fp32 on CPU
    chat_template_kwargs: dict = field(default_factory=lambda: {"enable_thinking": False})


@dataclass
class DrafterConfig:
    num_layers: int = 5
    block_size: int = 16
    target_layer_ids: Optional[list[int]] = None  # null: evenly spaced from 1 to L-3
    mask_token_id: Optional[int] = None           # null: the tokenizer's mask token (added if absent)
    init_from: Optional[str] = None               # an exported drafter/ dir to start from


@dataclass
class ObjectiveSection:
    num_anchors: int = 512           # per sequence
    anchors_per_batch: Optional[int] = None  # per micro-batch, all sequences together (drafter memory)
    gamma: Optional[float] = None  # null: the paper's value for the block size (16 -> 7)
    ddtree_budget: int = 64
    ddtree_blocks: int = 16
    attention: str = "auto"        # auto (flex on GPU, dense SDPA on CPU) | flex | dense


@dataclass
class OptimConfig:
    lr: float = 6e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    grad_accum: int = 1


@dataclass
class NoiseConfig:
    """Gaussian noise on the target features, std relative to each layer's per-token RMS; the std goes
    start -> end linearly over warmup_steps."""
    start: float = 0.0
    end: float = 0.0
    warmup_steps: int = 0


@dataclass
class DataConfig:
    path: str = MISSING
    eval_path: Optional[str] = None
    eval_fraction: float = 0.01
    max_length: int = 8192
    num_buckets: int = 6
    bucket_boundaries: Optional[list[int]] = None
    tokens_per_batch: int = 16384
    max_run: int = 3
    num_workers: int = 2
    prefetch_factor: int = 4
    seed: int = 0


@dataclass
class TrainConfig:
    epochs: int = 6
    max_steps: Optional[int] = None  # stop early; otherwise run all epochs
    log_every: int = 10
    save_every: int = 1000
    eval_every: int = 500
    eval_batches: int = 20           # per rank
    keep_last: int = 3
    resume: str = "auto"             # auto | never | a checkpoint dir
    max_bad_steps: int = 5           # non-finite steps in a row before the run stops
    ds_config: str = "ds_configs/zero2.json"
    threads_per_rank: Optional[int] = None  # CPU only; null: cores / local ranks
    # Served tau (drafter/served.py): replayed on the held-out split at every eval; real generation
    # of a fixed prompt set every generate_every steps and at the end.
    tau_budgets: list[int] = field(default_factory=lambda: [64])  # DDTree budgets of tau_/gen_tau_ddtree@B
    generate_every: int = 500        # 0: never
    generate_prompts: Optional[str] = None  # JSONL or hub benchmark; null: prompt side of held-out rows
    generate_max_prompts: int = 64   # per generation, all ranks together
    generate_max_new_tokens: int = 256
    generate_max_seconds: float = 60.0  # per rank and generation: no prompt starts after it


@dataclass
class WandbConfig:
    enabled: bool = True
    project: str = "dflash-ddtree"
    entity: Optional[str] = None
    mode: Optional[str] = None       # null: online if WANDB_API_KEY is set, else offline


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    objective: ObjectiveSection = field(default_factory=ObjectiveSection)
    optim: OptimConfig = field(default_factory=OptimConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


class ConfigError(ValueError):
    pass


def load_config(path: str, overrides: list[str] = ()) -> DictConfig:
    """YAML at `path` + `key.sub=value` overrides, validated against `Config`; names the run."""
    schema = OmegaConf.structured(Config)
    try:
        cfg = OmegaConf.merge(schema, OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides)))
        OmegaConf.to_container(cfg, throw_on_missing=True)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None) or "?"
        raise ConfigError(f"{path}: bad config key '{key}': {error.msg if hasattr(error, 'msg') else error}") from None
    stem = Path(path).stem
    if cfg.run.name is None:
        cfg.run.name = default_run_name(stem, cfg)
    if cfg.run.out_dir is None:
        cfg.run.out_dir = f"runs/{stem}"
    if cfg.target.path is None and cfg.target.random is None:
        raise ConfigError(f"{path}: set target.path (or target.random for a random target)")
    return cfg


def default_run_name(stem: str, cfg) -> str:
    """The config name plus the hyperparameters that distinguish runs: v3-g10-b95."""
    from drafter.objective import resolve_gamma
    gamma = resolve_gamma(cfg.objective.gamma, cfg.drafter.block_size)
    return f"{stem}-g{gamma:g}-b{round(cfg.optim.betas[1] * 100)}"


def noise_std(noise: NoiseConfig, step: int) -> float:
    """Feature-noise std at optimizer step `step` (0-based): linear start -> end over warmup_steps."""
    if noise.warmup_steps <= 0:
        return float(noise.end)
    frac = min(step / noise.warmup_steps, 1.0)
    return float(noise.start + (noise.end - noise.start) * frac)


def lr_factor(optim: OptimConfig, step: int, total_steps: int) -> float:
    """Multiplier of the base lr at `step`: linear warmup over warmup_ratio, then cosine to min_lr_ratio."""
    warmup = max(1, math.ceil(optim.warmup_ratio * total_steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def deepspeed_config(json_path: str, cfg, world_size: int, bf16: bool, log) -> dict[str, Any]:
    """The DeepSpeed JSON with its "auto" values filled from the YAML. A value hard-coded in the JSON
    wins; where it differs from the YAML, that is reported through `log`."""
    ds = json.loads(Path(json_path).read_text())
    owned = {
        ("train_micro_batch_size_per_gpu",): 1,  # one token-budget batch per micro step
        ("gradient_accumulation_steps",): cfg.optim.grad_accum,
        ("train_batch_size",): cfg.optim.grad_accum * world_size,
        ("gradient_clipping",): cfg.optim.grad_clip,
        ("bf16", "enabled"): bf16,
        ("optimizer", "params", "lr"): cfg.optim.lr,
        ("optimizer", "params", "betas"): list(cfg.optim.betas),
        ("optimizer", "params", "eps"): cfg.optim.eps,
        ("optimizer", "params", "weight_decay"): cfg.optim.weight_decay,
    }
    for keys, yaml_value in owned.items():
        parent = ds
        for key in keys[:-1]:
            parent = parent.setdefault(key, {})
        current = parent.get(keys[-1], "auto")
        if current == "auto":
            parent[keys[-1]] = yaml_value
        elif current != yaml_value:
            log(f"{json_path}: {'.'.join(keys)}={current!r} is hard-coded and wins over the YAML's {yaml_value!r}")
    return ds
