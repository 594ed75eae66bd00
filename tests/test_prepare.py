"""data/prepare.py and the chat helpers it shares: shapes, bad rows, the loss mask, lengths, caching."""
import json
import re

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from data import prepare
from drafter import chat
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

    out, stats = run(target, tmp_path, [jsonl, str(json_file), str(parquet)])

    assert stats["kept"] == len(rows) and stats["dropped"] == {}
    assert out.column_names == ["input_ids", "loss_mask", "length"]
    for sample, (row, expected) in zip(out, rows):
        assert supervised_runs(tokenizer, sample) == expected
        assert sample["length"] == len(sample["input_ids"]) == len(sample["loss_mask"])
        rendered = tokenizer.apply_chat_template(chat.normalize_row(row), tokenize=False,
                                                 enable_thinking=False)
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
        {"messages": [{"role": "tool", "content": "x"}, assistant("y")]},      # 4 unknown_role
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
    read, tokenize = prepare.conversation_rows, prepare.tokenize_row

    def counted_read(**kwargs):
        calls["read"] += 1
        yield from read(**kwargs)

    def counted_tokenize(*args, **kwargs):
        calls["tokenize"] += 1
        return tokenize(*args, **kwargs)

    monkeypatch.setattr(prepare, "conversation_rows", counted_read)
    monkeypatch.setattr(prepare, "tokenize_row", counted_tokenize)
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
        list(chat.read_rows([str(broken)]))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit, match="no rows to prepare in .*empty.jsonl"):
        run(target, tmp_path, [str(empty)])


def test_longest_run():
    masks = ([], [0, 0], [1], [1, 0, 1, 1, 0, 1], [0, 1, 1, 1])
    assert [chat.longest_run(mask) for mask in masks] == [0, 0, 1, 2, 3]


@pytest.mark.parametrize("answer", ["    return x + 1\n", "\n    return x + 1\n"])
def test_span_keeps_the_answer_indentation_and_not_the_header_newlines(tokenizer, answer):
    messages = [user("def f(x):"), assistant(answer)]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    (span,) = chat.assistant_spans(text, messages, chat.turn_end_regex(tokenizer))
    assert text[span[0]:span[1]] == "    return x + 1\n" + END


def test_answer_not_in_rendered_text_is_span_not_found():
    messages = [user("Hi"), assistant("Hello")]
    with pytest.raises(chat.BadRow) as error:
        chat.assistant_spans("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHey<|im_end|>",
                             messages, re.compile(r"\s*<\|im_end\|>"))
    assert error.value.reason == "span_not_found"


def test_loss_mask_marks_tokens_by_first_character():
    offsets = [(0, 3), (3, 5), (5, 9), (9, 9), (9, 12)]
    assert chat.tokens_in_spans(offsets, [(3, 9)]) == [0, 1, 1, 0, 0]
    # a token straddling a span's start or end belongs to the span its first character is in
    assert chat.tokens_in_spans(offsets, [(0, 4), (9, 12)]) == [1, 1, 0, 0, 1]
    assert chat.tokens_in_spans(offsets, [(4, 7)]) == [0, 0, 1, 0, 0]
