"""target.tp_size (drafter/tensor_parallel.py) on two CPU ranks over gloo through the real launchers.

Tolerances: a sharded target sums its row-parallel products over the group, in another order than one
matmul: the features agree to rel 2e-6 of their scale in fp32 (measured: 8e-7 dense, 3e-7 MoE), the
final hidden states too (1.5e-6, 2.7e-7). A
run's losses carry that through Adam at lr 3e-2 as the engines' reduction orders are carried
(test_engines.py): the per-step losses of tp 2 and tp 1 agree to rel 1e-4 (measured: 1.1e-5 over
12 steps from the start); the held-out metrics to rel 1e-4.
"""
import json
import re

import pytest
from transformers import GPT2Config, Qwen3Config

from drafter.tensor_parallel import TensorParallelError, check_tensor_parallel
from runs import REPO, VENV_BIN, _env, free_port, records, run_to_end, train_losses

RTOL = 1e-4


@pytest.mark.slow
def test_tp2_features_distillation_and_generation_equal_tp1_for_a_dense_and_a_moe_target(tmp_path):
    import subprocess
    cmd = [str(VENV_BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(REPO / "tests" / "tp_features.py"), str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, report in enumerate(reports):
        for family in ("dense", "moe"):
            r = report[family]
            assert r["max_diff"] <= 2e-6 * r["scale"], (rank, family, r)
            assert r["no_final"] and r["distill_features_diff"] <= 2e-6 * r["scale"], (rank, family, r)
            assert r["final_diff"] <= 2e-6 * r["final_scale"], (rank, family, r)  # what distillation reads
            # each rank holds about half of the layers' weights (norms and the MoE router stay whole)
            assert 0.5 <= r["sharded_layer_bytes"] / r["whole_layer_bytes"] < 0.51, (rank, family, r)
            if rank == 0:  # the other member had no batch: rank 0's features still come right
                assert r["alone_diff"] <= 2e-6 * r["scale"]
            else:
                assert r["alone_is_none"]
    # Generation: the group decodes all 4 prompts in lockstep (dflash and ddtree@4 on the sharded
    # target, its decoding probe included) and counts them once: the tau of the whole target.
    generation = reports[0]["generation"]
    expected, sharded = generation["expected"], generation["sharded"]
    assert expected["gen_tau_dflash_count"] == expected["gen_tau_ddtree@4_count"] == 4
    assert expected["gen_tau_dflash"] > 1.5  # a drafter that accepts something: prompts tell apart
    for key in ("gen_tau_dflash", "gen_tau_ddtree@4", "gen_tau_dflash_count", "gen_tau_ddtree@4_count"):
        assert sharded[key] == pytest.approx(expected[key], rel=1e-12), key
    assert sharded["gen_seconds_count"] == 1 and 0 < sharded["gen_seconds"] < 600  # one group's seconds
    member = reports[1]["generation"]  # the member that does not report adds zeros to the same sums
    assert member["reported_nothing"] and not generation["reported_nothing"] and member["sharded"] == sharded
    # rank 1 started 3 s late with a 2.5 s budget: rank 0's clock stops the group after one prompt
    # (a member stopping on its own clock would leave the other waiting on a sharded forward)
    assert generation["late"]["gen_tau_dflash_count"] == 1


@pytest.mark.slow
def test_a_tp1_checkpoint_resumes_at_tp2_and_logs_the_losses_of_tp1(reference_run, tmp_path):
    """The reference run is tp 1 on 2 ranks (deepspeed, ZeRO-2). Its step-18 checkpoint resumes at
    tp 2 (the same run: tp_size changes neither its identity nor its data position), and steps 19-24
    log the reference's losses and, at step 24, its held-out metrics."""
    ref_dir, cfg, _ = reference_run
    run = tmp_path / "tp2"
    out = run_to_end(cfg, f"run.out_dir={run}", f"train.resume={ref_dir / 'run' / 'checkpoints' / 'step_18'}",
                     "target.tp_size=2", "train.generate_every=0")
    assert "memory plan per GPU (target.tp_size=2, 2 ranks, ZeRO-2)" in out
    assert re.search(r"resumed from \S+step_18 at step 18 ", out), out[-2000:]
    expected, losses = train_losses(ref_dir / "run"), train_losses(run)
    assert sorted(losses) == list(range(19, 25))
    for step in losses:
        assert losses[step] == pytest.approx(expected[step], rel=RTOL), (step, losses[step], expected[step])
    (evaluated,), reference_eval = records(run, "eval"), records(ref_dir / "run", "eval")[-1]
    assert evaluated["step"] == reference_eval["step"] == 24 and evaluated["eval_responses"] == 16
    for key in ("loss", "acc", "tau_dflash", "tau_ddtree@16"):
        assert evaluated[key] == pytest.approx(reference_eval[key], rel=RTOL), key


def qwen3(**widths):
    return Qwen3Config(vocab_size=256, hidden_size=64, num_hidden_layers=4, head_dim=16, intermediate_size=128,
                       **widths)


@pytest.mark.parametrize("config, tp_size, node_ranks, message", [
    (qwen3(num_attention_heads=4, num_key_value_heads=2), 3, 6,
     "target.tp_size=3 cannot split the target's num_attention_heads=4 (qwen3)"),
    (qwen3(num_attention_heads=3, num_key_value_heads=1), 2, 2,  # the toy target's shape
     "target.tp_size=2 cannot split the target's num_attention_heads=3 (qwen3)"),
    (qwen3(num_attention_heads=4, num_key_value_heads=1), 2, 2,
     "target.tp_size=2 cannot split the target's num_key_value_heads=1 (qwen3)"),
    (qwen3(num_attention_heads=4, num_key_value_heads=2), 4, 2, "target.tp_size=4 must divide the ranks of a node (2 "),
    (GPT2Config(), 2, 2, "target.tp_size=2: the gpt2 family has no tensor-parallel plan in transformers; use target.tp_size=1"),
])
def test_a_target_the_group_cannot_split_is_refused_by_name(config, tp_size, node_ranks, message):
    with pytest.raises(TensorParallelError, match=re.escape(message)):
        check_tensor_parallel(config, tp_size, node_ranks, world_size=node_ranks)
    check_tensor_parallel(config, 1, node_ranks, world_size=node_ranks)  # tp 1 serves any target


def test_a_plan_style_this_trainer_does_not_apply_is_refused_by_name():
    from transformers import AutoConfig
    config = AutoConfig.for_model("qwen3_5_text")  # linear-attention layers: a gathered column split
    with pytest.raises(TensorParallelError, match=r"the qwen3_5_text plan shards .*colwise_gather_output"):
        check_tensor_parallel(config, 2, 2, 2)

