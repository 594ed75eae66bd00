from drafter.training.tracking import console_line, eval_line

TRAIN_RECORD = {"elapsed_s": 180, "step": 31, "loss": 4.06961, "acc": 0.25, "anchor_streak": 4.521,
                "anchor_ddtree@32": 5.834, "ddtree_budget": 32, "lr": 6.85e-6, "noise": 0.1,
                "grad_norm": 1.23, "target_batches_per_s": 0.63, "drafter_batches_per_s": 0.62,
                "tokens_per_s": 24600, "prefetch_queue": [5, 5], "epoch_progress": 0.01, "eta_s": 60,
                "skipped_steps": 0}


def test_console_line_names_the_random_anchor_metrics():
    line = console_line(TRAIN_RECORD)
    assert line.startswith("[3.0m] step=31 loss=4.0696 acc=0.250 anchor_streak=4.52 anchor_ddtree@32=5.83 ")
    other_budget = console_line({**TRAIN_RECORD, "ddtree_budget": 8, "anchor_ddtree@8": 2.0})
    assert " anchor_ddtree@8=2.00 " in other_budget and "@32" not in other_budget


def test_eval_line_shows_each_group_the_record_holds():
    held_out = {"step": 300, "loss": 2.10342, "acc": 0.45, "acc_pos": [0.5, 0.4], "anchor_streak": 4.52,
                "anchor_ddtree@32": 5.83, "tau_dflash": 1.623, "tau_ddtree@32": 2.41}
    assert eval_line(held_out) == ("eval step=300 | held-out loss=2.103 acc=0.45 anchor_streak=4.52 "
                                   "anchor_ddtree@32=5.83 | replayed tau_dflash=1.623 tau_ddtree@32=2.41")
    generated = {"step": 900, "gen_tau_dflash": 1.6, "gen_tau_ddtree@32": float("nan"), "gen_seconds": 4.1}
    assert eval_line(generated, "generate") == ("generate step=900 | generated gen_tau_dflash=1.6 "
                                                "gen_tau_ddtree@32=nan gen_seconds=4.1")
