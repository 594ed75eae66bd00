"""The offline feature store (data/features.py, drafter/pipeline/feature_store.py): the features it holds are
training's own, bit for bit, on any batch, and so are the target's labels it holds (its argmax, its
final hidden states); fp8's rounding; the plan, resume and the refusals of a dump; the refusals of a
store that does not match the run, cannot serve its objective or is not whole; rows a hybrid run
appends, a kill in the middle of an append, the eval's replay from a store. Through the launchers
(slow): a two-rank dump, and training from the store equal to training online (ZeRO-2, FSDP2 across a
kill, hybrid and cached, distillation)."""
import copy
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections import namedtuple
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from conftest import make_drafter
from data import features as features_cli
from drafter.config import ObjectiveConfig
from drafter.pipeline import feature_store_format
from drafter.pipeline.feature_store import FeatureStore, StoreCache, StoreFeatures
from drafter.pipeline.feature_store_format import FeatureStoreError, labels_refusal, row_key, store_refusal
from drafter.pipeline.loader import collate
from drafter.errors import ConfigError
from drafter.infra.run_lock import acquire
from drafter.losses.divergences import labels_needed
from drafter.losses.lm_head import target_next_tokens
from drafter.models.blocks import DraftingSetup, FeatureBatch
from drafter.target_model.model import random_qwen3
from drafter.target_model.tensor_parallel import TargetFeatures, feature_code_version, form_tp_group
from drafter.training.objective import training_step
from drafter.training.run_config import load_config
from eval import ddtree_accept
from tiny_tokenizer import save_tiny_tokenizer
from runs import (REPO, VENV_BIN, _env, free_port, kill_job, launch, records, run_to_end, train_losses, wait_for_step,
                  write_run)


@pytest.fixture(autouse=True, scope="module")
def own_environment():
    """A dump run in this process forms a world of one, which sets RANK, MASTER_ADDR and the rest in
    os.environ: put it back, so that the processes later tests launch do not inherit them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def dump(cfg: Path, out: Path, *extra: str) -> int:
    return features_cli.main(["--cfg", str(cfg), "--data", str(cfg.parent / "data"), "--out", str(out), *extra])


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("store")
    cfg = write_run(tmp)
    assert dump(cfg, tmp / "store", "--shard-rows", "40") == 0
    return cfg, tmp / "store"


def test_stored_features_are_the_online_features_of_any_batch(store):
    """Rows batched as training batches them (widths not a multiple of 16 among them) get exactly what
    the target's feature pass gives that batch."""
    cfg, out = store
    settings = load_config(str(cfg))
    target = random_qwen3(**settings.target.random)
    online = TargetFeatures(target, form_tp_group(1), torch.device("cpu"))
    stored = FeatureStore(str(out))
    rows = datasets.load_from_disk(str(cfg.parent / "data"))
    # a row alone whose length ends in the last 8 of a 16-wide chunk is padded to a width that is not
    # a multiple of 16: the CPU kernels' vector tails then reach its real positions
    tails = [i for i, length in enumerate(rows["length"]) if 0 < length % 16 <= 8][:3]
    for members in ([0, 1, 2], *([i] for i in tails), [7, 30, 90, 150], [100, 3]):
        batch = collate([rows[i] for i in members], bucket=0)
        expected, _ = online(batch["input_ids"], stored.layer_ids, batch["lengths"])  # as training calls it
        got = stored.features(batch["input_ids"], batch["lengths"])
        for i, length in enumerate(batch["lengths"].tolist()):
            assert torch.equal(got[i, :length], expected[i, :length]), (members, i)


def test_the_plan_is_printed_and_a_killed_dump_resumes_keeping_whole_shards(store, tmp_path, capsys):
    cfg, whole = store
    out = tmp_path / "store"
    shutil.copytree(whole, out)
    (out / "run.lock").unlink()
    shards = sorted(out.glob("shard-*.safetensors"))
    assert len(shards) == 4
    kept = shards[0].stat().st_mtime_ns
    with open(shards[1], "r+b") as f:  # as a kill -9 mid-write could not leave it (rename), but a bad disk could
        f.truncate(shards[1].stat().st_size - 100)
    shards[2].unlink()
    index = json.loads((out / "index.json").read_text())
    (out / "index.json").write_text(json.dumps({**index, "complete": False}))
    (out / (shards[3].name + ".tmp")).write_bytes(b"half")  # what a killed dump leaves
    with pytest.raises(FeatureStoreError, match="dump has not finished"):
        FeatureStore(str(out))
    capsys.readouterr()
    assert dump(cfg, out, "--shard-rows", "40") == 0
    printed = capsys.readouterr().out
    tokens = sum(datasets.load_from_disk(str(cfg.parent / "data"))["length"])
    assert f"160 rows, {tokens:,} tokens x (1 layers [2] x 64 hidden) in fp32 = 256 B a token" in printed
    assert "in 4 shards (2 already whole)" in printed and "free on its disk" in printed
    assert shards[0].stat().st_mtime_ns == kept  # skipped, not rewritten
    assert FeatureStore(str(out)).rows.keys() == FeatureStore(str(whole)).rows.keys()
    for shard in shards:
        rewritten, first = load_file(shard), load_file(whole / shard.name)
        assert all(torch.equal(rewritten[k], first[k]) for k in first), shard.name
    assert not list(out.glob("*.tmp"))


def test_a_dump_refuses_foreign_files_a_full_disk_a_busy_directory_and_a_tp_target(store, tmp_path, capsys,
                                                                                   monkeypatch):
    cfg, _ = store
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    assert dump(cfg, foreign) == 2
    assert "holds files a feature dump does not write (notes.txt)" in capsys.readouterr().err
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]  # nothing written, nothing deleted

    assert dump(cfg, tmp_path / "tp", "target.tp_size=2") == 2
    assert "error: target.tp_size=2: the dump runs the whole target on each rank" in capsys.readouterr().err
    assert not (tmp_path / "tp").exists()

    busy = tmp_path / "busy"
    with acquire(str(busy)):  # a dump already writing there
        assert dump(cfg, busy) == 2
    assert "is in use by another live run" in capsys.readouterr().err

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(features_cli.shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    small = tmp_path / "small"
    assert dump(cfg, small) == 2
    assert "needs 2.56 MiB more and its disk has 0.00 MiB free" in capsys.readouterr().err
    assert not list(small.glob("shard-*")) and not (small / "index.json").exists()


def test_a_store_that_is_not_whole_is_refused_naming_the_file(store, tmp_path):
    _, whole = store
    out = tmp_path / "store"
    shutil.copytree(whole, out)
    shard = out / "shard-00002-of-00004.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1)
    with pytest.raises(FeatureStoreError, match=f"shard {shard}: truncated"):
        FeatureStore(str(out))
    shard.unlink()
    with pytest.raises(FeatureStoreError, match=f"shard {shard}: missing"):
        FeatureStore(str(out))


@pytest.mark.parametrize("override, message", [
    ("drafter.target_layer_ids=[1]", "layer_ids (drafter.target_layer_ids): the store has [2], this run [1]"),
    ("target.dtype=bf16", "dtype (target.dtype): the store has 'fp32', this run 'bf16'"),
    ("target.random.seed=3", "target.random: the store has {"),
    ("data.max_length=256", "data.max_length (data.max_length): the store has 128, this run 256"),
])
def test_a_store_that_disagrees_with_the_run_is_refused_naming_the_field(store, override, message):
    cfg, out = store
    settings = load_config(str(cfg), [override])
    layer_ids = list(settings.drafter.target_layer_ids or [2])
    dtype = torch.bfloat16 if "bf16" in override else torch.float32
    assert message in store_refusal(FeatureStore(str(out)), settings, layer_ids, dtype, feature_code_version())
    assert store_refusal(FeatureStore(str(out)), load_config(str(cfg)), [2], torch.float32, feature_code_version()) is None


def test_another_dataset_is_refused(store, tmp_path):
    cfg, out = store
    rows = datasets.load_from_disk(str(cfg.parent / "data"))
    rows.select(range(159)).save_to_disk(str(tmp_path / "fewer"))
    settings = load_config(str(cfg), [f"data.path={tmp_path / 'fewer'}"])
    assert "dataset (data.path): the store has" in store_refusal(FeatureStore(str(out)), settings, [2], torch.float32, feature_code_version())


# ----------------------------------------------------------------------------- through the launchers

def dump_on_two_ranks(cfg: Path, out: Path, *extra: str) -> str:
    """data/features.py on two CPU ranks through torchrun."""
    cmd = [str(VENV_BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(REPO / "data" / "features.py"), "--cfg", str(cfg), "--data", str(cfg.parent / "data"),
           "--out", str(out), *extra]
    done = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def checkpoint_tensors(step_dir: Path) -> dict:
    """Every tensor a checkpoint holds: the exported drafter, each rank's RNG state, the engine's weights
    and optimizer state (DeepSpeed's .pt files or DCP's shards, read back as tensors)."""
    tensors = {}
    for path in sorted(step_dir.rglob("*.safetensors")):
        tensors.update({f"{path.relative_to(step_dir)}:{k}": v for k, v in load_file(path).items()})
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    for path in sorted(step_dir.rglob("*.pt")):
        with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):  # what DeepSpeed pickles beside tensors
            collect(torch.load(path, map_location="cpu", weights_only=True), str(path.relative_to(step_dir)), tensors)
    return tensors


def collect(value, prefix: str, out: dict):
    if torch.is_tensor(value):
        out[prefix] = value
    elif isinstance(value, dict):
        for k, v in value.items():
            collect(v, f"{prefix}.{k}", out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            collect(v, f"{prefix}.{i}", out)


@pytest.mark.slow
def test_training_from_an_fp32_store_equals_training_online(reference_run, tmp_path):
    """The two-rank ZeRO-2 reference run (deepspeed, online), and the same run reading a store that two
    ranks dumped through torchrun: the same loss at every step, the same eval, the same checkpoint."""
    tmp, cfg, _ = reference_run
    store = tmp_path / "store"
    printed = dump_on_two_ranks(cfg, store, "--shard-rows", "30")
    assert "complete (6 shards)" in printed
    offline = tmp_path / "offline"
    out = run_to_end(cfg, f"run.out_dir={offline}", f"data.features={store}", "train.generate_every=0")
    assert re.search(r"target weights +0.00 MiB", out) and "target embed + head" in out
    assert train_losses(offline) == train_losses(tmp / "run")
    assert [r["loss"] for r in records(offline, "eval")] == [r["loss"] for r in records(tmp / "run", "eval")]
    online, stored = checkpoint_tensors(tmp / "run" / "checkpoints" / "step_24"), checkpoint_tensors(
        offline / "checkpoints" / "step_24")
    assert online.keys() == stored.keys() and len(online) > 10
    for key in online:
        assert torch.equal(online[key], stored[key]), key


@pytest.mark.slow
def test_a_store_that_disagrees_or_is_not_whole_stops_training_in_one_line(reference_run, tmp_path):
    tmp, cfg, _ = reference_run
    store = tmp_path / "store"
    assert dump(cfg, store, "--shard-rows", "60") == 0
    common = [f"data.features={store}", "train.generate_every=0", "data.num_workers=0", "train.max_steps=2"]
    out = run_to_end(cfg, f"run.out_dir={tmp_path / 'a'}", *common, "drafter.target_layer_ids=[1]",
                     launcher="python", expect=2)
    assert (f"error: data.features={store} does not match this run: layer_ids (drafter.target_layer_ids): "
            "the store has [2], this run [1]") in out and "Traceback" not in out
    shard = store / "shard-00001-of-00003.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    out = run_to_end(cfg, f"run.out_dir={tmp_path / 'b'}", *common, launcher="python", expect=2)
    assert f"error: feature store shard {shard}: truncated" in out and "Traceback" not in out


@pytest.mark.slow
def test_fsdp2_from_a_store_killed_and_resumed_equals_fsdp2_online(tmp_path):
    """torchrun, train.engine=fsdp: a run from the store, SIGKILLed mid-epoch and resumed, gives the
    uninterrupted online run's loss at every step and its exported drafter."""
    cfg = write_run(tmp_path, max_steps=16, save_every=6, eval_every=1000, generate_every=0)
    store = tmp_path / "store"
    assert dump(cfg, store, "--shard-rows", "80") == 0
    online, offline = tmp_path / "online", tmp_path / "offline"
    run_to_end(cfg, f"run.out_dir={online}", "train.engine=fsdp", launcher="torchrun")
    proc = launch(cfg, f"run.out_dir={offline}", "train.engine=fsdp", f"data.features={store}", launcher="torchrun")
    wait_for_step(offline, 9, proc)
    kill_job(proc, signal.SIGKILL)
    proc.wait()
    assert not (offline / "checkpoints" / "step_16").exists()  # killed mid-run, past its step 6 save
    out = run_to_end(cfg, f"run.out_dir={offline}", "train.engine=fsdp", f"data.features={store}",
                     launcher="torchrun")
    assert "resumed from" in out
    assert train_losses(offline) == train_losses(online)
    exported = [load_file(run / "checkpoints" / "step_16" / "drafter" / "model.safetensors") for run in (online, offline)]
    assert exported[0].keys() == exported[1].keys()
    assert all(torch.equal(exported[0][k], exported[1][k]) for k in exported[0])


def test_a_disk_that_fills_mid_dump_keeps_the_whole_shards_and_resumes(store, tmp_path, capsys, monkeypatch):
    cfg, whole = store
    out = tmp_path / "store"
    written = []
    real_save = feature_store_format.save_file

    def fill_up(tensors, path, metadata):
        if len(written) == 2:
            Path(path).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(path)
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(feature_store_format, "save_file", fill_up)
    assert dump(cfg, out, "--shard-rows", "40") == 2
    err = capsys.readouterr().err
    assert "shard-00002-of-00004.safetensors: could not be written (No space left on device)" in err
    assert sorted(p.name for p in out.glob("shard-*")) == ["shard-00000-of-00004.safetensors",
                                                         "shard-00001-of-00004.safetensors"]
    monkeypatch.setattr(feature_store_format, "save_file", real_save)
    assert dump(cfg, out, "--shard-rows", "40") == 0
    assert "(2 already whole)" in capsys.readouterr().out
    assert FeatureStore(str(out)).rows.keys() == FeatureStore(str(whole)).rows.keys()


@pytest.mark.slow
def test_hybrid_rows_the_store_lacks_are_computed_by_the_target_and_cached_bit_for_bit(half_store, tmp_path):
    """data.features_missing=generate over a store of half the rows, appending what it computes
    (data.features_cache): the online run's losses; before, the same store is refused without the
    target, naming the dataset; after an epoch and an eval of every held-out row, it holds every row and
    trains without the target, the online run's losses again."""
    cfg, half = half_store
    partial = tmp_path / "partial"
    shutil.copytree(half, partial)
    common = ["train.epochs=1", "train.max_steps=null", "train.eval_every=1000", "train.eval_batches=1000",
              "train.save_every=1000", "data.num_workers=0"]
    run_to_end(cfg, f"run.out_dir={tmp_path / 'online'}", *common, launcher="python")
    strict = [*common, f"data.features={partial}", "train.generate_every=0"]
    out = run_to_end(cfg, f"run.out_dir={tmp_path / 'strict'}", *strict, launcher="python", expect=2)
    assert f"error: data.features={partial} does not match this run: dataset (data.path)" in out
    out = run_to_end(cfg, f"run.out_dir={tmp_path / 'hybrid'}", *common, f"data.features={partial}",
                     "data.features_missing=generate", "data.features_cache=true", launcher="python")
    assert list(partial.glob("cache-*.safetensors"))
    out = run_to_end(cfg, f"run.out_dir={tmp_path / 'grown'}", *strict, launcher="python")
    assert re.search(r"target weights +0.00 MiB", out)
    for run in ("hybrid", "grown"):
        assert train_losses(tmp_path / run) == train_losses(tmp_path / "online"), run
        assert [r["loss"] for r in records(tmp_path / run, "eval")] == [
            r["loss"] for r in records(tmp_path / "online", "eval")], run


@pytest.mark.slow
def test_distillation_from_a_store_of_the_targets_final_states_equals_distillation_online(labelled_stores, tmp_path):
    """objective.labels=target, loss=kl, from a store of the target's final hidden states (its whole
    distribution), its held-out rows (data.eval_path, rows the training store does not hold) from their
    own store (data.eval_features): the online run's losses and eval, without the target's weights."""
    cfg, full, _ = labelled_stores
    rows = datasets.load_from_disk(str(cfg.parent / "data")).select(range(32))
    shifted = rows.map(lambda row: {"input_ids": [(t + 1) % 32 for t in row["input_ids"]]})
    shifted.save_to_disk(str(tmp_path / "eval_data"))
    shutil.copy(cfg.parent / "data" / "stats.json", tmp_path / "eval_data" / "stats.json")
    eval_store = tmp_path / "eval_store"
    assert features_cli.main(["--cfg", str(cfg), "--data", str(tmp_path / "eval_data"), "--out", str(eval_store),
                              "--target-labels", "full"]) == 0
    common = ["train.max_steps=4", "train.eval_every=2", "data.num_workers=0", "train.generate_every=0",
              "objective.labels=target", "objective.loss=kl", f"data.eval_path={tmp_path / 'eval_data'}"]
    run_to_end(cfg, f"run.out_dir={tmp_path / 'online'}", *common, launcher="python")
    out = run_to_end(cfg, f"run.out_dir={tmp_path / 'stored'}", *common, f"data.features={full}",
                     f"data.eval_features={eval_store}", launcher="python")
    assert re.search(r"target weights +0.00 MiB", out)
    assert train_losses(tmp_path / "stored") == train_losses(tmp_path / "online")
    evals = [[r["loss"] for r in records(tmp_path / run, "eval")] for run in ("stored", "online")]
    assert evals[0] == evals[1] and len(evals[0]) == 2


@pytest.mark.slow
def test_a_feature_calibration_applies_to_stored_features_as_to_online_ones(store, tmp_path):
    """objective.feature_calibration=oracle from the store: the online run's losses, which are not those
    of the same store uncalibrated."""
    cfg, out = store
    common = ["train.max_steps=4", "train.eval_every=2", "data.num_workers=0", "train.generate_every=0"]
    oracle = "objective.feature_calibration=oracle"
    run_to_end(cfg, f"run.out_dir={tmp_path / 'online'}", *common, oracle, launcher="python")
    run_to_end(cfg, f"run.out_dir={tmp_path / 'stored'}", *common, oracle, f"data.features={out}", launcher="python")
    run_to_end(cfg, f"run.out_dir={tmp_path / 'plain'}", *common, f"data.features={out}", launcher="python")
    assert train_losses(tmp_path / "stored") == train_losses(tmp_path / "online")
    assert [r["loss"] for r in records(tmp_path / "stored", "eval")] == [
        r["loss"] for r in records(tmp_path / "online", "eval")]
    assert train_losses(tmp_path / "plain") != train_losses(tmp_path / "stored")


# ----------------------------------------------------------------------------- the target's labels, fp8, the cache

@pytest.fixture(scope="module")
def labelled_stores(store, tmp_path_factory):
    """The fixture's rows dumped again with the target's final hidden states (full) and with its argmax."""
    cfg, _ = store
    tmp = tmp_path_factory.mktemp("labelled")
    for labels in ("full", "argmax"):
        assert dump(cfg, tmp / labels, "--shard-rows", "80", "--target-labels", labels) == 0
    return cfg, tmp / "full", tmp / "argmax"


def test_stored_target_labels_give_the_online_objective_bit_for_bit(labelled_stores):
    """On training's batches, a store's final hidden states are the target's, and the training step
    from them (KL) and from its stored argmax (D-PACE weights on the target's hard labels) gives the
    loss and metrics of the step on the target's own final hidden states."""
    cfg, full, argmax = labelled_stores
    settings = load_config(str(cfg))
    target = random_qwen3(**settings.target.random)
    online = TargetFeatures(target, form_tp_group(1), torch.device("cpu"), final_hidden=True)
    drafter = make_drafter(target, num_layers=1, target_layer_ids=[2])
    rows = datasets.load_from_disk(str(cfg.parent / "data"))
    head = target.get_output_embeddings().weight
    next_tokens = lambda final: target_next_tokens(final, head, None, 64)  # noqa: E731
    from_full = StoreFeatures([FeatureStore(str(full))], torch.float32, "full")
    from_argmax = StoreFeatures([FeatureStore(str(argmax))], torch.float32, "argmax")
    kl = replace(ObjectiveConfig(), labels="target", loss="kl", num_anchors=8)
    dpace = replace(ObjectiveConfig(), labels="target", position_weights="dpace", num_anchors=8)
    for members in ([0, 1, 2], [7, 30, 90, 150], [100]):
        batch = collate([rows[i] for i in members], bucket=0)
        ids, mask, lengths = batch["input_ids"], batch["loss_mask"], batch["lengths"]
        features, final = online(ids, [2], lengths)
        stored_features, stored_final = from_full(ids, [2], lengths)
        _, stored_tokens = from_argmax(ids, [2], lengths)
        for i, length in enumerate(lengths.tolist()):
            assert torch.equal(stored_final[i, :length], final[i, :length]), (members, i)
            assert torch.equal(stored_tokens[i, :length], next_tokens(final[i, :length])), (members, i)
        for objective, labels in ((kl, stored_final), (dpace, stored_tokens)):
            step = lambda f, t: training_step(DraftingSetup(drafter, target, "dense"), FeatureBatch(ids, mask, f, t),
                                              objective, torch.Generator().manual_seed(3))
            (expected, expected_metrics), (got, got_metrics) = step(features, final), step(stored_features, labels)
            assert torch.equal(got, expected), (members, objective.loss)
            assert all(torch.equal(got_metrics[k], expected_metrics[k]) for k in expected_metrics)
    data_labels = training_step(DraftingSetup(drafter, target, "dense"), FeatureBatch(ids, mask, features),
                                replace(dpace, labels="data"), torch.Generator().manual_seed(3))[0]
    assert not torch.equal(data_labels, got)  # the target's argmax is not the data's next token everywhere


@pytest.mark.parametrize("overrides, which, message", [
    (["objective.labels=target"], "none", "target_labels: the store holds 'none', objective.labels=target with "
                                          "objective.loss=ce reads 'argmax' (dump the store with data/features.py "
                                          "--target-labels argmax)"),
    (["objective.labels=target", "objective.loss=kl"], "argmax", "the store holds 'argmax', objective.labels=target "
                                                                 "with objective.loss=kl reads 'full'"),
    (["objective.labels=target", "drafter.draft_vocab_size=64"], "argmax", "objective.labels=target with "
                                                                           "drafter.draft_vocab_size=64 reads 'full'"),
])
def test_an_objective_the_store_cannot_serve_is_refused_naming_the_field(store, labelled_stores, overrides, which,
                                                                         message):
    cfg, plain = store
    _, full, argmax = labelled_stores
    directory = {"none": plain, "argmax": argmax}[which]
    settings = load_config(str(cfg), overrides)
    needed = labels_needed(settings.objective, settings.drafter.draft_vocab_size is not None)
    refusal = labels_refusal(FeatureStore(str(directory)), settings, needed)
    assert refusal.startswith(f"data.features={directory} does not serve this objective: ") and message in refusal
    assert labels_refusal(FeatureStore(str(full)), settings, needed) is None


def test_an_fp8_store_holds_each_token_to_fp8_rounding_of_its_own_scale(store, tmp_path):
    """fp8 (e4m3) with a scale per token and layer: every value within half a step of 3 mantissa bits
    of the fp32 store's (1/16 of its token's largest), at about a quarter of the bytes; a run asking
    for another dtype is refused naming it."""
    cfg, whole = store
    out = tmp_path / "fp8"
    assert dump(cfg, out, "--shard-rows", "40", "--dtype", "fp8") == 0
    exact, fp8 = FeatureStore(str(whole)), FeatureStore(str(out))
    rows = datasets.load_from_disk(str(cfg.parent / "data"))
    batch = collate([rows[i] for i in (0, 5, 77)], bucket=0)
    expected = exact.features(batch["input_ids"], batch["lengths"])
    got = fp8.features(batch["input_ids"], batch["lengths"])
    for i, length in enumerate(batch["lengths"].tolist()):
        error = (got[i, :length] - expected[i, :length]).abs()
        largest = expected[i, :length].abs().amax(-1, keepdim=True)
        assert (error <= largest / 16 + 1e-6).all() and error.max() > 0
    size = lambda d: sum(p.stat().st_size for p in d.glob("shard-*"))  # noqa: E731
    assert size(out) < 0.3 * size(whole)
    asked = load_config(str(cfg), ["data.features_dtype=bf16"])
    assert "dtype (data.features_dtype): the store has 'fp8', this run 'bf16'" in store_refusal(
        fp8, asked, [2], torch.float32, feature_code_version())
    assert "dtype (target.dtype): the store has 'fp8', this run 'fp32'" in store_refusal(
        fp8, load_config(str(cfg)), [2], torch.float32, feature_code_version())
    assert store_refusal(fp8, load_config(str(cfg), ["data.features_dtype=fp8"]), [2], torch.float32,
                         feature_code_version()) is None


@pytest.fixture(scope="module")
def half_store(store, tmp_path_factory):
    """A store of the fixture's first 80 rows: the other 80 are what a hybrid run computes."""
    cfg, _ = store
    tmp = tmp_path_factory.mktemp("half")
    rows = datasets.load_from_disk(str(cfg.parent / "data"))
    rows.select(range(80)).save_to_disk(str(tmp / "data"))
    shutil.copy(cfg.parent / "data" / "stats.json", tmp / "data" / "stats.json")
    assert features_cli.main(["--cfg", str(cfg), "--data", str(tmp / "data"), "--out", str(tmp / "store")]) == 0
    return cfg, tmp / "store"


def hybrid(cfg: Path, directory: Path):
    """(a hybrid StoreFeatures over the store at `directory` appending what it computes, its cache)."""
    target = random_qwen3(**load_config(str(cfg)).target.random)
    store = FeatureStore(str(directory))
    cache = StoreCache(store)
    return StoreFeatures([store], torch.float32, generate=TargetFeatures(target, form_tp_group(1), torch.device("cpu")),
                         cache=cache), cache


def test_rows_a_hybrid_run_computes_are_appended_by_each_writer_and_read_back_bit_for_bit(half_store, tmp_path):
    """Two writers (two ranks) append at once to one store: each its own cache shard; the store read
    again holds both's rows, the target's features bit for bit."""
    cfg, half = half_store
    out = tmp_path / "store"
    shutil.copytree(half, out)
    rows = datasets.load_from_disk(str(cfg.parent / "data"))
    target = random_qwen3(**load_config(str(cfg)).target.random)
    online = TargetFeatures(target, form_tp_group(1), torch.device("cpu"))
    (first, first_cache), (second, second_cache) = hybrid(cfg, out), hybrid(cfg, out)
    batches = [collate([rows[i] for i in members], bucket=0) for members in ([3, 90, 91], [92, 150])]
    for features, batch in zip((first, second), batches):
        features(batch["input_ids"], [2], batch["lengths"])
    first_cache.flush()
    second_cache.flush()
    assert len(list(out.glob("cache-*.safetensors"))) == 2
    grown = FeatureStore(str(out))
    assert len(grown.rows) == 80 + 4
    for batch in batches:
        expected, _ = online(batch["input_ids"], [2], batch["lengths"])
        got = grown.features(batch["input_ids"], batch["lengths"])
        for i, length in enumerate(batch["lengths"].tolist()):
            assert torch.equal(got[i, :length], expected[i, :length])


KILLED_APPEND = """
import os, signal, sys
import datasets, torch
from drafter.pipeline import feature_store_format
from drafter.pipeline.loader import collate
from drafter.errors import ConfigError
sys.path.insert(0, {tests!r})
from test_features import hybrid
features, cache = hybrid({cfg!r}, {store!r})
rows = datasets.load_from_disk({data!r})
def append(members):
    batch = collate([rows[i] for i in members], bucket=0)
    features(batch["input_ids"], [2], batch["lengths"])
    cache.flush()
append([100, 101])
real = feature_store_format.save_file
def killed_mid_write(tensors, path, metadata):
    real(tensors, path, metadata=metadata)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    os.kill(os.getpid(), signal.SIGKILL)
feature_store_format.save_file = killed_mid_write
append([120, 121])
"""


def test_a_kill_in_the_middle_of_an_append_leaves_a_store_that_reads_correctly(half_store, tmp_path):
    """SIGKILL while a cache shard is half written: the store opens, with the appends before it and
    without the half one, which a later run appends again; a cache shard that is not whole under its
    own name is refused naming the file."""
    cfg, half = half_store
    out = tmp_path / "store"
    shutil.copytree(half, out)
    script = KILLED_APPEND.format(tests=str(REPO / "tests"), cfg=str(cfg), store=str(out),
                                  data=str(cfg.parent / "data"))
    done = subprocess.run([str(VENV_BIN / "python"), "-c", script], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert len(list(out.glob("cache-*.safetensors.tmp"))) == 1
    rows = datasets.load_from_disk(str(cfg.parent / "data"))
    keys = {i: int(row_key(rows[i]["input_ids"])) for i in (100, 101, 120, 121)}
    after_kill = FeatureStore(str(out))
    assert len(after_kill.rows) == 82 and {keys[100], keys[101]} <= after_kill.rows.keys()
    assert not {keys[120], keys[121]} & after_kill.rows.keys()
    features, cache = hybrid(cfg, out)
    batch = collate([rows[i] for i in (120, 121)], bucket=0)
    features(batch["input_ids"], [2], batch["lengths"])
    cache.flush()
    assert len(FeatureStore(str(out)).rows) == 84
    appended = sorted(out.glob("cache-*.safetensors"))[0]
    with open(appended, "r+b") as f:
        f.truncate(appended.stat().st_size - 8)
    with pytest.raises(FeatureStoreError, match=f"shard {appended}: truncated"):
        FeatureStore(str(out))


def test_the_eval_replay_reads_a_row_the_store_holds_and_refuses_another_targets_store(store, tmp_path, capsys):
    """eval/ddtree_accept.py --features: a replayed text the store holds takes its stored features, any
    other text the target's; a store of another target stops the eval naming target.path."""
    cfg, out = store
    settings = load_config(str(cfg))
    target = random_qwen3(**settings.target.random)
    rows = datasets.load_from_disk(str(cfg.parent / "data"))
    evaluator = SimpleNamespace(store=FeatureStore(str(out)), target=target, dtype=torch.float32,
                                drafter=SimpleNamespace(target_layer_ids=[2]))
    held = torch.tensor([rows[5]["input_ids"]])
    stored = FeatureStore(str(out)).features(held, [held.shape[1]])
    assert torch.equal(ddtree_accept.Evaluator.replay_features(evaluator, held), stored)
    new = torch.tensor([[7, 3, 1, 4, 1, 5, 9, 2, 6]])
    expected = ddtree_accept.context_features(target, new, [2])
    assert torch.equal(ddtree_accept.Evaluator.replay_features(evaluator, new), expected)
    with pytest.raises(SystemExit, match=f"--features {out}: target.path: the store has None, this eval /models/x"):
        ddtree_accept.replay_store(str(out), "/models/x", [2])


def test_an_append_that_cannot_be_written_is_said_once_and_the_run_goes_on(half_store, tmp_path, capsys,
                                                                           monkeypatch):
    cfg, half = half_store
    out = tmp_path / "store"
    shutil.copytree(half, out)

    def full_disk(tensors, path, metadata):
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(feature_store_format, "save_file", full_disk)
    features, cache = hybrid(cfg, out)
    rows = datasets.load_from_disk(str(cfg.parent / "data"))
    for members in ([90], [91]):
        batch = collate([rows[i] for i in members], bucket=0)
        assert features(batch["input_ids"], [2], batch["lengths"])[0].abs().sum() > 0
        cache.flush()
    err = capsys.readouterr().err
    assert err.count("warning: data.features_cache:") == 1 and "No space left on device" in err
    assert not list(out.glob("cache-*")) and len(FeatureStore(str(out)).rows) == 80


@pytest.mark.parametrize("overrides, message", [
    (["data.features_cache=true"], "data.features_cache is read only with data.features"),
    (["data.features_dtype=fp8"], "data.features_dtype is read only with data.features"),
    (["data.features=STORE", "data.features_cache=true"],
     "data.features_cache=true appends the rows the target computes to the store: it needs "
     "data.features_missing=generate"),
    (["data.features=STORE", "drafter.layers_from_target=[1]"],
     "drafter.layers_from_target=[1] copies the target's layers, and a run from data.features loads only its "
     "embedding and LM head"),
])
def test_store_settings_that_cannot_work_are_refused_before_anything_loads(store, overrides, message):
    from drafter.training.run_setup import check_store_settings
    cfg, out = store
    settings = load_config(str(cfg), [o.replace("STORE", str(out)) for o in overrides])
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_store_settings(settings)


def finished_run(settings, tmp_path: Path, monkeypatch):
    """bench/variants.py, and a run directory under tmp_path/run as a finished run leaves it: a fresh
    drafter of the store's layer 2 and the run's config; the target loads as the config's random one,
    in the dtype asked for. Returns (variants, the checkpoint directory)."""
    sys.path.insert(0, str(REPO / "bench"))
    import variants
    target = random_qwen3(**settings.target.random)
    latest = tmp_path / "run" / "checkpoints" / "latest"
    make_drafter(target, num_layers=1, block_size=8, target_layer_ids=[2]).save_pretrained(latest / "drafter")
    OmegaConf.save(settings, latest / "config.yaml")
    monkeypatch.setattr("drafter.target_model.model.load_target",
                        lambda path, device, dtype: copy.deepcopy(target).to(dtype))
    return variants, latest


def test_a_variants_replay_from_a_store_is_the_online_replay_and_another_targets_store_is_refused(
        store, tmp_path, monkeypatch):
    """bench/variants.py --also-eval-features: a run's final drafter replayed on a set whose store it is
    gives the online replay's taus exactly; the store of another target stops it naming the field."""
    cfg, out = store
    settings = load_config(str(cfg))
    variants, latest = finished_run(settings, tmp_path, monkeypatch)
    data = str(cfg.parent / "data")
    online = variants.replay(tmp_path / "run", data, 1, None)
    assert variants.replay(tmp_path / "run", data, 1, str(out)) == online
    settings.target.random.seed = 1
    OmegaConf.save(settings, latest / "config.yaml")
    with pytest.raises(SystemExit, match=re.escape(f"error: --also-eval-features {out}: ") + ".*target.random"):
        variants.replay(tmp_path / "run", data, 1, str(out))


def test_a_bf16_runs_variants_replay_reads_its_bf16_store_as_its_own_eval_does(store, tmp_path, monkeypatch):
    """A run trained in bf16 (target.dtype=bf16) is replayed in bf16 from a bf16 store, equal to its
    online bf16 replay: the replay once ran every run in fp32 and refused every bf16 store by dtype."""
    cfg, _ = store
    out = tmp_path / "store_bf16"
    assert dump(cfg, out, "--dtype", "bf16", "target.dtype=bf16") == 0
    variants, _ = finished_run(load_config(str(cfg), ["target.dtype=bf16"]), tmp_path, monkeypatch)
    data = str(cfg.parent / "data")
    online = variants.replay(tmp_path / "run", data, 1, None)
    assert variants.replay(tmp_path / "run", data, 1, str(out)) == online
    assert online["tau_dflash"] > 1


def test_the_eval_refuses_a_store_whose_target_path_now_holds_another_target(tmp_path):
    """eval/ddtree_accept.py --features: the target at the store's target.path retrained since the dump
    (its weights differ) would replay on the old target's features: refused naming target_weights."""
    cfg = write_run(tmp_path)
    settings = OmegaConf.load(cfg)
    target_dir, random = tmp_path / "target", OmegaConf.to_container(settings.target.random)
    random_qwen3(**random).save_pretrained(target_dir)
    save_tiny_tokenizer(target_dir)
    settings.target = {"path": str(target_dir)}
    OmegaConf.save(settings, cfg)
    assert dump(cfg, tmp_path / "store") == 0
    assert ddtree_accept.replay_store(str(tmp_path / "store"), str(target_dir), [2]).layer_ids == [2]
    random_qwen3(seed=1, **random).save_pretrained(target_dir)
    with pytest.raises(SystemExit, match=re.escape(f"error: --features {tmp_path / 'store'}: target_weights: ")):
        ddtree_accept.replay_store(str(tmp_path / "store"), str(target_dir), [2])


@pytest.mark.parametrize("argv, message", [(["--eval-features", "S"], "--eval-features is read only with --features"),
                                           (["--also-eval-features", "S"],
                                            "--also-eval-features is read only with --also-eval")])
def test_a_variants_store_flag_without_its_set_is_refused(argv, message, monkeypatch, capsys):
    sys.path.insert(0, str(REPO / "bench"))
    import variants
    monkeypatch.setattr(sys, "argv", ["variants.py", *argv])
    with pytest.raises(SystemExit):
        variants.main()
    assert message in capsys.readouterr().err


def test_a_store_path_that_is_a_file_or_an_index_that_is_no_object_is_one_line(tmp_path):
    (tmp_path / "file").write_text("not a store")
    with pytest.raises(FeatureStoreError, match=f"data.features={tmp_path / 'file'}: no index.json there"):
        FeatureStore(str(tmp_path / "file"))
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "index.json").write_text("[]")
    with pytest.raises(FeatureStoreError, match="index.json: store format None, this code reads"):
        FeatureStore(str(tmp_path / "store"))
