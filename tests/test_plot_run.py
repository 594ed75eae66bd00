import json
import math

import matplotlib.pyplot as plt
import pytest

from eval import plot_run

NAN = float("nan")


def write_run(run_dir, records, tail=""):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return run_dir


def lines(fig) -> dict[str, tuple[list, list]]:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
            for ax in fig.axes for line in ax.get_lines()}


def same(values, expected) -> bool:
    return len(values) == len(expected) and all(
        (math.isnan(v) and math.isnan(e)) or v == e for v, e in zip(values, expected))


TRAIN = [{"kind": "train", "step": s, "loss": 5 - s / 100, "acc": 0.1, "anchor_streak": 1 + s / 100,
          "anchor_ddtree@8": 2 + s / 100, "per_bucket": {"loss": [4.0, 6 - s / 100], "acc": [0, 0]}}
         for s in (50, 100, 150)]
EVAL = [{"kind": "eval", "step": 100, "loss": 4.2, "anchor_streak": 3.9, "anchor_ddtree@8": 4.5,
         "tau_dflash": 1.6, "tau_ddtree@8": NAN},
        {"kind": "eval", "step": 150, "loss": 4.1, "anchor_streak": 4.0, "anchor_ddtree@8": 4.6,
         "tau_dflash": 1.7, "tau_ddtree@8": 2.5}]
GENERATE = [{"kind": "generate", "step": 150, "gen_tau_dflash": 1.65, "gen_tau_ddtree@8": 2.4,
             "gen_seconds": 3.0}]
RESUMED = {**TRAIN[1], "loss": 9.5}  # a resumed run logs step 100 again: the later record counts


def test_plotted_lines_are_the_file_s_numbers(tmp_path, capsys):
    run = write_run(tmp_path / "run", TRAIN + EVAL + GENERATE + [RESUMED], tail='{"kind": "train", "st')
    records, problems = plot_run.read_metrics(run / "metrics.jsonl")
    assert problems == [f"{run / 'metrics.jsonl'}:8: truncated last line, ignored"]
    figs = plot_run.figures(records, None)
    assert sorted(figs) == ["anchor_metrics", "loss", "per_bucket_loss", "tau"]
    loss = lines(figs["loss"])
    assert loss["train: loss"] == ([50, 100, 150], [4.5, 9.5, 3.5])
    assert loss["eval: loss"] == ([100, 150], [4.2, 4.1])
    anchor = lines(figs["anchor_metrics"])
    assert sorted(anchor) == ["eval: anchor_ddtree@8", "eval: anchor_streak", "train: anchor_ddtree@8",
                              "train: anchor_streak"]
    assert anchor["train: anchor_ddtree@8"] == ([50, 100, 150], [2.5, 3.0, 3.5])
    tau = lines(figs["tau"])
    assert sorted(tau) == ["eval: anchor_ddtree@8", "eval: anchor_streak", "eval: tau_ddtree@8",
                           "eval: tau_dflash", "generate: gen_tau_ddtree@8", "generate: gen_tau_dflash"]
    assert tau["eval: tau_ddtree@8"][0] == [100, 150] and same(tau["eval: tau_ddtree@8"][1], [NAN, 2.5])
    assert tau["generate: gen_tau_dflash"] == ([150], [1.65])
    assert lines(figs["per_bucket_loss"])["bucket 1"] == ([50, 100, 150], [5.5, 5.0, 4.5])
    for fig in figs.values():
        plt.close(fig)

    written = plot_run.main([str(run)])
    assert sorted(p.name for p in written) == ["anchor_metrics.png", "loss.png", "per_bucket_loss.png",
                                               "tau.png"]
    assert all(p.parent == run / "plots" and p.stat().st_size > 1000 for p in written)
    assert "truncated last line" in capsys.readouterr().err


def test_a_run_from_before_the_renaming_and_without_eval_records(tmp_path, capsys):
    old = [{"kind": "train", "step": s, "loss": 3.0, "streak": 2.0 + s, "ddtree_streak4": 3.0,
            "ddtree_accept@32": 4.0 + s} for s in (1, 2, 3)]
    run = write_run(tmp_path / "old", old[:1],
                    tail="{broken\n" + "".join(json.dumps(r) + "\n" for r in old[1:]))
    written = plot_run.main([str(run)])
    assert sorted(p.name for p in written) == ["anchor_metrics.png", "loss.png"]
    assert f"{run / 'metrics.jsonl'}:2: not valid JSON, skipped" in capsys.readouterr().err
    records, _ = plot_run.read_metrics(run / "metrics.jsonl")
    anchor = lines(plot_run.figures(records, None)["anchor_metrics"])
    assert anchor["train: anchor_streak"] == ([1, 2, 3], [3.0, 4.0, 5.0])
    assert anchor["train: anchor_ddtree@32"] == ([1, 2, 3], [5.0, 6.0, 7.0])
    assert "train: anchor_top4_streak" in anchor
    plt.close("all")


def test_budget_sweep_from_eval_json(tmp_path, capsys):
    evals = [{**EVAL[0], "tau_ddtree@8": 2.2}, EVAL[1]]  # the sweep marks the last value: 2.5
    run = write_run(tmp_path / "run", TRAIN + evals + GENERATE)
    report = {"benchmarks": {"bench": {"methods": {
        "ar": {"tau": 1.0}, "dflash": {"tau": 2.0}, "ddtree@8": {"tau": 2.6}, "ddtree@32": {"tau": None},
        "ddtree@128": {"tau": 3.9}}}}}
    (run / "eval.json").write_text(json.dumps(report))
    records, _ = plot_run.read_metrics(run / "metrics.jsonl")
    fig = plot_run.figures(records, report)["budget_sweep"]
    sweep = lines(fig)
    assert sweep["bench: ddtree (eval.json)"][0] == [8, 32, 128]
    assert same(sweep["bench: ddtree (eval.json)"][1], [2.6, NAN, 3.9])
    assert sweep["bench: dflash (eval.json)"][1] == [2.0, 2.0]
    marks = {c.get_label(): c.get_offsets().tolist() for c in fig.axes[0].collections}
    assert marks == {"replayed during training (step 150)": [[8, 2.5]],
                     "generated during training (step 150)": [[8, 2.4]]}
    plt.close(fig)
    assert "budget_sweep.png" in [p.name for p in plot_run.main([str(run)])]

    (run / "eval.json").write_text('{"benchmarks": ')
    written = plot_run.main([str(run)])
    assert "budget_sweep.png" not in [p.name for p in written] and "loss.png" in [p.name for p in written]
    assert "eval.json: not valid JSON" in capsys.readouterr().err


def test_a_directory_without_metrics_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="metrics.jsonl: no such file"):
        plot_run.main([str(tmp_path)])
