"""drafter/synthesis/world.py: a world build's stages resume after a kill, an interrupted regeneration is never
taken for a finished one (its summary is returned either way), and a stage's bad input stops the build in
one line."""
import pytest

from drafter.synthesis import world


def fake_regenerate(summary: dict):
    def regenerate_answers(settings):
        assert settings.backend == "local" and settings.target.endswith("target") and not settings.thinking
        return summary
    return regenerate_answers


@pytest.mark.parametrize("summary, message", [
    ({"total": 4, "ok": 2, "remaining": 2, "interrupted": True, "failures": {}}, "2 of 4 prompts left"),
    ({"total": 4, "ok": 0, "remaining": 0, "interrupted": False, "failures": {"http_500": 4}}, "answered none"),
])
def test_an_unfinished_regeneration_stops_the_build(tmp_path, monkeypatch, summary, message):
    monkeypatch.setattr(world, "regenerate_answers", fake_regenerate(summary))
    with pytest.raises(SystemExit, match=message):
        world.regenerate(tmp_path, "prompts.jsonl", "answers.jsonl", world.AnswerSettings(max_tokens=8, batch_size=2))


def test_a_finished_regeneration_passes(tmp_path, monkeypatch):
    done = {"total": 4, "ok": 3, "remaining": 0, "interrupted": False, "failures": {"empty_answer": 1}}
    monkeypatch.setattr(world, "regenerate_answers", fake_regenerate(done))
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


def test_a_stage_whose_input_is_bad_stops_the_build_in_one_line(tmp_path):
    """The library's error (here prepare's, on answers with no rows) is the line, with the stage's name
    and without a traceback; the stage's output is not written, so a rerun tries it again."""
    (tmp_path / "answers.jsonl").write_text("")

    def step_dataset(out):
        world.prepare(out, "answers.jsonl", "dataset")

    with pytest.raises(SystemExit) as stopped:
        world.run_stages(tmp_path, [(step_dataset, "dataset")])
    assert stopped.value.code == f"[dataset] stopped: no rows to prepare in {tmp_path / 'answers.jsonl'}: the input is empty"
    assert not (tmp_path / "dataset").exists()
