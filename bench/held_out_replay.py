"""A checkpoint's held-out slot accuracy and replayed tau over a whole prepared set, so that runs whose
in-training evals read a few batches (or predate `replay_acc_pos`) compare on the same rows.

    python bench/held_out_replay.py --ckpt runs/a/checkpoints/latest [--ckpt ...] \\
        --data artifacts/smollm2/bench_chat_data [--budgets 8,32] [--dtype bf16] [--out table.json]

Every row is replayed on its own (no padding), with the target's features, as training's eval replays:
`replay_acc_pos` (each slot's top-1 accuracy at every anchor) and tau_dflash / tau_ddtree@B.
"""
import argparse
import json
import sys

import torch

from drafter.pipeline.datasets import load_prepared
from drafter.errors import ConfigError, UserError
from drafter.metric_sums import finalize_metrics
from drafter.models import load_drafter
from drafter.models.blocks import DraftingSetup, FeatureBatch
from drafter.serving.served import replayed_tau
from drafter.target_model.model import DTYPES, context_features, load_target
from drafter.training.checkpoint import drafter_dir


def replay_checkpoint(ckpt: str, data_path: str, budgets: list[int], dtype: torch.dtype) -> dict:
    directory = drafter_dir(ckpt)
    drafter = load_drafter(directory, dtype=dtype).eval()
    target_path = drafter.config.dflash_config.get("target_path")
    if target_path is None:
        raise ConfigError(f"{directory}: its dflash_config names no target_path (a run on a random target): "
                          "there is no target to replay with")
    target = load_target(target_path, "cpu", dtype)
    rows = load_prepared(data_path, target.config.get_text_config().vocab_size)
    summed = {}
    with torch.no_grad():
        for row in rows.with_format("torch"):
            input_ids, loss_mask = row["input_ids"][None].long(), row["loss_mask"][None].long()
            features = context_features(target, input_ids, drafter.target_layer_ids)
            for key, value in replayed_tau(DraftingSetup(drafter, target, "dense", budgets=tuple(budgets)),
                                           FeatureBatch(input_ids, loss_mask, features)).items():
                summed[key] = summed[key] + value if key in summed else value
    return {"ckpt": ckpt, "rows": len(rows), **finalize_metrics(summed)}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", action="append", required=True, help="a train.py checkpoint (repeatable)")
    parser.add_argument("--data", required=True, help="a prepared held-out set (data/prepare.py output)")
    parser.add_argument("--budgets", default="8,32", help="DDTree budgets, comma-separated")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--out", help="write the table as JSON here")
    args = parser.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",")]
    try:
        results = [replay_checkpoint(ckpt, args.data, budgets, DTYPES[args.dtype]) for ckpt in args.ckpt]
    except (UserError, FileNotFoundError) as error:  # no checkpoint, no target, no prepared set there
        sys.exit(f"error: {error}")
    print("| checkpoint | slot 1 / 2 / 4 / 8 / 15 | DFlash | " + " | ".join(f"DDTree@{b}" for b in budgets) + " |")
    for r in results:
        acc = r["replay_acc_pos"]
        slots = " / ".join(f"{acc[s - 1]:.3f}" for s in (1, 2, 4, 8, 15) if s <= len(acc))
        taus = " | ".join(f"{r[f'tau_ddtree@{b}']:.3f}" for b in budgets)
        print(f"| {r['ckpt']} | {slots} | {r['tau_dflash']:.3f} | {taus} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
