"""drafter/pipeline/datasets.py: the thinking check against the training config and the group-wise held-out split,
on datasets data/prepare.py writes from small files."""
import json

import numpy as np
import pytest
from omegaconf import OmegaConf

from data import prepare
from drafter.pipeline.datasets import load_datasets
from tests.tiny_tokenizer import save_tiny_tokenizer

VOCAB = 320


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return str(save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer")))


def prepared(target, tmp_path, name, rows, *flags) -> str:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / name
    prepare.main(["--input", str(path), "--target", target, "--out", str(out),
                  "--cache-dir", str(tmp_path / "cache"), "--num-proc", "1", *flags])
    return str(out)


def data_cfg(path, **overrides):
    return OmegaConf.create({"path": path, "eval_path": None, "eval_fraction": 0.1, "seed": 0, **overrides})


def conversation(i, group):
    return {"group": group, "messages": [{"role": "user", "content": f"Question {i}?"},
                                         {"role": "assistant", "content": f"Answer {i} is here."}]}


def test_thinking_mismatch_is_refused_naming_both(target, tmp_path):
    rows = [conversation(i, "g") for i in range(4)]
    off = prepared(target, tmp_path, "off", rows, "--no-thinking")
    on = prepared(target, tmp_path, "on", rows, "--thinking")
    with pytest.raises(ValueError, match=r"off was prepared with enable_thinking=False .* the config has "
                                         r"target\.chat_template_kwargs\.enable_thinking=True"):
        load_datasets(data_cfg(off), VOCAB, {"enable_thinking": True})
    with pytest.raises(ValueError, match=r"on was prepared with enable_thinking=True .*enable_thinking=False"):
        load_datasets(data_cfg(on), VOCAB, OmegaConf.create({"enable_thinking": False}))
    with pytest.raises(ValueError, match=r"on was prepared with enable_thinking=True"):  # the eval set too
        load_datasets(data_cfg(off, eval_path=on), VOCAB, {"enable_thinking": False})
    train, held = load_datasets(data_cfg(on, eval_path=on), VOCAB, {"enable_thinking": True})
    assert len(train) == len(held) == 4


def test_a_dataset_without_the_record_warns_and_loads(target, tmp_path):
    path = prepared(target, tmp_path, "old", [conversation(i, "g") for i in range(4)])
    stats_path = tmp_path / "old" / "stats.json"
    stats = json.loads(stats_path.read_text())
    del stats["settings"]
    stats_path.write_text(json.dumps(stats))
    with pytest.warns(UserWarning, match="thinking on/off cannot be checked"):
        train, held = load_datasets(data_cfg(path, eval_fraction=0.0), VOCAB, {"enable_thinking": True})
    assert len(train) == 4 and len(held) == 0


def test_the_eval_split_holds_out_whole_groups(target, tmp_path):
    files = [f"lib/module{i}.py" for i in range(12)]
    rows = [conversation(i, files[i % len(files)]) for i in range(96)]  # 8 rows per file, interleaved
    path = prepared(target, tmp_path, "grouped", rows)
    train, held = load_datasets(data_cfg(path, eval_fraction=0.2), VOCAB, {"enable_thinking": False})
    assert train.column_names == held.column_names == ["input_ids", "loss_mask", "length"]
    assert len(held) % 8 == 0 and abs(len(held) - 0.2 * 96) <= 4 and len(train) + len(held) == 96

    def questions(dataset):  # question i of the rows, read back from the token ids
        return {int(text.split("Question ")[1].split("?")[0]) for text in map(decode, dataset["input_ids"])}

    from transformers import AutoTokenizer
    decode = AutoTokenizer.from_pretrained(target).decode
    held_files = {files[i % len(files)] for i in questions(held)}
    train_files = {files[i % len(files)] for i in questions(train)}
    assert held_files and not held_files & train_files
    assert len(held_files) * 8 == len(held)


def test_a_dataset_without_groups_holds_out_rows_with_a_warning(tmp_path):
    import datasets

    rows = {"input_ids": [[1, 2, 3]] * 50, "loss_mask": [[0, 1, 1]] * 50, "length": [3] * 50}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "plain"))
    with pytest.warns(UserWarning) as caught:
        train, held = load_datasets(data_cfg(str(tmp_path / "plain")), VOCAB, {"enable_thinking": False})
    assert any("no 'group' column" in str(w.message) for w in caught)
    assert (len(train), len(held)) == (45, 5)
    assert np.isin(held["length"], [3]).all()


def test_a_missing_or_unprepared_data_directory_is_a_data_error_naming_the_key(target, tmp_path, monkeypatch):
    from drafter.pipeline.datasets import DataError
    good = prepared(target, tmp_path, "good", [conversation(i, "g") for i in range(4)], "--no-thinking")
    (tmp_path / "empty").mkdir()
    for cfg, message in [(data_cfg(str(tmp_path / "a" / "b")), f"data.path={tmp_path}/a/b: no such directory"),
                         (data_cfg(good, eval_path="held"), "data.eval_path=held: no such directory"),
                         (data_cfg(good + "/stats.json"), "stats.json: not a directory"),
                         (data_cfg(str(tmp_path / "empty")), "neither a `Dataset` directory")]:
        with pytest.raises(DataError, match=message):
            load_datasets(cfg, VOCAB, {"enable_thinking": False})
    monkeypatch.setenv("HOME", str(tmp_path))  # datasets reads '~' as the home directory: so does the check
    assert len(load_datasets(data_cfg("~/good", eval_path="~/good"), VOCAB, {"enable_thinking": False})[0]) == 4
