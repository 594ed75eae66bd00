"""Building a world (a target and the data a drafter needs) in cached, resumable stages.

A world build is a list of stages, each marked done by the output it writes last: a rerun skips the
stages whose marker exists, so a build killed half-way resumes where it stopped. A regeneration is
never a stage of its own (its summary is written even when it is interrupted): it runs inside the
stage that prepares its answers, whose dataset is the marker. The data stages call the library
functions behind `data/regenerate.py` and `data/prepare.py` (`answers.regenerate`,
`prepared.prepare`) in this process, with its thread count, so a world is made by the same code a
user's data is. A stage that fails on its input stops the build with one line naming the stage. Used
by `data/toy.py` and `data/smollm2.py`.
"""
import json
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from drafter.pipeline.prepared import PrepareSettings, prepare as prepare_dataset
from drafter.synthesis.regeneration import RegenerateSettings
from drafter.errors import UserError
from drafter.synthesis.answers import regenerate as regenerate_answers

Stage = tuple[Callable[[Path], None], str]  # (build out/..., the output that marks it done)


def run_stages(out: Path, stages: list[Stage]) -> dict[str, float]:
    """Run each stage whose marker is missing, in order; return the seconds each one took (0 if reused)."""
    seconds = {}
    for stage, marker in stages:
        name = stage.__name__.removeprefix("step_")
        if (out / marker).exists():
            print(f"[{name}] reusing {out / marker}", flush=True)
            seconds[name] = 0.0
            continue
        print(f"[{name}] building {out / marker}", flush=True)
        start = time.perf_counter()
        try:
            stage(out)
        except UserError as error:  # bad input, not a bug: its message is the line, without a traceback
            raise SystemExit(f"[{name}] stopped: {error}") from None
        seconds[name] = round(time.perf_counter() - start, 1)
        print(f"[{name}] done in {seconds[name]:.1f} s", flush=True)
    return seconds


def answer_outputs(answers: str) -> list[str]:
    """The files a regeneration to out/<answers>.jsonl writes (data/regenerate.py)."""
    return [answers + suffix for suffix in (".jsonl", ".summary.json", ".errors.jsonl", ".settings.json")]


def open_out(out: Path, outputs: list[str], force: bool) -> Path:
    """A build's output folder, made if missing; with `force`, its earlier outputs removed first."""
    if force:
        remove_outputs(out, outputs)
    out.mkdir(parents=True, exist_ok=True)
    return out


def remove_outputs(out: Path, names: list[str]) -> None:
    """--force: remove a build's outputs (`names` in out), and nothing else a user may keep beside them."""
    for name in names:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def sample_in_order(items: list, count: int, seed: int) -> list:
    """At most count items drawn at random (seeded), kept in their original order."""
    if len(items) <= count:
        return list(items)
    return [items[i] for i in sorted(random.Random(seed).sample(range(len(items)), count))]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """Write rows as JSONL through a temporary file, so a killed build never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    tmp.replace(path)


@dataclass(frozen=True)
class AnswerSettings:
    """How a world's target writes its answers (data/regenerate.py --backend local, greedy)."""
    max_tokens: int
    batch_size: int


def answered_dataset(out: Path, prompts: str, answers: str, dataset: str, generation: AnswerSettings,
                     **prepare_options) -> None:
    """The target's greedy answers to out/prompts, in out/answers, tokenised into out/dataset: one
    stage, whose marker is the dataset."""
    regenerate(out, prompts, answers, generation)
    prepare(out, answers, dataset, **prepare_options)


def regenerate(out: Path, prompts: str, answers: str, generation: AnswerSettings) -> None:
    """The target's greedy answers to out/prompts, written to out/answers (data/regenerate.py). An
    interrupted or empty regeneration stops the build: the stage that called it has no output yet, so
    a rerun resumes the regeneration (regenerate skips the answers already written)."""
    summary = regenerate_answers(RegenerateSettings(
        input=[str(out / prompts)], out=str(out / answers), backend="local", target=str(out / "target"),
        thinking=False, max_tokens=generation.max_tokens, batch_size=generation.batch_size))
    if summary["interrupted"] or summary["remaining"]:
        raise SystemExit(f"{out / answers}: regeneration stopped with {summary['remaining']} of "
                         f"{summary['total']} prompts left; rerun the build to resume it")
    if summary["ok"] == 0:
        raise SystemExit(f"{out / answers}: the target answered none of the {summary['total']} prompts "
                         f"(failures: {summary['failures']}); is it trained? (--force rebuilds it)")


def prepare(out: Path, answers: str, dataset: str, **options) -> None:
    """Tokenise out/answers with the target's chat template into the dataset out/dataset (`options`:
    more of PrepareSettings, as drop_loops=True)."""
    prepare_dataset(PrepareSettings(input=[str(out / answers)], target=str(out / "target"), out=str(out / dataset),
                                    thinking=False, num_proc=1, cache_dir=str(out / "datasets_cache"), **options))
