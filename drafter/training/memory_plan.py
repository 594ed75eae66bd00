"""The per-GPU memory plan of a run, computed from configs alone (no weights load):

    target weights        dtype bytes x (the parameters the family's tp plan splits / target.tp_size
                          + the rest: embedding, LM head, norms, routers), counted on the meta device;
                          0 with data.features (a feature store), where its embedding and LM head alone load
    drafter weights       under the engine: DeepSpeed keeps them whole except at ZeRO-3; FSDP2 shards
    drafter gradients     in the compute dtype (DeepSpeed; sharded from ZeRO-2) or fp32 shards (FSDP2)
    optimizer state       AdamW m and v (fp32), or with optim.name=muon torch.optim.Muon's one fp32
                          momentum buffer on the 2-D matrices and AdamW's two on the rest, plus
                          DeepSpeed's fp32 master copy, sharded over every rank
    activations           an estimate at data.tokens_per_batch and the anchors of one micro batch

Offloaded state (DeepSpeed offload_optimizer / offload_param, fsdp.cpu_offload) is counted in host
memory instead. Host memory per node while the target loads is a line of its own: none where each
rank reads the weights straight onto its GPU; the node's ranks x the whole target where each rank
loads it on the host (the CPU; target.tp_size > 1, sharded there; a random target, built in fp32),
or x the embedding and LM head of a feature store. The activation figure is a rough model (what
autograd keeps per drafter layer and row, the context K/V, one target layer's working set, one loss
chunk), good to a factor of about 2: the plan is for sizing a run and catching one that cannot fit,
not for accounting to the byte. Distillation (objective.labels=target) runs every target layer, but
without gradient one layer's working set is alive at a time, as for features alone; it adds the
final hidden states [tokens, H] kept for the loss, their rows gathered per block slot [rows, H], and
its loss chunks hold both sides' logits (losses.loss_chunk_peak_bytes: total variation,
objective.loss=tv, holds as many as KL; the block losses, objective.loss=expected_chain and
expected_tree, are a pass of CE rows like D-PACE's).
"""
import math
from dataclasses import dataclass, replace

import torch
from omegaconf import OmegaConf

from drafter.infra.memory import MemoryPlanError, size_text

ADAM_BYTES = 8    # fp32 m and v per parameter
MUON_BYTES = 4    # torch.optim.Muon's fp32 momentum buffer per parameter
MASTER_BYTES = 4  # DeepSpeed's fp32 copy of the weights it optimises


@dataclass(frozen=True)
class PlanInputs:
    target_params: int
    target_split_params: int  # those a tensor-parallel group splits (the rest stays whole on every rank)
    dtype_bytes: int          # of the target and of the drafter's compute
    tp_size: int
    drafter_params: int
    muon_params: int          # those torch.optim.Muon steps (optim.name=muon: the 2-D matrices), else 0
    world_size: int
    engine: str               # deepspeed | fsdp
    zero_stage: int | None    # deepspeed only
    offload_optimizer: bool   # deepspeed offload_optimizer, or fsdp.cpu_offload (with offload_params)
    offload_params: bool
    tokens_per_batch: int
    anchors: int              # blocks in one micro batch
    block_size: int
    hidden_size: int
    intermediate_size: int
    kv_width: int             # num_key_value_heads x head_dim
    feature_layers: int
    drafter_layers: int
    target_labels: bool       # objective.labels=target: the loss reads the target's final hidden states
    loss_chunk_peak: int      # bytes of logits alive at a loss chunk's peak (losses.loss_chunk_peak_bytes)
    head_params: int = 0      # with features from a store (data.features): the embedding and LM head alone load
    node_ranks: int = 1       # ranks on one node
    target_load_host: int = 0  # bytes of the target each rank holds in host memory while it loads


@dataclass(frozen=True)
class MemoryPlan:
    inputs: PlanInputs
    gpu: dict[str, int]    # bytes per GPU, by part
    host: dict[str, int]   # bytes per rank in host memory (offloaded state)

    @property
    def total(self) -> int:
        return sum(self.gpu.values())

    @property
    def target_load_host(self) -> int:
        """Host memory per node while the target loads: every rank's copy at once."""
        return self.inputs.node_ranks * self.inputs.target_load_host

    def lines(self, gpu_bytes: int | None = None) -> list[str]:
        p = self.inputs
        stage = f"ZeRO-{p.zero_stage}" if p.engine == "deepspeed" else "FSDP2"
        lines = [f"memory plan per GPU (target.tp_size={p.tp_size}, {p.world_size} ranks, {stage}"
                 + (", offload" if p.offload_optimizer or p.offload_params else "") + "):"]
        lines += [f"  {name:<20} {size_text(size):>11}" for name, size in self.gpu.items()]
        lines.append(f"  {'total':<20} {size_text(self.total):>11}" + (f" of {size_text(gpu_bytes)}" if gpu_bytes else ""))
        if self.host:
            lines.append("  host memory per rank: " + ", ".join(f"{n} {size_text(b)}" for n, b in self.host.items()))
        lines.append("  host memory per node loading the target: " + (
            f"{p.node_ranks} ranks x {size_text(p.target_load_host)} = {size_text(self.target_load_host)}"
            if p.target_load_host else "none (each rank reads it straight onto its GPU)"))
        if p.muon_params:
            lines.append(f"  optimizer state: Muon momentum on {p.muon_params:,} matrix parameters, AdamW m, v "
                         f"on {p.drafter_params - p.muon_params:,} others")
        lines.append("  activations include: " + ", ".join(f"{n} {size_text(b)}" for n, b in loss_parts(p).items()))
        return lines


def plan_memory(p: PlanInputs) -> MemoryPlan:
    n, w = p.world_size, p.dtype_bytes
    whole = p.target_params - p.target_split_params
    if p.head_params:
        gpu = {"target weights": 0, "target embed + head": p.head_params * w}
    else:
        gpu = {"target weights": math.ceil((whole + p.target_split_params / p.tp_size) * w)}
    optimizer = MUON_BYTES * p.muon_params + ADAM_BYTES * (p.drafter_params - p.muon_params)
    if p.engine == "fsdp":  # fp32 shards of weights and gradients; the optimizers' state of the shard
        state = {"drafter weights": 4 * p.drafter_params / n, "drafter gradients": 4 * p.drafter_params / n,
                 "optimizer state": optimizer / n}
        offloaded = set(state) if p.offload_optimizer else set()
    else:
        state = {"drafter weights": w * p.drafter_params / (n if p.zero_stage == 3 else 1),
                 "drafter gradients": w * p.drafter_params / (n if p.zero_stage >= 2 else 1),
                 "optimizer state": (MASTER_BYTES * p.drafter_params + optimizer) / n}
        offloaded = ({"optimizer state"} if p.offload_optimizer else set()) | (
            {"drafter weights"} if p.offload_params else set())
    gpu.update({name: math.ceil(size) for name, size in state.items() if name not in offloaded})
    gpu["activations (est.)"] = activation_bytes(p)
    return MemoryPlan(p, gpu, {name: math.ceil(state[name]) for name in state if name in offloaded})


def loss_parts(p: PlanInputs) -> dict[str, int]:
    """What the loss adds to the drafter's activations, by part."""
    rows, width = p.anchors * p.block_size, p.hidden_size * p.dtype_bytes
    parts = {"loss chunk logits": p.loss_chunk_peak, "hidden-state gradient": rows * width}
    if p.target_labels:
        parts.update({"target final hidden states": p.tokens_per_batch * width, "their block rows": rows * width})
    return parts


def activation_bytes(p: PlanInputs) -> int:
    """What one micro batch keeps alive at its peak (see the module docstring for the model)."""
    t, w, h = p.tokens_per_batch, p.dtype_bytes, p.hidden_size
    rows = p.anchors * p.block_size
    features = t * p.feature_layers * h * w                       # the target's output, the drafter's input
    target_layer = 0 if p.head_params else t * (4 * h + 3 * p.intermediate_size // p.tp_size) * w  # one layer's working set
    context = t * h * w + p.drafter_layers * t * 2 * p.kv_width * w  # fc output; K/V of the context
    per_layer = rows * (8 * h + 4 * p.intermediate_size) * w     # norms, q/k/v/o, attention out, MLP
    return features + max(target_layer, context + p.drafter_layers * per_layer + sum(loss_parts(p).values()))


def fitting_changes(p: PlanInputs, gpu_bytes: int, node_ranks: int) -> list[str]:
    """The single changes of the knobs a user has that bring the plan under `gpu_bytes`."""
    candidates = []
    tp = p.tp_size * 2
    while tp <= node_ranks:
        candidates.append((f"target.tp_size={tp}", replace(p, tp_size=tp)))
        tp *= 2
    if p.engine == "deepspeed" and p.zero_stage < 3:
        candidates.append(("train.ds_config=ds_configs/zero3.json", replace(p, zero_stage=3)))
    if p.engine == "fsdp" and not p.offload_optimizer:
        candidates.append(("fsdp.cpu_offload=true", replace(p, offload_optimizer=True, offload_params=True)))
    if p.engine == "deepspeed" and not p.offload_optimizer:
        candidates.append(("train.ds_config=ds_configs/zero2_offload.json",
                           replace(p, offload_optimizer=True, zero_stage=max(p.zero_stage, 2))))
    for factor in (2, 4):
        candidates.append((f"data.tokens_per_batch={p.tokens_per_batch // factor}",
                           replace(p, tokens_per_batch=p.tokens_per_batch // factor)))
        candidates.append((f"objective.anchors_per_batch={p.anchors // factor}",
                           replace(p, anchors=max(1, p.anchors // factor))))
    return [f"{knob} ({size_text(plan_memory(changed).total)})" for knob, changed in candidates
            if plan_memory(changed).total <= gpu_bytes]


def check_fits(plan: MemoryPlan, gpu_bytes: int, node_ranks: int) -> None:
    """Raise MemoryPlanError, with the plan and the changes that would fit, when it cannot fit."""
    if plan.total <= gpu_bytes:
        return
    changes = fitting_changes(plan.inputs, gpu_bytes, node_ranks)
    raise MemoryPlanError("\n".join(
        ["this run cannot fit the GPU's memory:", *plan.lines(gpu_bytes),
         "changes that fit: " + ("; ".join(changes) if changes else "none of target.tp_size, the ZeRO stage, "
                                 "offload, data.tokens_per_batch or objective.anchors_per_batch alone; combine them")]))


def check_host_fits(plan: MemoryPlan, host_bytes: int) -> None:
    """Raise MemoryPlanError when the node's ranks, each holding the target on the host while it loads,
    would need more than the node's memory: the kernel's OOM killer would end one rank mid-load and
    leave the others waiting in their next collective."""
    if plan.target_load_host <= host_bytes:
        return
    raise MemoryPlanError(
        f"host memory per node loading the target: {plan.inputs.node_ranks} ranks x "
        f"{size_text(plan.inputs.target_load_host)} = {size_text(plan.target_load_host)} > this node's "
        f"{size_text(host_bytes)}: every rank reads the whole target on the host (under target.tp_size too, "
        "before keeping its share); train from a feature store (data.features: only the head loads) or "
        "start fewer ranks per node")


# ---------------------------------------------------------------------------------------------
# From the configs
# ---------------------------------------------------------------------------------------------

def on_meta(model_config, model_class=None):
    """A model built from its config on the meta device (no memory, no weights)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return model_class(model_config) if model_class else AutoModelForCausalLM.from_config(model_config)


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def anchors_per_micro_batch(cfg) -> int:
    """objective.anchors_per_batch, or when it is null the blocks of the most sequences a batch can
    hold at data.max_length (shorter sequences make more: set anchors_per_batch to bound them)."""
    if cfg.objective.anchors_per_batch:
        return cfg.objective.anchors_per_batch
    return cfg.objective.num_anchors * max(1, cfg.data.tokens_per_batch // cfg.data.max_length)


def target_model_config(path: str | None, random: dict | None):
    """The target's whole model config (a multimodal target's too: its weights all load)."""
    if path is None:
        from drafter.target_model.model import target_config
        return target_config(None, random)
    from transformers import AutoConfig

    from drafter.errors import ConfigError, model_path_problem
    if problem := model_path_problem(path):
        raise ConfigError(f"target.path={path}: {problem}")
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as error:  # no such hub id; a model type transformers lacks
        raise ConfigError(f"target.path={path}: {error}") from None


def plan_inputs(cfg, model_config, world_size: int, ds_config: dict | None, dtype_bytes: int,
                device_type: str = "cuda") -> PlanInputs:
    """The plan's inputs from the run config, the target's (full) config and the DeepSpeed JSON, for
    ranks on `device_type`."""
    from drafter.models.configure import drafter_config
    from drafter.infra.engine import uses_muon
    from drafter.infra.launch import local_world_size
    from drafter.models import drafter_class
    from drafter.losses import loss_chunk_peak_bytes
    from drafter.target_model.tensor_parallel import planned_split

    text = model_config.get_text_config()
    draft = drafter_config(text, num_layers=cfg.drafter.num_layers, block_size=cfg.drafter.block_size,
                           mask_token_id=0, target_layer_ids=cfg.drafter.target_layer_ids,
                           variant=OmegaConf.to_object(cfg.drafter))
    zero = (ds_config or {}).get("zero_optimization", {})
    offloaded = lambda key: zero.get(key, {}).get("device", "none") not in ("none", None)  # noqa: E731
    fsdp_offload = cfg.train.engine == "fsdp" and cfg.fsdp.cpu_offload
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    target, drafter = on_meta(model_config), on_meta(draft, drafter_class(draft))
    matrices = sum(param.numel() for param in drafter.parameters() if uses_muon(param))
    objective = OmegaConf.to_object(cfg.objective)
    head_params = (2 * text.vocab_size * text.hidden_size
                   if cfg.data.get("features") and cfg.data.get("features_missing", "error") == "error" else 0)
    return PlanInputs(
        target_params=count_parameters(target),
        target_split_params=sum(param.numel() for param, _ in planned_split(target)[0]),
        dtype_bytes=dtype_bytes, tp_size=cfg.target.tp_size,
        drafter_params=count_parameters(drafter), world_size=world_size,
        muon_params=matrices if cfg.optim.name == "muon" else 0,
        engine=cfg.train.engine, zero_stage=zero.get("stage") if cfg.train.engine == "deepspeed" else None,
        offload_optimizer=fsdp_offload or offloaded("offload_optimizer"),
        offload_params=fsdp_offload or offloaded("offload_param"),
        tokens_per_batch=cfg.data.tokens_per_batch, anchors=anchors_per_micro_batch(cfg),
        block_size=cfg.drafter.block_size, hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size, kv_width=text.num_key_value_heads * head_dim,
        feature_layers=len(draft.dflash_config["target_layer_ids"]), drafter_layers=cfg.drafter.num_layers,
        target_labels=cfg.objective.labels == "target",
        loss_chunk_peak=loss_chunk_peak_bytes(objective, text.vocab_size,
                                              anchors_per_micro_batch(cfg) * (cfg.drafter.block_size - 1)),
        head_params=head_params, node_ranks=local_world_size(world_size),
        target_load_host=target_load_host(cfg, count_parameters(target), head_params, dtype_bytes, device_type))


def target_load_host(cfg, target_params: int, head_params: int, dtype_bytes: int, device_type: str) -> int:
    """Bytes of the target one rank holds in host memory while it loads (run_setup.build_target_and_tokenizer)."""
    if head_params:  # the embedding and LM head of a feature store
        return head_params * dtype_bytes
    if cfg.target.path is None:  # random_qwen3, built in fp32
        return target_params * 4
    if device_type == "cpu" or cfg.target.tp_size > 1:  # loaded on the host, or sharded there
        return target_params * dtype_bytes
    return 0  # load_target reads it straight onto the GPU
