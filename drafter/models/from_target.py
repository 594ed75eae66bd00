"""Starting a drafter's layers from the target's (`drafter.layers_from_target`: one target layer id per
drafter layer).

A fresh drafter must learn, before anything else, which context positions to read: its attention
starts uniform over hundreds of context keys, so the few that matter (the last positions before the
anchor) reach slot 1 diluted, and the loss sits on the unigram for hundreds of steps (docs/results.md,
"Calibrations"). The target's own layers already hold heads that read recent positions, with the
rotary the drafter shares. Each drafter layer takes every weight of its target layer of the same name
(attention projections, MLP, the two norms); what the target's layer has not (a Llama target has no
per-head q/k norms, a MoE layer no dense MLP) keeps its fresh init. A weight of another shape (a
tensor-parallel share) or a module that computes otherwise with the same weights (Gemma's (1 + w)
norms, Qwen2's biased projections) is refused: the layer would be neither fresh nor the target's.

The context path is started so that the copied layers see what they saw inside the target: `fc`
passes the first feature layer through unchanged (the identity on its slice, zeros elsewhere) and
`hidden_norm` takes the first copied layer's input norm. With the first copied layer right after the
first feature layer (target_layer_ids[0] + 1, the default this module suggests), the first drafter
layer's context keys and values are then exactly that target layer's (up to the drafter's q/k norms).
"""
import copy

import torch
from torch import nn

from drafter.errors import ConfigError
from drafter.target_model.model import decoder_layers


def suggested_layers(target_layer_ids: list[int], num_layers: int) -> list[int]:
    """The target layers right after the first feature layer, one per drafter layer."""
    return [target_layer_ids[0] + 1 + i for i in range(num_layers)]


def check_layer_ids(layer_ids: list[int], num_drafter_layers: int, num_target_layers: int) -> None:
    if len(layer_ids) != num_drafter_layers:
        raise ConfigError(f"drafter.layers_from_target={list(layer_ids)}: one target layer per drafter layer "
                          f"(drafter.num_layers={num_drafter_layers})")
    bad = [i for i in layer_ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_target_layers]
    if bad:
        raise ConfigError(f"drafter.layers_from_target={list(layer_ids)}: {bad} not layers of a target of "
                          f"{num_target_layers} layers")


@torch.no_grad()
def start_layers_from_target(drafter: nn.Module, target: nn.Module, layer_ids: list[int]) -> str:
    """Copy target layer `layer_ids[i]` into drafter layer i where names and shapes match, start `fc`
    as the first feature layer's identity and `hidden_norm` as the first layer's input norm; return
    one line saying what was copied."""
    target_layers = decoder_layers(target)
    check_layer_ids(layer_ids, len(drafter.layers), len(target_layers))
    copied, kept = set(), set()
    for layer, target_id in zip(drafter.layers, layer_ids):
        source = target_layers[target_id].state_dict()
        for name, tensor in layer.state_dict().items():
            if name not in source:
                kept.add(name)
                continue
            if source[name].shape != tensor.shape:  # a share of the layer (target.tp_size), or another layer
                raise ConfigError(f"drafter.layers_from_target: target layer {target_id}'s {name} is "
                                  f"{list(source[name].shape)}, the drafter's {list(tensor.shape)} (a target "
                                  "sharded by target.tp_size holds a share of each layer: start from a whole one)")
            tensor.copy_(source[name])
            copied.add(name)
        check_same_function(layer, target_layers[target_id], target_id, copied)
    if not copied:
        raise ConfigError(f"drafter.layers_from_target={list(layer_ids)}: no weight of the target's layers "
                          f"({type(target_layers[0]).__name__}) has a drafter layer's name and shape")
    hidden = drafter.fc.out_features
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, :hidden].copy_(torch.eye(hidden))
    drafter.hidden_norm.weight.copy_(drafter.layers[0].input_layernorm.weight)
    return (f"drafter layers from target layers {list(layer_ids)}: copied {', '.join(sorted(copied))}; "
            f"fresh {', '.join(sorted(kept)) or 'none'}; fc = the first feature layer, hidden_norm = "
            f"layer {layer_ids[0]}'s input norm")


def check_same_function(layer: nn.Module, target_layer: nn.Module, target_id: int, copied: set) -> None:
    """Every module whose weights were all copied computes what the target's module of that name does
    on the same input: a norm of another rule (Gemma's (1 + w)) or a projection whose bias the drafter
    has not would otherwise start a layer that is not the target's."""
    target_modules = dict(target_layer.named_modules())
    for name, module in layer.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if not params or not all(f"{name}.{p}" in copied for p in params) or name not in target_modules:
            continue
        weight = params["weight"]
        probe = torch.randn(3, weight.shape[-1], generator=torch.Generator().manual_seed(0)).to(weight)
        # the target's module where the drafter's lives, in its dtype (a bf16 target on a GPU, an fp32 drafter on the CPU)
        reference = copy.deepcopy(target_modules[name]).to(device=weight.device, dtype=weight.dtype)
        if not torch.allclose(module(probe), reference(probe), rtol=1e-4, atol=1e-5):
            raise ConfigError(f"drafter.layers_from_target: target layer {target_id}'s {name} "
                              f"({type(target_modules[name]).__name__}) computes otherwise than the drafter's "
                              f"({type(module).__name__}) with the same weights: this target's layers cannot "
                              "start the drafter's")
