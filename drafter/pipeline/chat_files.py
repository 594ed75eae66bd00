"""Conversation files read into rows (drafter/pipeline/chat.py normalises them): JSONL, JSON, parquet,
directories of them and hub datasets.

Source labels are "path:N", N being the 1-based line of a JSONL file or the 1-based row of a JSON
list, a parquet file or a hub dataset. A row's group (`row_group`, what the held-out split keeps
together) is its string field `group` when it has one, else "path#ID" with ID its `id`,
`conversation_id` or `uuid` field, else "path#N".

Repairs (the row is kept): a UTF-8 byte-order mark at the start of a line is skipped; a lone UTF-16
surrogate (a `"\\ud83d"` escape with no partner, which UTF-8 and Arrow cannot hold) becomes U+FFFD
and the row is flagged `lone_surrogate`; in source labels, file-name bytes that are not UTF-8
become U+FFFD.

A file that cannot be read as a whole (a missing or unreadable file, a `.json` array cut short or
nested too deep for the parser, UTF-16 or UTF-32 text, damaged parquet data, an unsupported type)
raises `InputError` naming it. Given a directory, only its data files are read:
hidden entries, data/regenerate.py's side files (`*.errors.jsonl`, `*.summary.json`,
`*.settings.json`) and saved `datasets` directories (data/prepare.py outputs) are skipped, and
other files (`unread_files`: a `.jsonl.gz`, a README) are reported by both tools.
"""
import codecs
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
# data/regenerate.py writes these next to its output; they are never conversations.
SIDE_FILE_SUFFIXES = (".errors.jsonl", ".summary.json", ".settings.json")
CONVERSATION_ID_FIELDS = ("id", "conversation_id", "uuid")


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
