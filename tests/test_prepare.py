"""data/prepare.py and the chat helpers it shares: shapes, bad rows, the loss mask, lengths, caching."""
import datetime
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from data import prepare
from drafter.pipeline import prepared
from drafter.pipeline import chat, chat_files, chat_template
from tests.tiny_tokenizer import save_tiny_tokenizer

END = "<|im_end|>"


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return str(save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture(scope="module")
def tokenizer(target):
    return AutoTokenizer.from_pretrained(target)


def write_jsonl(path, rows) -> str:
    """Rows are objects (dumped) or raw lines (str or bytes, written as they are)."""
    with open(path, "wb") as f:
        for row in rows:
            line = row if isinstance(row, (str, bytes)) else json.dumps(row)
            f.write((line.encode() if isinstance(line, str) else line) + b"\n")
    return str(path)


def run(target, tmp_path, inputs, out="out", *extra) -> tuple[datasets.Dataset, dict]:
    out_dir = tmp_path / out
    prepare.main(["--input", *inputs, "--target", target, "--out", str(out_dir),
                  "--cache-dir", str(tmp_path / "cache"), "--num-proc", "1", *extra])
    return datasets.load_from_disk(str(out_dir)), json.loads((out_dir / "stats.json").read_text())


def supervised_runs(tokenizer, sample) -> list[str]:
    """The decoded text of each run of consecutive supervised tokens."""
    runs, current = [], []
    for token, bit in zip(sample["input_ids"] + [None], sample["loss_mask"] + [0]):
        if bit:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def test_every_shape_is_read_and_only_answers_are_supervised(target, tokenizer, tmp_path):
    thought = "<think>\nLet me think step by step.\n</think>\n\n"
    rows = [  # (row, supervised text of each assistant turn, in order)
        ({"conversations": [{"from": "human", "value": "Hi there"},
                            {"from": "gpt", "value": "Hello world! How are you today?"}]},
         ["Hello world! How are you today?" + END]),
        # OpenAI with a system turn and text parts; an earlier turn's reasoning is not rendered
        # by the template, so only its answer is supervised; the last turn has none, so the
        # template's empty think block is not supervised.
        ({"messages": [{"role": "system", "content": "Be nice."},
                       {"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                                    {"type": "text", "text": "of France?"}]},
                       assistant(thought + "The capital of France is Paris."),
                       user("And 2 + 2?"), assistant("The answer is 4.")]},
         ["The capital of France is Paris." + END, "The answer is 4." + END]),
        # UltraChat: one-letter answers that also occur in the user text and in the role header.
        ({"id": "u1", "data": ["Pick a or b: a", "a", "Again, a", "a"]}, ["a" + END, "a" + END]),
        # Nemotron v2: reasoning in the last turn is rendered, and supervised from its <think> tag.
        ({"uuid": "n1", "category": "math", "reasoning": "on",
          "messages": [user("What is 4 * 3?"), assistant(thought + "The answer is 12.")]},
         [thought + "The answer is 12." + END]),
        # reasoning_content is folded in as a leading think block
        ({"messages": [user("Hello"), {"role": "assistant", "content": "Hello world!",
                                       "reasoning_content": "Greet back."}]},
         ["<think>\nGreet back.\n</think>\n\nHello world!" + END]),
        # Llama-Nemotron: input/output columns and a system prompt column
        ({"input": [user("Say hello")], "output": "Hello!", "system_prompt": "detailed thinking off"},
         ["Hello!" + END]),
        ({"messages": [user("Name a colour"), assistant("Blue.")]}, ["Blue." + END]),
        ({"input": "Say bye", "output": "Bye bye!"}, ["Bye bye!" + END]),
        ({"messages": [user("Hi"), assistant("Hello world!")]}, ["Hello world!" + END]),
        ({"messages": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello!"}]},
         ["Hello!" + END]),
    ]
    jsonl = write_jsonl(tmp_path / "shapes.jsonl", [row for row, _ in rows[:4]])
    json_file = tmp_path / "more.json"
    json_file.write_text(json.dumps([row for row, _ in rows[4:7]]))
    parquet = tmp_path / "last.parquet"
    # one parquet schema for three shapes: each row reads back the others' fields as None
    parquet_rows = [row for row, _ in rows[7:]]
    columns = {key for row in parquet_rows for key in row}
    pq.write_table(pa.Table.from_pydict({key: [row.get(key) for row in parquet_rows]
                                         for key in sorted(columns)}), parquet)

    out, stats = run(target, tmp_path, [jsonl, str(json_file), str(parquet)], "out", "--thinking")

    assert stats["kept"] == len(rows) and stats["dropped"] == {}
    assert out.column_names == ["input_ids", "loss_mask", "length", "group"]
    for sample, (row, expected) in zip(out, rows):
        assert supervised_runs(tokenizer, sample) == expected
        assert sample["length"] == len(sample["input_ids"]) == len(sample["loss_mask"])
        rendered = tokenizer.apply_chat_template(chat.normalize_row(row), tokenize=False,
                                                 enable_thinking=True)
        assert tokenizer.decode(sample["input_ids"]) == rendered
    assert stats["supervised_tokens"] == sum(sum(s["loss_mask"]) for s in out)
    assert stats["tokens"] == sum(out["length"])
    assert (tmp_path / "out" / "length_hist.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_rows_are_counted_by_reason_with_file_and_line(target, tmp_path):
    good = {"messages": [user("Hi there"), assistant("Hello world!")]}
    lines = [
        good,                                                                   # 1
        '{"messages": [',                                                      # 2 malformed_json
        b'{"messages": [{"role": "user", "content": "caf\xe9"}]}',             # 3 encoding
        {"messages": [{"role": "robot", "content": "x"}, assistant("y")]},     # 4 unknown_role
        {"conversations": [{"from": "human", "value": "  "},
                           {"from": "gpt", "value": "y"}]},                    # 5 empty_content
        {"messages": [user("q"), assistant(None)]},                            # 6 non_string_content
        {"messages": [user([{"type": "image_url", "image_url": "x"}]),
                      assistant("y")]},                                        # 7 non_string_content
        {"messages": [{"role": "system", "content": "s"}, user("q")]},        # 8 no_assistant_turn
        [1, 2],                                                                 # 9 not_a_conversation
        {"text": "just text"},                                                  # 10 not_a_conversation
        "",                                                                     # 11 blank: skipped
        {"messages": [user("q"), assistant("<think>\nonly thinking\n</think>\n\n")]},  # 12 empty_content
        {"data": ["q", 7]},                                                     # 13 non_string_content
        good,                                                                   # 14
    ]
    path = write_jsonl(tmp_path / "bad.jsonl", lines)

    out, stats = run(target, tmp_path, [path])

    assert stats["kept"] == len(out) == 2
    assert stats["dropped"] == {"malformed_json": 1, "encoding": 1, "unknown_role": 1,
                                "empty_content": 2, "non_string_content": 3,
                                "no_assistant_turn": 1, "not_a_conversation": 2}
    assert stats["examples"]["encoding"] == [f"{path}:3"]
    assert stats["examples"]["non_string_content"] == [f"{path}:6", f"{path}:7", f"{path}:13"]
    assert stats["examples"]["not_a_conversation"] == [f"{path}:9", f"{path}:10"]
    assert stats["rows"] == len(lines) - 1  # the blank line is not a row


def test_too_long_dropped_or_truncated_and_short_supervision_dropped(target, tmp_path):
    long_answer = "The quick brown fox jumps over the lazy dog. " * 6
    path = write_jsonl(tmp_path / "long.jsonl", [
        {"messages": [user("Tell me about the fox"), assistant(long_answer)]},
        {"messages": [user("Hi"), assistant("Hello world!")]},
    ])
    full, _ = run(target, tmp_path, [path], "full", "--max-length", "4096")
    long_length = full[0]["length"]
    first_supervised = full[0]["loss_mask"].index(1)
    limit = (first_supervised + long_length) // 2
    assert full[1]["length"] < limit < long_length

    dropped, stats = run(target, tmp_path, [path], "dropped", "--max-length", str(limit))
    assert stats["kept"] == 1 and stats["dropped"] == {"too_long": 1}
    assert dropped[0]["input_ids"] == full[1]["input_ids"]

    truncated, stats = run(target, tmp_path, [path], "truncated", "--max-length", str(limit),
                           "--truncate")
    assert stats["kept"] == 2 and truncated[0]["length"] == limit
    assert truncated[0]["input_ids"] == full[0]["input_ids"][:limit]
    assert truncated[0]["loss_mask"] == full[0]["loss_mask"][:limit]

    # cut right after the first answer token: a single supervised token is too little
    _, stats = run(target, tmp_path, [path], "short", "--max-length", str(first_supervised + 1),
                   "--truncate")
    assert stats["dropped"] == {"too_little_supervision": 1}


def test_last_turn_only_and_system_prompt(target, tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "multi.jsonl", [
        {"messages": [user("Hi"), assistant("Hello world!"),
                      user("And?"), assistant("The answer is 4.")]},
        {"messages": [{"role": "system", "content": "Own system."}, user("Hi"), assistant("Hello!")]},
    ])
    out, stats = run(target, tmp_path, [path], "out", "--last-turn-only", "--system-prompt", "Be brief.")
    assert supervised_runs(tokenizer, out[0]) == ["The answer is 4." + END]
    assert tokenizer.decode(out[0]["input_ids"]).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert tokenizer.decode(out[1]["input_ids"]).startswith("<|im_start|>system\nOwn system.<|im_end|>")
    assert stats["settings"]["system_prompt"] == "Be brief." and stats["settings"]["last_turn_only"]


def test_rerun_is_deterministic_and_reuses_the_cache(target, tmp_path, monkeypatch):
    rows = [{"messages": [user(f"Question {i}?"), assistant(f"Answer {i} is here.")]} for i in range(6)]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    first, _ = run(target, tmp_path, [path], "first")

    calls = {"read": 0, "tokenize": 0}
    read, tokenize = prepared.conversation_rows, prepared.tokenize_row

    def counted_read(**kwargs):
        calls["read"] += 1
        yield from read(**kwargs)

    def counted_tokenize(*args, **kwargs):
        calls["tokenize"] += 1
        return tokenize(*args, **kwargs)

    monkeypatch.setattr(prepared, "conversation_rows", counted_read)
    monkeypatch.setattr(prepared, "tokenize_row", counted_tokenize)
    second, _ = run(target, tmp_path, [path], "second")
    assert calls == {"read": 0, "tokenize": 0}
    assert second.to_dict() == first.to_dict()

    # a changed setting re-tokenises the cached rows; a changed input file is read again
    run(target, tmp_path, [path], "third", "--system-prompt", "Be brief.")
    assert calls == {"read": 0, "tokenize": len(rows)}
    write_jsonl(path, rows[:5])
    fourth, _ = run(target, tmp_path, [path], "fourth")
    assert calls == {"read": 1, "tokenize": 2 * len(rows) - 1}
    assert fourth.to_dict() == first.select(range(5)).to_dict()


def test_two_workers_give_the_same_output(target, tmp_path):
    rows = [{"messages": [user(f"Question {i}?"), assistant(f"Answer {i}.")]} for i in range(8)]
    rows[3] = {"messages": [user("only a question")]}
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    one, stats_one = run(target, tmp_path, [path], "one")
    prepare.main(["--input", path, "--target", target, "--out", str(tmp_path / "two"),
                  "--cache-dir", str(tmp_path / "cache2"), "--num-proc", "2"])
    two = datasets.load_from_disk(str(tmp_path / "two"))
    assert two.to_dict() == one.to_dict()
    assert json.loads((tmp_path / "two" / "stats.json").read_text())["examples"] == stats_one["examples"]


def test_hub_dataset_name_goes_through_load_dataset(target, tmp_path, monkeypatch):
    rows = [{"messages": [user("Hi"), assistant("Hello world!")]}, {"messages": [user("q")]}]
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    out, stats = run(target, tmp_path, ["someone/chat-data:sft"])
    assert calls == [("someone/chat-data", "sft")]
    assert stats["kept"] == 1 and stats["examples"] == {"no_assistant_turn": ["someone/chat-data:sft:2"]}


def test_missing_or_unreadable_files_are_named(target, tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        run(target, tmp_path, [str(tmp_path / "missing.jsonl")])
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="broken.parquet"):
        list(chat_files.read_rows([str(broken)]))
    damaged = tmp_path / "damaged.parquet"  # its footer is fine, a data page is not
    rows = [[user(f"Question {i}?"), assistant(f"Answer {i}. " * 20)] for i in range(400)]
    pq.write_table(pa.table({"messages": rows}), damaged, row_group_size=100, compression="none")
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2:len(data) // 2 + 2000] = b"A" * 2000
    damaged.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="damaged.parquet: damaged parquet data"):
        run(target, tmp_path, [str(damaged)])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit, match="no rows to prepare in .*empty.jsonl"):
        run(target, tmp_path, [str(empty)])


def test_longest_supervised_run():
    masks = ([], [0, 0], [1], [1, 0, 1, 1, 0, 1], [0, 1, 1, 1])
    assert [chat_template.longest_supervised_run(mask) for mask in masks] == [0, 0, 1, 2, 3]


@pytest.mark.parametrize("answer", ["    return x + 1\n", "\n    return x + 1\n"])
def test_span_keeps_the_answer_indentation_and_not_the_header_newlines(tokenizer, answer):
    messages = [user("def f(x):"), assistant(answer)]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    (span,) = chat_template.assistant_spans(text, messages, chat_template.turn_end_regex(tokenizer))
    assert text[span[0]:span[1]] == "    return x + 1\n" + END


def test_answer_not_in_rendered_text_is_span_not_found():
    messages = [user("Hi"), assistant("Hello")]
    with pytest.raises(chat.BadRow) as error:
        chat_template.assistant_spans("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHey<|im_end|>",
                             messages, re.compile(r"\s*<\|im_end\|>"))
    assert error.value.reason == "span_not_found"


def test_loss_mask_marks_tokens_by_first_character():
    offsets = [(0, 3), (3, 5), (5, 9), (9, 9), (9, 12)]
    assert chat_template.tokens_in_spans(offsets, [(3, 9)]) == [0, 1, 1, 0, 0]
    # a token straddling a span's start or end belongs to the span its first character is in
    assert chat_template.tokens_in_spans(offsets, [(0, 4), (9, 12)]) == [1, 1, 0, 0, 1]
    assert chat_template.tokens_in_spans(offsets, [(4, 7)]) == [0, 0, 1, 0, 0]


# --- real corpora: odd rows repaired or counted, never the end of a run ---------------------------

def test_repairable_and_unreadable_rows_never_end_the_run(target, tokenizer, tmp_path):
    good = {"messages": [user("Hi there"), assistant("Hello world!")]}
    lines = [
        b"\xef\xbb\xbf" + json.dumps(good).encode(),                            # 1 BOM: kept
        '{"messages": [{"role": "user", "content": "Hi \\ud83d there"}, '
        '{"role": "assistant", "content": "Hello \\ud83d world!"}]}',           # 2 repaired
        '{"note": "\\udc00", "messages": [{"role": "user", "content": "Hi"}, '
        '{"role": "assistant", "content": "A smile \\ud83d\\ude00 here"}]}',    # 3 lone one in a side field
        "[" * 100_000 + "]" * 100_000,                                          # 4 nesting_too_deep
        "[1, 2]",                                                               # 5 not_a_conversation
        "7",                                                                    # 6 not_a_conversation
        good,                                                                   # 7
    ]
    path = write_jsonl(tmp_path / "odd.jsonl", lines)
    json_list = tmp_path / "odd.json"  # a JSON list with a BOM and a lone surrogate
    json_list.write_bytes(b"\xef\xbb\xbf" + json.dumps(
        [{"messages": [user("Bye \udfff now"), assistant("Bye bye!")]}]).encode())

    out, stats = run(target, tmp_path, [path, str(json_list)])

    assert stats["dropped"] == {"nesting_too_deep": 1, "not_a_conversation": 2}
    assert stats["examples"]["nesting_too_deep"] == [f"{path}:4"]
    assert stats["kept"] == len(out) == 5
    assert stats["flags"]["lone_surrogate"] == {
        "rows": 3, "examples": [f"{path}:2", f"{path}:3", f"{json_list}:1"]}
    texts = [tokenizer.decode(sample["input_ids"]) for sample in out]
    assert "Hi \ufffd there" in texts[1] and supervised_runs(tokenizer, out[1]) == ["Hello \ufffd world!" + END]
    assert "A smile \U0001F600 here" in texts[2]  # a surrogate pair is one character, not a repair
    assert "Bye \ufffd now" in texts[4]
    assert out[0]["input_ids"] == out[3]["input_ids"]  # the BOM line reads like any other


def test_deep_rows_joined_files_and_odd_file_names_never_end_the_run(target, tmp_path):
    good = {"messages": [user("Hi there"), assistant("Hello world!")]}

    def deep_line(levels):  # parses, but no conversation nests so deep; repairing it recursed that deep
        nested = "[" * levels + '"\\ud83d"' + "]" * levels
        return '{"messages": ' + json.dumps(good["messages"]) + ', "x": ' + nested + "}"

    data = tmp_path / "data"
    data.mkdir()
    path = write_jsonl(data / "joined.jsonl", [good, deep_line(150), b"\xef\xbb\xbf" + json.dumps(good).encode()])
    json_list = data / "list.json"
    json_list.write_text("[" + json.dumps(good) + ", " + deep_line(600) + "]")  # crashed prepare
    odd_name = os.fsencode(data) + b"/caf\xe9.jsonl"  # a file name that is not UTF-8 (an old archive's)
    with open(odd_name, "wb") as f:
        f.write(json.dumps(good).encode() + b"\n")

    out, stats = run(target, tmp_path, [str(data)])

    label = str(data / "caf\ufffd.jsonl")
    assert stats["dropped"] == {"nesting_too_deep": 2}
    assert stats["examples"]["nesting_too_deep"] == [f"{path}:2", f"{json_list}:2"]
    assert stats["kept"] == len(out) == 4  # the BOM inside the joined file is skipped like the first
    assert out["group"][0] == f"{label}#1"


def test_parquet_rows_with_bytes_that_are_not_utf8_or_json_are_counted(target, tmp_path):
    messages = pa.array([[user("Hi"), assistant("Hello world!")]] * 3)
    note = pa.array([b"fine", b"caf\xe9", b"fine"], type=pa.binary()).view(pa.string())  # written by another tool
    strings = tmp_path / "strings.parquet"
    pq.write_table(pa.table({"note": note, "messages": messages}), strings)
    call = {"type": "function", "function": {"name": "f", "arguments": {"when": datetime.datetime(2024, 1, 1)}}}
    dated = tmp_path / "dated.parquet"
    turns = [user("When?"), {"role": "assistant", "content": "x", "tool_calls": [call]}]
    pq.write_table(pa.table({"messages": [turns]}), dated)

    out, stats = run(target, tmp_path, [str(strings), str(dated)])

    assert stats["dropped"] == {"encoding": 1, "bad_tool_call": 1}
    assert stats["examples"] == {"encoding": [f"{strings}:2"], "bad_tool_call": [f"{dated}:1"]}
    assert stats["kept"] == len(out) == 2


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32"])
def test_a_utf16_file_stops_naming_it(target, tmp_path, encoding):
    text = json.dumps({"messages": [user("Hi"), assistant("Hello world!")]}) + "\n"
    for name in ("windows.jsonl", "windows.json"):
        (tmp_path / name).write_bytes(text.encode(encoding))  # with its byte-order mark, as Windows writes it
        with pytest.raises(SystemExit, match=f"{name}: UTF-16 or UTF-32 text .* convert it to UTF-8"):
            run(target, tmp_path, [str(tmp_path / name)])
    assert not (tmp_path / "out").exists()


def test_a_json_list_cut_short_stops_before_anything_is_written(target, tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [{"messages": [user("Hi"), assistant("Hello world!")]}])
    earlier, _ = run(target, tmp_path, [good], "out")
    cut = tmp_path / "download.json"
    cut.write_text(json.dumps([{"messages": [user("Hi"), assistant(f"Answer {i}.")]} for i in range(20)],
                              indent=1)[:700])
    with pytest.raises(SystemExit, match=r"download\.json: not a complete JSON list .*cut short"):
        run(target, tmp_path, [good, str(cut)], "out")
    assert datasets.load_from_disk(str(tmp_path / "out")).to_dict() == earlier.to_dict()  # untouched
    with pytest.raises(SystemExit, match="download.json"):
        run(target, tmp_path, [str(cut)], "new")
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "download.json", "good.jsonl", "out"]


def test_a_directory_input_reads_only_data_files(target, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "chat.jsonl", [{"messages": [user("Hi"), assistant("Hello world!")]}])
    write_jsonl(data / "regen.jsonl", [{"id": "x", "source": "s", "truncated": False,
                                        "messages": [user("Bye"), assistant("Bye bye!")]}])
    # data/regenerate.py's side files, a hidden folder and an earlier prepare output
    write_jsonl(data / "regen.errors.jsonl", [{"id": "y", "source": "s", "reason": "http_500", "detail": ""}])
    (data / "regen.summary.json").write_text(json.dumps({"total": 2, "ok": 1}))
    (data / "regen.settings.json").write_text(json.dumps({"backend": "server"}))
    (data / ".cache").mkdir()
    write_jsonl(data / ".cache" / "junk.jsonl", ["not json"])
    (data / "README.md").write_text("# chat data")  # not data: reported, not read
    (data / "more.jsonl.gz").write_bytes(b"\x1f\x8b")
    prepare.main(["--input", str(data / "chat.jsonl"), "--target", target, "--out", str(data / "prepared"),
                  "--cache-dir", str(tmp_path / "cache"), "--num-proc", "1"])

    out, stats = run(target, tmp_path, [str(data)])

    assert stats["settings"]["files"] == [str(data / "chat.jsonl"), str(data / "regen.jsonl")]
    assert stats["rows"] == stats["kept"] == len(out) == 2 and stats["dropped"] == {}
    unread = [str(data / "README.md"), str(data / "more.jsonl.gz")]
    assert stats["unread_files"] == {"files": 2, "examples": unread}


def test_out_that_prepare_did_not_write_is_refused_and_left_alone(target, tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"messages": [user("Hi"), assistant("Hello world!")]}])
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    (tmp_path / "out.tmp").mkdir()  # the old code's scratch name, here a user's folder
    (tmp_path / "out.tmp" / "notes.txt").write_text("keep me too")
    with pytest.raises(SystemExit, match="mine exists and is not an output of data/prepare.py"):
        run(target, tmp_path, [path], "mine")
    with pytest.raises(SystemExit, match="not an output of data/prepare.py"):
        run(target, tmp_path, [path], "rows.jsonl")
    assert (mine / "notes.txt").read_text() == "keep me"

    first, _ = run(target, tmp_path, [path], "out")
    second, stats = run(target, tmp_path, [path], "out", "--system-prompt", "Be brief.")  # replaced
    assert second[0]["input_ids"] != first[0]["input_ids"] and stats["written_by"] == "data/prepare.py"
    assert (tmp_path / "out.tmp" / "notes.txt").read_text() == "keep me too"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "mine", "out", "out.tmp", "rows.jsonl"]


def test_an_output_marked_by_the_tool_before_its_folder_was_renamed_is_replaced(target, tmp_path):
    """An earlier dataset's stats.json names the script at its old path; it is still this tool's output."""
    path = write_jsonl(tmp_path / "rows.jsonl", [{"messages": [user("Hi"), assistant("Hello world!")]}])
    first, stats = run(target, tmp_path, [path], "out")
    (tmp_path / "out" / "stats.json").write_text(json.dumps({**stats, "written_by": "data_tools/prepare.py"}))
    second, _ = run(target, tmp_path, [path], "out", "--system-prompt", "Be brief.")
    assert second[0]["input_ids"] != first[0]["input_ids"]
    (tmp_path / "out" / "stats.json").write_text(json.dumps({**stats, "written_by": "someone/else.py"}))
    with pytest.raises(SystemExit, match="not an output of data/prepare.py"):
        run(target, tmp_path, [path], "out")


def test_a_failure_while_writing_leaves_the_earlier_output_whole(target, tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"messages": [user("Hi"), assistant("Hello world!")]}])
    first, _ = run(target, tmp_path, [path], "out")

    def disk_full(*args):
        raise OSError("No space left on device")

    monkeypatch.setattr(prepared, "plot_lengths", disk_full)  # fails after the new rows are saved
    with pytest.raises(OSError, match="No space left"):
        run(target, tmp_path, [path], "out", "--system-prompt", "Be brief.")
    assert datasets.load_from_disk(str(tmp_path / "out")).to_dict() == first.to_dict()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "out", "rows.jsonl"]  # no temporary left


SLOW_SAVE = """
import runpy, sys, time
import datasets
save = datasets.Dataset.save_to_disk
def save_then_wait(self, path, **kwargs):  # the rows are written; the signal comes before the swap
    save(self, path, **kwargs)
    print("SAVED", flush=True)
    time.sleep(60)
datasets.Dataset.save_to_disk = save_then_wait
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_sigterm_while_writing_leaves_the_earlier_output_and_no_temporary(target, tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"messages": [user("Hi"), assistant("Hello world!")]}])
    first, _ = run(target, tmp_path, [path], "out")
    wrapper = tmp_path / "slow_save.py"
    wrapper.write_text(SLOW_SAVE)
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, str(wrapper), str(repo / "data" / "prepare.py"), "--input", path, "--target", target,
         "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"), "--num-proc", "1",
         "--system-prompt", "Be brief."],
        env={**os.environ, "PYTHONPATH": str(repo)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert any("SAVED" in line for line in proc.stdout)
        proc.send_signal(signal.SIGTERM)  # as a scheduler's time limit does
        returncode = proc.wait(timeout=30)
    finally:
        proc.kill()
    assert datasets.load_from_disk(str(tmp_path / "out")).to_dict() == first.to_dict()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "out", "rows.jsonl", "slow_save.py"]
    assert returncode == 128 + signal.SIGTERM


TOOL_TEMPLATE = (  # renders tool calls and tool turns (the toy template does neither)
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + message['content'] -}}"
    "{%- for call in message.get('tool_calls', []) -%}"
    "{{- '<call>' + call['function']['name'] + ' ' + call['function']['arguments'] + '</call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def test_tool_calls_are_supervised_when_the_template_renders_them(target, tmp_path):
    tool_target = tmp_path / "tool_target"
    tool_tokenizer = AutoTokenizer.from_pretrained(target)
    tool_tokenizer.chat_template = TOOL_TEMPLATE
    tool_tokenizer.save_pretrained(tool_target)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    rows = [
        {"messages": [user("Weather in Paris?"), {"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
                      assistant("It is sunny.")]},
        {"messages": [user("Hi"), {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
                      {"role": "tool", "content": ""}, assistant("Done.")]},
        {"messages": [user("Hi"), {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
        {"messages": [user("Hi"), {"role": "assistant", "tool_calls": "get_weather()"}]},
        # the closer's text in the arguments would end the turn inside the call
        {"messages": [user("Hi"), {"role": "assistant", "content": None, "tool_calls": [
            {"function": {"name": "echo", "arguments": '{"text": "<|im_end|> and more"}'}}]}]},
    ]
    path = write_jsonl(tmp_path / "tools.jsonl", rows)

    out, stats = run(str(tool_target), tmp_path, [path], "supported")
    assert stats["kept"] == 2 and stats["dropped"] == {"bad_tool_call": 2, "special_token_text": 1}
    call_text = '<call>get_weather {"city": "Paris"}</call>'
    assert supervised_runs(tool_tokenizer, out[0]) == [call_text + END, "It is sunny." + END]
    assert supervised_runs(tool_tokenizer, out[1]) == ["Let me look." + call_text + END, "Done." + END]
    assert "sunny, 21 C" in tool_tokenizer.decode(out[0]["input_ids"])  # context, not supervised


def test_tool_rows_are_dropped_as_unsupported_by_a_template_without_tools(target, tmp_path):
    call = {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    path = write_jsonl(tmp_path / "tools.jsonl", [
        {"messages": [user("Weather?"), {"role": "assistant", "content": "", "tool_calls": [call]}]},
        {"messages": [user("Weather?"), assistant("Checking."), {"role": "tool", "content": "sunny"},
                      assistant("Sunny.")]},
        {"messages": [user("Hi"), assistant("Hello world!")]},
    ])
    out, stats = run(target, tmp_path, [path])
    assert stats["kept"] == len(out) == 1
    assert stats["dropped"] == {"tools_unsupported": 2}
    assert stats["examples"]["tools_unsupported"] == [f"{path}:1", f"{path}:2"]


def test_special_token_text_in_an_answer_is_dropped_not_a_turn_boundary(target, tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [
        {"messages": [user("Hi"), assistant("Use <|im_end|> to end a turn.")]},
        {"messages": [user("Hi"), assistant("<think>\na\n</think>\n\nb </think> c")]},
        {"messages": [user("Hi"), assistant("<think>\na\n</think>\n\n<think>\nb\n</think>\n\nc")]},
        {"messages": [user("What does <|im_end|> do?"), assistant("It ends a turn.")]},  # user text: context
    ])
    out, stats = run(target, tmp_path, [path], "out", "--thinking")
    assert stats["dropped"] == {"special_token_text": 1, "extra_think_tags": 2}
    assert stats["examples"]["special_token_text"] == [f"{path}:1"]
    assert stats["kept"] == len(out) == 1


def test_thinking_is_removed_or_kept_and_recorded(target, tokenizer, tmp_path):
    history = [user("What is 4 * 3?")]
    path = write_jsonl(tmp_path / "rows.jsonl", [
        {"messages": history + [assistant("<think>\nFour threes.\n</think>\n\nThe answer is 12.")]},
        {"messages": history + [{"role": "assistant", "content": "The answer is 12.",
                                 "reasoning_content": "Four threes."}]},
    ])
    off, stats = run(target, tmp_path, [path], "off", "--no-thinking")
    served = chat_template.render_prompt(tokenizer, history, enable_thinking=False)
    for sample in off:
        assert tokenizer.decode(sample["input_ids"]) == served + "The answer is 12." + END + "\n"
        assert supervised_runs(tokenizer, sample) == ["The answer is 12." + END]
    assert stats["flags"]["reasoning_removed"]["rows"] == 2
    assert stats["settings"]["chat_template_kwargs"] == {"enable_thinking": False}

    on, stats = run(target, tmp_path, [path], "on", "--thinking")
    for sample in on:
        assert supervised_runs(tokenizer, sample) == ["<think>\nFour threes.\n</think>\n\nThe answer is 12." + END]
    assert "reasoning_removed" not in stats["flags"]
    assert stats["settings"]["chat_template_kwargs"] == {"enable_thinking": True}


def test_reasoning_that_never_closes_is_dropped_unless_cut_by_max_tokens(target, tokenizer, tmp_path):
    cut = [user("Weather?"), assistant("<think>\nLet me think about the weather in Paris and")]
    path = write_jsonl(tmp_path / "rows.jsonl", [
        {"messages": cut},                     # a corpus row whose reasoning was cut: its end of turn is false
        {"messages": cut, "truncated": True},  # regenerate's: the target's reasoning, cut by --max-tokens
        {"messages": [user("Hi"), assistant("Hello world!")]},
    ])
    off, stats = run(target, tmp_path, [path], "off", "--no-thinking")  # nothing could remove that reasoning
    assert stats["dropped"] == {"unclosed_think": 2}
    assert stats["examples"]["unclosed_think"] == [f"{path}:1", f"{path}:2"]
    assert len(off) == 1

    on, stats = run(target, tmp_path, [path], "on", "--thinking")
    assert stats["dropped"] == {"unclosed_think": 1} and stats["examples"]["unclosed_think"] == [f"{path}:1"]
    assert supervised_runs(tokenizer, on[0]) == [cut[1]["content"]]  # no closing token


def test_a_truncated_answer_keeps_its_text_but_not_its_closing_token(target, tokenizer, tmp_path):
    messages = [user("Count"), assistant("one two three four")]
    path = write_jsonl(tmp_path / "regen.jsonl", [
        {"id": "a", "source": "in:1", "messages": messages, "truncated": True},
        {"id": "b", "source": "in:2", "messages": messages, "truncated": False},
    ])
    out, stats = run(target, tmp_path, [path])
    assert supervised_runs(tokenizer, out[0]) == ["one two three four"]
    assert supervised_runs(tokenizer, out[1]) == ["one two three four" + END]
    assert out[0]["input_ids"] == out[1]["input_ids"]
    assert stats["flags"]["truncated"] == {"rows": 1, "examples": [f"{path}:1"]}


# --- groups (rows of one source document) and loops -----------------------------------------------

def test_rows_record_their_group(target, tmp_path):
    def row(**fields):
        return {"messages": [user("Hi"), assistant("Hello world!")], **fields}

    path = write_jsonl(tmp_path / "rows.jsonl", [
        row(group="stdlib/json/decoder.py", id="ignored"), row(id="conv-7"), row(conversation_id=12),
        row(uuid="u-1"), row(), row(group=""), row(id=True)])
    json_list = tmp_path / "rows.json"
    json_list.write_text(json.dumps([row(), row(group="g")]))
    out, stats = run(target, tmp_path, [path, str(json_list)])
    assert out["group"] == ["stdlib/json/decoder.py", f"{path}#conv-7", f"{path}#12", f"{path}#u-1",
                            f"{path}#5", f"{path}#6", f"{path}#7", f"{json_list}#1", "g"]
    assert stats["groups"] == 9


def test_answers_that_loop_are_counted_and_dropped_on_request(target, tokenizer, tmp_path):
    loop = "the value of " * 30
    ending = "and so it ends here, in a plain sentence that says what the value is and why it matters."
    path = write_jsonl(tmp_path / "rows.jsonl", [
        {"messages": [user("Explain"), assistant("It is " + loop)], "truncated": True},  # cut mid-loop
        {"messages": [user("Explain"), assistant("It is " + loop)]},          # loops up to its end of turn
        {"messages": [user("Explain"), assistant(loop + ending)]},                 # the loop ended
        {"messages": [user("Explain"), assistant("Hello world!")]},
    ])
    out, stats = run(target, tmp_path, [path])
    assert stats["flags"]["loop"] == {"rows": 2, "examples": [f"{path}:1", f"{path}:2"]} and stats["kept"] == 4
    assert stats["loop_rule"] == prepared.LOOP_RULE

    kept, stats = run(target, tmp_path, [path], "dropped", "--drop-loops")
    assert stats["dropped"] == {"loop": 2} and "loop" not in stats["flags"]
    assert kept.to_dict() == out.select([2, 3]).to_dict()


@pytest.mark.parametrize("period", [1, 3, 10, 16])
def test_repeating_tail_rule(period):
    window = prepared.LOOP_WINDOW
    loop = (list(range(100, 100 + period)) * window)[:window]
    head = list(range(50))
    assert prepared.repeating_tail(head + loop)
    assert not prepared.repeating_tail(loop[1:])                             # one token short of the window
    assert not prepared.repeating_tail(head + loop + list(range(200, 230)))  # the loop ended
    assert not prepared.repeating_tail(list(range(200)))


def test_repeating_tail_bounds_and_line_wraps():  # the rule as documented: 16 distinct 4-grams in 48 tokens
    assert prepared.repeating_tail(list(range(16)) * 3)
    assert not prepared.repeating_tail((list(range(17)) * 3)[:48])
    assert not prepared.repeating_tail((list(range(16)) * 3)[:47])
    # "self.name, self.name, self.name,\n    self.name, ...": 4 tokens, a line break every 3 times
    wrapped = ([1, 2, 3, 4] * 3 + [9, 10]) * 5
    assert prepared.repeating_tail(wrapped)
