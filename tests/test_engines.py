"""Engines, ZeRO stages and launchers, on two CPU ranks over gloo through the real launchers.

Every ZeRO stage a user can write (and optimizer offload) trains, resumes and exports the full weights:
ZeRO-3 the reference drafter, ZeRO-1 and offload a distilled DFlash2 variant, whose offload resume is
exact; FSDP2 under torchrun follows the DeepSpeed trajectory, resumes exactly after SIGKILL and
exports for the public `dflash` package; a non-finite step that only one rank sees is skipped on both;
gradient accumulation agrees between the engines; `srun`-style tasks form one world and stop on SIGUSR1.

Tolerances: with two ranks the gradient all-reduce adds two fp32 numbers, which is exact in any order,
so the engines differ only in how they partition, average (divide before or after the sum), clip and
step: a few fp32 ulps per step, which Adam at lr 3e-2 carries forward. The per-step losses of
different engines agree to rel 1e-4 (measured: see the closing notes); a resume of the same engine
agrees to rel 1e-6.
"""
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runs import REPO, UNIFORM_LOSS, kill_job, launch, records, run_to_end, train_losses, wait_for_step

pytestmark = pytest.mark.slow
ENGINE_RTOL = 1e-4
RESUME_RTOL = 1e-6


def ds_config(tmp_path: Path, base: str, **zero) -> str:
    config = json.loads((REPO / "ds_configs" / base).read_text())
    config["zero_optimization"].update(zero)
    path = tmp_path / f"ds_{base}"
    path.write_text(json.dumps(config))
    return str(path)


def exported(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step_{step}" / "drafter" / "model.safetensors"))


def assert_same_trajectory(losses: dict, expected: dict, steps, rtol: float):
    for step in steps:
        assert losses[step] == pytest.approx(expected[step], rel=rtol), (step, losses[step], expected[step])


def assert_same_weights(ours: dict, theirs: dict, rtol: float):
    """Each tensor within rtol of the other in norm. Not element by element: Adam turns reduction-order
    noise in a near-zero gradient entry into an update of up to lr, so a few single weights of two
    engines' runs drift apart while the tensors stay equal to ~1e-4 (a wrong or partial export is off
    by far more: every weight moves by about lr per step)."""
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name].numel() > 0 and torch.isfinite(ours[name]).all(), name
        assert ours[name].shape == theirs[name].shape, name
        assert (ours[name] - theirs[name]).norm() <= rtol * theirs[name].norm(), name


def params_line(out: str) -> str:
    return next(line for line in out.splitlines() if "M params" in line).split("drafter ")[1].split(",")[0]


def test_zero3_partitions_trains_resumes_and_exports_full_weights(reference_run, tmp_path):
    ref_dir, cfg, ref_out = reference_run
    # a persistence threshold of 0 partitions even the tiny test drafter's weights
    json_path = ds_config(tmp_path, "zero3.json", stage3_param_persistence_threshold=0)
    run = tmp_path / "run"
    common = [f"run.out_dir={run}", f"train.ds_config={json_path}", "train.schedule_steps=24"]
    first = run_to_end(cfg, *common, "train.max_steps=6")
    assert "resumed from" in run_to_end(cfg, *common, "train.max_steps=12")
    assert "ZeRO-3" in first
    assert params_line(first) == params_line(ref_out)  # counted before ZeRO-3 partitions the weights
    expected = train_losses(ref_dir / "run")
    assert list(train_losses(run)) == list(range(1, 13))
    assert_same_trajectory(train_losses(run), expected, range(1, 13), ENGINE_RTOL)
    assert_same_weights(exported(run, 12), exported(ref_dir / "run", 12), rtol=10 * ENGINE_RTOL)
    from dflash.model import DFlashDraftModel as PublicDraftModel
    public = PublicDraftModel.from_pretrained(run / "checkpoints" / "step_12" / "drafter", dtype=torch.float32)
    assert sum(p.numel() for p in public.parameters()) == sum(t.numel() for t in exported(run, 12).values())


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, reference_run):
    """The reference config under train.engine=fsdp through torchrun, uninterrupted."""
    _, cfg, _ = reference_run
    run = tmp_path_factory.mktemp("fsdp") / "run"
    out = run_to_end(cfg, f"run.out_dir={run}", "train.engine=fsdp", launcher="torchrun")
    return run, out


def test_fsdp_trains_like_deepspeed_and_exports_for_dflash(reference_run, fsdp_run):
    ref_dir, _, ref_out = reference_run
    run, out = fsdp_run
    assert "fsdp2 (fp32" in out and params_line(out) == params_line(ref_out)
    losses, expected = train_losses(run), train_losses(ref_dir / "run")
    assert list(losses) == list(range(1, 25))
    assert sum(list(losses.values())[-4:]) / 4 < UNIFORM_LOSS - 0.5  # well below where a fresh drafter starts
    assert_same_trajectory(losses, expected, range(1, 21), ENGINE_RTOL)
    assert_same_weights(exported(run, 24), exported(ref_dir / "run", 24), rtol=10 * ENGINE_RTOL)
    assert (run / "checkpoints" / "step_24" / "fsdp" / ".metadata").exists()  # torch.distributed.checkpoint
    from dflash.model import DFlashDraftModel as PublicDraftModel
    public = PublicDraftModel.from_pretrained(run / "checkpoints" / "latest" / "drafter", dtype=torch.float32)
    assert public.block_size == 8 and public.mask_token_id == 255


def test_fsdp_sigkill_then_resume_reproduces_the_uninterrupted_losses(reference_run, fsdp_run, tmp_path):
    _, cfg, _ = reference_run
    run = tmp_path / "killed"
    proc = launch(cfg, f"run.out_dir={run}", "train.engine=fsdp", launcher="torchrun")
    wait_for_step(run, 14, proc)
    kill_job(proc, signal.SIGKILL)
    proc.wait()
    assert not (run / "checkpoints" / "step_24").exists()
    out = run_to_end(cfg, f"run.out_dir={run}", "train.engine=fsdp", launcher="torchrun")
    assert re.search(r"resumed from \S+ at step (12|18) ", out), out[-3000:]
    assert [r["step"] for r in records(run)] == list(range(1, 25))
    assert_same_trajectory(train_losses(run), train_losses(fsdp_run[0]), range(1, 25), RESUME_RTOL)


# docs/design.md contract 11: the variant launches below train DFlash2 with a sliding layer.
VARIANT = ["drafter.arch=dflash2", "drafter.layer_types=[sliding_attention]", "drafter.sliding_window=4",
           "drafter.selector_rank=8", "drafter.selector_top_k=8"]
# objective.* options that only the FSDP launch of tests/test_distill.py ran before: distillation with D-PACE weights
DISTILL = ["objective.labels=target", "objective.loss=kl", "objective.position_weights=dpace"]


def assert_public_dflash2_loads_every_weight(drafter_dir: Path):
    from dflash.model import DFlash2DraftModel as PublicDraftModel
    public, loading = PublicDraftModel.from_pretrained(drafter_dir, dtype=torch.float32, output_loading_info=True)
    assert not any(loading.values()), loading
    assert public.layers[0].self_attn.sliding_window == 4 and public.candidate_selector.top_k == 8


def test_a_distilled_variant_trains_under_zero1_and_offload_resumes_exactly_and_exports(reference_run, tmp_path):
    """DFlash2 with a sliding layer, distilled (target KL labels, D-PACE weights): ZeRO-1 and ZeRO-2 with
    optimizer offload train it alike; the offload run resumed from its step-6 checkpoint replays steps
    7-12 to rel 1e-6 and ends on the same weights (convolutions and selector included); both exports
    load in the public DFlash2DraftModel with every weight."""
    ref_dir, cfg, _ = reference_run
    common = [*VARIANT, *DISTILL, "train.max_steps=12", "train.schedule_steps=24"]
    zero1, offload = tmp_path / "zero1", tmp_path / "offload"
    out = run_to_end(cfg, f"run.out_dir={zero1}", f"train.ds_config={ds_config(tmp_path, 'zero2.json', stage=1)}",
                     *common)
    assert "deepspeed ZeRO-1, torch AdamW" in out and "run tiny-g4-b95-target-kl-dpace" in out
    offload_args = [f"run.out_dir={offload}", f"train.ds_config={REPO / 'ds_configs' / 'zero2_offload.json'}", *common]
    assert "deepspeed ZeRO-2, optimizer offload to cpu, DeepSpeed AdamW from the JSON" in run_to_end(cfg, *offload_args)
    uninterrupted, final_weights = train_losses(offload), exported(offload, 12)
    assert list(uninterrupted) == list(range(1, 13)) and "selector_loss" in records(offload)[-1]
    assert uninterrupted[1] != pytest.approx(train_losses(ref_dir / "run")[1], rel=1e-3)  # KL, not data CE
    assert_same_trajectory(train_losses(zero1), uninterrupted, range(1, 13), ENGINE_RTOL)
    assert_same_weights(exported(zero1, 12), final_weights, rtol=10 * ENGINE_RTOL)

    out = run_to_end(cfg, *offload_args, f"train.resume={offload / 'checkpoints' / 'step_6'}")
    assert re.search(r"resumed from \S+step_6 at step 6 ", out), out[-3000:]
    assert [r["step"] for r in records(offload)] == list(range(1, 13))
    assert_same_trajectory(train_losses(offload), uninterrupted, range(7, 13), RESUME_RTOL)
    assert_same_weights(exported(offload, 12), final_weights, rtol=RESUME_RTOL)
    for run in (zero1, offload):
        assert_public_dflash2_loads_every_weight(run / "checkpoints" / "step_12" / "drafter")


@pytest.mark.parametrize("engine", ["deepspeed zero3", "fsdp"])
def test_a_nonfinite_step_on_one_rank_is_skipped_on_both(reference_run, tmp_path, engine):
    """Also: a DFlash2 drafter with a sliding layer trains under ZeRO-3 and FSDP2 and its export loads
    in the public DFlash2DraftModel, every weight (convolutions and selector included) changed."""
    _, cfg, _ = reference_run
    run = tmp_path / "run"
    chosen = (["train.engine=fsdp"] if engine == "fsdp" else
              [f"train.ds_config={ds_config(tmp_path, 'zero3.json', stage3_param_persistence_threshold=0)}"])
    out = run_to_end(cfg, f"run.out_dir={run}", *chosen, *VARIANT, "train.max_steps=6", "train.save_every=2",
                     "train.keep_last=10", "train.eval_every=1000", launcher="torchrun",
                     faults={"nan_steps": "3,4", "nan_ranks": "1"})
    assert "step 3: non-finite loss or gradient; the step was skipped on all ranks" in out
    assert [r["skipped_steps"] for r in records(run)] == [0, 0, 1, 2, 2, 2]
    assert_same_weights(exported(run, 4), exported(run, 2), rtol=0)  # nothing moved on either rank
    assert not torch.equal(next(iter(exported(run, 6).values())), next(iter(exported(run, 4).values())))
    assert all(not torch.equal(exported(run, 6)[name], value) for name, value in exported(run, 2).items()
               if "norm" not in name)
    assert "selector_loss" in records(run)[-1]
    assert_public_dflash2_loads_every_weight(run / "checkpoints" / "step_6" / "drafter")


def test_gradient_accumulation_with_hard_coded_batch_keys_matches_fsdp(reference_run, tmp_path):
    """All three batch keys hard-coded (consistently) in the JSON: no step is miscounted as
    non-finite, and two micro batches per step give the FSDP engine's trajectory (for a DFlash2
    drafter with a sliding layer: both engines train its convolutions and selector alike)."""
    _, cfg, _ = reference_run
    path = tmp_path / "ds.json"
    config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=2, train_batch_size=4)
    path.write_text(json.dumps(config))
    common = ["optim.grad_accum=2", "train.max_steps=6", "train.eval_every=1000", *VARIANT]
    run_to_end(cfg, f"run.out_dir={tmp_path / 'ds'}", f"train.ds_config={path}", *common)
    run_to_end(cfg, f"run.out_dir={tmp_path / 'fsdp'}", "train.engine=fsdp", *common, launcher="torchrun")
    ds, fsdp = records(tmp_path / "ds"), records(tmp_path / "fsdp")
    assert [r["skipped_steps"] for r in ds] == [0] * 6
    assert_same_trajectory(train_losses(tmp_path / "ds"), train_losses(tmp_path / "fsdp"), range(1, 7), ENGINE_RTOL)
    assert [r["grad_norm"] for r in ds] == pytest.approx([r["grad_norm"] for r in fsdp], rel=1e-3)


def test_srun_tasks_form_one_world_and_stop_on_sigusr1(reference_run, tmp_path):
    """Two `srun` tasks (SLURM variables, no RANK): one world, the reference trajectory; SLURM's
    --signal=USR1@N early warning saves and exits, before evaluating that step."""
    ref_dir, cfg, _ = reference_run
    run = tmp_path / "run"
    proc = launch(cfg, f"run.out_dir={run}", "train.eval_every=1", "train.save_every=1000", launcher="slurm")
    wait_for_step(run, 4, proc)
    kill_job(proc, signal.SIGUSR1, launcher=False)  # srun signals the tasks (here: not the shell that waits)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "2 ranks on cpu" in out
    state = json.loads((run / "checkpoints" / "latest" / "trainer_state.json").read_text())
    stopped = state["step"]
    assert f"stop requested: saving at step {stopped}" in out
    assert list(train_losses(run)) == list(range(1, stopped + 1))
    assert_same_trajectory(train_losses(run), train_losses(ref_dir / "run"), range(1, stopped + 1), 1e-6)
    assert [r["step"] for r in records(run, "eval")] == list(range(1, stopped))  # not the stop step


def test_a_slurm_world_that_cannot_form_fails_clearly(reference_run, tmp_path):
    """One task of a two-task step (the other never starts): a clear error, not a hang."""
    _, cfg, _ = reference_run
    env = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_PROCID": "0",
           "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "localhost"}
    import subprocess
    import sys
    start = time.time()
    proc = subprocess.run([sys.executable, "train.py", "--cfg", str(cfg), "train.dist_timeout_minutes=0.1",
                           f"run.out_dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")},
                                            **env, "MASTER_PORT": str(20000 + os.getpid() % 10000)})
    assert proc.returncode != 0 and time.time() - start < 100
    assert "launch error: could not form a world of 2 ranks (srun: rank 0, master localhost" in proc.stderr
    assert "one task per GPU" in proc.stderr
