"""Prompt sets for eval/ddtree_accept.py: the papers' hub benchmarks and local JSONL files.

A prompt set is a list of `Prompt`s: messages that come before the first generated turn (e.g. a
system prompt) and the user turns, each sent after the model's answer to the previous one
(MT-Bench style). Hub sets use the prompt formats and sample counts of the DFlash/DDTree papers
(128 samples, 164 for HumanEval, 80 for MT-Bench), drawn with a fixed shuffle (seed 0).

A `--bench` entry is one of
    NAME          a hub benchmark (HUB_BENCHMARKS), read through `datasets.load_dataset`: from the
                  hub, or from the local hub cache when HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1
    NAME=PATH     the same benchmark from a local copy of its hub split: a directory written by
                  `datasets.save_to_disk`, or a JSONL file of the hub rows in the hub's order;
                  the same prompts as from the hub
    PATH          a prompt JSONL file of our own format (below)
`max_samples` takes the first N of the hub sets' fixed shuffle, and a seeded shuffle (seed 0) of a
prompt file's lines, never the file's first N lines.

Prompt JSONL: one object per line with one of
    {"prompt": str}                       a single user turn
    {"turns": [str, ...]}                 user turns, multi-turn
    {"messages": [{"role", "content"}]}   OpenAI style, ending with the user turn to answer
"""
import random
from dataclasses import dataclass
from pathlib import Path

from drafter.pipeline.chat_files import read_jsonl

REASON_BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."
CODE_TASK = "Write a solution to the following problem and make sure that it passes the tests:\n"


@dataclass
class Prompt:
    source: str                 # "path:line" or "hub name:row"
    history: list[dict]         # messages before the first user turn
    turns: list[str]            # user turns, answered one after the other


def _alpaca(row: dict) -> list[str]:
    return [f"{row['instruction']}\n\nInput:\n{row['input']}" if row["input"] else row["instruction"]]


# name -> (load_dataset args, split, sample count, row -> user turns)
HUB_BENCHMARKS = {
    "gsm8k": (("openai/gsm8k", "main"), "test", 128, lambda row: [row["question"] + REASON_BOXED]),
    "math500": (("HuggingFaceH4/MATH-500",), "test", 128, lambda row: [row["problem"] + REASON_BOXED]),
    "humaneval": (("openai/openai_humaneval",), "test", 164,
                  lambda row: [f"{CODE_TASK}```python\n{row['prompt']}\n```"]),
    "mbpp": (("google-research-datasets/mbpp", "sanitized"), "test", 128, lambda row: [row["prompt"]]),
    "mt-bench": (("HuggingFaceH4/mt_bench_prompts",), "train", 80, lambda row: list(row["prompt"])),
    "alpaca": (("tatsu-lab/alpaca",), "train", 128, _alpaca),
}


def load_prompts(spec: str, max_samples: int | None = None) -> tuple[str, list[Prompt]]:
    """(benchmark name, prompts) for a `--bench` entry: NAME, NAME=PATH or PATH (module docstring)."""
    name, equals, local_copy = spec.partition("=")
    if name in HUB_BENCHMARKS and equals and not local_copy:
        raise ValueError(f"--bench {spec!r}: no path after '='")
    if name in HUB_BENCHMARKS:
        prompts = load_hub(name, Path(local_copy) if local_copy else None)
        return name, prompts[:max_samples] if max_samples is not None else prompts
    if not Path(spec).is_file():
        raise ValueError(f"--bench {spec!r}: not a file, nor NAME or NAME=PATH with NAME one of "
                         f"{', '.join(HUB_BENCHMARKS)}")
    prompts = load_jsonl(Path(spec))
    if max_samples is not None and max_samples < len(prompts):
        prompts = random.Random(0).sample(prompts, max_samples)
    return Path(spec).stem, prompts


def load_hub(name: str, local_copy: Path | None = None) -> list[Prompt]:
    """A hub benchmark's prompts, from the hub (or its cache) or from `local_copy` of its split."""
    import datasets

    load_args, split, count, turns_of = HUB_BENCHMARKS[name]
    if local_copy is None:
        rows, where = datasets.load_dataset(*load_args, split=split), name
    else:
        rows, where = _local_split(local_copy, split), f"{name}={local_copy}"
    rows = rows.shuffle(seed=0).select(range(min(count, len(rows))))
    prompts = []
    for i, row in enumerate(rows):
        try:
            prompts.append(Prompt(f"{name}:{i}", [], turns_of(row)))
        except (KeyError, TypeError) as error:
            raise ValueError(f"{where}: row {i} of the shuffled split lacks the hub's columns "
                             f"({error!r}; columns: {', '.join(rows.column_names)})") from error
    return prompts


def _local_split(path: Path, split: str):
    """A `datasets.Dataset` from a `save_to_disk` directory (a DatasetDict must hold `split`) or a
    JSONL file of rows."""
    import datasets

    if path.is_dir():
        try:
            rows = datasets.load_from_disk(str(path))
        except FileNotFoundError as error:
            raise ValueError(f"{path}: not a directory written by datasets.save_to_disk ({error})") from error
        if isinstance(rows, datasets.DatasetDict):
            if split not in rows:
                raise ValueError(f"{path}: no {split!r} split (found {', '.join(rows)})")
            rows = rows[split]
        return rows
    if not path.is_file():
        raise ValueError(f"{path}: no such file or directory")
    records = []
    for row in read_jsonl(path):
        if row.reason:
            raise ValueError(f"{row.source}: {_UNREADABLE[row.reason]}")
        if not isinstance(row.value, dict):
            raise ValueError(f"{row.source}: expected a JSON object, found {type(row.value).__name__}")
        records.append(row.value)
    if not records:
        raise ValueError(f"{path}: no rows")
    return datasets.Dataset.from_list(records)


_UNREADABLE = {"malformed_json": "not valid JSON", "encoding": "not valid UTF-8"}


def load_jsonl(path: Path) -> list[Prompt]:
    """Prompts of a local JSONL file; a bad line raises ValueError naming the file, line and reason."""
    prompts = []
    for row in read_jsonl(Path(path)):
        if row.reason:
            raise ValueError(f"{row.source}: {_UNREADABLE[row.reason]}")
        prompts.append(parse_prompt(row.value, row.source))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def parse_prompt(row, source: str) -> Prompt:
    if not isinstance(row, dict):
        raise ValueError(f"{source}: expected a JSON object, found {type(row).__name__}")
    if isinstance(row.get("prompt"), str) and row["prompt"].strip():
        return Prompt(source, [], [row["prompt"]])
    turns = row.get("turns")
    if isinstance(turns, list) and turns and all(isinstance(t, str) and t.strip() for t in turns):
        return Prompt(source, [], turns)
    messages = row.get("messages")
    if isinstance(messages, list) and messages:
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                   and isinstance(m.get("content"), str) for m in messages):
            raise ValueError(f"{source}: every message needs a string role and content")
        if messages[-1]["role"] != "user":
            raise ValueError(f"{source}: the last message must be the user turn to answer")
        return Prompt(source, messages[:-1], [messages[-1]["content"]])
    raise ValueError(f"{source}: expected a non-empty \"prompt\" string, a \"turns\" list of "
                     "strings or a \"messages\" list")
