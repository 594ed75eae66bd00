"""train.py end to end: two CPU ranks over gloo through the real `deepspeed` launcher, plus unit checks
of the config, the noise ramp and the fault handling."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
import yaml

from drafter.config import ConfigError, deepspeed_config, load_config, lr_factor, noise_std

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def write_run(tmp_path: Path, **train) -> Path:
    """A tiny prepared dataset (arithmetic sequences over 32 tokens) and a config for a random target."""
    rng = np.random.default_rng(0)
    rows = {"input_ids": [], "loss_mask": [], "length": []}
    for _ in range(160):
        n, start, stride = int(rng.integers(24, 100)), int(rng.integers(0, 32)), int(rng.integers(1, 4))
        rows["input_ids"].append([(start + stride * t) % 32 for t in range(n)])
        rows["loss_mask"].append([0] * 4 + [1] * (n - 4))
        rows["length"].append(n)
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "data"))
    cfg = {
        "run": {"out_dir": str(tmp_path / "run"), "seed": 0},
        "target": {"random": {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                              "intermediate_size": 128,
                              "initializer_range": 0.3}},  # a frozen LM head with room to learn through
        "drafter": {"num_layers": 1, "block_size": 8, "mask_token_id": 255},
        "objective": {"num_anchors": 16, "ddtree_budget": 16, "ddtree_blocks": 4},
        "optim": {"lr": 3e-2, "warmup_ratio": 0.1},
        "noise": {"start": 0.0, "end": 0.01, "warmup_steps": 10},
        "data": {"path": str(tmp_path / "data"), "eval_fraction": 0.1, "max_length": 128, "num_buckets": 3,
                 "tokens_per_batch": 384, "num_workers": 1, "prefetch_factor": 2},
        "train": {"epochs": 3, "max_steps": 24, "log_every": 1, "save_every": 6, "eval_every": 12,
                  "eval_batches": 2, "threads_per_rank": 1, **train},
        "wandb": {"enabled": False},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def launch(cfg: Path, *overrides: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    cmd = [str(VENV_BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(29500 + os.getpid() % 1000),
           "train.py", "--cfg", str(cfg), *overrides]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, **popen)


def run_to_end(cfg: Path, *overrides: str) -> str:
    proc = launch(cfg, *overrides)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    return out


def train_losses(out_dir: Path) -> dict[int, float]:
    """step -> loss; a re-run step (after a resume) overwrites the killed run's record."""
    losses = {}
    for line in (out_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train":
            losses[record["step"]] = record["loss"]
    return losses


def wait_for_step(out_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (out_dir / "metrics.jsonl").exists() and any(s >= step for s in train_losses(out_dir)):
            return
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.02)
    raise TimeoutError(f"step {step} never logged")


def assert_loadable_by_public_dflash(ckpt: Path):
    from dflash.model import DFlashDraftModel as PublicDraftModel
    drafter = PublicDraftModel.from_pretrained(ckpt / "drafter", dtype=torch.float32)
    assert drafter.block_size == 8 and drafter.mask_token_id == 255
    assert (ckpt / "trainer_state.json").exists()


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """An uninterrupted run with saves every 6 steps."""
    tmp = tmp_path_factory.mktemp("reference")
    cfg = write_run(tmp)
    out = run_to_end(cfg)
    return tmp, cfg, out


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
    assert np.mean(losses[-4:]) < 0.8 * np.mean(losses[:4])
    assert "step=24 loss=" in out  # the console line
    checkpoints = run / "checkpoints"
    assert os.readlink(checkpoints / "latest") == "step_24"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_12", "step_18", "step_24"]  # keep 3
    assert_loadable_by_public_dflash(checkpoints / "latest")


def test_checkpoint_saves_do_not_change_the_trajectory(reference_run, tmp_path):
    _, cfg, _ = reference_run
    run_to_end(cfg, f"run.out_dir={tmp_path / 'nosave'}", "train.save_every=1000")
    assert train_losses(tmp_path / "nosave") == train_losses(reference_run[0] / "run")


def test_sigkill_then_resume_reproduces_the_uninterrupted_losses(reference_run, tmp_path):
    _, cfg, _ = reference_run
    out_dir = tmp_path / "killed"
    proc = launch(cfg, f"run.out_dir={out_dir}")
    wait_for_step(out_dir, 14, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out_dir / "checkpoints" / "step_24").exists()
    run_to_end(cfg, f"run.out_dir={out_dir}", "train.resume=auto")
    expected = train_losses(reference_run[0] / "run")
    resumed = train_losses(out_dir)
    assert resumed.keys() == expected.keys()
    for step in range(13, 25):  # resumed from step 12 (or a later complete checkpoint)
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step


def test_sigterm_saves_a_loadable_checkpoint_and_exits_cleanly(reference_run, tmp_path):
    _, cfg, _ = reference_run
    out_dir = tmp_path / "term"
    proc = launch(cfg, f"run.out_dir={out_dir}", "train.save_every=1000")
    wait_for_step(out_dir, 3, proc)
    os.killpg(proc.pid, signal.SIGTERM)  # as a scheduler (scancel) or Ctrl-C does: every process of the job
    out, _ = proc.communicate(timeout=120)
    assert "stop requested: saving at step" in out, out[-3000:]
    latest = out_dir / "checkpoints" / "latest"
    state = json.loads((latest / "trainer_state.json").read_text())
    assert 3 <= state["step"] < 24
    assert_loadable_by_public_dflash(latest)


def test_config_typo_fails_fast_naming_the_key(tmp_path):
    cfg = write_run(tmp_path)
    for override, key in (("optim.lrr=1", "optim.lrr"), ("train.max_steps=many", "train.max_steps")):
        proc = subprocess.run([sys.executable, "train.py", "--cfg", str(cfg), override], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0
        assert key in proc.stderr, proc.stderr[-2000:]
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


def test_deepspeed_json_autos_are_filled_and_conflicts_reported(tmp_path):
    cfg = load_config(str(REPO / "configs" / "v3.yaml"), ["data.path=/x", "optim.grad_accum=4"])
    messages = []
    ds = deepspeed_config(str(REPO / "ds_configs" / "zero2.json"), cfg, world_size=8, bf16=True,
                          log=messages.append)
    assert ds["train_batch_size"] == 32 and ds["gradient_accumulation_steps"] == 4
    assert ds["optimizer"]["params"]["betas"] == [0.9, 0.95] and ds["bf16"]["enabled"] is True
    assert ds["zero_optimization"]["stage"] == 2 and not messages
    custom = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    custom["gradient_clipping"] = 0.5
    (tmp_path / "ds.json").write_text(json.dumps(custom))
    ds = deepspeed_config(str(tmp_path / "ds.json"), cfg, world_size=8, bf16=True, log=messages.append)
    assert ds["gradient_clipping"] == 0.5  # the JSON wins...
    assert len(messages) == 1 and "gradient_clipping" in messages[0]  # ...and says so


FAULTY_MAIN = """
import sys, torch, train
nan_steps, calls, real_step = set(map(int, sys.argv[1].split(","))), [0], train.training_step
def faulty_step(*args, **kwargs):
    loss, metrics = real_step(*args, **kwargs)
    if torch.is_grad_enabled():  # a training micro step, not eval
        calls[0] += 1
        if calls[0] in nan_steps:
            loss = loss * float("nan")
    return loss, metrics
train.training_step = faulty_step
sys.exit(train.main(sys.argv[2:]))
"""


def run_with_nan_losses(cfg: Path, nan_steps, *overrides: str) -> subprocess.CompletedProcess:
    """Plain `python` (a world of one) with non-finite losses injected at `nan_steps` (1-based)."""
    return subprocess.run([sys.executable, "-c", FAULTY_MAIN, ",".join(map(str, nan_steps)), "--cfg", str(cfg),
                           "train.eval_every=1000", "data.num_workers=0", *overrides],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_nonfinite_steps_are_skipped_and_too_many_in_a_row_stop_the_run(tmp_path):
    from safetensors.torch import load_file
    cfg = write_run(tmp_path)
    out = tmp_path / "run"
    proc = run_with_nan_losses(cfg, [3, 4], "train.max_steps=8", "train.save_every=2", "train.keep_last=10")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "step 3: non-finite loss or gradient" in proc.stdout
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if r["kind"] == "train"]
    assert records[-1]["skipped_steps"] == 2 and records[-1]["step"] == 8
    assert all(np.isfinite(r["grad_norm"]) or r["step"] in (3, 4) for r in records)
    # a skipped step leaves the weights as they were: step_4 == step_2
    before = load_file(str(out / "checkpoints" / "step_2" / "drafter" / "model.safetensors"))
    after = load_file(str(out / "checkpoints" / "step_4" / "drafter" / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)
    for name in before:
        assert torch.isfinite(before[name]).all()

    out2 = tmp_path / "run2"
    proc = run_with_nan_losses(cfg, range(5, 100), f"run.out_dir={out2}", "train.max_steps=20",
                               "train.save_every=4", "train.max_bad_steps=3", "train.keep_last=5")
    assert proc.returncode == 1 and "3 non-finite steps in a row" in proc.stdout
    assert os.readlink(out2 / "checkpoints" / "latest") == "step_4"  # the last good checkpoint
    assert not (out2 / "checkpoints" / "step_8").exists()
    good = load_file(str(out2 / "checkpoints" / "step_4" / "drafter" / "model.safetensors"))
    assert all(torch.isfinite(v).all() for v in good.values())


def test_bad_prepared_data_is_rejected_up_front_naming_the_row(tmp_path):
    from drafter.data import load_prepared
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
