"""train.py's small pieces: the lr schedule's notes on resume report without changing the saved state,
and every error a user's setting causes is one UserError, which train.py reports as one line."""
import dataclasses

import pytest

from drafter.config import ConfigError
from drafter.pipeline.datasets import DataError
from drafter.errors import UserError
from drafter.infra.engine import EngineConfigError
from drafter.infra.launch import LaunchError
from drafter.infra.run_lock import RunDirectoryBusy
from drafter.target_model.model import TargetError
from drafter.target_model.tensor_parallel import TensorParallelError
from drafter.training.checkpoint import ResumeError, TrainerState
from drafter.infra.memory import MemoryPlanError
from drafter.training.run_config import load_config
from runs import REPO


def v3(*overrides):
    return load_config(str(REPO / "configs" / "v3.yaml"), ["data.path=/x", *overrides])


@pytest.mark.parametrize("overrides, saved_steps, total, note", [
    (["train.schedule_steps=200"], 100, 100, "train.schedule_steps=200: the lr factor moves from"),
    ([], 100, 60, "this run stops at step 60; the lr schedule keeps its 100 steps"),
    ([], 100, 100, None),
    (["train.schedule_steps=100"], 100, 60, "this run stops at step 60"),
])
def test_schedule_notes_report_a_resume_without_changing_the_saved_state(overrides, saved_steps, total, note):
    from train import schedule_notes
    saved = TrainerState(step=40, schedule_steps=saved_steps)
    before = dataclasses.asdict(saved)
    notes = schedule_notes(v3(*overrides), saved, total)
    assert dataclasses.asdict(saved) == before
    assert (notes == []) if note is None else (len(notes) == 1 and notes[0].startswith(note))


@pytest.mark.parametrize("error, also", [
    (ConfigError, ValueError), (EngineConfigError, ValueError), (DataError, ValueError), (TargetError, ValueError),
    (TensorParallelError, ValueError), (ResumeError, RuntimeError), (LaunchError, RuntimeError),
    (RunDirectoryBusy, RuntimeError), (MemoryPlanError, RuntimeError),
])
def test_every_user_facing_error_is_a_user_error_and_keeps_its_builtin_base(error, also):
    assert issubclass(error, UserError) and issubclass(error, also)


def test_step_generators_are_distinct_and_do_not_rest_on_the_interpreters_hash(monkeypatch):
    import builtins

    import torch

    from train import step_generator

    def draw(*key):
        return torch.rand(4, generator=step_generator(*key)).tolist()

    keys = [(0, 5, 0, 1), (1, 5, 0, 1), (0, 6, 0, 1), (0, 5, 1, 1), (0, 5, 0, -1), (0, 5, 0, 2)]
    draws = [draw(*key) for key in keys]
    assert len({tuple(d) for d in draws}) == len(keys)  # any one of the four changed: another stream
    monkeypatch.setattr(builtins, "hash", lambda _: 0)   # a Python whose tuple hash differs
    assert [draw(*key) for key in keys] == draws
