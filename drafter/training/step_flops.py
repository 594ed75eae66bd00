"""FLOPs of one training step, counted from the shapes (no profiler): what bench/gpu_check.py's MFU
divides by.

A linear layer costs 2 * rows * fan_in * fan_out forward, and backward twice that (input and weight
gradients). With T = seq_len, b = batch, H = hidden, Aw = q_heads * head_dim, Kw = kv_heads * head_dim,
I = intermediate, V = vocab:
  target     L_run = max(target_layer_ids) + 1 layers, forward only:
             2 * P_layer * b*T * L_run  +  4 * Aw * b*T*(T+1)/2 * L_run          (causal QK^T and AV)
             with P_layer = H*Aw + 2*H*Kw + Aw*H + 3*H*I (the layer's linear weights).
  drafter    forward + backward = 3x forward over its own rows, L_d layers, Q = b * A * B block rows:
             q/o/MLP on the Q block rows, k/v on the b*T context rows + the Q block rows, so
             6 * L_d * (Q * (2*H*Aw + 3*H*I) + (b*T + Q) * 2*H*Kw)
             + fc on the context: 4 * b*T * K*H * H (forward + weight gradient; features need no grad)
             + attention: 12 * Aw * L_d * pairs, pairs = sum over block rows of the keys the block mask
               shows them (anchor position + B); the keys flex_attention computes in partly masked
               tiles are not counted.
  LM head    frozen, on the S supervised rows: 2*V*H*S forward + 2*V*H*S for the hidden-state gradient
             (the step also computes the rows of unsupervised slots, at weight 0: not counted).
MFU = (all three) / step time / the chip's peak.
"""
import torch

from drafter.config import ObjectiveConfig, resolve_gamma
from drafter.models.blocks import build_blocks, sample_anchors


def linear_params(module: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


def layer_linear_params(cfg) -> int:
    """P_layer: the weights of one Qwen3 decoder layer's linears (the drafter's layers have the same)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    Aw, Kw = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return H * Aw + 2 * H * Kw + Aw * H + 3 * H * I


def formula_problem(target_cfg, drafter) -> str | None:
    """Why the formula no longer fits the drafter's layers (their linear weights differ from P_layer's
    count), or None."""
    expected = drafter.config.num_hidden_layers * layer_linear_params(target_cfg)
    counted = linear_params(drafter.layers)
    if counted == expected:
        return None
    return (f"FLOP formula out of date: drafter layers hold {counted} linear weights, the formula "
            f"{expected} (has the layer gained a projection or a bias?)")


def step_flops(target_cfg, drafter, seq_len: int, anchors: torch.Tensor, supervised_rows: int) -> dict:
    """FLOPs of one step by part (see the module docstring); `anchors` [b, A] as the step draws them."""
    H, V = target_cfg.hidden_size, target_cfg.vocab_size
    Aw = target_cfg.num_attention_heads * target_cfg.head_dim
    Kw = target_cfg.num_key_value_heads * target_cfg.head_dim
    b, B = anchors.shape[0], drafter.block_size
    ctx_rows, block_rows = b * seq_len, anchors.numel() * B
    layers_run, draft_layers = max(drafter.target_layer_ids) + 1, drafter.config.num_hidden_layers

    target = layers_run * (2 * layer_linear_params(target_cfg) * ctx_rows
                           + 4 * Aw * b * seq_len * (seq_len + 1) // 2)
    per_layer_rows = (block_rows * (2 * H * Aw + 3 * H * target_cfg.intermediate_size)
                      + (ctx_rows + block_rows) * 2 * H * Kw)
    pairs = B * int((anchors.long() + B).sum())
    drafter_linear = 6 * draft_layers * per_layer_rows + 4 * ctx_rows * len(drafter.target_layer_ids) * H * H
    drafter_attention = 12 * Aw * draft_layers * pairs
    lm_head = 4 * V * H * supervised_rows
    return {"target_forward": target, "drafter_linear": drafter_linear,
            "drafter_attention": drafter_attention, "lm_head": lm_head}


def drawn_blocks(drafter, input_ids, loss_mask, objective: ObjectiveConfig, seed: int):
    """The anchors and supervised-row count `training_step` will draw with a generator seeded `seed`
    (anchor sampling is the generator's first use there), for the FLOP count."""
    anchors, valid = sample_anchors(loss_mask, objective.num_anchors, torch.Generator().manual_seed(seed),
                                    objective.anchors_per_batch)
    blocks = build_blocks(input_ids, loss_mask, anchors, valid, drafter.block_size,
                          drafter.mask_token_id, resolve_gamma(objective.gamma, drafter.block_size))
    return anchors, int(valid.sum()), int((blocks.weights > 0).sum())
