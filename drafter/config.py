"""The training config: a typed OmegaConf schema, YAML + dotlist overrides, validation.

    cfg = load_config("configs/v3.yaml", ["optim.lr=3e-4", "train.max_steps=100"])  # training/run_config.py

Unknown keys and wrong types fail here, before any model loads, with the full key path. The values a
registered part's key may take (`objective.loss`, `drafter.arch`, ...) come from the registries, which
sit above this schema: `load_yaml_config` takes them as `choices`, and the keys only one part reads as
`settings`; drafter/training/run_config.py's `load_config` reads both from the registries and passes them in.
"""
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from drafter.errors import ConfigError

__all__ = ["Config", "ConfigError", "DrafterVariant", "ObjectiveConfig", "load_yaml_config"]
LAYER_TYPES = ("full_attention", "sliding_attention")
DTYPE_ALIASES = {"auto": "auto", "bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32", "float32": "fp32"}


def out_of_range(section: str, values, positive=(), positive_or_null=(), non_negative=(), fractions=(),
                 finite=()) -> list[str]:
    """Each named field of `values` outside its range, named `section.field` (NaN is out of every range)."""
    problems = []
    for name in positive + positive_or_null:
        value = getattr(values, name)
        if (value is not None or name in positive) and not (value is not None and value > 0):
            problems.append(f"{section}.{name}={value!r} must be > 0" + (" (or null)" if name in positive_or_null else ""))
    problems += [f"{section}.{name}={getattr(values, name)!r} must be >= 0"
                 for name in non_negative if not getattr(values, name) >= 0]
    problems += [f"{section}.{name}={getattr(values, name)!r} must be in [0, 1]"
                 for name in fractions if not 0 <= getattr(values, name) <= 1]
    problems += [f"{section}.{name}=inf must be finite ({why})" for name, why in finite if getattr(values, name) == math.inf]
    return problems


class Section:
    """A config section: `problems()` lists what its values get wrong that OmegaConf's types cannot
    see, each naming its key, cross-key checks included (beside the keys they guard)."""

    def problems(self) -> list[str]:
        return []


@dataclass
class RunConfig(Section):
    name: Optional[str] = None     # default: config name + what distinguishes runs, e.g. v3-g10-b95
    out_dir: Optional[str] = None  # default: runs/<config name>
    seed: int = 0

    def problems(self) -> list[str]:
        return out_of_range("run", self, non_negative=("seed",))


@dataclass
class TargetConfig(Section):
    path: Optional[str] = None     # HF hub id or local dir; null -> a random Qwen3 of `random` shape
    random: Optional[dict] = None  # drafter.target_model.model.random_qwen3 kwargs (tests, GPU check)
    dtype: str = "auto"            # auto: bf16 on GPU; on a CPU bf16 only where a probe measures it faster
    tp_size: int = 1               # ranks sharing one tensor-parallel copy (consecutive, within a node)
    chat_template_kwargs: dict = field(default_factory=lambda: {"enable_thinking": False})

    def problems(self) -> list[str]:
        problems = out_of_range("target", self, positive=("tp_size",))
        if self.dtype not in DTYPE_ALIASES:
            problems.append(f"target.dtype={self.dtype!r} is not one of auto, bf16 (bfloat16), fp32 (float32)")
        return problems


@dataclass
class DrafterVariant:
    """What tells the drafter variants apart: the `drafter.*` keys beyond the sizes (docs/variants.md),
    written to the export as `dflash` 0.1.0 reads them (drafter/models/configure.py).

    layer_types: one of LAYER_TYPES per draft layer (None: all full_attention).
    sliding_window: the window of the sliding layers, in positions, the query's own included.
    causal: None is the public default (sliding layers causal inside the block, full layers
        bidirectional); True / False makes every layer causal / bidirectional (`is_causal`).
    arch: a name in drafter.models.ARCHITECTURES ("dflash", "dflash2", checked there); the conv_* and selector_*
        settings are DFlash2's own (its `variant_keys`): the convolution's taps and channel group, the
        selector's rank and candidates.
    """
    layer_types: Optional[list[str]] = None   # one per layer: full_attention | sliding_attention; null: all full
    sliding_window: Optional[int] = None      # positions a sliding layer sees, the query's own and block ones included
    causal: Optional[bool] = None             # null: sliding layers causal in the block, full ones not; true/false: all
    arch: str = "dflash"                      # a drafter.models.ARCHITECTURES name: dflash | dflash2
    conv_kernel_size: int = 2                 # dflash2: taps of the block convolutions
    conv_group_size: int = 16                 # dflash2: channels sharing one dynamic tap (divides hidden)
    selector_rank: int = 256                  # dflash2: rank of the selector's pair score
    selector_top_k: int = 16                  # dflash2: candidates the selector re-ranks per slot

    def variant_problems(self, num_layers: int) -> list[str]:
        """What is wrong with this variant for a drafter of `num_layers` layers, each naming its key."""
        problems = []
        types = self.layer_types
        if types is not None and len(types) != num_layers:
            problems.append(f"layer_types has {len(types)} entries for {num_layers} draft layers "
                            "(one per layer)")
        if types is not None and not set(types) <= set(LAYER_TYPES):
            problems.append(f"layer_types {list(types)}: each entry must be one of {', '.join(LAYER_TYPES)}")
        sliding = types is not None and "sliding_attention" in types
        if sliding and self.sliding_window is None:
            problems.append("sliding_window must be set for sliding_attention layers")
        if self.sliding_window is not None and self.sliding_window < 1:
            problems.append(f"sliding_window={self.sliding_window} must be >= 1 (the query itself)")
        if self.sliding_window is not None and not sliding:
            problems.append(f"sliding_window={self.sliding_window} is set but no layer_types entry is "
                            "sliding_attention")
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if getattr(self, key) < 1:
                problems.append(f"{key}={getattr(self, key)} must be >= 1")
        return problems

    def config_fields(self, num_layers: int) -> dict:
        """The Qwen3Config fields that `dflash` 0.1.0 reads for this variant."""
        types = list(self.layer_types or ["full_attention"] * num_layers)
        sliding = "sliding_attention" in types
        fields = {"layer_types": types, "use_sliding_window": sliding,
                  "sliding_window": self.sliding_window if sliding else None}
        if self.causal is not None:
            fields["is_causal"] = bool(self.causal)
        return fields


@dataclass
class DrafterConfig(DrafterVariant, Section):
    """The `drafter` section: the sizes, and (inherited) the variant."""
    num_layers: int = 5
    block_size: int = 16
    target_layer_ids: Optional[list[int]] = None  # null: evenly spaced from 1 to L-3
    mask_token_id: Optional[int] = None           # null: chosen from the tokenizer and the data (drafter/models/mask_token.py)
    init_from: Optional[str] = None               # an exported drafter/ dir to start from
    layers_from_target: Optional[list[int]] = None  # target layer ids that start the drafter's layers, one
                                                  # per layer (drafter/models/from_target.py); null: fresh
    draft_vocab_size: Optional[int] = None        # K: the LM head cut to the K commonest answer tokens
                                                  # (drafter/models/draft_vocab.py); null: the target's whole head

    def problems(self) -> list[str]:
        problems = out_of_range("drafter", self, positive=("num_layers",))
        if self.block_size < 2:
            problems.append(f"drafter.block_size={self.block_size} must be >= 2 (an anchor and a draft)")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            problems.append(f"drafter.mask_token_id={self.mask_token_id} must be >= 0 (or null)")
        ids = self.target_layer_ids
        if ids is not None and (not ids or min(ids) < 0 or len(set(ids)) != len(ids)):
            problems.append(f"drafter.target_layer_ids={list(ids)} must be distinct layer indices >= 0 (or null)")
        return problems + [f"drafter.{problem}" for problem in self.variant_problems(self.num_layers)]


@dataclass
class ObjectiveConfig(Section):
    """The `objective` section, which is also what the training step reads (drafter/training/objective.py):
    the loss's parts are the registered components of drafter/losses/."""
    num_anchors: int = 512           # per sequence
    anchors_per_batch: Optional[int] = None  # per micro-batch, all sequences together (drafter memory)
    gamma: Optional[float] = None  # null: the paper's value for the block size (16 -> 7)
    ddtree_budget: int = 64
    ddtree_blocks: int = 16
    attention: str = "auto"        # auto (flex_compiled on CUDA, dense elsewhere) | flex_compiled | flex | dense
                                   # (models.blocks.attention_kernel; flex: eager, materialises the scores)
    labels: str = "data"           # data | target: the target's own next-token distribution (distillation)
    loss: str = "ce"               # ce | kl (forward KL to the target's distribution; needs labels=target)
                                   # | tv (tv_ce_weight x CE + the rest x total variation; labels=target)
                                   # | expected_chain | expected_tree: minus the expected accepted length
                                   # (their own slot weighting: position_weights stays exp, gamma unused)
    tv_ce_weight: float = 0.1      # loss=tv: w of w CE + (1 - w) TV (DSpark's 0.1)
    tree_temperature: float = 1.0  # loss=expected_tree: surrogate temperature in nats (budget: ddtree_budget)
    block_ce_weight: float = 0.1   # loss=expected_*: + w x CE under exp weights (0: the block loss alone)
    position_weights: str = "exp"  # exp: exp(-(k-1)/gamma) | dpace | tree (drafter/losses/weights.py)
    weight_smoothing: float = 0.5  # a of the dpace and tree weights
    truncate: str = "none"         # none | first_failure: a block's slots after its first argmax miss weigh 0
    normalize: str = "weights"     # weights: loss / sum of the weights | count: / supervised slots (speculators)
    anchor_candidates: str = "pair"  # pair: p and p+1 supervised | supervised: any supervised p (speculators)
    selector_alpha: float = 1.0    # the drafter's auxiliary loss weight (dflash2: the selector's K-way CE)
    chunk_bytes: int = 256 * 2**20  # fp32 logits alive at once in the chunked LM-head loss (memory only)
    feature_calibration: str = "none"  # none | zeros | oracle: diagnostics (drafter/target_model/calibration.py)

    def problems(self) -> list[str]:
        problems = out_of_range(
            "objective", self, positive=("num_anchors", "ddtree_budget", "chunk_bytes", "tree_temperature"),
            positive_or_null=("anchors_per_batch", "gamma"),
            non_negative=("ddtree_blocks", "selector_alpha", "block_ce_weight"),
            fractions=("weight_smoothing", "tv_ce_weight"),
            finite=(("selector_alpha", "a loss term's weight"), ("block_ce_weight", "a loss term's weight"),
                    ("tree_temperature", "at inf the expected_tree surrogate is flat: no gradient, and NaN "
                                         "where the whole tree fits the budget")))
        if self.loss == "kl" and self.labels != "target":
            problems.append("objective.loss=kl needs objective.labels=target (KL to the data's one-hot labels is CE)")
        if self.loss == "tv" and self.labels != "target":
            problems.append("objective.loss=tv needs objective.labels=target (total variation to the target's "
                            f"distribution; got objective.labels={self.labels})")
        if self.loss.startswith("expected_") and self.position_weights != "exp":
            problems.append(f"objective.loss={self.loss} weighs the slots by itself: objective.position_weights "
                            f"must stay exp (got {self.position_weights})")
        return problems


@dataclass
class OptimConfig(Section):
    name: str = "adamw"            # adamw | muon: Muon on the 2-D weight matrices, AdamW on the rest
    lr: float = 6e-4               # AdamW's (all parameters with adamw; the non-matrices with muon)
    muon_lr: float = 0.02          # Muon's, scaled per matrix by sqrt(max(1, rows / cols)) (Muon's own rule)
    muon_momentum: float = 0.95
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    grad_accum: int = 1

    def problems(self) -> list[str]:
        problems = out_of_range("optim", self, positive=("lr", "muon_lr", "eps", "grad_accum"),
                                non_negative=("weight_decay", "grad_clip"), fractions=("warmup_ratio", "min_lr_ratio"))
        if not 0 <= self.muon_momentum < 1:
            problems.append(f"optim.muon_momentum={self.muon_momentum!r} must be in [0, 1)")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            problems.append(f"optim.betas={list(self.betas)} must be two values in [0, 1)")
        return problems


@dataclass
class NoiseConfig(Section):
    """Gaussian noise on the target features, std relative to each layer's per-token RMS; the std goes
    start -> end linearly over warmup_steps."""
    start: float = 0.0
    end: float = 0.0
    warmup_steps: int = 0

    def problems(self) -> list[str]:
        return out_of_range("noise", self, non_negative=("start", "end", "warmup_steps"))


@dataclass
class DataConfig(Section):
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
    features: Optional[str] = None   # a feature store of data.path (data/features.py): no target forward, no target weights
    eval_features: Optional[str] = None  # with data.features: the store of data.eval_path
    features_missing: str = "error"  # a row no store holds: error (named) | generate (the target, loaded too, computes it)
    features_cache: bool = False     # with features_missing=generate: the rows computed are appended to data.features
    features_dtype: Optional[str] = None  # the stores' dtype: fp32 | bf16 | fp8; null: the training dtype's

    def problems(self) -> list[str]:
        problems = out_of_range("data", self, positive=("max_length", "num_buckets", "tokens_per_batch", "max_run",
                                                        "prefetch_factor"), non_negative=("num_workers", "seed"))
        if not 0 <= self.eval_fraction < 1:
            problems.append(f"data.eval_fraction={self.eval_fraction!r} must be in [0, 1)")
        bounds = self.bucket_boundaries
        if bounds is not None and (not bounds or bounds[0] < 1 or any(b <= a for a, b in zip(bounds, bounds[1:]))):
            problems.append(f"data.bucket_boundaries={list(bounds)} must be increasing positive lengths (or null)")
        if bounds and bounds[-1] > self.max_length:
            problems.append(f"data.bucket_boundaries ends at {bounds[-1]} > data.max_length={self.max_length}")
        return problems


@dataclass
class TrainConfig(Section):
    epochs: int = 6
    max_steps: Optional[int] = None  # stop early; otherwise run all epochs
    schedule_steps: Optional[int] = None  # lr schedule length; null: the run's length when it started
    log_every: int = 10
    save_every: int = 1000
    eval_every: int = 500
    eval_batches: int = 20           # per rank
    keep_last: int = 3
    resume: str = "auto"             # auto | never | force | a checkpoint dir (see drafter/training/checkpoint.py)
    max_bad_steps: int = 5           # non-finite steps in a row before the run stops
    engine: str = "deepspeed"        # deepspeed (ZeRO from ds_config) | fsdp (torch FSDP2, the fsdp section)
    ds_config: str = "ds_configs/zero2.json"
    threads_per_rank: Optional[int] = None  # CPU only; null: cores / local ranks
    profile_timing: Optional[bool] = None   # per-stage timers; null: on where free (CPU), off on CUDA (syncs)
    dist_timeout_minutes: float = 30.0      # forming the world, and any one collective (a checkpoint save)
    # Served tau (drafter/serving/served.py): replayed on the held-out split at every eval; real generation
    # of a fixed prompt set every generate_every steps and at the end.
    tau_budgets: list[int] = field(default_factory=lambda: [64])  # DDTree budgets of tau_/gen_tau_ddtree@B
    generate_every: int = 500        # 0: never
    generate_prompts: Optional[str] = None  # JSONL or hub benchmark; null: prompt side of held-out rows
    generate_max_prompts: int = 64   # per generation, all ranks together
    generate_max_new_tokens: int = 256
    generate_max_seconds: float = 60.0  # per rank and generation: no prompt starts after it

    def problems(self) -> list[str]:
        problems = out_of_range(
            "train", self, positive=("epochs", "log_every", "save_every", "eval_every", "eval_batches", "keep_last",
                                     "max_bad_steps", "generate_max_prompts", "generate_max_new_tokens",
                                     "dist_timeout_minutes", "generate_max_seconds"),
            positive_or_null=("max_steps", "schedule_steps", "threads_per_rank"), non_negative=("generate_every",))
        if not self.tau_budgets or min(self.tau_budgets) < 1:
            problems.append(f"train.tau_budgets={list(self.tau_budgets)} must be tree budgets >= 1")
        if not isinstance(self.resume, str) or not self.resume:
            problems.append("train.resume must be auto, never, force or a checkpoint directory")
        return problems


@dataclass
class FSDPConfig(Section):
    """Per-cluster knobs of train.engine=fsdp (torch FSDP2, `fully_shard` per decoder layer)."""
    reshard_after_forward: bool = True  # free gathered weights after forward (re-gathered in backward)
    cpu_offload: bool = False           # parameters, gradients and optimizer state on the CPU (CUDA only)


@dataclass
class WandbConfig(Section):
    enabled: bool = True
    project: str = "dflash-ddtree"
    entity: Optional[str] = None
    mode: Optional[str] = None       # null: online if WANDB_API_KEY is set, else offline


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


CONFIG_FILE_ERRORS = (OmegaConfBaseException, yaml.YAMLError)  # what loading and merging a config raise


def config_error_reason(error: Exception) -> str:
    """One line for a CONFIG_FILE_ERRORS error: YAML's where and what, or the first line of OmegaConf's
    message (it appends the key and types on lines of their own)."""
    if isinstance(error, yaml.YAMLError):
        return "not valid YAML: " + " ".join(str(error).split())
    lines = str(getattr(error, "msg", None) or error).splitlines()
    return lines[0] if lines and lines[0].strip() else type(error).__name__


def merged_config(path: str, overrides: list[str]) -> DictConfig:
    """The schema's defaults, then the YAML at `path`, then each `key.sub=value` override, resolved. A key
    the schema does not have, or a value it refuses, is one ConfigError line naming the file (and the
    override that wrote it) and the key, or what is not valid YAML."""
    source = path
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path))
        for override in overrides:
            source = f"{path}: override {override}"
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([override]))
        source = path
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # ${...} that cannot resolve too
    except yaml.YAMLError as error:
        raise ConfigError(f"{source}: {config_error_reason(error)}") from None
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None) or "?"
        raise ConfigError(f"{source}: bad config key '{key}': {config_error_reason(error)}") from None
    return cfg


def load_yaml_config(path: str, overrides: list[str], choices: dict[str, tuple],
                     settings: dict[str, dict[str, tuple[str, ...]]] | None = None) -> DictConfig:
    """YAML at `path` + `key.sub=value` overrides, validated against `Config`, `choices` (each key's
    allowed values) and `settings` (`unread_settings`); names the run."""
    cfg = merged_config(path, overrides)
    problems = validate(cfg, choices, settings or {})
    if problems:
        raise ConfigError(f"{path}: " + "; ".join(problems))
    stem = Path(path).stem
    if cfg.run.name is None:
        cfg.run.name = default_run_name(stem, cfg)
    if cfg.run.out_dir is None:
        cfg.run.out_dir = f"runs/{stem}"
    if cfg.target.path is None and cfg.target.random is None:
        raise ConfigError(f"{path}: set target.path (or target.random for a random target)")
    return cfg


def validate(cfg, choices: dict[str, tuple], settings: dict[str, dict[str, tuple[str, ...]]]) -> list[str]:
    """Every value problem OmegaConf's types cannot see, each naming its key (empty: all good): each
    section's own `problems()`, a key of `choices` must hold one of its values, and no component's own
    setting is set for nothing (`unread_settings`). Normalises target.dtype aliases (bfloat16 -> bf16,
    float32 -> fp32) in place."""
    sections = OmegaConf.to_object(cfg)
    problems = [problem for f in fields(sections) for problem in getattr(sections, f.name).problems()]
    unknown = [key for key, allowed in choices.items() if OmegaConf.select(cfg, key) not in allowed]
    for key in unknown:
        names = ", ".join("null" if c is None else c for c in choices[key])
        problems.append(f"{key}={OmegaConf.select(cfg, key)!r} is not one of {names}")
    known = {chooser: readers for chooser, readers in settings.items() if chooser not in unknown}
    problems += [problem for problem in unread_settings(sections, known)
                 if not any(other.startswith(problem.split("=")[0] + "=") for other in problems)]
    if cfg.target.dtype in DTYPE_ALIASES:
        cfg.target.dtype = DTYPE_ALIASES[cfg.target.dtype]
    return problems


def unread_settings(sections: Config, settings: dict[str, dict[str, tuple[str, ...]]]) -> list[str]:
    """A registered component's own keys, set off their defaults while another component is chosen:
    they would do nothing. `settings`: the key that chooses a component (`objective.loss`) -> each
    component's keys in that section (`tv` -> tv_ce_weight), from the tables beside the registries;
    a key belongs to one chooser (validate skips a chooser whose value is no registered choice, and a
    key whose value is already refused)."""
    problems = []
    for chooser, readers in settings.items():
        section_name, choice_key = chooser.split(".")
        section = getattr(sections, section_name)
        chosen = getattr(section, choice_key)
        for key in dict.fromkeys(key for keys in readers.values() for key in keys):
            value = getattr(section, key)
            if key in readers.get(chosen, ()) or value == section.__dataclass_fields__[key].default:
                continue
            owners = " or ".join(name for name, keys in readers.items() if key in keys)
            problems.append(f"{section_name}.{key}={value!r} is read only with {chooser}={owners}")
    return problems


DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # DFlash paper, by block size


def resolve_gamma(gamma: float | None, block_size: int) -> float:
    """objective.gamma, or where it is null the paper's value for the block size."""
    if gamma is not None:
        return float(gamma)
    if block_size not in DEFAULT_GAMMA:
        raise ConfigError(f"drafter.block_size={block_size} has no default loss gamma (the paper's are for "
                          f"block sizes {', '.join(map(str, sorted(DEFAULT_GAMMA)))}); set objective.gamma")
    return DEFAULT_GAMMA[block_size]


def default_run_name(stem: str, cfg) -> str:
    """The config name plus the hyperparameters that distinguish runs: v3-g10-b95, and the objective
    where it is not the default: v3-g10-b95-target-kl-dpace, v3-g10-b95-expected_tree-first_failure."""
    gamma = resolve_gamma(cfg.objective.gamma, cfg.drafter.block_size)
    objective = cfg.objective
    variant = "".join(f"-{value}" for value, default in ((objective.labels, "data"), (objective.loss, "ce"),
                                                         (objective.position_weights, "exp"),
                                                         (objective.truncate, "none"),
                                                         (cfg.optim.name, "adamw")) if value != default)
    return f"{stem}-g{gamma:g}-b{round(cfg.optim.betas[1] * 100)}{variant}"
