"""bench/floor.py: the count-based slot predictors, checked on rows whose answers are counted by hand."""
import datasets
import pytest

from bench import floor


def rows(sequences, prompt_len=1):
    """Rows whose first `prompt_len` tokens are unsupervised."""
    return datasets.Dataset.from_dict({
        "input_ids": sequences,
        "loss_mask": [[0] * prompt_len + [1] * (len(s) - prompt_len) for s in sequences]})


def test_unigram_and_anchor_predictors_by_hand(tmp_path, capsys):
    # training slot 1: after 5 comes 6 twice and 7 once, after 6 comes 8 twice and 6 twice (a tie: the
    # smaller id, 6), and 6 is the commonest label (4 of 8); slot 2: two after 5 is 8 twice and 9 once
    train = rows([[0, 5, 6, 8], [0, 5, 6, 8], [0, 5, 7, 9], [0, 6, 6, 6]])
    # held out, slot 1: anchors 5 (label 6: both right) and 6 (label 8: both guess 6); slot 2: 5 (label 8)
    held = rows([[0, 5, 6, 8]])
    slots = floor.slot_floors(train, held, block_size=3)
    assert slots[0] == {"slot": 1, "anchors": 2, "unigram": 0.5, "anchor": 0.5}
    assert slots[1] == {"slot": 2, "anchors": 1, "unigram": 0.0, "anchor": 1.0}  # 5->8 by the skip-2 table
    gap = datasets.Dataset.from_dict({"input_ids": [[0, 5, 2, 8]], "loss_mask": [[0, 1, 0, 1]]})
    assert floor.anchor_pairs(gap, 2)[0].size == 0  # p+1 unsupervised: no anchor at p, as training draws them
    unseen = rows([[0, 9, 7, 7]])  # anchor 9 was never one in training: the unigram (6) is guessed
    assert floor.slot_floors(train, unseen, block_size=2)[0]["anchor"] == 0.0
    train.save_to_disk(str(tmp_path / "train"))
    held.save_to_disk(str(tmp_path / "held"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "eval", "step": 5, "acc_pos": [0.25, 0.5]}\n\n'
                                     '{"kind": "train", "step": 6, "acc_pos": [0.0, 0.0]}\n{"kind": "ev')  # cut by a kill
    floor.main(["--train", str(tmp_path / "train"), "--eval", str(tmp_path / "held"), "--run", str(run),
                "--block-size", "3"])
    assert "| 2 | 1 | 0.000 | 1.000 | 0.500 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        floor.main(["--train", str(tmp_path / "none"), "--eval", str(tmp_path / "held")])
    with pytest.raises(ValueError, match="no anchor"):  # a floor of nothing is no floor
        floor.slot_floors(rows([[0, 5, 6]], prompt_len=3), held, block_size=2)
