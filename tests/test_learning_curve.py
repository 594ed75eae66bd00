"""bench/learning_curve.py: seeds of one recipe drawn as one line with a band, other recipes apart,
every-anchor slot accuracy read before the eval step's few anchors, and runs it cannot draw named."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import learning_curve  # noqa: E402

from drafter.config import Config  # noqa: E402


def make_run(root: Path, name: str, seed: int, lr: float, slot1: list[float], held_out_set="abc", counts=True,
             replayed=None):
    run = root / name
    run.mkdir()
    cfg = OmegaConf.structured(Config)
    cfg.run.name, cfg.run.out_dir, cfg.run.seed, cfg.data.seed, cfg.optim.lr = name, str(run), seed, seed, lr
    cfg.drafter.block_size = 4
    OmegaConf.save(cfg, run / "config.yaml")
    lines = []
    for i, acc in enumerate(slot1):
        record = {"kind": "eval", "step": 10 * (i + 1), "acc_pos": [acc / 10, 0.0, 0.0], "tau_dflash": 1 + acc}
        if replayed is None or replayed[i]:
            record["replay_acc_pos"] = [acc, acc / 2, acc / 4]
        if counts:
            record |= {"supervised_tokens": 100 * (i + 1), "blocks_trained": 10 * (i + 1), "held_out_set": held_out_set}
        lines.append(json.dumps(record))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run


def test_seeds_group_into_a_band_and_recipes_apart(tmp_path):
    runs = [make_run(tmp_path, "a_s0", 0, 1e-3, [0.1, 0.3]), make_run(tmp_path, "a_s1", 1, 1e-3, [0.2, 0.5]),
            make_run(tmp_path, "b_s0", 0, 2e-3, [0.0, 0.1])]
    report = learning_curve.main([*map(str, runs), "--out", str(tmp_path / "ab"), "--no-floor"])
    assert [g["seeds"] for g in report["groups"]] == [[0, 1], [0]]
    assert (tmp_path / "ab" / "curve.png").stat().st_size > 0
    group = {"runs": [learning_curve.read_run(r) for r in runs[:2]]}
    x, mean, low, high = learning_curve.group_series(group, "supervised_tokens", lambda p: p["acc"][1])
    assert x.tolist() == [100, 200] and mean.tolist() == pytest.approx([0.15, 0.4])
    assert low.tolist() == [0.1, 0.3] and high.tolist() == [0.2, 0.5]  # every-anchor accuracy, not acc_pos


def test_runs_it_cannot_draw_are_named(tmp_path, capsys):
    a = make_run(tmp_path, "a", 0, 1e-3, [0.1])
    other = make_run(tmp_path, "other", 0, 1e-3, [0.1], held_out_set="xyz")
    with pytest.raises(SystemExit, match=r"different held-out sets.*abc: .*a; xyz: .*other"):
        learning_curve.main([str(a), str(other), "--out", str(tmp_path / "o"), "--no-floor"])
    old = make_run(tmp_path, "old", 0, 1e-3, [0.1], counts=False)
    with pytest.raises(SystemExit, match=r"old: the evals at steps \[10\] hold no trained-on counts"):
        learning_curve.main([str(old), "--no-floor"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="empty: not a train.py run directory"):
        learning_curve.main([str(tmp_path / "empty"), "--no-floor"])


def test_runs_that_predate_every_anchor_accuracy_draw_all_with_the_eval_steps(tmp_path, capsys):
    """A run resumed across replay_acc_pos, or drawn with a run from before it, would mix two measures
    in one curve or one band: every run then reads acc_pos."""
    resumed = make_run(tmp_path, "resumed", 0, 1e-3, [0.1, 0.3], replayed=[False, True])
    assert [p["acc"][1] for p in learning_curve.read_run(resumed)["points"]] == pytest.approx([0.01, 0.03])
    new = make_run(tmp_path, "new", 1, 1e-3, [0.2, 0.5])
    report = learning_curve.main([str(resumed), str(new), "--out", str(tmp_path / "o"), "--no-floor"])
    [group] = report["groups"]
    assert [[p["acc"][1] for p in run["points"]] for run in group["runs"]] == [pytest.approx([0.01, 0.03]),
                                                                                pytest.approx([0.02, 0.05])]
    assert "resumed predate replay_acc_pos" in capsys.readouterr().err
    alone = learning_curve.main([str(new), "--no-floor"])  # a run of its own keeps every-anchor accuracy
    assert [p["acc"][1] for p in alone["groups"][0]["runs"][0]["points"]] == pytest.approx([0.2, 0.5])


def test_extrapolation_finds_where_a_log_linear_curve_reaches_the_goal():
    x = np.array([1e2, 1e3, 1e4, 1e5])
    exact = learning_curve.extrapolate(x, 1 + 0.25 * np.log10(x), goal=3.0)  # 3 at 10^8
    assert exact["needed"] == pytest.approx(1e8, rel=1e-6) and exact["slope_se"] == pytest.approx(0, abs=1e-9)
    assert exact["low"] == pytest.approx(1e8, rel=1e-6) and exact["high"] == pytest.approx(1e8, rel=1e-6)
    noisy = learning_curve.extrapolate(x, 1 + 0.25 * np.log10(x) + np.array([0.05, -0.05, 0.05, -0.05]), goal=3.0)
    assert noisy["low"] < noisy["needed"] < noisy["high"]  # a steeper slope gets there sooner
    flat = learning_curve.extrapolate(x, np.array([1.4, 1.3, 1.4, 1.3]), goal=2.0)
    assert flat["needed"] is None and "does not rise" in flat["why"]
    assert learning_curve.extrapolate(x[:2], x[:2], goal=2.0)["why"] == "fewer than 3 points"


def test_break_even_extrapolations_go_into_the_report_and_a_tau_no_run_logged_is_named(tmp_path, capsys):
    run = make_run(tmp_path, "a_s0", 0, 1e-3, [0.1, 0.2, 0.3, 0.4])  # tau_dflash 1.1 .. 1.4 over 100 .. 400 tokens
    report = learning_curve.main([str(run), "--no-floor", "--break-even", "tau_dflash=2.0"])
    fits = {f["x"]: f for f in report["extrapolations"]}
    assert set(fits) == {"supervised_tokens", "blocks_trained"} and fits["supervised_tokens"]["needed"] > 400
    assert json.loads((run / "curve.json").read_text())["extrapolations"][0]["tau"] == "tau_dflash"
    assert "tau_dflash reaches 2.0 at supervised_tokens" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="tau_ddtree@8, which no run logged"):
        learning_curve.main([str(run), "--no-floor", "--break-even", "tau_ddtree@8=2.4"])
    with pytest.raises(SystemExit, match="is not NAME=TAU"):
        learning_curve.main([str(run), "--no-floor", "--break-even", "tau_dflash=two"])


def test_groups_of_one_run_name_are_labelled_by_what_their_recipe_changes(tmp_path):
    runs = [make_run(tmp_path, "a_s0", 0, 1e-3, [0.1, 0.3]), make_run(tmp_path, "b_s0", 0, 2e-3, [0.0, 0.1])]
    for run in runs:  # run.name unset: both runs get train.py's default name
        cfg = OmegaConf.load(run / "config.yaml")
        cfg.run.name = "smollm2-g10-b95"
        OmegaConf.save(cfg, run / "config.yaml")
    report = learning_curve.main([*map(str, runs), "--out", str(tmp_path / "ab"), "--no-floor"])
    assert [g["label"] for g in report["groups"]] == ["0: smollm2-g10-b95", "1: optim.lr=0.002"]
