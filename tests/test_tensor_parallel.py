"""target.tp_size (drafter/target_model/tensor_parallel.py) on two CPU ranks over gloo through the real launchers.

Tolerances: a sharded target sums its row-parallel products over the group, in another order than one
matmul: the features agree to rel 2e-6 of their scale in fp32 (measured: 8e-7 dense, 3e-7 MoE), the
final hidden states too (1.5e-6, 2.7e-7). A run's losses carry that through Adam at lr 3e-2, which
amplifies it as training goes on (more than the engines' few ulps, test_engines.py): the per-step
losses of tp 2 and tp 1 agree to rel 1e-4 over the first 12 steps (measured: 1.1e-5) and to rel 2e-3
over steps 13-24 (measured: 4.7e-4, at step 20; an uninterrupted tp 2 run logs the killed and
resumed one's losses exactly, measured once by hand); the held-out metrics to rel 1e-4 (measured: 4.9e-5
at step 24). A greedy decode is lossless, so with drafters this close the generated tau is equal.
"""
import json
import re
import signal

import pytest
from transformers import GPT2Config, Qwen3Config

from drafter.target_model.tensor_parallel import TensorParallelError, check_tensor_parallel
from drafter.training.run_config import load_config
from runs import REPO, VENV_BIN, _env, free_port, kill_job, launch, records, run_to_end, train_losses, wait_for_step

RTOL = 1e-4
LATE_RTOL = 2e-3  # steps 13-24 from the start (module docstring)


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


def max_rel_diff(got: dict, expected: dict, keys) -> float:
    return max(abs(got[k] - expected[k]) / abs(expected[k]) for k in keys)


@pytest.mark.slow
def test_a_tp2_run_killed_under_slurm_resumes_at_tp2_with_the_losses_generation_and_eval_of_tp1(
        reference_run, tmp_path):
    """A tp 2 run on 2 ranks (one group sharing the target), generating every 6 steps, started as srun
    starts tasks and SIGKILLed after its step-6 checkpoint; resumed at tp 2 through deepspeed. The
    reference is tp 1 (deepspeed, ZeRO-2), which generates only at its last step. Every step's loss, the
    held-out metrics and the step-24 generated tau are the reference's; each step is logged once."""
    ref_dir, cfg, _ = reference_run
    run = tmp_path / "tp2"
    tp2 = (f"run.out_dir={run}", "target.tp_size=2", "train.generate_every=6")
    proc = launch(cfg, *tp2, launcher="slurm")
    try:
        wait_for_step(run, 8, proc)
    finally:  # a rank that died would leave the other waiting in a collective
        kill_job(proc, signal.SIGKILL)
        proc.wait()
    assert [r["step"] for r in records(run, "generate")] == [6]  # generated at tp 2 before the kill
    out = run_to_end(cfg, *tp2, "train.resume=auto")
    assert "memory plan per GPU (target.tp_size=2, 2 ranks, ZeRO-2)" in out
    assert re.search(r"resumed from \S+step_6 at step 6 ", out), out[-2000:]
    expected, losses = train_losses(ref_dir / "run"), train_losses(run)
    assert [r["step"] for r in records(run)] == list(range(1, 25))
    early = [step for step in expected if step <= 12]
    assert max_rel_diff(losses, expected, early) <= RTOL, {s: (losses[s], expected[s]) for s in early}
    assert max_rel_diff(losses, expected, expected) <= LATE_RTOL, {s: (losses[s], expected[s]) for s in expected}
    generated, reference_gen = records(run, "generate"), records(ref_dir / "run", "generate")
    assert [r["step"] for r in generated] == [6, 12, 18, 24] and [r["step"] for r in reference_gen] == [24]
    # one group decodes all 4 prompts (the reference: 2 ranks, 2 each); a lossless decode with drafters
    # this close (the losses above) commits the same tokens per step
    assert generated[-1]["gen_responses"] == reference_gen[0]["gen_responses"] == 4
    for key in ("gen_tau_dflash", "gen_tau_ddtree@4", "gen_tau_ddtree@16"):
        assert generated[-1][key] == pytest.approx(reference_gen[0][key], rel=1e-12), key
    evaluated, reference_eval = records(run, "eval"), records(ref_dir / "run", "eval")
    assert [r["step"] for r in evaluated] == [r["step"] for r in reference_eval] == [12, 24]
    for got, want in zip(evaluated, reference_eval):
        assert got["eval_responses"] == want["eval_responses"] == 16
        for key in ("loss", "acc", "tau_dflash", "tau_ddtree@16"):
            assert got[key] == pytest.approx(want[key], rel=RTOL), (got["step"], key)


def test_the_tp_size_may_change_across_a_resume():
    """A tp 1 checkpoint resumes at tp 2 and back: target.tp_size is in neither the run's identity nor
    its data position (the features, and so the trajectory, are those of tp 1)."""
    from types import SimpleNamespace

    import numpy as np

    from drafter.training.checkpoint import run_identity
    from drafter.training.run_setup import data_position
    tp1, tp2 = (load_config(str(REPO / "configs" / "v3.yaml"), ["data.path=/x", f"target.tp_size={g}"]) for g in (1, 2))
    assert run_identity(tp1) == run_identity(tp2)
    sampler = SimpleNamespace(boundaries=np.array([64, 128]), lengths=np.arange(10))
    assert data_position(tp1, sampler, 2, None) == data_position(tp2, sampler, 2, None)


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

