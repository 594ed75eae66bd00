"""bench/held_out_replay.py: a checkpoint replayed over every row of a prepared held-out set, each row
on its own, pooled by anchors and responses (not averaged per row), with the target the checkpoint names."""
import copy
import json
import re
import sys
from pathlib import Path

import datasets
import pytest
import torch

from drafter.metric_sums import finalize_metrics
from drafter.models import load_drafter
from drafter.models.blocks import DraftingSetup, FeatureBatch
from drafter.serving.served import replayed_tau
from drafter.target_model.model import context_features

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import held_out_replay  # noqa: E402

CUTS = [30, 48, 39]  # each row: a prompt and the target's greedy answer, cut to its own length


def prepared_rows(trained) -> list[dict]:
    rows = []
    for sequence, cut in zip(trained.sequences, CUTS):
        prompt = trained.prompts.shape[1]
        rows.append({"input_ids": sequence[:cut].tolist(), "loss_mask": [0] * prompt + [1] * (cut - prompt),
                     "length": cut})
    return rows


@pytest.fixture(scope="module")
def checkpoint(trained, tmp_path_factory):
    """The drafter trained on the target's greedy text (so tau differs row by row), saved as a run
    checkpoint naming its saved target."""
    tmp = tmp_path_factory.mktemp("replay")
    trained.target.save_pretrained(tmp / "target")
    drafter = copy.deepcopy(trained.drafter)
    drafter.config.dflash_config["target_path"] = str(tmp / "target")
    drafter.save_pretrained(tmp / "ckpt" / "drafter")
    datasets.Dataset.from_list(prepared_rows(trained)).save_to_disk(str(tmp / "data"))
    return tmp


def test_every_row_is_replayed_alone_and_pooled_over_the_set(trained, checkpoint, capsys):
    tmp, target, drafter = checkpoint, trained.target, trained.drafter
    [result] = held_out_replay.main(["--ckpt", str(tmp / "ckpt"), "--data", str(tmp / "data"), "--budgets", "4",
                                     "--out", str(tmp / "table.json")])
    summed = {}
    for row in prepared_rows(trained):
        ids, mask = torch.tensor([row["input_ids"]]), torch.tensor([row["loss_mask"]])
        features = context_features(target, ids, drafter.target_layer_ids)
        for key, value in replayed_tau(DraftingSetup(drafter, target, "dense", budgets=(4,)),
                                       FeatureBatch(ids, mask, features)).items():
            summed[key] = summed.get(key, 0) + value
    expected = finalize_metrics(summed)
    assert result["rows"] == len(CUTS) and expected["tau_dflash"] > 1.5  # a drafter that has learnt
    for key in ("tau_dflash", "tau_ddtree@4", "replay_acc_pos"):
        assert result[key] == pytest.approx(expected[key], abs=1e-6), key
    assert json.loads((tmp / "table.json").read_text())[0]["tau_ddtree@4"] == pytest.approx(expected["tau_ddtree@4"])
    assert f"| {tmp / 'ckpt'} |" in capsys.readouterr().out


def test_a_missing_checkpoint_set_or_target_is_one_line(checkpoint, tmp_path):
    random_target = tmp_path / "random" / "drafter"
    drafter = load_drafter(str(checkpoint / "ckpt" / "drafter"))
    drafter.config.dflash_config["target_path"] = None
    drafter.save_pretrained(random_target)
    for ckpt, data, message in [(tmp_path / "none", checkpoint / "data", f"error: {tmp_path / 'none'}: no DFlash"),
                                (checkpoint / "ckpt", tmp_path / "none", f"error: {tmp_path / 'none'}: "),
                                (random_target.parent, checkpoint / "data", "names no target_path")]:
        with pytest.raises(SystemExit, match=re.escape(message)):
            held_out_replay.main(["--ckpt", str(ckpt), "--data", str(data)])
