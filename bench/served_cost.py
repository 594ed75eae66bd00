"""What measuring served tau during training costs, against the training steps it rides on.

    python bench/served_cost.py [--cfg configs/toy.yaml] [--threads 1]

A target and a drafter of the config's shapes (the toy target's architecture from data/toy.py,
random weights) on one rank, one batch of the config's token budget (rows of --row-length tokens,
the first --prompt-length unsupervised). Timed by drafter/infra/timing.py, best of about --min-run-time
seconds of calls after a warm-up:
  train step   target features + training forward + backward + AdamW step (the baseline)
  replay       drafter/serving/served.py's replayed_tau on the same batch (features included), at the
               config's train.tau_budgets: what each eval batch now adds
  generation   generation_tau on --prompt-length-token prompts, at the config's generate settings:
               a random drafter accepts nothing, so every step commits one token (the most steps a
               prompt can take: an upper bound); one timed call
and the share of the run's time they would take at the config's step counts:
  replay:     evals x eval_batches x replay / (max_steps x train step)
  generation: generations x min(per-rank prompts x per-prompt time, generate_max_seconds + one prompt)
              / (max_steps x train step)
"""
import argparse
import math
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # data/toy.py's shapes, run from anywhere

from data.toy import TARGET_CONFIG, VOCAB_SIZE  # noqa: E402
from drafter.infra.timing import best_time  # noqa: E402
from drafter.models import DFlashDraftModel  # noqa: E402
from drafter.models.blocks import DraftingSetup, FeatureBatch  # noqa: E402
from drafter.models.configure import drafter_config  # noqa: E402
from drafter.serving.served import generation_tau, replayed_tau  # noqa: E402
from drafter.target_model.model import context_features, random_qwen3  # noqa: E402
from drafter.training.objective import training_step  # noqa: E402
from drafter.training.run_config import load_config  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cfg", default="configs/toy.yaml")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the toy: 1 per rank)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks the run's prompts are split over")
    parser.add_argument("--row-length", type=int, default=256)
    parser.add_argument("--prompt-length", type=int, default=100)
    parser.add_argument("--min-run-time", type=float, default=1.0, help="seconds of timed calls per measure")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.cfg)
    train = cfg.train

    target = random_qwen3(vocab_size=VOCAB_SIZE, **TARGET_CONFIG)
    mask_token_id = VOCAB_SIZE - 1
    drafter = DFlashDraftModel(drafter_config(target.config, num_layers=cfg.drafter.num_layers,
                                              block_size=cfg.drafter.block_size, mask_token_id=mask_token_id))
    objective = OmegaConf.to_object(cfg.objective)
    rows = cfg.data.tokens_per_batch // args.row_length
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, VOCAB_SIZE - 1, (rows, args.row_length), generator=gen)
    loss_mask = torch.zeros_like(input_ids)
    loss_mask[:, args.prompt_length:] = 1
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)

    def train_step():
        features = context_features(target, input_ids, drafter.target_layer_ids)
        loss, _ = training_step(DraftingSetup(drafter, target, "dense"), FeatureBatch(input_ids, loss_mask, features),
                                objective, torch.Generator().manual_seed(0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def replay():
        features = context_features(target, input_ids, drafter.target_layer_ids)
        replayed_tau(DraftingSetup(drafter.eval(), target, "dense", budgets=tuple(train.tau_budgets),
                                   blocks_per_forward=cfg.objective.anchors_per_batch or 2048),
                     FeatureBatch(input_ids, loss_mask, features))
        drafter.train()

    prompts = input_ids[:, :args.prompt_length].tolist()

    def generation():
        out = generation_tau(DraftingSetup(drafter, target, budgets=tuple(train.tau_budgets)), prompts,
                             max_new_tokens=train.generate_max_new_tokens, max_seconds=math.inf)
        assert out["gen_tau_dflash"][1] == len(prompts)

    train_s = best_time(train_step, args.min_run_time)
    replay_s = best_time(replay, args.min_run_time)
    per_prompt_s = best_time(generation, 0) / len(prompts)

    steps = train.max_steps
    evals = steps // train.eval_every + (steps % train.eval_every != 0)
    generations = (steps // train.generate_every + (steps % train.generate_every != 0)
                   if train.generate_every else 0)
    per_rank_prompts = math.ceil(train.generate_max_prompts / args.ranks)
    generation_s = min(per_rank_prompts * per_prompt_s, train.generate_max_seconds + per_prompt_s)
    run_s = steps * train_s
    print(f"{args.cfg}: {rows} rows x {args.row_length} tokens ({args.prompt_length} prompt), "
          f"{args.threads} thread(s), budgets {list(train.tau_budgets)}")
    print(f"train step {train_s * 1e3:.0f} ms | replay {replay_s * 1e3:.0f} ms per eval batch "
          f"({replay_s / train_s:.2f} train steps) | generation {per_prompt_s:.2f} s per prompt "
          f"({train.generate_max_new_tokens} new tokens, {1 + len(train.tau_budgets)} methods)")
    replay_total, generation_total = evals * train.eval_batches * replay_s, generations * generation_s
    print(f"{steps} steps: replay {evals} x {train.eval_batches} batches = {replay_total:.1f} s "
          f"({replay_total / run_s:.1%}), generation {generations} x {generation_s:.1f} s = "
          f"{generation_total:.1f} s ({generation_total / run_s:.1%}) of {run_s:.0f} s of training steps")


if __name__ == "__main__":
    main()
