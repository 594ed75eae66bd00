"""The frozen target sharded by tensor parallelism over `target.tp_size` consecutive ranks, while every
rank keeps training the drafter on its own micro batch.

    group = form_tp_group(tp_size)                    # collective: consecutive ranks, within a node
    target = shard_target(whole_target, group)        # on the host, before the target moves to its GPU
    features = TargetFeatures(target, group, device)
    features(input_ids, layer_ids)                    # this rank's (features, None), as tp 1 computes them

Sharding applies the family's own plan (`base_model_tp_plan` of its transformers config): column-
parallel projections keep their share of output rows (attention heads, MLP channels), row-parallel
ones their share of input columns, and the outputs of row-parallel modules (and of MoE expert blocks)
are summed over the group. The embedding, the final norm and the LM head stay whole on every rank: the
drafter reads them with its own rows. A family without a plan, a plan style this module does not
apply, or a width the group cannot split is refused by name before anything loads.

The group's members hold different batches, so `TargetFeatures` runs the sharded target once per
member: the member's input ids are broadcast to the group, every member computes the same
(replicated) features, and the final hidden states for distillation (the final norm is whole on
every member), and only the owner keeps them. The data plan, anchors, noise, metrics and
checkpoints are those of a tp 1 run; the target's weights per GPU are divided by the group size.
"""
import hashlib
import inspect
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from drafter.errors import UserError
from drafter.target_model import model
from drafter.target_model.model import context_features, features_and_final_hidden, load_target

SPLIT_DIM = {"colwise": -2, "packed_colwise": -2, "rowwise": -1}  # the weight dim each style splits
SUMMED = ("rowwise", "moe_tp_experts")   # modules whose output is a partial sum over the group
WHOLE = ("replicated_with_grad_allreduce",)  # kept whole (its gradient all-reduce is for training it)
# config keys of the widths a group splits: heads, channels
FEATURE_WIDTH_MULTIPLE = 16  # 16 fp32 lanes (AVX-512); a multiple of 8 (AVX2) as well
PAD_ID = 0  # the width padding's id: any works, causal attention keeps it from the real positions
SPLIT_WIDTHS = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size")


class TensorParallelError(UserError, ValueError):
    pass


def family_plan(model_config) -> dict[str, str]:
    return dict(getattr(model_config.get_text_config(), "base_model_tp_plan", None) or {})


def check_tensor_parallel(model_config, tp_size: int, node_ranks: int, world_size: int,
                          key: str = "target.tp_size") -> None:
    """Raise TensorParallelError, naming the key (the config's, or a CLI flag) and the reason, unless
    the target can be split."""
    if tp_size == 1:
        return
    if node_ranks % tp_size or world_size % tp_size:
        raise TensorParallelError(f"{key}={tp_size} must divide the ranks of a node ({node_ranks} here, "
                                  f"{world_size} in all): a group's ranks share one node")
    text = model_config.get_text_config()
    plan = family_plan(model_config)
    if not plan:
        raise TensorParallelError(f"{key}={tp_size}: the {text.model_type} family has no tensor-parallel "
                                  f"plan in transformers; use {key}=1")
    unknown = sorted({f"{name}: {style}" for name, style in plan.items()
                      if style not in (*SPLIT_DIM, *SUMMED, *WHOLE)})
    if unknown:
        raise TensorParallelError(f"{key}={tp_size}: the {text.model_type} plan shards "
                                  f"{', '.join(unknown)}, a style this trainer does not apply; use {key}=1")
    for name in SPLIT_WIDTHS:
        width = getattr(text, name, None)
        if width is not None and width % tp_size:
            raise TensorParallelError(f"{key}={tp_size} cannot split the target's {name}={width} "
                                      f"({text.model_type}); choose a tp size that divides it")


@dataclass(frozen=True)
class TPGroup:
    ranks: list[int]   # global ranks of this rank's group, consecutive
    index: int         # this rank's place in it (0: the member that reports, in evaluation)
    group: object      # the process group (None at tp 1)

    @property
    def size(self) -> int:
        return len(self.ranks)


def form_tp_group(tp_size: int, backend: str | None = None) -> TPGroup:
    """Collective: every rank creates every group (torch requires it) and keeps its own. tp 1 needs
    no process group, nor an initialised world (a single-process evaluation)."""
    if tp_size == 1:
        return TPGroup([dist.get_rank() if dist.is_initialized() else 0], 0, None)
    rank, mine = dist.get_rank(), None
    for first in range(0, dist.get_world_size(), tp_size):
        ranks = list(range(first, first + tp_size))
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            mine = TPGroup(ranks, ranks.index(rank), group)
    return mine


def load_tp_target(path: str, group: TPGroup, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """`load_target`, sharded over `group` on the host first: a sharded target is never whole on a GPU.
    Host memory pays for it: every rank of the group loads the whole target there before keeping its
    share, so a node holds (its ranks) x (the target's bytes) at once while it loads (the memory plan's
    host line)."""
    if group.size == 1:
        return load_target(path, device, dtype)
    return shard_target(load_target(path, "cpu", dtype), group).to(device)


def _style(name: str, plan: dict[str, str]) -> str | None:
    for pattern, style in plan.items():
        if re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), name):
            return style
    return None


def _keep_share(param: nn.Parameter, style: str, index: int, size: int) -> None:
    """Replace `param`'s data by this member's share along the style's dim (each half of a packed
    weight, e.g. gate and up, split alike)."""
    if style == "rowwise" and param.dim() == 1:  # a row-parallel bias: added once, by the first member
        if index:
            param.data = torch.zeros_like(param.data)
        return
    dim = SPLIT_DIM[style] if param.dim() > 1 else 0  # a column-parallel bias splits with its rows
    parts = param.data.chunk(2, dim=dim) if style == "packed_colwise" else (param.data,)
    param.data = torch.cat([part.chunk(size, dim=dim)[index] for part in parts], dim=dim).contiguous()


def planned_split(target: nn.Module) -> tuple[list[tuple[nn.Parameter, str]], list[nn.Module]]:
    """(the parameters the family's plan splits, with their style; the modules whose outputs are sums)."""
    plan, split, summed = family_plan(target.config), [], []
    for name, module in target.get_decoder().named_modules():
        style = _style(name, plan)
        for param_name, param in module.named_parameters(recurse=False):
            param_style = style if style in SPLIT_DIM else _style(f"{name}.{param_name}", plan)
            if param_style in SPLIT_DIM:
                split.append((param, param_style))
        if style in SUMMED:
            summed.append(module)
    return split, summed


def shard_target(target: nn.Module, group: TPGroup) -> nn.Module:
    """Keep this member's share of every weight the family's plan splits; sum partial outputs over the group."""
    if group.size == 1:
        return target
    split, summed = planned_split(target)
    for param, style in split:
        _keep_share(param, style, group.index, group.size)
    for module in summed:
        module.register_forward_hook(_sum_over(group.group))
    return target


def _sum_over(process_group):
    def hook(module, inputs, output):
        dist.all_reduce(output, group=process_group)
        return output
    return hook


class TargetFeatures:
    """What the objective reads of this rank's batch, through its group's sharded target: the context
    features (`context_features`), and with `final_hidden` (distillation) the target's final-normed
    last hidden states too (`features_and_final_hidden`)."""

    def __init__(self, target: nn.Module, group: TPGroup, device: torch.device, final_hidden: bool = False):
        self.target, self.group, self.device, self.final_hidden = target, group, device, final_hidden

    def __call__(self, input_ids: torch.Tensor | None, layer_ids: list[int], lengths=None):
        """(features [b, T, K*H], final hidden states [b, T, H] or None without `final_hidden`).
        Collective over the group: every member calls it the same number of times; a member with no
        batch this time passes None (and gets (None, None)). With `lengths` (the rows' real lengths)
        and a tp size of 1, a CPU computes each row alone (`_row_by_row`)."""
        if self.group.size == 1:
            if lengths is not None and input_ids.device.type == "cpu":
                return self._row_by_row(input_ids, layer_ids, lengths)
            return self._target_pass(input_ids, layer_ids)
        shapes = self._gather(torch.tensor(input_ids.shape if input_ids is not None else (0, 0), device=self.device))
        mine = None, None
        for member, shape in zip(self.group.ranks, shapes.tolist()):
            if shape[0] == 0:
                continue
            ids = input_ids if member == dist.get_rank() else torch.empty(shape, dtype=torch.long, device=self.device)
            dist.broadcast(ids, src=member, group=self.group.group)
            passed = self._target_pass(ids, layer_ids)
            if member == dist.get_rank():
                mine = passed
        return mine

    def _row_by_row(self, input_ids: torch.Tensor, layer_ids: list[int], lengths):
        """Each row's own forward at its length rounded up to FEATURE_WIDTH_MULTIPLE (zeros past it): on
        the CPU a batched forward gives a row other bits in another batch (the GEMM kernels block by the
        batch's shape, the vector tails by its width), so a row's features stored once (data/features.py)
        could not equal those of every batch it is in; alone, a row always gets the same bits."""
        rows = [self._target_pass(input_ids[i:i + 1, :length], layer_ids)
                for i, length in enumerate(lengths.tolist() if torch.is_tensor(lengths) else lengths)]
        features = input_ids.new_zeros((*input_ids.shape, rows[0][0].shape[-1]), dtype=rows[0][0].dtype)
        final = (input_ids.new_zeros((*input_ids.shape, rows[0][1].shape[-1]), dtype=rows[0][1].dtype)
                 if self.final_hidden else None)
        for i, (row_features, row_final) in enumerate(rows):
            features[i, :row_features.shape[1]] = row_features[0]
            if final is not None:
                final[i, :row_final.shape[1]] = row_final[0]
        return features, final

    def _target_pass(self, input_ids: torch.Tensor, layer_ids: list[int]):
        """The target's forward on the batch right-padded to a multiple of FEATURE_WIDTH_MULTIPLE (the
        CPU kernels' vectorised tails would otherwise reach the last real positions)."""
        width = input_ids.shape[1]
        ids = F.pad(input_ids, (0, -width % FEATURE_WIDTH_MULTIPLE), value=PAD_ID)
        if self.final_hidden:
            features, final = features_and_final_hidden(self.target, ids, layer_ids)
            return features[:, :width].contiguous(), final[:, :width].contiguous()
        return context_features(self.target, ids, layer_ids)[:, :width].contiguous(), None

    def most_in_group(self, count: int) -> int:
        """The largest `count` of the group's members (how many calls each member makes)."""
        if self.group.size == 1:
            return count
        return int(self._gather(torch.tensor([count], device=self.device)).max())

    def _gather(self, value: torch.Tensor) -> torch.Tensor:
        gathered = [torch.empty_like(value) for _ in self.group.ranks]
        dist.all_gather(gathered, value, group=self.group.group)
        return torch.stack(gathered)


def feature_code_version() -> str:
    """A hash of the source of the functions that compute the features: a feature store written by other
    code is refused rather than trusted."""
    parts = [model.context_features, model.features_and_final_hidden, model.FeatureTap, model.layer_state,
             TargetFeatures._target_pass, TargetFeatures._row_by_row]
    source = "".join(inspect.getsource(part) for part in parts) + str(FEATURE_WIDTH_MULTIPLE)
    return hashlib.sha256(source.encode()).hexdigest()[:16]
