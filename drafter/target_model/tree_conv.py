"""LFM2's short convolution over a DDTree: the one tree-structured state fork here, family code in its
own home.

A short conv's output at a position reads the inputs of that position and the k - 1 before it
(k = `conv_L_cache`, 3 in LFM2). In a tree, a node's k - 1 predecessors are its ancestors, and then
the prefix's last inputs (the conv history the cache holds). So a whole tree passes through the conv
layer in one flat forward, each node's state computed once from its parent's: during the verify,
each `Lfm2ShortConv` reads its window along every verify row's ancestor chain (`tree_convolution`)
while the attention layers take the tree mask (`TargetCache.tree_attention_mask`). Its inputs are
appended to the cache's conv history like any forward's, one column per verify row, and
`TargetCache.compact` keeps the accepted path's columns as it keeps the attention keys' rows.
This costs nodes + 1 tokens where the batch of paths costs leaves x (depth + 1)
(bench/hybrid_verify.py); no other conv or recurrent layer kind has this form here.
"""
import functools
import weakref
from contextlib import contextmanager

import torch
import torch.nn.functional as F

try:
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv
except ImportError:  # a transformers without LFM2
    Lfm2ShortConv = None


_SHORT_CONVS = weakref.WeakKeyDictionary()  # target -> its LFM2 short convs, found once


def short_convs(target) -> list:
    """The target's LFM2 short conv mixers."""
    if target not in _SHORT_CONVS:
        _SHORT_CONVS[target] = [module for module in target.modules()
                                if Lfm2ShortConv and isinstance(module, Lfm2ShortConv)]
    return _SHORT_CONVS[target]


def tree_conv_layers(target) -> set[int]:
    """Indices of the cache layers whose state an LFM2 short conv holds (computed over a tree here)."""
    return {module.layer_idx for module in short_convs(target)}


def ancestor_windows(parent_rows: torch.Tensor, width: int) -> torch.Tensor:
    """[q, width] indices into (the prefix's last width - 1 inputs, then the q verify rows): for verify
    row i (parent_rows[i] its parent's row, -1 for the root), its width - 1 ancestors oldest first, then
    itself; above the root the chain runs into the prefix's inputs."""
    history = width - 1
    extended_parent = torch.cat([torch.arange(-1, history - 1, device=parent_rows.device),
                                 torch.where(parent_rows < 0, history - 1, parent_rows + history)])
    window = [torch.arange(history, history + len(parent_rows), device=parent_rows.device)]
    for _ in range(history):
        window.insert(0, extended_parent[window[0]])
    return torch.stack(window, dim=1)


def _tree_forward(module, windows, hidden_states, cache=None, attention_mask=None, **kwargs):
    """`Lfm2ShortConv.forward` over the verify rows of a tree (`windows`: `ancestor_windows`)."""
    gates, values, inputs = module.in_proj(hidden_states).transpose(-1, -2).chunk(3, dim=-2)
    inputs = gates * inputs                                                   # [1, H, q]
    width = module.conv_kernel_size
    layer = cache.layers[module.layer_idx]
    history = layer.conv_states[0][..., -(width - 1):]
    history = F.pad(history, (width - 1 - history.shape[-1], 0))  # a prefix shorter than the kernel
    rows = torch.cat([history.to(inputs.dtype), inputs], dim=-1)[..., windows]  # [1, H, q, width]
    out = (rows * module.conv.weight[:, 0, None, :]).sum(-1)
    if module.conv.bias is not None:
        out = out + module.conv.bias[:, None]
    cache.update_conv_state(inputs, module.layer_idx, conv_kernel_size=width)
    return module.out_proj((values * out).transpose(-1, -2).contiguous())


@contextmanager
def tree_convolution(target, parent_rows: torch.Tensor):
    """Within the context, each LFM2 short conv of `target` computes a flat verify forward's rows as a
    tree whose row i has parent row parent_rows[i] (-1 for the root); a no-op on other targets."""
    convs = short_convs(target)
    for module in convs:
        module.forward = functools.partial(_tree_forward, module,
                                           ancestor_windows(parent_rows, module.conv_kernel_size))
    try:
        yield
    finally:
        for module in convs:
            del module.forward
