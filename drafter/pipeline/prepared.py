"""A prepared dataset: chat data tokenised for drafter training, with input_ids, loss_mask (assistant
tokens only), length and group; the work of `data/prepare.py`, whose docstring gives the user's view.

Thinking is one decision: with enable_thinking off reasoning (`<think>` blocks) is removed from every
answer, so a conversation is rendered exactly as the serving template renders it with
enable_thinking=False; with it on the reasoning is kept and supervised. The choice is recorded in
OUT/stats.json (`settings.chat_template_kwargs`), which train.py checks against its config.

Rows of a regeneration marked `truncated` (an answer hit its token limit) are kept without their
closing tokens supervised (flag `truncated`). An answer whose tail repeats a short n-gram is a loop
(flag `loop`; dropped with drop_loops): its last 48 tokens (closing token excluded) hold at most 16
distinct 4-grams of their 45. A repeated n-gram of up to 16 tokens has exactly n distinct 4-grams;
the slack allows a few breaks (line wraps); answers shorter than 48 tokens never count.

Two cached `datasets` stages: reading + normalising rows (keyed by the input files' paths, sizes
and mtimes) and tokenising (keyed by the rows, the tokenizer, the settings and this code), so a
re-run with the same inputs and settings does no work. Output order follows input order. An output
directory is written aside and swapped in, and only a directory this code wrote (its stats.json's
mark) is ever replaced.
"""
import functools
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np

from drafter.pipeline import chat, chat_files, chat_template
from drafter.pipeline.datasets import DataError

RAW_FEATURES = datasets.Features({
    "messages": datasets.Value("string"),  # JSON: tool-call arguments have no fixed schema
    "source": datasets.Value("string"),
    "group": datasets.Value("string"),
    "truncated": datasets.Value("bool"),
    "flags": datasets.List(datasets.Value("string")),
    "reason": datasets.Value("string"),
})
TOKENIZED_FEATURES = datasets.Features({
    "input_ids": datasets.List(datasets.Value("int32")),
    "loss_mask": datasets.List(datasets.Value("int8")),
    "length": datasets.Value("int32"),
    "supervised": datasets.Value("int32"),
    "source": datasets.Value("string"),
    "group": datasets.Value("string"),
    "flags": datasets.List(datasets.Value("string")),
    "reason": datasets.Value("string"),
})
OUTPUT_COLUMNS = ["input_ids", "loss_mask", "length", "group"]
WRITTEN_BY = "data/prepare.py"  # stats.json's mark: this directory is ours to replace
EARLIER_MARKS = ("data_tools/prepare.py",)  # the same tool's mark while its folder was data_tools/
MIN_SUPERVISED_RUN = 2
EXAMPLES_PER_REASON = 5
LOOP_WINDOW, LOOP_NGRAM, LOOP_MAX_DISTINCT = 48, 4, 16
LOOP_RULE = (f"the answer's last {LOOP_WINDOW} tokens (closing token excluded) hold at most "
             f"{LOOP_MAX_DISTINCT} distinct {LOOP_NGRAM}-grams")


@dataclass(frozen=True)
class PrepareSettings:
    """What to prepare, and how (data/prepare.py's flags, named as its flags are)."""
    input: list[str]          # files, directories of them, or hub dataset names
    target: str               # the model path or hub id whose tokenizer and chat template render the rows
    out: str                  # a new directory, or an earlier output of this code (replaced atomically)
    system_prompt: str | None = None  # a system turn for conversations that have none
    thinking: bool = False    # keep and supervise reasoning (enable_thinking=True); else it is removed
    max_length: int = 3072
    truncate: bool = False    # keep the first max_length tokens of longer samples (else drop them)
    last_turn_only: bool = False  # supervise only the last assistant turn
    drop_loops: bool = False  # drop rows with an answer that loops (else keep them, flagged)
    num_proc: int = 1
    cache_dir: str | None = None  # the datasets cache (None: the HF cache)


def conversation_rows(inputs: list[str]):
    """Generator for `Dataset.from_generator`: one record per input row, bad ones with a reason."""
    for raw in chat_files.read_rows(inputs):
        messages, reason = [], raw.reason or ""
        if not reason:
            try:
                messages = chat.normalize_row(raw.value)
            except chat.BadRow as bad:
                reason = bad.reason
        truncated = isinstance(raw.value, dict) and raw.value.get("truncated") is True
        yield {"messages": json.dumps(messages, ensure_ascii=False), "source": raw.source,
               "group": chat_files.row_group(raw), "truncated": truncated,
               "flags": ["lone_surrogate"] if raw.repaired else [], "reason": reason}


@functools.lru_cache(maxsize=None)
def load_tokenizer(target: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target)


# over six: a datasets.map function, its settings passed by name as fn_kwargs (prepare's settings)
def tokenize_row(row: dict, target: str, enable_thinking: bool, system_prompt: str | None,
                 max_length: int, truncate: bool, last_turn_only: bool, drop_loops: bool) -> dict:
    """Map function: a normalised row -> input_ids, loss_mask, length, flags, and a drop reason or ""."""
    flags = list(row["flags"])
    result = {"input_ids": [], "loss_mask": [], "length": 0, "supervised": 0, "reason": row["reason"],
              "flags": flags}
    if result["reason"]:
        return result
    messages = json.loads(row["messages"])
    assistant_turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant_turns:
        return result | {"reason": "no_assistant_turn"}
    # Turns after the last answer would only be unsupervised context.
    messages = chat.with_system_prompt(messages[: assistant_turns[-1] + 1], system_prompt)
    if chat_template.has_unclosed_reasoning(messages) and not (enable_thinking and row["truncated"]):
        return result | {"reason": "unclosed_think"}
    if not enable_thinking:
        messages, removed = chat_template.without_reasoning(messages)
        flags += ["reasoning_removed"] if removed else []
    flags += ["truncated"] if row["truncated"] else []
    try:
        input_ids, loss_mask = chat_template.tokenize_conversation(load_tokenizer(target), messages, enable_thinking,
                                                          last_turn_only, closers=not row["truncated"])
    except chat.BadRow as bad:
        return result | {"reason": bad.reason}
    if len(input_ids) > max_length:
        if not truncate:
            return result | {"reason": "too_long", "length": len(input_ids)}
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    if chat_template.longest_supervised_run(loss_mask) < MIN_SUPERVISED_RUN:
        return result | {"reason": "too_little_supervision", "length": len(input_ids)}
    answers = supervised_runs(input_ids, loss_mask)
    if any(repeating_tail(ids if row["truncated"] else ids[:-1]) for ids in answers):
        if drop_loops:
            return result | {"reason": "loop", "length": len(input_ids)}
        flags.append("loop")
    return result | {"input_ids": input_ids, "loss_mask": loss_mask, "length": len(input_ids),
                     "supervised": sum(loss_mask)}


def supervised_runs(input_ids: list[int], loss_mask: list[int]) -> list[list[int]]:
    """The token ids of each run of consecutive supervised tokens (one answer each)."""
    runs, start = [], None
    for i, bit in enumerate(loss_mask + [0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            runs.append(input_ids[start:i])
            start = None
    return runs


def repeating_tail(ids: list[int]) -> bool:
    """Whether the tail of `ids` repeats a short n-gram (LOOP_RULE)."""
    if len(ids) < LOOP_WINDOW:
        return False
    tail = ids[-LOOP_WINDOW:]
    return len({tuple(tail[i:i + LOOP_NGRAM]) for i in range(LOOP_WINDOW - LOOP_NGRAM + 1)}) <= LOOP_MAX_DISTINCT


def digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def code_digest() -> str:
    """Changes whenever the reading or tokenising code changes, so stale caches are not reused."""
    return digest(*(Path(f).read_text() for f in (chat.__file__, chat_files.__file__, chat_template.__file__,
                                                  __file__)))


def tokenizer_digest(tokenizer) -> str:
    return digest(tokenizer.backend_tokenizer.to_str(), tokenizer.chat_template)


def build(prep: PrepareSettings) -> tuple[datasets.Dataset, dict]:
    """The tokenised dataset (every row, dropped ones with their reason) and the settings used."""
    num_proc = prep.num_proc if prep.num_proc > 1 else None
    rows_fingerprint = digest(chat_files.input_signature(prep.input), code_digest())
    try:
        raw = datasets.Dataset.from_generator(
            conversation_rows, gen_kwargs={"inputs": prep.input}, features=RAW_FEATURES,
            cache_dir=prep.cache_dir, fingerprint=rows_fingerprint)
    except datasets.exceptions.DatasetGenerationError as error:
        if isinstance(error.__cause__, chat_files.InputError):  # a file that cannot be read as a whole
            raise DataError(f"stopped, nothing written: {error.__cause__}") from None
        raise
    except ValueError as error:  # datasets' words for a generator that yielded nothing
        if "corresponds to no data" not in str(error):
            raise
        raise DataError(f"no rows to prepare in {', '.join(prep.input)}: the input is empty") from None
    settings = {"target": prep.target, "enable_thinking": prep.thinking,
                "system_prompt": prep.system_prompt, "max_length": prep.max_length,
                "truncate": prep.truncate, "last_turn_only": prep.last_turn_only,
                "drop_loops": prep.drop_loops}
    tokenized = raw.map(
        tokenize_row, fn_kwargs=settings, remove_columns=["messages", "truncated"],
        features=TOKENIZED_FEATURES, num_proc=num_proc,
        new_fingerprint=digest(rows_fingerprint, tokenizer_digest(load_tokenizer(prep.target)),
                               settings, code_digest()),
        desc="tokenize")
    return tokenized, settings


def first_sources(sources, indices: np.ndarray) -> list[str]:
    return [sources[int(index)].as_py() for index in indices[:EXAMPLES_PER_REASON]]


def summarize(tokenized: datasets.Dataset, settings: dict, inputs: list[str]) -> tuple[dict, np.ndarray]:
    """stats.json content and the indices of kept rows."""
    table = tokenized.data
    reasons = np.asarray(table.column("reason").to_pylist(), dtype=object)
    kept = np.flatnonzero(reasons == "")
    sources = table.column("source")
    dropped = Counter(reasons[reasons != ""].tolist())
    examples = {reason: first_sources(sources, np.flatnonzero(reasons == reason)) for reason in sorted(dropped)}
    row_flags = table.column("flags").to_pylist()
    flagged = {}
    for index in kept:
        for flag in row_flags[index]:
            flagged.setdefault(flag, []).append(index)
    flags = {flag: {"rows": len(rows), "examples": first_sources(sources, np.asarray(rows))}
             for flag, rows in sorted(flagged.items())}
    lengths = np.asarray(table.column("length").to_pylist(), dtype=np.int64)[kept]
    supervised = np.asarray(table.column("supervised").to_pylist(), dtype=np.int64)[kept]
    groups = np.asarray(table.column("group").to_pylist(), dtype=object)[kept]
    stats = {
        "written_by": WRITTEN_BY,
        "kept": int(len(kept)),
        "dropped": dict(sorted(dropped.items())),
        "examples": examples,
        "flags": flags,  # kept rows: lone_surrogate, reasoning_removed, truncated, loop
        "loop_rule": LOOP_RULE,
        "rows": int(len(reasons)),
        "groups": int(len(set(groups.tolist()))),
        "tokens": int(lengths.sum()),
        "supervised_tokens": int(supervised.sum()),
        "length": length_summary(lengths),
        "unread_files": unread_files_summary(inputs),
        # chat_template_kwargs spelled as the training config spells it
        "settings": settings | {
            "inputs": inputs, "files": chat_files.expand_inputs(inputs),
            "chat_template_kwargs": {"enable_thinking": settings["enable_thinking"]}},
    }
    return stats, kept


def unread_files_summary(inputs: list[str]) -> dict:
    unread = chat_files.unread_files(inputs)
    return {"files": len(unread), "examples": unread[:EXAMPLES_PER_REASON]}


def length_summary(lengths: np.ndarray) -> dict:
    if len(lengths) == 0:
        return {}
    quantiles = np.percentile(lengths, [50, 90, 99])
    return {"min": int(lengths.min()), "mean": round(float(lengths.mean()), 1),
            "p50": int(quantiles[0]), "p90": int(quantiles[1]), "p99": int(quantiles[2]),
            "max": int(lengths.max())}


def plot_lengths(lengths: np.ndarray, max_length: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(lengths, bins=min(100, max(1, len(np.unique(lengths)))))
    ax.axvline(max_length, color="red", linestyle="--", label=f"max length {max_length}")
    ax.set_xlabel("tokens per sample")
    ax.set_ylabel("samples")
    ax.set_title(f"{len(lengths)} samples, {int(lengths.sum())} tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def is_prepared_output(path: Path) -> bool:
    """Whether `path` is a directory this tool wrote (its stats.json carries the mark)."""
    try:
        return json.loads((path / "stats.json").read_text()).get("written_by") in (WRITTEN_BY, *EARLIER_MARKS)
    except (OSError, ValueError, AttributeError):
        return False


def check_out(out: Path, inputs: list[str]) -> None:
    """Refuse an --out that this tool may not replace, before any work."""
    if out.exists() and not is_prepared_output(out):
        raise DataError(f"--out {out} exists and is not an output of {WRITTEN_BY} (no stats.json with its "
                        "mark): refusing to replace it; choose another --out, or remove it yourself")
    for item in inputs:
        if Path(item).exists() and out.resolve() in (Path(item).resolve(), *Path(item).resolve().parents):
            raise DataError(f"--out {out} would replace the input {item}")


def write_output(dataset: datasets.Dataset, stats: dict, out: Path) -> None:
    """Write into a new temporary sibling directory, then swap it in: a crash never leaves a
    half-written OUT, and only a directory this tool wrote is ever removed."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        dataset.save_to_disk(str(tmp))
        plot_lengths(np.asarray(dataset["length"], dtype=np.int64), stats["settings"]["max_length"],
                     tmp / "length_hist.png")
        (tmp / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")  # the mark, last
    except BaseException:
        shutil.rmtree(tmp)
        raise
    if not out.exists():
        tmp.rename(out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    out.rename(old / out.name)
    tmp.rename(out)
    shutil.rmtree(old)


def report(stats: dict) -> None:
    print(f"kept {stats['kept']} of {stats['rows']} rows ({stats['groups']} groups); {stats['tokens']} tokens, "
          f"{stats['supervised_tokens']} supervised; length {stats['length']}")
    for reason, count in stats["dropped"].items():
        print(f"dropped {count} {reason}: e.g. {', '.join(stats['examples'][reason])}")
    for flag, flagged in stats["flags"].items():
        print(f"kept {flagged['rows']} flagged {flag}: e.g. {', '.join(flagged['examples'])}")
    unread = stats["unread_files"]
    if unread["files"]:
        print(f"not read: {unread['files']} files in the input directories that are not "
              f"{'/'.join(chat_files.FILE_SUFFIXES)}: e.g. {', '.join(unread['examples'])}")


def unwind_on_sigterm() -> None:
    """Make SIGTERM (a scheduler's, kill's) unwind as Ctrl-C does, so that `write_output` removes its
    half-written temporary directory instead of leaving the data set's size behind, hidden: for the main
    thread of a command line that prepares data (prepare's, the world builders')."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def prepare(prep: PrepareSettings) -> dict:
    """Tokenise `prep.input` into the dataset `prep.out` and return its stats.json (printed in
    short). Input that leaves nothing to write raises DataError before anything is written."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the workers are the parallelism
    out = Path(prep.out)
    check_out(out, prep.input)
    tokenized, settings = build(prep)
    stats, kept = summarize(tokenized, settings, prep.input)
    if stats["kept"] == 0:
        report(stats)
        raise DataError("no sample kept: see the drop reasons above")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_output(tokenized.select(kept).select_columns(OUTPUT_COLUMNS), stats, out)
    report(stats)
    print(f"wrote {out}")
    return stats
