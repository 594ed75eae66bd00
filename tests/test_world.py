"""drafter/data/world.py: a world build's stages resume after a kill, and an interrupted regeneration is never
taken for a finished one (its summary is written either way)."""
import json

import pytest

from drafter.data import world


def fake_regenerate(summary: dict):
    def run_cli(script, args):
        out = args[args.index("--out") + 1]
        (world.Path(out).with_suffix(".summary.json")).write_text(json.dumps(summary))
    return run_cli


@pytest.mark.parametrize("summary, message", [
    ({"total": 4, "ok": 2, "remaining": 2, "interrupted": True, "failures": {}}, "2 of 4 prompts left"),
    ({"total": 4, "ok": 0, "remaining": 0, "interrupted": False, "failures": {"http_500": 4}}, "answered none"),
])
def test_an_unfinished_regeneration_stops_the_build(tmp_path, monkeypatch, summary, message):
    monkeypatch.setattr(world, "run_cli", fake_regenerate(summary))
    with pytest.raises(SystemExit, match=message):
        world.regenerate(tmp_path, "prompts.jsonl", "answers.jsonl", world.AnswerSettings(max_tokens=8, batch_size=2))


def test_a_finished_regeneration_passes(tmp_path, monkeypatch):
    done = {"total": 4, "ok": 3, "remaining": 0, "interrupted": False, "failures": {"empty_answer": 1}}
    monkeypatch.setattr(world, "run_cli", fake_regenerate(done))
    world.regenerate(tmp_path, "prompts.jsonl", "answers.jsonl", world.AnswerSettings(max_tokens=8, batch_size=2))


def test_stages_run_once_and_a_failed_stage_runs_again(tmp_path):
    calls = []

    def step_first(out):
        calls.append("first")
        (out / "first.txt").write_text("x")

    def step_second(out):
        calls.append("second")
        if calls.count("second") == 1:
            raise SystemExit("killed")  # its marker was never written
        (out / "second").mkdir()

    stages = [(step_first, "first.txt"), (step_second, "second")]
    with pytest.raises(SystemExit):
        world.run_stages(tmp_path, stages)
    seconds = world.run_stages(tmp_path, stages)
    assert calls == ["first", "second", "second"] and seconds["first"] == 0.0


def test_a_failed_data_cli_stops_the_build_in_one_line(tmp_path, monkeypatch):
    """Its own error is printed by the CLI; the build adds which CLI stopped, not a traceback."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "prepare.py").write_text("raise SystemExit(3)\n")
    monkeypatch.setattr(world, "REPO_ROOT", tmp_path)
    with pytest.raises(SystemExit, match=r"data/prepare.py stopped \(exit 3\)"):
        world.run_cli("prepare.py", ["--input", "x"])
