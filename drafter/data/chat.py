"""Chat data: reading conversation files, normalising their shapes, rendering, and the loss mask.

Shared by `data/prepare.py` (tokenise + loss mask), `data/regenerate.py` (the target rewrites the
answers) and prompt formatting for evaluation, so that all three see a conversation the same way.

Input rows (one JSON object each) come in these shapes; all become a list of
`{"role": "system"|"user"|"assistant"|"tool", "content": str}` messages:
  ShareGPT     {"conversations": [{"from": "human"|"gpt"|"system"|"user"|"assistant", "value": str}]}
  OpenAI       {"messages": [{"role": ..., "content": str | [{"type": "text", "text": str}, ...]}]}
               (also UltraChat-200k and Nemotron-Post-Training v1/v2, whose other columns such as
               `reasoning`, `category` are ignored; an assistant `reasoning_content` string
               is folded into the content as a leading `<think>` block). Tool use in the OpenAI
               shape is kept: an assistant turn's `tool_calls` (normalised to
               `[{"type": "function", "function": {"name", "arguments"}}]`, content may be empty)
               and `tool` turns (`function` is an alias), which the target's chat template renders.
  UltraChat    {"data": [user, assistant, user, ...]} (alternating strings)
  Llama-Nemotron {"input": str | messages, "output": str, "system_prompt": str (optional)}

Source labels are "path:N", N being the 1-based line of a JSONL file or the 1-based row of a JSON
list, a parquet file or a hub dataset. A row's group (`row_group`, what the held-out split keeps
together) is its string field `group` when it has one, else "path#ID" with ID its `id`,
`conversation_id` or `uuid` field, else "path#N".

Repairs (the row is kept): a UTF-8 byte-order mark at the start of a line is skipped; a lone UTF-16
surrogate (a `"\\ud83d"` escape with no partner, which UTF-8 and Arrow cannot hold) becomes U+FFFD
and the row is flagged `lone_surrogate`; in source labels, file-name bytes that are not UTF-8
become U+FFFD.

Reasons a row is dropped (stable strings; counted in prepare's stats.json and regenerate's summary):
  encoding               a JSONL line, or a string of a parquet row, that is not valid UTF-8
  malformed_json         a JSONL line that does not parse as JSON
  nesting_too_deep       a row nested deeper than MAX_NESTING (100) lists and objects
  not_a_conversation     a row that is not an object or holds no conversation in a known shape
  unknown_role           a turn whose role is not system/user/assistant/tool (or an alias of one)
  non_string_content     a turn whose content is neither a string nor a list of text parts
  empty_content          a turn whose content is empty or blank (for an assistant: its answer)
  bad_tool_call          an assistant `tool_calls` entry without a function name, or with arguments
                         that are neither a string nor an object JSON can write
  tools_unsupported      tool calls or tool turns that the target's chat template does not render
  tool_turns             tool calls or tool turns: regenerate cannot run the tools (regenerate)
  special_token_text     an answer or tool call holding the text of a special token (a literal
                         `<|im_end|>`), which would become a turn boundary mid-answer (prepare)
  extra_think_tags       an answer with more than one `<think>` or `</think>` tag (prepare)
  unclosed_think         an answer whose `<think>` is never closed: reasoning cut short (prepare;
                         kept, without its closing token, in a `truncated` row with --thinking)
  no_assistant_turn      nothing to supervise (prepare)
  no_user_turn           nothing to answer (regenerate)
  template_error         the tokenizer's chat template raised on the conversation
  span_not_found         an assistant answer could not be located in the rendered conversation
  too_long               more than --max-length tokens, without --truncate (prepare)
  too_little_supervision fewer than 2 consecutive supervised tokens (prepare)
  loop                   with --drop-loops: an answer whose tail repeats a short n-gram (prepare)

A file that cannot be read as a whole (a missing or unreadable file, a `.json` array cut short or
nested too deep for the parser, UTF-16 or UTF-32 text, damaged parquet data, an unsupported type)
raises `InputError` naming it. Given a directory, only its data files are read:
hidden entries, data/regenerate.py's side files (`*.errors.jsonl`, `*.summary.json`,
`*.settings.json`) and saved `datasets` directories (data/prepare.py outputs) are skipped, and
other files (`unread_files`: a `.jsonl.gz`, a README) are reported by both tools.

Loss mask (which tokens the drafter learns to predict): for every assistant turn (or only the
last one), the answer text, any whitespace after it and the special token that closes the turn
(`<|im_end|>` for Qwen): at serving time the drafter must propose that token too. In a row that
data/regenerate.py marks `truncated` (an answer hit --max-tokens) no closing token is supervised:
the target never chose to end there. When the message carries reasoning
that the template renders, the span starts at its `<think>` tag, which the target generates
itself. A tool-call turn is supervised as the template renders it (its calls included). The
answer's indentation is supervised; its leading newlines are not (templates strip them, or they
cannot be told from the header's). Template text is never supervised: role headers, and the empty
`<think>\\n\\n</think>\\n\\n` that Qwen3 templates insert for thinking-off turns (at serving time it
is part of the prompt). Spans are found as character offsets in the rendered text and mapped to
tokens with the tokenizer's offset mapping: a token is supervised when its first character lies
inside a span (a token that merges template whitespace with the answer's first characters is
therefore not).
"""
import bisect
import codecs
import functools
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


ROLE_ALIASES = {
    "system": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "model": "assistant",
    "tool": "tool", "function": "tool",
}
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
# data/regenerate.py writes these next to its output; they are never conversations.
SIDE_FILE_SUFFIXES = (".errors.jsonl", ".summary.json", ".settings.json")
CONVERSATION_ID_FIELDS = ("id", "conversation_id", "uuid")


class BadRow(Exception):
    """A row that cannot be used; `reason` is one of the stable strings in the module docstring."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class InputError(ValueError):
    """A file that cannot be read as a whole; the message names it and says what is wrong."""


@dataclass(frozen=True)
class RawRow:
    """One input row: the parsed JSON value, or `reason` when it could not even be read.
    `repaired`: lone surrogates in it were replaced by U+FFFD."""
    source: str
    value: Any = None
    reason: str | None = None
    repaired: bool = False


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------

def expand_inputs(inputs: list[str], exclude: tuple[str, ...] = ()) -> list[str]:
    """Files stay as given (in order); a directory becomes its data files, sorted (see the module
    docstring for what is skipped); a name that is not a local path nor a data file name is taken
    as a hub dataset `owner/name[:split]`. Files that resolve to one of `exclude` are left out."""
    excluded = {Path(path).resolve() for path in exclude}
    expanded = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            expanded += sorted(str(p) for p in path.rglob("*") if is_data_file(p, path))
        elif path.suffix in FILE_SUFFIXES and not path.is_file():
            raise FileNotFoundError(f"{item}: no such file")
        else:
            expanded.append(item)
    return [item for item in expanded if Path(item).resolve() not in excluded]


def is_data_file(path: Path, root: Path) -> bool:
    """Whether a file found under directory `root` is input data."""
    return path.is_file() and path.suffix in FILE_SUFFIXES and not skipped_by_rule(path, root)


def skipped_by_rule(path: Path, root: Path) -> bool:
    """Whether a file found under directory `root` is one that is never input: a hidden entry, a
    data/regenerate.py side file, a file of a saved dataset."""
    parts = path.relative_to(root).parts
    folders = [root.joinpath(*parts[:depth]) for depth in range(len(parts))]
    return (path.name.endswith(SIDE_FILE_SUFFIXES) or any(part.startswith(".") for part in parts)
            or any(is_saved_dataset(folder) for folder in folders))


def unread_files(inputs: list[str]) -> list[str]:
    """Files under the directory inputs that are not read for their type (a compressed `.jsonl.gz`,
    a README), as labels: worth a word to the user, unlike the files skipped by rule."""
    unread = []
    for item in inputs:
        root = Path(item)
        if root.is_dir():
            unread += sorted(path_label(p) for p in root.rglob("*") if p.is_file()
                             and p.suffix not in FILE_SUFFIXES and not skipped_by_rule(p, root))
    return unread


def is_saved_dataset(directory: Path) -> bool:
    """A `datasets` save_to_disk directory (data/prepare.py writes these)."""
    return (directory / "dataset_info.json").is_file() and (directory / "state.json").is_file()


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


def read_rows(inputs: list[str], exclude: tuple[str, ...] = ()) -> Iterator[RawRow]:
    """Every row of every input, in order. A bad row comes back with a reason; a file that cannot
    be read as a whole raises InputError (FileNotFoundError when missing)."""
    for item in expand_inputs(inputs, exclude):
        path = Path(item)
        if path.suffix == ".jsonl":
            yield from read_jsonl(path)
        elif path.suffix == ".json":
            yield from read_json(path)
        elif path.suffix == ".parquet":
            yield from read_parquet(path)
        elif path.exists():
            raise InputError(f"{path_label(path)}: unsupported file type (expected {', '.join(FILE_SUFFIXES)})")
        else:
            yield from read_hub(item)


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
MAX_NESTING = 100  # no conversation nests deeper; the cap keeps every later step off Python's recursion limit


def parse_json(text: str) -> tuple[Any, bool]:
    """(value, repaired) of a JSON text; lone UTF-16 surrogates in its strings become U+FFFD.
    Raises json.JSONDecodeError, or RecursionError for nesting deeper than MAX_NESTING."""
    return checked_value(json.loads(text), _SURROGATE_ESCAPE.search(text) is not None)


def checked_value(value: Any, may_hold_surrogates: bool) -> tuple[Any, bool]:
    """(value, repaired): lone surrogates replaced when the JSON text held a surrogate escape (the
    only way one gets into a str); RecursionError when nested deeper than MAX_NESTING."""
    if nesting_depth(value) > MAX_NESTING:
        raise RecursionError(f"nested deeper than {MAX_NESTING} levels")
    if not may_hold_surrogates:
        return value, False
    repaired = without_lone_surrogates(value)
    return repaired, repaired != value


def nesting_depth(value: Any) -> int:
    """How many levels of lists and objects `value` holds (0 for a scalar), level by level rather
    than by recursion."""
    depth, level = 0, [value]
    while level := [item for item in level if isinstance(item, (list, dict))]:
        depth += 1
        level = [child for item in level for child in (item.values() if isinstance(item, dict) else item)]
    return depth


def without_lone_surrogates(value: Any) -> Any:
    """`value` with every lone surrogate in its strings (keys included) replaced by U+FFFD."""
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, list):
        return [without_lone_surrogates(item) for item in value]
    if isinstance(value, dict):
        return {without_lone_surrogates(k): without_lone_surrogates(v) for k, v in value.items()}
    return value


def path_label(path: Path) -> str:
    """`path` as text that UTF-8 (and Arrow) can hold, for source labels: the bytes of a file name
    that are not UTF-8 (which Python keeps as lone surrogates) become U+FFFD."""
    return os.fsencode(path).decode("utf-8", "replace")


UTF16_32_BOMS = (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE, codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)


def check_not_utf16(path: Path, head: bytes) -> None:
    """Raise InputError for a file that starts with a UTF-16 or UTF-32 byte-order mark (Windows
    tools write these): read as UTF-8 its every line would be a bad row."""
    if head.startswith(UTF16_32_BOMS):
        raise InputError(f"{path_label(path)}: UTF-16 or UTF-32 text (byte-order mark {head[:4].hex()}); "
                         "convert it to UTF-8 first, e.g. iconv -f UTF-16 -t UTF-8")


def read_jsonl(path: Path) -> Iterator[RawRow]:
    """Read line by line in binary so that one bad line (encoding, JSON) is counted, not fatal.
    A UTF-8 byte-order mark is skipped on any line (files joined with `cat` carry one inside)."""
    name = path_label(path)
    with open(path, "rb") as f:
        check_not_utf16(path, f.read(4))
        f.seek(0)
        for line_number, raw in enumerate(f, start=1):
            source = f"{name}:{line_number}"
            try:
                line = raw.decode("utf-8-sig")
            except UnicodeDecodeError:
                yield RawRow(source, reason="encoding")
                continue
            if not line.strip():
                continue
            try:
                value, repaired = parse_json(line)
            except json.JSONDecodeError:
                yield RawRow(source, reason="malformed_json")
            except RecursionError:
                yield RawRow(source, reason="nesting_too_deep")
            else:
                yield RawRow(source, value, repaired=repaired)


def read_json(path: Path) -> Iterator[RawRow]:
    """A JSON file holding a list of rows; a file that is really JSON Lines is read as such. A
    list that does not parse (a download cut short) or a value that is not a list raises."""
    name, data = path_label(path), path.read_bytes()
    check_not_utf16(path, data)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise InputError(f"{name}: not valid UTF-8 ({error})") from None
    try:
        rows = json.loads(text)
    except RecursionError:
        raise InputError(f"{name}: nested deeper than Python's JSON parser goes; split it into JSON Lines "
                         "so that the deep rows can be skipped one by one") from None
    except json.JSONDecodeError as error:
        if text.lstrip().startswith("["):
            raise InputError(f"{name}: not a complete JSON list ({error}); is the file cut short?") from None
        yield from read_jsonl(path)
        return
    if not isinstance(rows, list):
        raise InputError(f"{name}: a .json input must hold a list of rows, found {type(rows).__name__}")
    may_hold_surrogates = _SURROGATE_ESCAPE.search(text) is not None
    for index, row in enumerate(rows, start=1):
        try:
            value, repaired = checked_value(row, may_hold_surrogates)
        except RecursionError:
            yield RawRow(f"{name}:{index}", reason="nesting_too_deep")
            continue
        yield RawRow(f"{name}:{index}", value, repaired=repaired)


def read_parquet(path: Path, batch_size: int = 1024) -> Iterator[RawRow]:
    """Rows of a parquet file; a row with a string that is not UTF-8 (other writers store any bytes
    in string columns) comes back with reason `encoding`."""
    import pyarrow.parquet as pq

    name = path_label(path)
    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # pyarrow's errors do not name the file
        raise InputError(f"{name}: not a readable parquet file ({error})") from error
    index = 0
    for batch in parquet_batches(parquet, name, batch_size):
        try:
            rows = batch.to_pylist()
        except UnicodeDecodeError:  # find the row(s): one at a time
            rows = [parquet_row(batch.slice(i, 1)) for i in range(batch.num_rows)]
        for row in rows:
            index += 1
            yield RawRow(f"{name}:{index}", reason="encoding") if row is None else RawRow(f"{name}:{index}", row)


def parquet_batches(parquet, name: str, batch_size: int) -> Iterator:
    """The record batches of a parquet file; damaged data past the footer (a page overwritten, a
    copy gone wrong) raises InputError naming the file, since pyarrow's error does not."""
    batches = parquet.iter_batches(batch_size=batch_size)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as error:  # ArrowInvalid, OSError, ...
            raise InputError(f"{name}: damaged parquet data ({error})") from error
        yield batch


def parquet_row(one_row_batch) -> dict | None:
    """The only row of a batch, or None when one of its strings is not UTF-8."""
    try:
        return one_row_batch.to_pylist()[0]
    except UnicodeDecodeError:
        return None


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


def normalize_turn(turn: Any) -> dict:
    if not isinstance(turn, dict):
        raise BadRow("not_a_conversation", f"a turn is a {type(turn).__name__}, not an object")
    # `or`: a parquet schema merged from both spellings holds None in the unused pair of columns
    raw_role = turn.get("role") or turn.get("from")
    role = ROLE_ALIASES.get(raw_role.lower()) if isinstance(raw_role, str) else None
    if role is None:
        raise BadRow("unknown_role", repr(raw_role))
    raw_content = turn.get("content") if turn.get("content") is not None else turn.get("value")
    tool_calls = turn.get("tool_calls") if role == "assistant" else None
    if role == "tool" or (tool_calls and raw_content is None):
        raw_content = "" if raw_content is None else raw_content  # a call or a result may be empty
    content = content_text(raw_content)
    reasoning = turn.get("reasoning_content")
    if role == "assistant" and isinstance(reasoning, str) and reasoning.strip():
        content = join_reasoning(reasoning, content)
    if role == "tool":
        return {"role": "tool", "content": content}
    if tool_calls:
        return {"role": "assistant", "content": content, "tool_calls": normalize_tool_calls(tool_calls)}
    body = split_reasoning(content)[1] if role == "assistant" else content
    if not body.strip():
        raise BadRow("empty_content", f"{role} turn")
    return {"role": role, "content": content}


def normalize_tool_calls(calls: Any) -> list[dict]:
    """OpenAI `tool_calls` as `[{"type": "function", "function": {"name", "arguments"}}]`, the
    arguments kept as given (a JSON string or an object); raises BadRow("bad_tool_call")."""
    if not isinstance(calls, list):
        raise BadRow("bad_tool_call", f"tool_calls is a {type(calls).__name__}, not a list")
    normalized = []
    for call in calls:
        function = call.get("function", call) if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", {}) if isinstance(function, dict) else None
        if not (isinstance(name, str) and name.strip()) or not is_json_text_or_object(arguments):
            raise BadRow("bad_tool_call", json.dumps(call, default=str)[:100])
        normalized.append({"type": "function", "function": {"name": name, "arguments": arguments}})
    return normalized


def is_json_text_or_object(arguments: Any) -> bool:
    """A string, or an object that JSON can write (a parquet column may hold dates or bytes)."""
    if not isinstance(arguments, (str, dict)):
        return False
    try:
        json.dumps(arguments)
    except (TypeError, ValueError):
        return False
    return True


def uses_tools(messages: list[dict]) -> bool:
    return any(m["role"] == "tool" or "tool_calls" in m for m in messages)


def row_group(raw: RawRow) -> str:
    """The group a row belongs to for the held-out split (see the module docstring)."""
    value = raw.value if isinstance(raw.value, dict) else {}
    if isinstance(value.get("group"), str) and value["group"]:
        return value["group"]
    file, _, number = raw.source.rpartition(":")
    for field in CONVERSATION_ID_FIELDS:
        conversation_id = value.get(field)
        if isinstance(conversation_id, (str, int)) and not isinstance(conversation_id, bool) and conversation_id != "":
            return f"{file}#{conversation_id}"
    return f"{file}#{number}"


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
def special_token_regex(tokenizer) -> re.Pattern:
    """One of the tokenizer's special added tokens (the turn closers among them)."""
    specials = {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
    return re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))


@functools.lru_cache(maxsize=8)
def turn_end_regex(tokenizer) -> re.Pattern:
    """Whitespace then one of the tokenizer's special added tokens (the turn closers)."""
    return re.compile(rf"\s*(?:{special_token_regex(tokenizer).pattern})")


def check_answers(tokenizer, messages: list[dict]) -> None:
    """Raise BadRow for answers whose text the template or tokenizer would read as structure: a
    special token's text, in the content or in a tool call (it would end the turn mid-answer), or
    more than one think tag."""
    specials = special_token_regex(tokenizer)
    for message in messages:
        if message["role"] != "assistant":
            continue
        calls = json.dumps(message.get("tool_calls", []), ensure_ascii=False)
        found = specials.search(message["content"]) or specials.search(calls)
        if found:
            raise BadRow("special_token_text", found.group())
        if message["content"].count(THINK_OPEN) > 1 or message["content"].count(THINK_CLOSE) > 1:
            raise BadRow("extra_think_tags")


def has_unclosed_reasoning(messages: list[dict]) -> bool:
    """Whether an answer opens a `<think>` block and never closes it: reasoning cut short, which
    no split can remove and after which the end of turn is false."""
    return any(m["role"] == "assistant" and THINK_OPEN in m["content"] and THINK_CLOSE not in m["content"]
               for m in messages)


def without_reasoning(messages: list[dict]) -> tuple[list[dict], bool]:
    """(messages with each assistant turn's `<think>` block removed, whether any held reasoning)."""
    stripped, removed = [], False
    for message in messages:
        reasoning, answer = split_reasoning(message["content"]) if message["role"] == "assistant" else (None, "")
        if reasoning is None:
            stripped.append(message)
            continue
        removed |= bool(reasoning)
        stripped.append(message | {"content": answer.lstrip("\n")})
    return stripped, removed


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


def rendered_answer(tokenizer, messages: list[dict], index: int, enable_thinking: bool) -> str:
    """The answer of assistant turn `index` as the template renders it after the generation prompt
    (tool calls included), up to the turn closer and without a leading think block: the text the
    target writes for it. Raises BadRow("tools_unsupported") when the calls are not rendered."""
    prompt = render(tokenizer, messages[:index], enable_thinking, add_generation_prompt=True)
    through = render(tokenizer, messages[:index + 1], enable_thinking)
    closer = turn_end_regex(tokenizer).search(through, len(prompt))
    if not through.startswith(prompt) or closer is None:
        raise BadRow("tools_unsupported", "the tool-call turn does not follow the generation prompt")
    answer = split_reasoning(through[len(prompt):closer.start()])[1]
    for call in messages[index]["tool_calls"]:
        if call["function"]["name"] not in answer:
            raise BadRow("tools_unsupported", f"the template does not render the call to {call['function']['name']!r}")
    return answer


def assistant_spans(text: str, messages: list[dict], turn_end: re.Pattern,
                    answers: dict[int, str] | None = None, closers: bool = True) -> list[tuple[int, int]]:
    """Character spans [start, end) of the supervised part of each assistant turn in `text`.

    `answers` overrides the answer text of some turns (tool calls, as `rendered_answer` gives them);
    `closers=False` leaves each turn's closing whitespace and token out of its span. Walks the
    messages in order with a cursor past each located turn, so that an answer is never matched
    inside an earlier turn (a user turn quoting it, say).
    """
    spans, cursor = [], 0
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            content = message["content"].strip()
            found = text.find(content, cursor)
            if found >= 0:
                cursor = found + len(content)
            elif message["role"] == "tool":
                raise BadRow("tools_unsupported", "the template does not render a tool turn's content")
            continue
        reasoning, answer = split_reasoning(message["content"])
        answer = (answers or {}).get(index, answer)
        span = find_answer(text, answer.strip(), cursor, turn_end)
        if span is None:
            raise BadRow("span_not_found", answer.strip()[:60])
        start, end = span
        if not closers:
            end = start + len(answer.strip())
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
        cursor = span[1]
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
                          last_turn_only: bool = False, closers: bool = True) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a full conversation; raises BadRow (template_error,
    span_not_found, special_token_text, extra_think_tags, tools_unsupported). `closers=False`:
    no turn's closing token is supervised (a row whose answer was cut off)."""
    check_answers(tokenizer, messages)
    try:
        text = render(tokenizer, messages, enable_thinking)
        answers = {index: rendered_answer(tokenizer, messages, index, enable_thinking)
                   for index, message in enumerate(messages) if "tool_calls" in message}
    except BadRow as bad:
        if bad.reason == "template_error" and uses_tools(messages):
            raise BadRow("tools_unsupported", str(bad)) from bad
        raise
    spans = assistant_spans(text, messages, turn_end_regex(tokenizer), answers, closers)
    if last_turn_only:
        spans = spans[-1:]
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoding["input_ids"]), tokens_in_spans(encoding["offset_mapping"], spans)


def longest_supervised_run(mask: list[int]) -> int:
    """Length of the longest run of consecutive 1s."""
    return max(map(len, bytes(mask).split(b"\x00")))
