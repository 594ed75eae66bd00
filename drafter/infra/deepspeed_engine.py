"""The DeepSpeed engine (drafter/infra/engine.py's interface): `deepspeed.initialize` over the drafter, its
JSON filled from the YAML and checked before any model loads (`deepspeed_config`), and whether the
optimizer op the JSON asks for can be built here (`deepspeed_op_problem`)."""
import json
import math
import os
import shutil
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from drafter.infra.engine import EngineConfigError, StepResult, build_optimizers, trainable, uses_muon
from drafter.infra.repo_paths import find_in_repo
from drafter.nested import flatten

ZERO_STAGES = (1, 2, 3)

# DeepSpeed's ZeRO step calls a torch collective that torch 2.13 deprecates: a note to DeepSpeed's
# authors, printed on every rank's first step, with nothing for a user to decide
warnings.filterwarnings("ignore", message="`torch.distributed.all_gather_into_tensor` is deprecated",
                        category=FutureWarning)


MUON_NS_METHOD = "gram"  # DeepSpeed's default Newton-Schulz form: see DeepSpeedEngine


def deepspeed_muon(params: list[nn.Parameter], optim, device: torch.device) -> torch.optim.Optimizer:
    """DeepSpeed's MuonWithAuxAdam over `params` with the settings of `build_optimizers`: Muon on the
    matrices of `uses_muon` (tagged `param.use_muon`, which is how DeepSpeed's ZeRO finds them) at
    optim.muon_lr, optim.muon_momentum, Nesterov and optim.weight_decay; torch's AdamW on the rest
    (fused where its state is on a GPU). ZeRO runs DeepSpeed's `muon_update` (momentum, Nesterov,
    Newton-Schulz, the sqrt(max(1, rows / cols)) scale) on the full matrices once per optimizer step,
    where it reduces the gradients; the optimizer's own step then applies the update to its partition."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    for param in params:
        param.use_muon = uses_muon(param)
    matrices, others = [p for p in params if p.use_muon], [p for p in params if not p.use_muon]
    groups = [dict(params=matrices, use_muon=True, lr=optim.muon_lr, momentum=optim.muon_momentum,
                   weight_decay=optim.weight_decay, ns_method=MUON_NS_METHOD),
              dict(params=others, use_muon=False, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                   weight_decay=optim.weight_decay)]
    return MuonWithAuxAdam([group for group in groups if group["params"]], adam_optimizer=torch.optim.AdamW,
                           adam_optimizer_kwargs={"fused": True} if device.type == "cuda" else {})


def deepspeed_config(json_path: str, cfg, world_size: int, bf16: bool, hidden_size: int,
                     on_cpu: bool) -> dict:
    """The DeepSpeed JSON with its "auto" values filled from the YAML, checked before any model loads.

    Values the YAML owns (batch shape, clipping, bf16, optimizer hyperparameters) may be hard-coded in
    the JSON only when they agree with the YAML; a contradiction, an "auto" left unfilled, a
    `scheduler` block (the YAML owns the schedule), fp16 or a ZeRO stage outside 1-3 is an error that
    names the key and both values. Without an `optimizer` block (zero2.json, zero3.json) the step is
    torch's AdamW, built by `DeepSpeedEngine`; a block (zero2_offload.json) makes DeepSpeed build its
    own, a compiled op on a GPU (`deepspeed_op_problem` checks that it can be built). With
    optim.name=muon the engine builds DeepSpeed's Muon itself (`deepspeed_muon`) under any stage, with
    or without optimizer offload: a JSON `optimizer` block is then refused, ZeRO-3's reduce_scatter is
    turned off (DeepSpeed's ZeRO-3 Muon refuses it) and offload takes the engine's optimizer
    (zero_force_ds_cpu_optimizer=false); either written the other way in the JSON is refused, and so is
    ZeRO-3 with offload and more than one micro batch per step (DeepSpeed loses micro batches there).
    """
    json_file = find_in_repo(json_path, "ds_configs", f"train.ds_config={json_path}")  # load_config's, for other callers
    try:
        ds = json.loads(json_file.read_text())
    except (OSError, ValueError) as error:
        raise EngineConfigError(f"train.ds_config={json_path}: cannot read it as JSON ({error})") from None
    problems = []
    if "scheduler" in ds:
        problems.append("a `scheduler` block: the learning-rate schedule is the YAML's (optim.*); remove it")
    if ds.get("fp16", {}).get("enabled") not in (None, False, "auto"):
        problems.append("fp16 is not supported (the frozen target runs in bf16 or fp32): use bf16")
    ds.pop("fp16", None)
    yaml_owned = {  # JSON key path -> (the YAML's value, where the YAML sets it)
        "train_micro_batch_size_per_gpu": (1, "one token-budget batch per micro step: data.tokens_per_batch"),
        "gradient_accumulation_steps": (cfg.optim.grad_accum, "optim.grad_accum"),
        "train_batch_size": (cfg.optim.grad_accum * world_size, "optim.grad_accum x world size"),
        "gradient_clipping": (cfg.optim.grad_clip, "optim.grad_clip"),
        "bf16.enabled": (bf16, "target.dtype"),
        "optimizer.params.lr": (cfg.optim.lr, "optim.lr"),
        "optimizer.params.betas": (list(cfg.optim.betas), "optim.betas"),
        "optimizer.params.eps": (cfg.optim.eps, "optim.eps"),
        "optimizer.params.weight_decay": (cfg.optim.weight_decay, "optim.weight_decay"),
    }
    if "optimizer" not in ds:  # torch's AdamW, built by DeepSpeedEngine from the YAML
        yaml_owned = {path: owned for path, owned in yaml_owned.items() if not path.startswith("optimizer.")}
    for path, (yaml_value, yaml_key) in yaml_owned.items():
        *parents, leaf = path.split(".")
        node = ds
        for key in parents:
            node = node.setdefault(key, {})
        current = node.get(leaf, "auto")
        if current == "auto":
            node[leaf] = yaml_value
        elif current != yaml_value:
            problems.append(f"{path}={current!r} in the JSON contradicts {yaml_key} = {yaml_value!r}")
    if bf16:
        ds["bf16"].setdefault("check_grad_overflow", True)  # skip non-finite steps in bf16 too
    if on_cpu and "optimizer" in ds:  # DeepSpeed's compiled optimizers are CUDA (or x86 C++) ops
        ds["optimizer"].setdefault("params", {}).setdefault("torch_adam", True)
    zero = ds.setdefault("zero_optimization", {})
    for key, value in (("reduce_bucket_size", hidden_size * hidden_size),
                       ("stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size)),
                       ("stage3_param_persistence_threshold", 10 * hidden_size)):
        if zero.get(key) == "auto":
            zero[key] = value
    stage = zero.get("stage")
    if stage not in ZERO_STAGES:
        problems.append(f"zero_optimization.stage={stage!r}: use 1, 2 or 3 (stage 0 does not skip "
                        "non-finite steps in every precision)")
    offload = zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None)
    if cfg.optim.name == "muon":
        if "optimizer" in ds:
            problems.append(f"optimizer.type={ds['optimizer'].get('type')!r} in the JSON contradicts optim.name = "
                            "'muon' (the engine builds DeepSpeed's Muon from the YAML): remove the `optimizer` block")
        if stage == 3 and zero.setdefault("reduce_scatter", False) is not False:
            problems.append(f"zero_optimization.reduce_scatter={zero['reduce_scatter']!r} in the JSON contradicts "
                            "optim.name = 'muon': DeepSpeed's ZeRO-3 Muon needs false")
        if cfg.optim.grad_clip > 0:
            problems.append(f"optim.grad_clip={cfg.optim.grad_clip} with optim.name=muon under train.engine="
                            "deepspeed: ZeRO orthogonalises while it reduces, so the norm it clips by is that of "
                            "Muon's update, not of the gradients, and would shrink every step; set "
                            "optim.grad_clip=0, or use train.engine=fsdp")
        if offload and ds.setdefault("zero_force_ds_cpu_optimizer", False) is not False:
            problems.append(f"zero_force_ds_cpu_optimizer={ds['zero_force_ds_cpu_optimizer']!r} in the JSON "
                            "contradicts optim.name = 'muon' with offload_optimizer: it needs false (the offloaded "
                            "state steps with the engine's Muon and torch's AdamW)")
    elif offload and "optimizer" not in ds:
        problems.append("zero_optimization.offload_optimizer needs an `optimizer` block (DeepSpeed's CPU Adam "
                        "steps the offloaded state; ds_configs/zero2_offload.json has one)")
    if offload and stage == 3 and cfg.optim.grad_accum > 1:
        problems.append(f"zero_optimization.stage=3 with offload_optimizer and optim.grad_accum = "
                        f"{cfg.optim.grad_accum}: DeepSpeed's ZeRO-3 offload steps on only part of the step's "
                        "gradient when micro batches accumulate (seen on the CPU, tests/test_muon_zero.py); use "
                        "optim.grad_accum=1, stage 1 or 2, or no offload")
    if zero.get("offload_param") and stage != 3:
        problems.append("zero_optimization.offload_param needs stage 3 (offload_optimizer works with 1-3)")
    left = [key for key, value in flatten(ds).items() if value == "auto"]
    if left:
        problems.append(f"\"auto\" that this trainer does not fill: {', '.join(left)} (write a value)")
    if problems:
        raise EngineConfigError(f"train.ds_config={json_path}: " + "; ".join(problems))
    return ds


def deepspeed_optimizer(ds_config: dict, device: torch.device, muon: bool = False) -> str:
    """What steps the drafter under this JSON: torch's AdamW (no `optimizer` block; with `muon`,
    DeepSpeed's Muon and torch's AdamW), or the DeepSpeed optimizer its block names, with the compiled
    op it builds (None: a torch optimizer)."""
    if muon:
        return "DeepSpeed Muon on the matrices, torch AdamW on the rest"
    if "optimizer" not in ds_config:
        return "torch AdamW" + (" (fused)" if device.type == "cuda" else "")
    op = deepspeed_op(ds_config, device)
    return f"DeepSpeed {ds_config['optimizer'].get('type')} from the JSON" + (f" (op {op})" if op else "")


def deepspeed_op(ds_config: dict, device: torch.device) -> str | None:
    """The compiled DeepSpeed op that the JSON's `optimizer` block makes DeepSpeed build, or None."""
    block = ds_config.get("optimizer")
    if block is None or device.type != "cuda" or block.get("params", {}).get("torch_adam"):
        return None
    offload = ds_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    on_host = offload not in ("none", None)
    kind = str(block.get("type", "")).lower()
    if kind in ("adam", "adamw"):
        return "cpu_adam" if on_host else "fused_adam"
    if kind == "lion":
        return "cpu_lion" if on_host else "fused_lion"
    return {"lamb": "fused_lamb", "adagrad": "cpu_adagrad" if on_host else None}.get(kind)


def deepspeed_op_problem(ds_config: dict, device: torch.device) -> str | None:
    """Why the op of `deepspeed_op` cannot be built on this machine, or None: a CPU op needs a C++
    compiler and ninja; a CUDA op needs CUDA_HOME with an nvcc of torch's CUDA major version. An op
    that DeepSpeed was installed with (DS_BUILD_*=1) needs neither. Checked before any weights load,
    where DeepSpeed itself would fail at its first step, minutes in, with a compiler trace."""
    op = deepspeed_op(ds_config, device)
    if op is None:
        return None
    from deepspeed.git_version_info import installed_ops
    if installed_ops.get(op):
        return None
    from torch.utils.cpp_extension import is_ninja_available
    missing = [] if is_ninja_available() else ["ninja (pip install ninja)"]
    if op.startswith("cpu_"):
        if not shutil.which(os.environ.get("CXX", "c++")):
            missing.append(f"a C++ compiler ({os.environ.get('CXX', 'c++')} is not on PATH)")
    else:
        missing += cuda_toolkit_problems()
    if not missing:
        return None
    return (f"the JSON's optimizer {ds_config['optimizer'].get('type')} makes DeepSpeed compile its op {op}, "
            f"which needs {'; '.join(missing)}: install it, or remove the `optimizer` block to step with "
            "torch's AdamW (docs/cluster.md)")


def cuda_toolkit_problems() -> list[str]:
    """What is missing to compile a CUDA extension against this torch: nvcc under CUDA_HOME, of
    torch's CUDA major version (DeepSpeed refuses a major mismatch)."""
    from deepspeed.ops.op_builder.builder import installed_cuda_version
    try:
        major, minor = installed_cuda_version()
    except Exception as error:  # MissingCUDAException: no CUDA_HOME, or no nvcc in it
        return [f"the CUDA toolkit's nvcc ({error})"]
    torch_cuda = torch.version.cuda or "none (a CPU build of torch)"
    if torch_cuda.split(".")[0] != str(major):
        return [f"an nvcc of torch's CUDA {torch_cuda} (CUDA_HOME's nvcc is {major}.{minor})"]
    return []


class DeepSpeedEngine:
    """`deepspeed.initialize` with the optimizer the YAML names (or the JSON's `optimizer` block).

    With optim.name=muon the optimizer is DeepSpeed's ZeRO Muon (`deepspeed_muon`): the matrices of
    `uses_muon`, at optim.muon_lr times the caller's lr / optim.lr, with torch.optim.Muon's momentum,
    Nesterov, 5 quintic Newton-Schulz steps (3.4445, -4.7750, 2.0315), sqrt(max(1, rows / cols))
    scale and decoupled weight decay; AdamW on the rest. It differs from FSDP2's torch.optim.Muon in:
      - Newton-Schulz's rounding: DeepSpeed iterates on the Gram matrix in fp16 (fp32 where the device
        has no fp16), torch on the matrix in bf16: the updates differ by about 1%, torch's rounding
        (on the CPU, 64-1024 wide: DeepSpeed's within 0.5% of the iteration in fp64, torch's 1-1.3%);
      - clipping: ZeRO orthogonalises while it reduces the gradients, so optim.grad_clip and the
        logged grad_norm cover Muon's update (norm about sqrt(sum of min(rows, cols))) and the other
        parameters' gradients, not the raw gradients as under FSDP2: a grad_clip under that norm
        shrinks every Muon step by it;
      - in bf16 runs the momentum is bf16, the gradients' dtype (torch.optim.Muon under FSDP2: fp32).
    """

    def __init__(self, drafter: nn.Module, ds_config: dict, optim, device: torch.device):
        import deepspeed

        self.num_parameters = sum(p.numel() for p in drafter.parameters())  # before ZeRO-3 partitions them
        self.stage = ds_config["zero_optimization"]["stage"]
        offload = ds_config["zero_optimization"].get("offload_optimizer", {}).get("device", "none")
        offloaded = offload not in ("none", None)
        muon = optim.name == "muon"
        self.description = (f"deepspeed ZeRO-{self.stage}"
                            + (f", optimizer offload to {offload}" if offloaded else "")
                            + f", {deepspeed_optimizer(ds_config, device, muon)}")
        if device.type == "cuda":  # DeepSpeed takes LOCAL_RANK for the device index: with one GPU per srun
            os.environ["LOCAL_RANK"] = str(device.index)  # task that is cuda:0, whatever the node-local rank
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
        params = trainable(drafter)
        if muon:  # deepspeed_config refuses an `optimizer` block with it
            client = deepspeed_muon(params, optim, torch.device("cpu") if offloaded else device)
        elif "optimizer" in ds_config:
            client = None
        else:
            client = build_optimizers(params, optim, device)[0]
        self.muon_lr_ratio = optim.muon_lr / optim.lr  # the Muon groups' lr, relative to the caller's
        self.engine, _, _, _ = deepspeed.initialize(model=drafter, model_parameters=params, optimizer=client,
                                                    config=ds_config)
        self.module = self.engine.module
        self.sharded = self.stage == 3

    def backward(self, loss: torch.Tensor) -> None:
        # What DeepSpeed's own forward() does first, which the caller's forward through engine.module
        # skips: without it ZeRO-3 counts every micro batch as a step's first and keeps only the last one's
        # gradient (ZeRO-1 and 2 accumulate either way)
        self.engine.optimizer.clear_backward_seen_flag()
        self.engine.backward(loss)  # scales by 1 / gradient_accumulation_steps
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()  # DeepSpeed counts micro batches in step(); nothing is updated here

    def step(self, lr: float) -> StepResult:
        for group in self.engine.optimizer.param_groups:  # with Muon: its group and AdamW's
            group["lr"] = lr * (self.muon_lr_ratio if group.get("use_muon") else 1.0)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return StepResult(self.engine.was_step_applied(), math.nan if norm is None else float(norm))

    def save(self, directory: Path) -> None:
        self.engine.save_checkpoint(str(directory.parent), tag=directory.name, save_latest=False)

    def load(self, directory: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(directory.parent), tag=directory.name,
                                              load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint to load in {directory}")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        import deepspeed

        gathered = (deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None)
                    if self.stage == 3 else nullcontext())
        with gathered:
            return {name: tensor.detach().cpu().clone() for name, tensor in self.module.state_dict().items()}


# ---------------------------------------------------------------------------------------------
