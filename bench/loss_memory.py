"""Peak memory of the drafter loss: chunked LM-head loss vs materialising all logits.

Real vocabulary (151,936, Qwen3), 512 anchors x 16 block slots, small hidden size. Each variant runs in
its own process (on CPU the peak is the process's max RSS; on CUDA, max_memory_allocated), then the
parent checks that loss and gradients agree and prints the ratio. Goal: chunked peak <= 1/8 of naive.
`--objective target-kl` measures distillation (objective.labels=target, loss=kl): the chunked loss
reads the target's final hidden states and computes its logits chunk by chunk; the naive baseline
materialises both sides' logits.

    python bench/loss_memory.py [--vocab 151936 --anchors 512 --block 16 --hidden 64]
    python bench/loss_memory.py --objective target-kl
"""
import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from drafter.infra.memory import peak_memory_bytes
from drafter.losses.lm_head import (ChunkedLMHeadLoss, RowLossSpec, chunk_rows_for, dense_lm_head_loss,
                                    dense_row_loss, weighted_data_ce)
from drafter.losses.weights import position_weights


def make_inputs(args, device):
    gen = torch.Generator().manual_seed(0)
    rows = args.anchors * args.block
    hidden = (torch.randn(rows, args.hidden, generator=gen) / args.hidden ** 0.5).to(device)
    head = torch.randn(args.vocab, args.hidden, generator=gen).to(device)
    labels = torch.randint(0, args.vocab, (rows,), generator=gen).to(device)
    weights = position_weights(args.block, 7.0, device).repeat(args.anchors)
    teacher = (torch.randn(rows, args.hidden, generator=gen) * 2 / args.hidden ** 0.5).to(device)
    return hidden.requires_grad_(True), head, labels, weights, teacher


def weighted(row_loss, weights):
    return (row_loss * weights).sum() / weights.sum()


def loss_of(args, hidden, head, labels, weights, teacher):
    """The variant's loss: data CE (the fixed-weight one-pass loss) or forward KL to the target."""
    kl = RowLossSpec("target", "kl", chunk_rows_for(args.vocab))
    if args.objective == "data-ce":
        if args.variant == "naive":
            return dense_lm_head_loss(hidden, head, labels, weights)
        return weighted_data_ce(hidden, head, labels, weights, chunk_rows_for(args.vocab))[0]
    if args.variant == "naive":
        return weighted(dense_row_loss(hidden, head, labels, teacher, kl), weights)
    return weighted(ChunkedLMHeadLoss.apply(hidden, head, labels, teacher, kl)[0], weights)


def run_variant(args, out: Path):
    device = torch.device(args.device)
    inputs = make_inputs(args, device)
    hidden = inputs[0]
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = peak_memory_bytes(device)
    start = time.perf_counter()
    loss = loss_of(args, *inputs)
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    save_file({"loss": loss.detach().cpu()[None], "grad": hidden.grad.cpu()}, str(out / f"{args.variant}.safetensors"))
    (out / f"{args.variant}.json").write_text(json.dumps(
        {"peak_bytes": peak_memory_bytes(device) - before, "seconds": seconds}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--objective", choices=["data-ce", "target-kl"], default="data-ce")
    parser.add_argument("--variant", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        return run_variant(args, Path(args.out))

    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for variant in ("naive", "chunked"):
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--variant", variant, "--out", tmp],
                           check=True)
            results[variant] = {**json.loads(Path(tmp, f"{variant}.json").read_text()),
                                **load_file(str(Path(tmp, f"{variant}.safetensors")))}
    naive, chunked = results["naive"], results["chunked"]
    loss_diff = (naive["loss"] - chunked["loss"]).abs().item()
    grad_diff = ((naive["grad"] - chunked["grad"]).abs().max() / naive["grad"].abs().max()).item()
    ratio = chunked["peak_bytes"] / naive["peak_bytes"]
    gib = 2 ** 30
    print(f"loss memory | {args.objective} | vocab {args.vocab} | {args.anchors} anchors x {args.block} | hidden {args.hidden} | {args.device}")
    print(f"  naive   (all fp32 logits): peak {naive['peak_bytes'] / gib:7.3f} GiB  {naive['seconds']:6.2f} s")
    print(f"  chunked (ours)           : peak {chunked['peak_bytes'] / gib:7.3f} GiB  {chunked['seconds']:6.2f} s")
    print(f"  peak ratio chunked/naive = {ratio:.4f} (goal <= 0.125: {'PASS' if ratio <= 0.125 else 'FAIL'})")
    print(f"  |loss diff| = {loss_diff:.2e}   max rel grad diff = {grad_diff:.2e}")
    if loss_diff > 1e-3 or grad_diff > 1e-3:
        sys.exit("chunked loss or gradients disagree with the naive version")


if __name__ == "__main__":
    main()
