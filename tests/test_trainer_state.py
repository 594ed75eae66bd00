"""trainer_state.json is a named, versioned format (drafter/training/checkpoint.py TrainerState): today's files
round-trip, the unversioned files of earlier trainers still resume, and anything else is refused by
name before a run continues from it."""
import json
from pathlib import Path

import pytest

from drafter.training.checkpoint import TRAINER_STATE_FORMAT, TRAINER_STATE_VERSION, ResumeError, TrainerState

# A trainer_state.json as the trainers before the format was named wrote it (version 1).
UNVERSIONED = {"step": 12, "epoch": 1, "micro_step_in_epoch": 3, "skipped_steps": 1, "wandb_id": "abc",
               "elapsed_s": 42.5, "schedule_steps": 24, "identity": {"run.seed": 0, "optim.lr": 0.03},
               "data_position": {"world_size": 2, "data.seed": 0}}


def write(tmp_path, content) -> Path:
    path = tmp_path / "trainer_state.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_a_state_round_trips_and_names_its_format(tmp_path):
    state = TrainerState(**UNVERSIONED)
    saved = json.loads(state.to_json())
    assert saved["format"] == TRAINER_STATE_FORMAT and saved["version"] == TRAINER_STATE_VERSION
    assert TrainerState.read(write(tmp_path, state.to_json())) == state


def test_an_unversioned_state_of_the_earlier_trainers_still_reads(tmp_path):
    assert TrainerState.read(write(tmp_path, UNVERSIONED)) == TrainerState(**UNVERSIONED)
    named = {"format": TRAINER_STATE_FORMAT, "version": 1, **UNVERSIONED}  # version 1 said in so many words
    assert TrainerState.read(write(tmp_path, named)) == TrainerState(**UNVERSIONED)


def test_states_before_the_trained_on_counts_read_them_as_zero_and_later_ones_must_hold_them(tmp_path):
    version2 = {"format": TRAINER_STATE_FORMAT, "version": 2, **UNVERSIONED}
    state = TrainerState.read(write(tmp_path, version2))
    assert (state.supervised_tokens, state.blocks_trained) == (0, 0) and state.step == UNVERSIONED["step"]
    counted = TrainerState(**UNVERSIONED, supervised_tokens=1234, blocks_trained=56)
    assert TrainerState.read(write(tmp_path, counted.to_json())) == counted
    without = {k: v for k, v in json.loads(counted.to_json()).items() if k != "blocks_trained"}
    with pytest.raises(ResumeError, match="without blocks_trained"):
        TrainerState.read(write(tmp_path, without))


@pytest.mark.parametrize("written_as, match", [
    ({"format": TRAINER_STATE_FORMAT, "version": TRAINER_STATE_VERSION + 1}, f"version {TRAINER_STATE_VERSION + 1}"),
    ({"format": "someone-else/state", "version": 2}, "someone-else/state"),
    ({"format": TRAINER_STATE_FORMAT}, "version None"),
    ({"version": 2}, "None"),
])
def test_another_format_or_a_newer_version_is_refused_by_name(tmp_path, written_as, match):
    with pytest.raises(ResumeError, match=match):
        TrainerState.read(write(tmp_path, {**written_as, **UNVERSIONED}))


def test_broken_or_incomplete_states_are_refused_naming_the_file(tmp_path):
    for content, match in (("{not json", "not a readable trainer state"), ("[1, 2]", "a JSON object"),
                           (b"\xff\xfe".decode("latin-1"), "not a readable")):
        with pytest.raises(ResumeError, match=match) as error:
            TrainerState.read(write(tmp_path, content))
        assert "trainer_state.json" in str(error.value)
    without_identity = {k: v for k, v in UNVERSIONED.items() if k != "identity"}
    with pytest.raises(ResumeError, match="predates run identities"):
        TrainerState.read(write(tmp_path, without_identity))
    with pytest.raises(ResumeError, match="without epoch"):
        TrainerState.read(write(tmp_path, {k: v for k, v in UNVERSIONED.items() if k != "epoch"}))
