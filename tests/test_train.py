"""train.py end to end: two CPU ranks over gloo through the real `deepspeed` launcher (the shared
`reference_run`), resume and signals, run identity, plus unit checks of the config, the DeepSpeed
JSON, the noise ramp and the fault handling. Engines, ZeRO stages and other launchers: test_engines.py."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from drafter.config import ConfigError
from drafter.infra.deepspeed_engine import deepspeed_config
from drafter.infra.engine import EngineConfigError
from drafter.infra.launch import LaunchError, expand_hostlist, launcher_environment, slurm_environment
from drafter.infra.run_lock import RunDirectoryBusy, acquire
from drafter.training.run_config import load_config
from drafter.training.schedules import lr_factor, noise_std
from runs import (REPO, UNIFORM_LOSS, descendants, kill_job, launch, records, run_to_end, shm_buffers, train_losses,
                  wait_for_step, write_run)


def assert_loadable_by_public_dflash(ckpt: Path):
    from dflash.model import DFlashDraftModel as PublicDraftModel
    drafter = PublicDraftModel.from_pretrained(ckpt / "drafter", dtype=torch.float32)
    assert drafter.block_size == 8 and drafter.mask_token_id == 255
    assert (ckpt / "trainer_state.json").exists()
    return drafter


@pytest.mark.slow
def test_two_rank_run_learns_logs_and_exports(reference_run):
    tmp, _, out = reference_run
    run = tmp / "run"
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 25))
    for key in ("loss", "acc", "top4_acc", "top8_acc", "anchor_streak", "anchor_top4_streak",
                "anchor_top8_streak", "anchor_ddtree@16", "lr", "noise", "grad_norm", "per_bucket",
                "pad_efficiency", "tokens_per_s", "time_split_s", "prefetch_queue", "eta_s"):
        assert key in train[-1], key
    assert len(train[-1]["prefetch_queue"]) == 2  # one queue depth per rank
    assert any(r["kind"] == "eval" for r in records)
    losses = [r["loss"] for r in train]
    assert np.mean(losses[-4:]) < UNIFORM_LOSS - 0.5  # well below the uniform distribution it starts at
    assert "step=24 loss=" in out  # the console line
    assert "memory plan per GPU (target.tp_size=1, 2 ranks, ZeRO-2)" in out and "target weights" in out
    for cause in ("skipped (too long)", "dropped (ranks)", "cut (accumulation)"):  # the start-up plan
        assert cause in out, cause
    checkpoints = run / "checkpoints"
    assert os.readlink(checkpoints / "latest") == "step_24"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_12", "step_18", "step_24"]  # keep 3
    public = assert_loadable_by_public_dflash(checkpoints / "latest")
    count = sum(p.numel() for p in public.parameters())
    assert f"drafter {count / 1e6:.2f}M params" in out and count > 10_000


@pytest.mark.slow
def test_saves_evaluation_and_generation_do_not_change_the_trajectory(reference_run, tmp_path):
    """The reference saves every 6 steps, evaluates at 12 and 24 and generates at the end; this run
    never saves, evaluates and generates every 6 steps: the same losses."""
    _, cfg, _ = reference_run
    run = tmp_path / "nosave"
    run_to_end(cfg, f"run.out_dir={run}", "train.save_every=1000", "train.eval_every=6", "train.generate_every=6")
    assert train_losses(run) == train_losses(reference_run[0] / "run")
    generated = records(run, "generate")
    assert [r["step"] for r in generated] == [6, 12, 18, 24]
    assert all(r["gen_responses"] == 4 and r["gen_tau_dflash"] >= 1 and "gen_tau_ddtree@16" in r for r in generated)
    evals = records(run, "eval")
    assert [r["step"] for r in evals] == [6, 12, 18, 24]
    assert all(r["eval_responses"] == 16 for r in evals)  # every held-out row (16 groups of one), none dropped
    assert all(1 <= r["tau_dflash"] <= 8 and 1 <= r["tau_ddtree@16"] <= 8 for r in evals)  # block size 8


@pytest.mark.slow
def test_sigkill_then_resume_reproduces_the_uninterrupted_losses(reference_run, tmp_path):
    """Resume replays the exact trajectory, logs every step exactly once, removes what a cut-short
    save left, and every rank resumes rank 0's choice even when its own listing is stale."""
    _, cfg, _ = reference_run
    out_dir = tmp_path / "killed"
    proc = launch(cfg, f"run.out_dir={out_dir}")
    wait_for_step(out_dir, 14, proc)
    with pytest.raises(RunDirectoryBusy) as busy:  # the live run holds its directory...
        acquire(str(out_dir))
    assert int(re.search(r"pid (\d+)", str(busy.value)).group(1)) in descendants(proc.pid)
    kill_job(proc, signal.SIGKILL)  # ...and, killed, leaves nothing that blocks the resume below
    proc.wait()
    assert not (out_dir / "checkpoints" / "step_24").exists()
    logged_before = [r["step"] for r in records(out_dir)]
    assert max(logged_before) >= 14  # steps past the checkpoint were logged and will run again
    partial = out_dir / "checkpoints" / "step_99.tmp"
    partial.mkdir()
    (partial / "half_written.pt").write_bytes(b"x")
    out = run_to_end(cfg, f"run.out_dir={out_dir}", "train.resume=auto", faults={"stale_listing": "1"})
    assert re.search(r"resumed from \S+ at step (12|18) ", out) and not partial.exists()
    expected = train_losses(reference_run[0] / "run")
    resumed = train_losses(out_dir)
    assert resumed.keys() == expected.keys()
    for step in range(13, 25):  # resumed from step 12 (or a later complete checkpoint)
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step
    assert [r["step"] for r in records(out_dir)] == list(range(1, 25))  # each step once, in order
    assert [r["step"] for r in records(out_dir, "eval")] == [12, 24]


@pytest.mark.slow
def test_a_rank_that_cannot_see_its_files_fails_every_rank_clearly(reference_run, tmp_path):
    """As on node-local disks: rank 1's files are missing from the chosen checkpoint."""
    tmp, cfg, _ = reference_run
    out_dir = tmp_path / "local_disk"
    shutil.copytree(tmp / "run", out_dir, symlinks=True)
    (out_dir / "checkpoints" / "step_24" / "rng_rank1.safetensors").unlink()
    out = run_to_end(cfg, f"run.out_dir={out_dir}", "train.max_steps=30", expect=None, launcher="torchrun")
    assert "rank 1: cannot resume from" in out and "missing " + str(out_dir) in out, out[-3000:]
    assert "rank 0: cannot resume from" in out and "another rank cannot see its files" in out
    assert "filesystem every node shares" in out
    assert "ResumeError" not in out  # said as a message, not a traceback

@pytest.mark.slow
def test_sigterm_saves_a_loadable_checkpoint_and_exits_cleanly(reference_run, tmp_path):
    _, cfg, _ = reference_run
    out_dir = tmp_path / "term"
    proc = launch(cfg, f"run.out_dir={out_dir}", "train.save_every=1000")
    wait_for_step(out_dir, 3, proc)
    kill_job(proc, signal.SIGTERM)  # as a scheduler (scancel) or Ctrl-C does: every process of the job
    out, _ = proc.communicate(timeout=120)
    assert "stop requested: saving at step" in out, out[-3000:]
    assert shm_buffers(proc) == []  # each rank removed DeepSpeed's CPU all-reduce buffer as it exited
    latest = out_dir / "checkpoints" / "latest"
    state = json.loads((latest / "trainer_state.json").read_text())
    assert 3 <= state["step"] < 24
    assert_loadable_by_public_dflash(latest)


def test_config_typo_fails_fast_naming_the_key(tmp_path):
    cfg = write_run(tmp_path)
    proc = subprocess.run([sys.executable, "train.py", "--cfg", str(cfg), "optim.lrr=1"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "optim.lrr" in proc.stderr, proc.stderr[-2000:]
    with pytest.raises(ConfigError, match="train.max_steps"):
        load_config(str(cfg), ["train.max_steps=many"])
    with pytest.raises(ConfigError, match="data.path"):
        load_config(str(REPO / "configs" / "v3.yaml"))  # data.path is required


def test_v3_config_and_run_name():
    cfg = load_config(str(REPO / "configs" / "v3.yaml"), ["data.path=/x"])
    assert cfg.run.name == "v3-g10-b95"
    assert (cfg.drafter.block_size, cfg.drafter.num_layers, cfg.objective.num_anchors) == (16, 5, 512)
    assert (cfg.optim.lr, list(cfg.optim.betas), cfg.optim.warmup_ratio) == (6e-4, [0.9, 0.95], 0.04)
    assert cfg.data.max_length == 8192 and cfg.data.num_buckets == 6


def test_noise_std_follows_the_ramp_and_is_applied():
    from train import add_feature_noise
    cfg = load_config(str(REPO / "configs" / "v3.yaml"),
                      ["data.path=/x", "noise.start=0.2", "noise.end=0.05", "noise.warmup_steps=100"])
    for step, expected in ((0, 0.2), (50, 0.125), (100, 0.05), (5000, 0.05)):
        std = noise_std(cfg.noise, step)
        assert std == pytest.approx(expected)
        scale = torch.tensor([1.0, 30.0]).repeat_interleave(64)  # two layers, different magnitudes
        features = torch.randn(4, 512, 128, generator=torch.Generator().manual_seed(9)).sign() * scale
        noisy = add_feature_noise(features, std, 2, torch.Generator().manual_seed(step))
        applied = (noisy - features).unflatten(-1, (2, 64))
        assert applied[..., 0, :].std().item() == pytest.approx(expected, rel=0.03)
        assert applied[..., 1, :].std().item() == pytest.approx(30 * expected, rel=0.03)


def test_lr_schedule_warms_up_then_decays():
    cfg = load_config(str(REPO / "configs" / "v3.yaml"), ["data.path=/x"])
    factors = [lr_factor(cfg.optim, s, 1000) for s in range(1000)]
    assert factors[0] == pytest.approx(1 / 40) and factors[39] == pytest.approx(1.0)
    assert max(factors) == pytest.approx(1.0) and factors[-1] < 1e-4
    assert all(a >= b for a, b in zip(factors[40:], factors[41:]))


def ds_json(tmp_path, **edits) -> str:
    """zero2.json with `edits` (dotted keys) applied, written to tmp_path."""
    config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    for dotted, value in edits.items():
        *parents, leaf = dotted.split(".")
        node = config
        for key in parents:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    path = tmp_path / f"ds{len(list(tmp_path.glob('ds*.json')))}.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_deepspeed_json_autos_are_filled_from_the_yaml(tmp_path):
    cfg = load_config(str(REPO / "configs" / "v3.yaml"), ["data.path=/x", "optim.grad_accum=4"])
    ds = deepspeed_config(str(REPO / "ds_configs" / "zero2.json"), cfg, world_size=8, bf16=True,
                          hidden_size=4096, on_cpu=False)
    assert ds["train_batch_size"] == 32 and ds["gradient_accumulation_steps"] == 4
    assert ds["train_micro_batch_size_per_gpu"] == 1 and ds["gradient_clipping"] == 1.0
    assert "optimizer" not in ds  # torch's AdamW, built by the engine from the YAML
    assert ds["bf16"] == {"enabled": True, "check_grad_overflow": True}
    assert ds["zero_optimization"]["stage"] == 2
    # hard-coded values that agree with the YAML are fine; HF-style size autos are filled
    consistent = ds_json(tmp_path, gradient_accumulation_steps=4, train_batch_size=32,
                         train_micro_batch_size_per_gpu=1, **{"optimizer.params.lr": 0.0006,
                                                              "zero_optimization.reduce_bucket_size": "auto"})
    ds = deepspeed_config(consistent, cfg, world_size=8, bf16=True, hidden_size=4096, on_cpu=False)
    assert ds["zero_optimization"]["reduce_bucket_size"] == 4096 ** 2
    offload = deepspeed_config(str(REPO / "ds_configs" / "zero2_offload.json"), cfg, 8, True, 4096, on_cpu=False)
    assert offload["optimizer"]["params"] == {"lr": 6e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}
    offload = deepspeed_config(str(REPO / "ds_configs" / "zero2_offload.json"), cfg, 8, True, 4096, on_cpu=True)
    assert offload["optimizer"]["params"]["torch_adam"] is True  # CPU-only machines


CUDA = torch.device("cuda")  # constructible without a GPU: deepspeed_op_problem only reads its type


@pytest.fixture
def toolkit(monkeypatch):
    """A machine's build tools, as deepspeed_op_problem sees them: `state` is edited by each test."""
    from deepspeed.ops.op_builder import builder
    from torch.utils import cpp_extension

    import deepspeed.git_version_info as info
    state = {"nvcc": (12, 8), "torch_cuda": "12.8", "prebuilt": set(), "cxx": True, "ninja": True}

    def nvcc(name=""):
        if state["nvcc"] is None:
            raise builder.MissingCUDAException("CUDA_HOME does not exist, unable to compile CUDA op(s)")
        return state["nvcc"]
    monkeypatch.setattr(builder, "installed_cuda_version", nvcc)
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: state["ninja"])
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/c++" if state["cxx"] else None)

    def refresh():
        monkeypatch.setattr(torch.version, "cuda", state["torch_cuda"])
        monkeypatch.setattr(info, "installed_ops", {op: op in state["prebuilt"] for op in ("fused_adam", "cpu_adam")})
    return state, refresh


@pytest.mark.parametrize("json_name, edits, change, message", [
    ("zero2.json", {}, {"nvcc": None}, None),  # torch's AdamW: nothing to compile
    ("zero2.json", {"optimizer.type": "AdamW"}, {}, None),
    ("zero2.json", {"optimizer.type": "AdamW"}, {"nvcc": None}, "compile its op fused_adam, which needs the CUDA toolkit's nvcc (CUDA_HOME does not exist"),
    ("zero2.json", {"optimizer.type": "AdamW"}, {"nvcc": (11, 8)}, "needs an nvcc of torch's CUDA 12.8 (CUDA_HOME's nvcc is 11.8)"),
    ("zero2.json", {"optimizer.type": "AdamW"}, {"nvcc": None, "prebuilt": {"fused_adam"}}, None),
    ("zero2.json", {"optimizer.type": "AdamW"}, {"ninja": False}, "needs ninja"),
    ("zero2.json", {"optimizer.type": "AdamW", "optimizer.params.torch_adam": True}, {"nvcc": None}, None),
    ("zero2_offload.json", {}, {"nvcc": None}, None),  # CPU Adam is C++: no nvcc needed
    ("zero2_offload.json", {}, {"cxx": False}, "compile its op cpu_adam, which needs a C++ compiler"),
])
def test_a_json_whose_optimizer_cannot_be_built_is_refused_before_weights_load(
        tmp_path, toolkit, json_name, edits, change, message):
    """On a GPU, a JSON `optimizer` block makes DeepSpeed compile FusedAdam (or CPU Adam under offload)
    at its first step; without the tools for it the run stops at the config, in one line naming them."""
    from drafter.infra.engine_choice import engine_settings
    state, refresh = toolkit
    state.update(change)
    refresh()
    source = json.loads((REPO / "ds_configs" / json_name).read_text())
    path = tmp_path / json_name
    path.write_text(json.dumps(source))
    path = ds_json(tmp_path, **edits) if json_name == "zero2.json" else str(path)
    cfg = load_config(str(REPO / "configs" / "v3.yaml"), ["data.path=/x", f"train.ds_config={path}"])
    if message is None:
        assert engine_settings(cfg, 8, CUDA, torch.bfloat16, 4096)["zero_optimization"]
    else:
        with pytest.raises(EngineConfigError, match=f"train.ds_config={re.escape(path)}: .*{re.escape(message)}"):
            engine_settings(cfg, 8, CUDA, torch.bfloat16, 4096)


def test_an_offload_json_without_an_optimizer_block_is_refused(tmp_path):
    """DeepSpeed refuses a client optimizer under offload at initialize; here it stops at the config."""
    cfg = load_config(str(REPO / "configs" / "v3.yaml"), ["data.path=/x"])
    source = json.loads((REPO / "ds_configs" / "zero2_offload.json").read_text())
    del source["optimizer"]
    path = tmp_path / "offload.json"
    path.write_text(json.dumps(source))
    with pytest.raises(EngineConfigError, match="offload_optimizer needs an `optimizer` block"):
        deepspeed_config(str(path), cfg, 8, True, 4096, on_cpu=False)


@pytest.mark.parametrize("edits, message", [
    ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps=2 in the JSON contradicts optim.grad_accum = 4"),
    ({"train_batch_size": 64}, "train_batch_size=64 in the JSON contradicts optim.grad_accum x world size = 32"),
    ({"train_micro_batch_size_per_gpu": 4}, "train_micro_batch_size_per_gpu=4 in the JSON contradicts"),
    ({"gradient_clipping": 0.5}, "gradient_clipping=0.5 in the JSON contradicts optim.grad_clip = 1.0"),
    ({"optimizer.params.betas": [0.9, 0.999]}, "optimizer.params.betas=[0.9, 0.999] in the JSON contradicts optim.betas"),
    ({"bf16.enabled": False}, "bf16.enabled=False in the JSON contradicts target.dtype = True"),
    ({"scheduler": {"type": "WarmupLR"}}, "a `scheduler` block"),
    ({"fp16": {"enabled": True}}, "fp16 is not supported"),
    ({"zero_optimization.stage": 0}, "zero_optimization.stage=0"),
    ({"zero_optimization.stage": None}, "zero_optimization.stage=None"),
    ({"zero_optimization.offload_param": {"device": "cpu"}}, "offload_param needs stage 3"),
    ({"zero_optimization.sub_group_size": "auto"}, "\"auto\" that this trainer does not fill: zero_optimization.sub_group_size"),
])
def test_deepspeed_json_contradicting_the_yaml_is_refused_naming_both(tmp_path, edits, message):
    cfg = load_config(str(REPO / "configs" / "v3.yaml"), ["data.path=/x", "optim.grad_accum=4"])
    path = ds_json(tmp_path, **edits)
    with pytest.raises(EngineConfigError, match=f"train.ds_config={re.escape(path)}: .*{re.escape(message)}"):
        deepspeed_config(path, cfg, world_size=8, bf16=True, hidden_size=4096, on_cpu=False)


@pytest.mark.parametrize("edits, filled, message", [
    ({}, {}, None),  # zero2.json: no optimizer block, the engine hands DeepSpeed its Muon
    ({"zero_optimization.stage": 1}, {}, None),
    ({"zero_optimization.stage": 3, "zero_optimization.reduce_scatter": None},
     {"zero_optimization.reduce_scatter": False}, None),  # DeepSpeed's ZeRO-3 Muon refuses reduce_scatter
    ({"zero_optimization.offload_optimizer": {"device": "cpu"}}, {"zero_force_ds_cpu_optimizer": False}, None),
    ({"optimizer.type": "AdamW"}, {}, "optimizer.type='AdamW' in the JSON contradicts optim.name = 'muon'"),
    ({"zero_optimization.stage": 3}, {}, "zero_optimization.reduce_scatter=True in the JSON contradicts "
                                         "optim.name = 'muon': DeepSpeed's ZeRO-3 Muon needs false"),
    ({"zero_optimization.offload_optimizer": {"device": "cpu"}, "zero_force_ds_cpu_optimizer": True}, {},
     "zero_force_ds_cpu_optimizer=True in the JSON contradicts optim.name = 'muon' with offload_optimizer"),
    ({"zero_optimization.stage": 3, "zero_optimization.reduce_scatter": None,
      "zero_optimization.offload_optimizer": {"device": "cpu"}}, {},
     "zero_optimization.stage=3 with offload_optimizer and optim.grad_accum = 2: DeepSpeed's ZeRO-3 offload"),
])
def test_muon_under_deepspeed_takes_the_engine_s_optimizer_in_every_stage(tmp_path, edits, filled, message):
    """optim.name=muon under DeepSpeed (ZeRO 1-3, offload): the engine builds DeepSpeed's Muon from the YAML
    (tests/test_muon_zero.py steps it), so the JSON holds no `optimizer` block and nothing is compiled."""
    from drafter.infra.deepspeed_engine import deepspeed_op_problem, deepspeed_optimizer
    cfg = load_config(str(REPO / "configs" / "v3.yaml"), ["data.path=/x", "optim.name=muon", "optim.grad_accum=2",
                                                           "optim.grad_clip=0"])
    path = ds_json(tmp_path, **edits)
    if message is not None:
        with pytest.raises(EngineConfigError, match=f"train.ds_config={re.escape(path)}: .*{re.escape(message)}"):
            deepspeed_config(path, cfg, world_size=8, bf16=True, hidden_size=4096, on_cpu=False)
        return
    ds = deepspeed_config(path, cfg, world_size=8, bf16=True, hidden_size=4096, on_cpu=False)
    assert "optimizer" not in ds and deepspeed_op_problem(ds, CUDA) is None
    assert deepspeed_optimizer(ds, CUDA, muon=True) == "DeepSpeed Muon on the matrices, torch AdamW on the rest"
    for dotted, value in filled.items():
        *parents, leaf = dotted.split(".")
        node = ds
        for key in parents:
            node = node[key]
        assert node[leaf] is value, dotted


def test_muon_under_deepspeed_with_clipping_is_refused_naming_the_key(tmp_path):
    """ZeRO clips by the norm of Muon's update, not the gradients': any grad_clip would shrink every step."""
    cfg = load_config(str(REPO / "configs" / "v3.yaml"), ["data.path=/x", "optim.name=muon"])
    path = ds_json(tmp_path)
    with pytest.raises(EngineConfigError, match=re.escape("optim.grad_clip=1.0 with optim.name=muon under "
                                                          "train.engine=deepspeed")):
        deepspeed_config(path, cfg, world_size=8, bf16=True, hidden_size=4096, on_cpu=False)


@pytest.mark.parametrize("edits, filled, message", [
    ({"zero_optimization.offload_optimizer": {"device": "cpu"}, "zero_optimization.stage": 3}, {},
     "zero_optimization.stage=3 with offload_optimizer and optim.grad_accum = 4"),
])
def test_zero3_offload_with_accumulation_is_refused_for_adamw_too(tmp_path, edits, filled, message):
    cfg = load_config(str(REPO / "configs" / "v3.yaml"), ["data.path=/x", "optim.grad_accum=4"])
    with pytest.raises(EngineConfigError, match=re.escape(message)):
        deepspeed_config(ds_json(tmp_path, **edits), cfg, world_size=8, bf16=True, hidden_size=4096, on_cpu=False)


def test_a_json_contradiction_or_an_optimizer_block_with_muon_stops_train_py_before_any_model_loads(tmp_path):
    """optim.name=muon builds DeepSpeed's Muon from the YAML: a JSON `optimizer` block is refused by name
    with the JSON's other problems, before the data or any model loads."""
    cfg = write_run(tmp_path)
    path = ds_json(tmp_path, gradient_accumulation_steps=8, **{"optimizer.type": "AdamW"})
    proc = subprocess.run([sys.executable, "train.py", "--cfg", str(cfg), f"train.ds_config={path}", "optim.name=muon"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2
    assert "gradient_accumulation_steps=8 in the JSON contradicts optim.grad_accum = 1" in proc.stderr
    assert "optimizer.type='AdamW' in the JSON contradicts optim.name = 'muon'" in proc.stderr
    assert "Traceback" not in proc.stderr and "params" not in proc.stdout  # no model was built


@pytest.mark.parametrize("override, returncode, message", [
    ("drafter.block_size=12", 1, "config error: drafter.block_size=12 has no default loss gamma"),  # load_config
    ("drafter.mask_token_id=300", 2, "error: drafter.mask_token_id=300 has no row in the target's embedding"),
    ("drafter.mask_token_id=5", 2, "error: drafter.mask_token_id=5 occurs in the training data"),  # ids 0..31
])
def test_a_setting_the_target_cannot_take_stops_train_py_in_one_line(tmp_path, override, returncode, message):
    cfg = write_run(tmp_path)
    proc = subprocess.run([sys.executable, "train.py", "--cfg", str(cfg), "train.engine=fsdp", override], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == returncode and message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_the_start_up_table_names_every_sample_left_out():
    from drafter.pipeline.sampler import BucketSampler, plan_notes
    from train import bucket_summary

    lengths = np.concatenate([np.full(300, 100), [1500, 1800, 1800], [5000]])  # 3 over the budget, 1 too long
    stats = BucketSampler(lengths, [128, 2048], tokens_per_batch=1024, world_size=2, steps_multiple=4).stats(0)
    summary = bucket_summary(stats).splitlines()
    notes = plan_notes(stats)
    assert [line.split()[0] for line in notes] == ["skipped", "dropped", "cut", "warning:"]
    assert all(line in summary for line in notes)
    assert sum("longer than tokens_per_batch" in line for line in summary) == 1


def test_data_prepared_with_other_thinking_stops_train_py_naming_both(tmp_path):
    cfg = write_run(tmp_path)
    proc = subprocess.run([sys.executable, "train.py", "--cfg", str(cfg),
                           "target.chat_template_kwargs={enable_thinking: true}"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (f"{tmp_path / 'data'} was prepared with enable_thinking=False" in proc.stderr
            and "target.chat_template_kwargs.enable_thinking=True" in proc.stderr)
    assert "Traceback" not in proc.stderr and "params" not in proc.stdout  # no model was built


@pytest.mark.parametrize("override, message", [
    ("objective.attention=flexx", "objective.attention='flexx' is not one of auto, dense, flex, flex_compiled"),
    ("target.dtype=float16", "target.dtype='float16' is not one of auto, bf16"),
    ("train.engine=megatron", "train.engine='megatron' is not one of deepspeed, fsdp"),
    ("wandb.mode=loud", "wandb.mode='loud' is not one of null, online, offline, disabled"),
    ("train.log_every=0", "train.log_every=0 must be > 0"),
    ("train.keep_last=0", "train.keep_last=0 must be > 0"),
    ("train.max_steps=-5", "train.max_steps=-5 must be > 0 (or null)"),
    ("optim.betas=[0.9]", "optim.betas=[0.9] must be two values in [0, 1)"),
    ("optim.lr=0", "optim.lr=0.0 must be > 0"),
    ("optim.warmup_ratio=1.5", "optim.warmup_ratio=1.5 must be in [0, 1]"),
    ("data.eval_fraction=1.0", "data.eval_fraction=1.0 must be in [0, 1)"),
    ("data.num_workers=-1", "data.num_workers=-1 must be >= 0"),
    ("drafter.block_size=1", "drafter.block_size=1 must be >= 2"),
    ("drafter.target_layer_ids=[3,3]", "drafter.target_layer_ids=[3, 3] must be distinct"),
    ("data.bucket_boundaries=[512,256]", "data.bucket_boundaries=[512, 256] must be increasing"),
    ("drafter.layer_types=[sliding_attention]", "drafter.layer_types has 1 entries for 5 draft layers"),
    ("drafter.sliding_window=0", "drafter.sliding_window=0 must be >= 1"),
    ("objective.labels=teacher", "objective.labels='teacher' is not one of data, target"),
    ("objective.loss=jsd", "objective.loss='jsd' is not one of ce, kl, tv, expected_chain, expected_tree"),
    ("objective.loss=tv", "objective.loss=tv needs objective.labels=target (total variation to the target's "
                          "distribution; got objective.labels=data)"),
    ("objective.tv_ce_weight=1.2", "objective.tv_ce_weight=1.2 must be in [0, 1]"),
    ("objective.tree_temperature=0", "objective.tree_temperature=0.0 must be > 0"),
    ("objective.block_ce_weight=-0.1", "objective.block_ce_weight=-0.1 must be >= 0"),
    ("objective.block_ce_weight=inf", "objective.block_ce_weight=inf must be finite"),
    ("noise.end=nan", "noise.end=nan must be >= 0"),
    ("objective.tree_temperature=inf", "objective.tree_temperature=inf must be finite"),
    ("objective.truncate=last", "objective.truncate='last' is not one of none, first_failure"),
    ("objective.normalize=tokens", "objective.normalize='tokens' is not one of weights, count"),
    ("objective.anchor_candidates=all", "objective.anchor_candidates='all' is not one of pair, supervised"),
    ("objective.position_weights=flat", "objective.position_weights='flat' is not one of exp, dpace, tree"),
    ("objective.loss=kl", "objective.loss=kl needs objective.labels=target"),
    ("objective.weight_smoothing=1.5", "objective.weight_smoothing=1.5 must be in [0, 1]"),
    # a component's own key, set while another component is chosen, would do nothing
    ("objective.tv_ce_weight=0.3", "objective.tv_ce_weight=0.3 is read only with objective.loss=tv"),
    ("objective.tree_temperature=2", "objective.tree_temperature=2.0 is read only with objective.loss=expected_tree"),
    ("objective.block_ce_weight=0", "objective.block_ce_weight=0.0 is read only with objective.loss=expected_chain"),
    ("objective.weight_smoothing=0.3", "objective.weight_smoothing=0.3 is read only with objective.position_weights=dpace"),
    ("optim.muon_lr=0.01", "optim.muon_lr=0.01 is read only with optim.name=muon"),
])
def test_invalid_values_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(str(REPO / "configs" / "v3.yaml"), ["data.path=/x", override])


def test_each_component_setting_belongs_to_a_registered_choice_and_a_field_of_its_section():
    """The tables of component settings against the registries and the schema: a typo in either
    would refuse a key under its own component, or fail with an AttributeError instead of a ConfigError."""
    from dataclasses import fields

    from drafter.config import Config
    from drafter.training.run_config import choices, settings
    sections = {f.name: {g.name for g in fields(f.type)} for f in fields(Config)}
    owners = {}
    for chooser, readers in settings().items():
        section = chooser.split(".")[0]
        assert set(readers) <= set(choices()[chooser]), chooser
        for key in {key for keys in readers.values() for key in keys}:
            assert key in sections[section], f"{section}.{key}"
            assert owners.setdefault(f"{section}.{key}", chooser) == chooser  # one chooser per key


def test_a_misspelt_choice_or_a_bad_value_is_one_message_not_two():
    v3 = str(REPO / "configs" / "v3.yaml")
    for overrides, message, absent in ((["objective.loss=TV", "objective.tv_ce_weight=0.3"],
                                        "objective.loss='TV' is not one of", "is read only"),
                                       (["drafter.arch=dflash3", "drafter.selector_rank=8"],
                                        "drafter.arch='dflash3' is not one of", "is read only"),
                                       (["drafter.selector_rank=0"], "selector_rank=0 must be >= 1", "is read only")):
        with pytest.raises(ConfigError, match=re.escape(message)) as refused:
            load_config(v3, ["data.path=/x", *overrides])
        assert absent not in str(refused.value)

def test_a_value_or_key_the_schema_refuses_is_one_line_naming_the_key(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("data: [1\n")
    with pytest.raises(ConfigError, match=r"broken.yaml: not valid YAML: .*line 2, column 1$"):
        load_config(str(broken))
    for override, reason in [("optim.lr=abc", "'optim.lr': Value 'abc' of type 'str' could not be converted to Float"),
                             ("objective.nonexistent=1", "'objective.nonexistent': Key 'nonexistent' not in"),
                             ("optim=3", "int is not a subclass of OptimConfig"),
                             ("optim.lr=${nope}", "'optim.lr': Interpolation key 'nope' not found")]:
        with pytest.raises(ConfigError) as refused:
            load_config(str(REPO / "configs" / "v3.yaml"), ["data.path=/x", override])
        assert reason in str(refused.value) and "\n" not in str(refused.value)


def test_dtype_aliases_and_several_problems_at_once():
    assert load_config(str(REPO / "configs" / "v3.yaml"), ["data.path=/x", "target.dtype=bfloat16"]).target.dtype == "bf16"
    assert load_config(str(REPO / "configs" / "v3.yaml"), ["data.path=/x", "target.dtype=float32"]).target.dtype == "fp32"
    with pytest.raises(ConfigError) as refused:
        load_config(str(REPO / "configs" / "v3.yaml"), ["data.path=/x", "train.log_every=0", "optim.betas=[1.5, 0.9]"])
    assert "train.log_every=0 must be > 0" in str(refused.value) and "; " in str(refused.value)
    assert "optim.betas=[1.5, 0.9] must be two values" in str(refused.value)


def run_with_nan_losses(cfg: Path, nan_steps, *overrides: str) -> subprocess.CompletedProcess:
    """Plain `python` (a world of one) with non-finite losses injected at `nan_steps` (1-based)."""
    proc = launch(cfg, "train.eval_every=1000", "data.num_workers=0", *overrides, launcher="python",
                  faults={"nan_steps": ",".join(map(str, nan_steps))})
    out, _ = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


@pytest.mark.slow
def test_too_many_nonfinite_steps_in_a_row_stop_at_the_last_good_checkpoint(tmp_path):
    """One skipped step on one rank: tests/test_engines.py. Here every step from 5 on is non-finite."""
    from safetensors.torch import load_file
    cfg = write_run(tmp_path)
    out = tmp_path / "run"
    proc = run_with_nan_losses(cfg, range(5, 100), f"run.out_dir={out}", "train.max_steps=20",
                               "train.save_every=4", "train.max_bad_steps=3", "train.keep_last=5")
    assert proc.returncode == 1 and "3 non-finite steps in a row" in proc.stdout
    assert "step 5: non-finite loss or gradient; the step was skipped on all ranks (1 in a row)" in proc.stdout
    assert os.readlink(out / "checkpoints" / "latest") == "step_4"  # the last good checkpoint
    assert not (out / "checkpoints" / "step_8").exists()
    good = load_file(str(out / "checkpoints" / "step_4" / "drafter" / "model.safetensors"))
    assert all(torch.isfinite(v).all() for v in good.values())


def test_bad_prepared_data_is_rejected_up_front_naming_the_row(tmp_path):
    from drafter.pipeline.datasets import load_prepared
    rows = {"input_ids": [[1, 2, 3], [4, 5], [6, 7]], "loss_mask": [[0, 1, 1], [1, 1], [1, 1]], "length": [3, 2, 2]}
    cases = {
        "length column": {**rows, "length": [3, 3, 2]},
        "len\\(loss_mask\\)": {**rows, "loss_mask": [[0, 1, 1], [1, 1], [1]]},
        "token id 300 outside": {**rows, "input_ids": [[1, 2, 3], [4, 5], [6, 300]]},
    }
    for i, (message, columns) in enumerate(cases.items()):
        datasets.Dataset.from_dict(columns).save_to_disk(str(tmp_path / str(i)))
        with pytest.raises(ValueError, match=f"row {1 if i == 0 else 2}: {message}"):
            load_prepared(str(tmp_path / str(i)), vocab_size=256)
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "good"))
    assert len(load_prepared(str(tmp_path / "good"), vocab_size=256)) == 3


def test_slurm_variables_make_the_world():
    env = {"SLURM_JOB_ID": "123", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
           "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NODELIST": "gpu[07-08,11]",
           "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "1"}
    launcher, variables = launcher_environment(env)
    assert launcher == "srun"
    assert variables == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                         "MASTER_ADDR": "gpu07", "MASTER_PORT": str(15000 + 123)}
    # torchrun inside srun (one torchrun per node) sets RANK itself: it wins
    assert launcher_environment({**env, "RANK": "0", "WORLD_SIZE": "16"}) == ("torchrun/deepspeed", {})
    # the batch script itself (no srun step) and a bare salloc shell are worlds of one
    batch = {k: v for k, v in env.items() if k != "SLURM_STEP_ID"}
    assert launcher_environment(batch)[0] == "single process"
    assert launcher_environment({**env, "SLURM_STEP_ID": "4294967294"})[0] == "single process"
    assert expand_hostlist("a[1-2],b,c[08-10]x") == ["a1", "a2", "b", "c08x", "c09x", "c10x"]
    with pytest.raises(LaunchError, match="SLURM task without SLURM_LOCALID: launch with `srun`"):
        slurm_environment({k: v for k, v in env.items() if k != "SLURM_LOCALID"})


def test_ranks_per_node_from_each_launcher(monkeypatch):
    from drafter.infra.launch import local_world_size
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert local_world_size(16) == 16                # no launcher said: one node
    monkeypatch.setenv("LOCAL_SIZE", "8")            # deepspeed --hostfile over 2 nodes
    assert local_world_size(16) == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")      # torchrun, srun
    assert local_world_size(16) == 4


@pytest.mark.slow
def test_a_run_directory_belongs_to_one_run(tmp_path):
    cfg = write_run(tmp_path)
    run = tmp_path / "run"
    common = ["data.num_workers=0", "train.eval_every=1000", "train.save_every=3"]
    run_to_end(cfg, *common, "train.max_steps=3", launcher="python")
    # a new experiment in the same directory stops before any model loads, naming the key and the ways out
    out = run_to_end(cfg, *common, "optim.lr=1e-3", "train.max_steps=6", launcher="python", expect=2)
    assert "was written by a different run (optim.lr: 0.03 -> 0.001)" in out
    assert "new run.out_dir" in out and "train.resume=never" in out and "train.resume=force" in out
    assert "M params" not in out
    # how long to run, logging and saving may change
    out = run_to_end(cfg, *common, "train.max_steps=4", "train.log_every=2", launcher="python")
    assert "resumed from" in out and "the lr schedule keeps its 3 steps" in out
    # force continues the checkpoint with the new settings...
    out = run_to_end(cfg, *common, "optim.lr=1e-3", "train.max_steps=5", "train.resume=force", launcher="python")
    assert "train.resume=force: continuing despite optim.lr: 0.03 -> 0.001" in out and "resumed from" in out
    # ...but not under a batch shape that gives the saved data position another meaning
    out = run_to_end(cfg, *common, "optim.lr=1e-3", "data.tokens_per_batch=512", "train.max_steps=6",
                     "train.resume=force", launcher="python", expect=2)
    assert "data.tokens_per_batch: 384 -> 512" in out
    # never: start over; the earlier run's files are set aside, nothing is deleted
    out = run_to_end(cfg, *common, "train.max_steps=3", "train.resume=never", launcher="python")
    (aside,) = (run / "previous").iterdir()
    assert f"moved to {aside}" in out
    assert (aside / "checkpoints" / "step_5").is_dir() and [r["step"] for r in records(aside)] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in records(run)] == [1, 2, 3] and os.readlink(run / "checkpoints" / "latest") == "step_3"


def test_resume_truncates_the_metrics_past_the_checkpoint(tmp_path):
    from drafter.training.tracking import truncate_metrics
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"kind": "train", "step": s, "loss": 1.0}) for s in range(1, 6)]
    lines.insert(3, json.dumps({"kind": "eval", "step": 3, "loss": 2.0}))
    path.write_text("\n".join(lines) + '\n{"kind": "train", "st')  # a line cut short by a kill
    assert truncate_metrics(path, 3) == 5
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in kept] == [("train", 1), ("train", 2), ("train", 3), ("eval", 3)]
