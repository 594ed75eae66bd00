"""Chat data: reading conversation files, normalising their shapes, rendering, and the loss mask.

Shared by `data/prepare.py` (tokenise + loss mask), `data/regenerate.py` (the target rewrites the
answers) and prompt formatting for evaluation, so that all three see a conversation the same way.

Input rows (one JSON object each) come in these shapes; all become a list of
`{"role": "system"|"user"|"assistant", "content": str}` messages:
  ShareGPT     {"conversations": [{"from": "human"|"gpt"|"system"|"user"|"assistant", "value": str}]}
  OpenAI       {"messages": [{"role": ..., "content": str | [{"type": "text", "text": str}, ...]}]}
               (also UltraChat-200k and Nemotron-Post-Training v1/v2, whose other columns such as
               `reasoning`, `uuid`, `category` are ignored; an assistant `reasoning_content` string
               is folded into the content as a leading `<think>` block)
  UltraChat    {"data": [user, assistant, user, ...]} (alternating strings)
  Llama-Nemotron {"input": str | messages, "output": str, "system_prompt": str (optional)}

Source labels are "path:N", N being the 1-based line of a JSONL file or the 1-based row of a JSON
list, a parquet file or a hub dataset.

Reasons a row is dropped (stable strings; counted in prepare's stats.json and regenerate's summary):
  encoding               a JSONL line that is not valid UTF-8
  malformed_json         a JSONL line that does not parse as JSON
  not_a_conversation     a row that is not an object or holds no conversation in a known shape
  unknown_role           a turn whose role is not system/user/assistant (or an alias of one)
  non_string_content     a turn whose content is neither a string nor a list of text parts
  empty_content          a turn whose content is empty or blank (for an assistant: its answer)
  no_assistant_turn      nothing to supervise (prepare)
  no_user_turn           nothing to answer (regenerate)
  template_error         the tokenizer's chat template raised on the conversation
  span_not_found         an assistant answer could not be located in the rendered conversation
  too_long               more than --max-length tokens, without --truncate (prepare)
  too_little_supervision fewer than 2 consecutive supervised tokens (prepare)

Loss mask (which tokens the drafter learns to predict): for every assistant turn (or only the
last one), the answer text, any whitespace after it and the special token that closes the turn
(`<|im_end|>` for Qwen): at serving time the drafter must propose that token too. When the
message carries reasoning that the template renders, the span starts at its `<think>` tag, which
the target generates itself. The answer's indentation is supervised; its leading newlines are not
(templates strip them, or they cannot be told from the header's). Template text is never
supervised: role headers, and the empty `<think>\\n\\n</think>\\n\\n` that Qwen3 templates insert
for thinking-off turns (at serving time it is part of the prompt). Spans are found as character
offsets in the rendered text and mapped to tokens with the tokenizer's offset mapping: a token is
supervised when its first character lies inside a span (a token that merges template whitespace
with the answer's first characters is therefore not).
"""
import bisect
import functools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


ROLE_ALIASES = {
    "system": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "model": "assistant",
}
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


class BadRow(Exception):
    """A row that cannot be used; `reason` is one of the stable strings in the module docstring."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class RawRow:
    """One input row: the parsed JSON value, or `reason` when it could not even be read."""
    source: str
    value: Any = None
    reason: str | None = None


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------

def expand_inputs(inputs: list[str]) -> list[str]:
    """Files stay as given (in order); a directory becomes its data files, sorted; a name that is
    not a local path nor a data file name is taken as a hub dataset `owner/name[:split]`."""
    expanded = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            expanded += sorted(str(p) for p in path.rglob("*") if p.suffix in FILE_SUFFIXES)
        elif path.suffix in FILE_SUFFIXES and not path.is_file():
            raise FileNotFoundError(f"{item}: no such file")
        else:
            expanded.append(item)
    return expanded


def input_signature(inputs: list[str]) -> list[list]:
    """What identifies the rows of `inputs` for caching: path, size and mtime of each file (so an
    edited file is read again), or the name of a hub dataset."""
    signature = []
    for item in expand_inputs(inputs):
        path = Path(item)
        if path.is_file():
            stat = path.stat()
            signature.append([item, str(path.resolve()), stat.st_size, stat.st_mtime_ns])
        else:
            signature.append([item])
    return signature


def read_rows(inputs: list[str]) -> Iterator[RawRow]:
    """Every row of every input, in order. A bad row comes back with a reason; only a missing or
    unreadable file raises."""
    for item in expand_inputs(inputs):
        path = Path(item)
        if path.suffix == ".jsonl":
            yield from read_jsonl(path)
        elif path.suffix == ".json":
            yield from read_json(path)
        elif path.suffix == ".parquet":
            yield from read_parquet(path)
        elif path.exists():
            raise ValueError(f"{item}: unsupported file type (expected {', '.join(FILE_SUFFIXES)})")
        else:
            yield from read_hub(item)


def read_jsonl(path: Path) -> Iterator[RawRow]:
    """Read line by line in binary so that one bad line (encoding, JSON) is counted, not fatal."""
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            source = f"{path}:{line_number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield RawRow(source, reason="encoding")
                continue
            if not line.strip():
                continue
            try:
                yield RawRow(source, json.loads(line))
            except json.JSONDecodeError:
                yield RawRow(source, reason="malformed_json")


def read_json(path: Path) -> Iterator[RawRow]:
    """A JSON file holding a list of rows; a file that is really JSON Lines is read as such."""
    try:
        rows = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError):
        yield from read_jsonl(path)
        return
    if not isinstance(rows, list):
        raise ValueError(f"{path}: a .json input must hold a list of rows, found {type(rows).__name__}")
    for index, row in enumerate(rows, start=1):
        yield RawRow(f"{path}:{index}", row)


def read_parquet(path: Path, batch_size: int = 1024) -> Iterator[RawRow]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # pyarrow's errors do not name the file
        raise ValueError(f"{path}: not a readable parquet file ({error})") from error
    index = 0
    for batch in parquet.iter_batches(batch_size=batch_size):
        for row in batch.to_pylist():
            index += 1
            yield RawRow(f"{path}:{index}", row)


def read_hub(spec: str) -> Iterator[RawRow]:
    """A hub dataset `owner/name[:split]` (default split: train), through `datasets.load_dataset`."""
    import datasets

    name, _, split = spec.partition(":")
    for index, row in enumerate(datasets.load_dataset(name, split=split or "train"), start=1):
        yield RawRow(f"{spec}:{index}", row)


# ---------------------------------------------------------------------------------------------
# Normalising shapes
# ---------------------------------------------------------------------------------------------

def normalize_row(row: Any) -> list[dict[str, str]]:
    """The row's conversation as `[{"role", "content"}]` with canonical roles; raises BadRow."""
    if not isinstance(row, dict):
        raise BadRow("not_a_conversation", f"a {type(row).__name__}, not an object")
    if isinstance(row.get("conversations"), list):
        turns = row["conversations"]
    elif isinstance(row.get("messages"), list):
        turns = row["messages"]
    elif isinstance(row.get("data"), list):
        turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": text}
                 for i, text in enumerate(row["data"])]
    elif "input" in row and "output" in row:
        turns = _input_output_turns(row)
    else:
        raise BadRow("not_a_conversation", "no conversations/messages/data/input+output field")
    if not turns:
        raise BadRow("not_a_conversation", "empty conversation")
    return [normalize_turn(turn) for turn in turns]


def _input_output_turns(row: dict) -> list:
    prompt = row["input"]
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not isinstance(turns, list):
        raise BadRow("not_a_conversation", "`input` is neither a string nor a list of messages")
    system = row.get("system_prompt")
    head = [{"role": "system", "content": system}] if isinstance(system, str) and system.strip() else []
    return head + turns + [{"role": "assistant", "content": row["output"]}]


def normalize_turn(turn: Any) -> dict[str, str]:
    if not isinstance(turn, dict):
        raise BadRow("not_a_conversation", f"a turn is a {type(turn).__name__}, not an object")
    # `or`: a parquet schema merged from both spellings holds None in the unused pair of columns
    raw_role = turn.get("role") or turn.get("from")
    role = ROLE_ALIASES.get(raw_role.lower()) if isinstance(raw_role, str) else None
    if role is None:
        raise BadRow("unknown_role", repr(raw_role))
    content = content_text(turn.get("content") if turn.get("content") is not None else turn.get("value"))
    reasoning = turn.get("reasoning_content")
    if role == "assistant" and isinstance(reasoning, str) and reasoning.strip():
        content = join_reasoning(reasoning, content)
    body = split_reasoning(content)[1] if role == "assistant" else content
    if not body.strip():
        raise BadRow("empty_content", f"{role} turn")
    return {"role": role, "content": content}


def content_text(content: Any) -> str:
    """A message content as text: a string, or the text parts of an OpenAI content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            for part in content):
        return "\n".join(part["text"] for part in content)
    raise BadRow("non_string_content", type(content).__name__)


def split_reasoning(content: str) -> tuple[str | None, str]:
    """(reasoning, answer) of an assistant content; reasoning is None without a `</think>`."""
    if THINK_CLOSE not in content:
        return None, content
    head, _, answer = content.rpartition(THINK_CLOSE)
    return head.split(THINK_OPEN)[-1].strip(), answer


def join_reasoning(reasoning: str, answer: str) -> str:
    """The inline form of a reasoning + answer pair, as Qwen3-style templates parse it."""
    return f"{THINK_OPEN}\n{reasoning.strip()}\n{THINK_CLOSE}\n\n{answer.lstrip()}"


def with_system_prompt(messages: list[dict], system_prompt: str | None) -> list[dict]:
    """Prepend `system_prompt` unless it is empty or the conversation has its own system turn."""
    if not system_prompt or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": system_prompt}] + messages


# ---------------------------------------------------------------------------------------------
# Rendering and the loss mask
# ---------------------------------------------------------------------------------------------

def render(tokenizer, messages: list[dict], enable_thinking: bool,
           add_generation_prompt: bool = False) -> str:
    """The conversation as text through the tokenizer's chat template; raises BadRow."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             enable_thinking=enable_thinking)
    except Exception as error:  # templates raise anything (jinja errors, "roles must alternate")
        raise BadRow("template_error", str(error)[:200]) from error


def render_prompt(tokenizer, messages: list[dict], enable_thinking: bool,
                  system_prompt: str | None = None) -> str:
    """The text a target is given to answer `messages` (which should end with a user turn)."""
    return render(tokenizer, with_system_prompt(messages, system_prompt), enable_thinking,
                  add_generation_prompt=True)


def prompt_token_ids(tokenizer, messages: list[dict], enable_thinking: bool) -> list[int]:
    """Token ids of `render_prompt` (the chat template adds any special tokens itself)."""
    return tokenizer(render_prompt(tokenizer, messages, enable_thinking), add_special_tokens=False).input_ids


@functools.lru_cache(maxsize=8)
def turn_end_regex(tokenizer) -> re.Pattern:
    """Whitespace then one of the tokenizer's special added tokens (the turn closers)."""
    specials = {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
    alternatives = "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))
    return re.compile(rf"\s*(?:{alternatives})")


def find_answer(text: str, answer: str, start: int, turn_end: re.Pattern) -> tuple[int, int] | None:
    """[start, end) of the first `answer` at or after `start` that a turn closer follows; the end
    includes the closer. Requiring the closer keeps a short answer from matching inside a header."""
    found = text.find(answer, start)
    while found >= 0:
        closer = turn_end.match(text, found + len(answer))
        if closer:
            return found, closer.end()
        found = text.find(answer, found + 1)
    return None


def assistant_spans(text: str, messages: list[dict], turn_end: re.Pattern) -> list[tuple[int, int]]:
    """Character spans [start, end) of the supervised part of each assistant turn in `text`.

    Walks the messages in order with a cursor past each located turn, so that an answer is never
    matched inside an earlier turn (a user turn quoting it, say).
    """
    spans, cursor = [], 0
    for message in messages:
        if message["role"] != "assistant":
            content = message["content"].strip()
            found = text.find(content, cursor)
            if found >= 0:
                cursor = found + len(content)
            continue
        reasoning, answer = split_reasoning(message["content"])
        span = find_answer(text, answer.strip(), cursor, turn_end)
        if span is None:
            raise BadRow("span_not_found", answer.strip()[:60])
        start, end = span
        # The answer's own indentation (code) is the target's output too, when the template kept it.
        indent = answer[: len(answer) - len(answer.lstrip())].rsplit("\n", 1)[-1]
        if indent and start - len(indent) >= cursor and text[start - len(indent):start] == indent:
            start -= len(indent)
        if reasoning:
            thought = text.find(reasoning, cursor, start)
            if thought >= 0:
                tag = text.rfind(THINK_OPEN, cursor, thought)
                start = tag if tag >= 0 else thought
        spans.append((start, end))
        cursor = end
    return spans


def tokens_in_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """0/1 per token: 1 when the token's first character lies inside one of `spans`.
    `offsets` are a single sequence's (start, end) character offsets, so starts never decrease."""
    starts = [start for start, _ in offsets]
    mask = [0] * len(offsets)
    for span_start, span_end in spans:
        for i in range(bisect.bisect_left(starts, span_start), bisect.bisect_left(starts, span_end)):
            mask[i] = int(offsets[i][1] > offsets[i][0])
    return mask


def tokenize_conversation(tokenizer, messages: list[dict], enable_thinking: bool,
                          last_turn_only: bool = False) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a full conversation; raises BadRow (template_error, span_not_found)."""
    text = render(tokenizer, messages, enable_thinking)
    spans = assistant_spans(text, messages, turn_end_regex(tokenizer))
    if last_turn_only:
        spans = spans[-1:]
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoding["input_ids"]), tokens_in_spans(encoding["offset_mapping"], spans)


def longest_run(mask: list[int]) -> int:
    """Length of the longest run of consecutive 1s."""
    return max(map(len, bytes(mask).split(b"\x00")))
