"""Throughput, peak memory and MFU of bf16 drafter training steps on one GPU (random weights).

    python bench/gpu_train_step.py                      # Qwen3-8B-shaped target + 5-layer drafter, H200
    python bench/gpu_train_step.py --tiny               # tiny shapes, runs on the CPU in seconds

One step is what train.py does per micro-batch on one rank, without DeepSpeed: target features
(`context_features`, no grad, layers 0..max(target_layer_ids) only), `training_step` (anchors, block
mask, drafter forward, chunked LM-head loss, metrics), backward, AdamW on the bf16 drafter (fused on
CUDA; train.py's ZeRO-2 keeps fp32 master weights instead, so its optimizer time differs). Feature
noise is left out. Each sequence is random tokens with the loss mask on after a `--prompt`-token prompt.

FLOPs per step are counted from the shapes (no profiler); a linear layer costs 2 * rows * fan_in *
fan_out forward, and backward twice that (input and weight gradients). With T = seq_len, b = batch,
H = hidden, Aw = q_heads * head_dim, Kw = kv_heads * head_dim, I = intermediate, V = vocab:
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
  LM head    frozen, on the S supervised rows: 2*V*H*S forward + 2*V*H*S for the hidden-state gradient.
MFU = (all three) / step time / --peak-tflops (989 = H100/H200 SXM dense bf16).
Ends with one JSON line holding every number.
"""
import argparse
import json
import resource
import sys
import time
from contextlib import contextmanager

import torch

from drafter.model import DFlashDraftModel, drafter_config
from drafter.objective import ObjectiveConfig, build_blocks, resolve_gamma, sample_anchors, training_step
from drafter.target import context_features, random_qwen3

QWEN3_8B = dict(vocab_size=151_936, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, intermediate_size=12_288, rope_theta=1e6,
                max_position_embeddings=40_960)
QWEN3_8B_DRAFTER = dict(num_layers=5, block_size=16, target_layer_ids=[1, 9, 17, 25, 33],
                        mask_token_id=151_669)
QWEN3_8B_RUN = dict(seq_len=3072, prompt=128, num_anchors=512)

TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=128, rope_theta=1e6)
TINY_DRAFTER = dict(num_layers=2, block_size=16, target_layer_ids=[1, 4], mask_token_id=511)
TINY_RUN = dict(seq_len=256, prompt=32, num_anchors=32)

START = time.perf_counter()


def log(message: str):
    print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - START:6.1f}s] {message}", flush=True)


def sync_time(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@contextmanager
def build_on(device: torch.device, dtype: torch.dtype):
    """Modules built inside get their weights created (and initialised) directly on `device` in
    `dtype`: the 8B target is never materialised in fp32 on the CPU."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)  # later float tensors (anchor scores, weights) stay fp32


def linear_params(module: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


def layer_linear_params(cfg) -> int:
    """P_layer: the weights of one Qwen3 decoder layer's linears (the drafter's layers have the same)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    Aw, Kw = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return H * Aw + 2 * H * Kw + Aw * H + 3 * H * I


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


def build_models(args, device: torch.device):
    shapes, drafter_shapes = (TINY, TINY_DRAFTER) if args.tiny else (QWEN3_8B, QWEN3_8B_DRAFTER)
    with build_on(device, torch.bfloat16):
        target = random_qwen3(**shapes, seed=0)
        torch.manual_seed(1)
        drafter = DFlashDraftModel(drafter_config(target.config, **drafter_shapes)).train()
    expected = drafter.config.num_hidden_layers * layer_linear_params(target.config)
    counted = linear_params(drafter.layers)
    if counted != expected:
        sys.exit(f"FLOP formula out of date: drafter layers hold {counted} linear weights, the formula "
                 f"{expected} (has the layer gained a projection or a bias?)")
    return target, drafter


def make_batch(vocab_size: int, batch: int, seq_len: int, prompt: int, device: torch.device):
    """Random tokens; loss mask on after the prompt."""
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab_size, (batch, seq_len), generator=gen).to(device)
    loss_mask = torch.ones(batch, seq_len, dtype=torch.long, device=device)
    loss_mask[:, :prompt] = 0
    return input_ids, loss_mask


def drawn_blocks(input_ids, loss_mask, objective: ObjectiveConfig, seed: int):
    """The anchors and supervised-row count `training_step` will draw with a generator seeded `seed`
    (anchor sampling is the generator's first use there), for the FLOP count."""
    anchors, valid = sample_anchors(loss_mask, objective.num_anchors, torch.Generator().manual_seed(seed),
                                    objective.anchors_per_batch)
    blocks = build_blocks(input_ids, loss_mask, anchors, valid, objective.block_size,
                          objective.mask_token_id, resolve_gamma(objective.gamma, objective.block_size))
    return anchors, int(valid.sum()), int((blocks.weights > 0).sum())


def run_step(target, drafter, optimizer, input_ids, loss_mask, objective, seed: int, use_flex: bool,
             device: torch.device) -> dict:
    t0 = sync_time(device)
    features = context_features(target, input_ids, drafter.target_layer_ids)
    t1 = sync_time(device)
    loss, _ = training_step(drafter, target, features, input_ids, loss_mask, objective,
                            torch.Generator().manual_seed(seed), use_flex)
    loss.backward()
    t2 = sync_time(device)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    t3 = sync_time(device)
    return {"target_s": t1 - t0, "drafter_s": t2 - t1, "optimizer_s": t3 - t2, "step_s": t3 - t0,
            "loss": loss.detach().item()}


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU allowed)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--seq-len", type=int, help="default 3072 (tiny: 256)")
    parser.add_argument("--prompt", type=int, help="unsupervised prefix; default 128 (tiny: 32)")
    parser.add_argument("--anchors", type=int, help="anchors per sequence; default 512 (tiny: 32)")
    parser.add_argument("--anchors-per-batch", type=int, help="cap on blocks per step (default: none)")
    parser.add_argument("--attention", choices=["auto", "flex", "dense"], default="auto",
                        help="auto: flex on CUDA, dense on the CPU (flex has no CPU backward)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (compilation)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU")
    args = parser.parse_args()
    run = {**(TINY_RUN if args.tiny else QWEN3_8B_RUN),
           **{k: v for k, v in (("seq_len", args.seq_len), ("prompt", args.prompt),
                                ("num_anchors", args.anchors)) if v is not None}}
    if not torch.cuda.is_available() and not args.tiny:
        sys.exit("CUDA is not available: the Qwen3-8B-shaped check needs a GPU (use --tiny on the CPU)")
    if not 0 < run["prompt"] < run["seq_len"] - 1:
        sys.exit(f"--prompt {run['prompt']} leaves no supervised anchor in --seq-len {run['seq_len']}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    shapes = "tiny" if args.tiny else "Qwen3-8B"
    log(f"device {device_name}; building target and drafter ({shapes} shapes, bf16)")

    target, drafter = build_models(args, device)
    weights_gib = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
    target_params = sum(p.numel() for p in target.parameters())
    drafter_params = sum(p.numel() for p in drafter.parameters())
    log(f"built: target {target_params / 1e9:.3f}B params, drafter {drafter_params / 1e9:.3f}B params"
        + (f", weights {weights_gib:.1f} GiB" if weights_gib is not None else ""))

    optimizer = torch.optim.AdamW(drafter.parameters(), lr=args.lr, fused=device.type == "cuda")
    objective = ObjectiveConfig(block_size=drafter.block_size, mask_token_id=drafter.mask_token_id,
                                num_anchors=run["num_anchors"], ddtree_budget=64,
                                anchors_per_batch=args.anchors_per_batch)
    input_ids, loss_mask = make_batch(target.config.vocab_size, args.batch, run["seq_len"], run["prompt"],
                                      device)
    use_flex = args.attention == "flex" or (args.attention == "auto" and device.type == "cuda")

    timed, flops, blocks = [], [], 0
    for step in range(args.warmup + args.steps):
        anchors, valid_blocks, supervised_rows = drawn_blocks(input_ids, loss_mask, objective, seed=step)
        result = run_step(target, drafter, optimizer, input_ids, loss_mask, objective, step, use_flex, device)
        phase = "warmup" if step < args.warmup else "timed"
        log(f"{phase} step {step}: {result['step_s']:.3f}s (target {result['target_s']:.3f} drafter "
            f"{result['drafter_s']:.3f} optimizer {result['optimizer_s']:.3f}) loss {result['loss']:.4f}")
        if step >= args.warmup:
            timed.append(result)
            flops.append(step_flops(target.config, drafter, run["seq_len"], anchors, supervised_rows))
            blocks += valid_blocks

    seconds = {k: sum(r[k] for r in timed) for k in ("step_s", "target_s", "drafter_s", "optimizer_s")}
    flops_by_part = {k: sum(f[k] for f in flops) for k in flops[0]}
    total_flops = sum(flops_by_part.values())
    drafter_flops = total_flops - flops_by_part["target_forward"]
    report = {
        "device": device_name, "shapes": "tiny" if args.tiny else "qwen3-8b",
        "attention": "flex" if use_flex else "dense",
        "batch": args.batch, **run, "anchors_per_batch": args.anchors_per_batch,
        "block_size": drafter.block_size, "target_layer_ids": drafter.target_layer_ids,
        "warmup_steps": args.warmup, "timed_steps": args.steps,
        "target_params": target_params, "drafter_params": drafter_params,
        "tokens_per_s": args.batch * run["seq_len"] * args.steps / seconds["step_s"],
        "blocks_per_s": blocks / seconds["step_s"],
        "step_s": seconds["step_s"] / args.steps,
        "time_split_s": {k.removesuffix("_s"): seconds[k] / args.steps
                         for k in ("target_s", "drafter_s", "optimizer_s")},
        "weights_gib": weights_gib, "peak_memory_gib": peak_memory_gib(device),
        "peak_memory_kind": "cuda_max_allocated" if device.type == "cuda" else "cpu_max_rss",
        "tflop_per_step": {k: v / args.steps / 1e12 for k, v in flops_by_part.items()},
        "achieved_tflops": total_flops / seconds["step_s"] / 1e12,
        "target_tflops": flops_by_part["target_forward"] / seconds["target_s"] / 1e12,
        "drafter_tflops": drafter_flops / seconds["drafter_s"] / 1e12,
        "peak_tflops": args.peak_tflops,
        "mfu": total_flops / seconds["step_s"] / (args.peak_tflops * 1e12),
        "loss_first_last": [timed[0]["loss"], timed[-1]["loss"]],
        "wall_s": time.perf_counter() - START,
    }
    print_table(report)
    print(json.dumps(report))


def print_table(r: dict):
    rows = [("tokens/s", f"{r['tokens_per_s']:,.0f}"), ("blocks/s", f"{r['blocks_per_s']:,.0f}"),
            ("step", f"{r['step_s'] * 1e3:.1f} ms"),
            *((f"  {k}", f"{v * 1e3:.1f} ms ({v / r['step_s']:.0%})") for k, v in r["time_split_s"].items()),
            (f"peak memory ({r['peak_memory_kind']})", f"{r['peak_memory_gib']:.2f} GiB"),
            ("TFLOP per step", f"{sum(r['tflop_per_step'].values()):.4g}"),
            *((f"  {k}", f"{v:.4g}") for k, v in r["tflop_per_step"].items()),
            ("achieved TFLOP/s", f"{r['achieved_tflops']:.4g} (target fwd {r['target_tflops']:.4g}, "
                                 f"drafter fwd+bwd + LM head {r['drafter_tflops']:.4g})"),
            (f"MFU vs {r['peak_tflops']:.0f} TFLOP/s", f"{r['mfu']:.1%}")]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
