"""data/regenerate.py against a flaky local OpenAI-compatible stub server, and the local backend."""
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from transformers import AutoTokenizer

from data import regenerate
from drafter.pipeline import chat, chat_template
from drafter.synthesis import answer_server, regeneration
from drafter.synthesis.answers import LocalBackend
from drafter.target_model.model import random_qwen3
from tests.tiny_tokenizer import save_tiny_tokenizer


def canned_answer(messages: list[dict]) -> str:
    """The stub's answer depends on the whole history, so a test can tell which history was sent."""
    digest = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:8]
    return f"[{digest}] re: {messages[-1]['content']}"


PACED_SECONDS = 0.5


class StubServer:
    """/v1/chat/completions on 127.0.0.1 with failures chosen by markers in the last user turn:
    FLAKY fails twice (500, then 429) and then answers; FAIL always answers 500; REJECT answers
    400; EMPTY answers with no text; LONG answers with finish_reason "length". Misbehaving replies,
    always: NULLMSG (`message: null`), PARTS (content as a list of parts), BADREASON (a number as
    reasoning_content), NOTJSON (an HTML body), HANG (no reply until released), CUT200 (a reply
    whose body stops short), STUCK500 (a 500 whose body stops until released), TRICKLE (a reply
    sent a byte at a time, slower in all than --timeout); NULLONCE sends `message: null` once, then
    answers; SURR answers with a lone surrogate; SLOW answers only once released; PACED answers
    429 with a Retry-After of PACED_SECONDS once, then answers. With
    enable_thinking it returns the reasoning separately, as vLLM's reasoning parser does."""

    def __init__(self, delay: float = 0.02):
        self.requests, self.arrivals, self.attempts = [], [], {}
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        self.released = threading.Event()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, reply = stub.respond(self.path, body)
                payload = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
                last = body["messages"][-1]["content"]
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    if status == 429 and "PACED" in last:
                        self.send_header("Retry-After", str(PACED_SECONDS))
                    missing = 1000 if "CUT" in last or "STUCK500" in last else 0  # bytes that never come
                    self.send_header("Content-Length", str(len(payload) + missing))
                    self.end_headers()
                    step = 1 if "TRICKLE" in last else max(1, len(payload))
                    for start in range(0, len(payload), step):
                        self.wfile.write(payload[start:start + step])
                        self.wfile.flush()
                        time.sleep(0.05 if step == 1 else 0)
                    if "STUCK500" in last:  # the rest of the error body never comes
                        stub.released.wait(30)
                except ConnectionError:  # the client gave up (HANG, TRICKLE): nothing to answer
                    pass

            def log_message(self, *args):
                pass

        self.delay = delay
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    def respond(self, path: str, body: dict) -> tuple[int, dict]:
        assert path == "/v1/chat/completions"
        last = body["messages"][-1]["content"]
        key = json.dumps(body["messages"])
        with self.lock:
            self.requests.append(body)
            self.arrivals.append(time.monotonic())
            attempt = self.attempts[key] = self.attempts.get(key, 0) + 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            time.sleep(self.delay)
            if "FAIL" in last or "STUCK500" in last or ("FLAKY" in last and attempt == 1):
                return 500, {"error": "internal"}
            if ("FLAKY" in last and attempt == 2) or ("PACED" in last and attempt == 1):
                return 429, {"error": "slow down"}
            if "REJECT" in last:
                return 400, {"error": "bad request"}
            if "HANG" in last or "SLOW" in last:
                self.released.wait(30)
            if "HANG" in last:
                return 200, {"error": "too late"}
            if "NOTJSON" in last:
                return 200, b"<html>502 Bad Gateway</html>"
            if "NULLMSG" in last or ("NULLONCE" in last and attempt == 1):
                return 200, {"choices": [{"index": 0, "message": None, "finish_reason": "stop"}]}
            content = "" if "EMPTY" in last else canned_answer(body["messages"])
            content = [{"type": "text", "text": content}] if "PARTS" in last else content
            content = "bad \ud83d end" if "SURR" in last else content
            message = {"role": "assistant", "content": content}
            if "BADREASON" in last:
                message["reasoning_content"] = 5
            if body["chat_template_kwargs"]["enable_thinking"]:
                message["reasoning_content"] = f"thinking about {last}"
            finish = "length" if "LONG" in last else "stop"
            return 200, {"choices": [{"index": 0, "message": message, "finish_reason": finish}]}
        finally:
            with self.lock:
                self.in_flight -= 1

    def attempts_for(self, marker: str) -> int:
        return sum(n for key, n in self.attempts.items() if marker in json.loads(key)[-1]["content"])

    def close(self):
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub():
    server = StubServer()
    yield server
    server.close()


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


GOOD_ROWS = [
    {"messages": [user(f"Question {i}?"), assistant(f"old answer {i}")]} for i in range(6)
] + [
    {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                       {"from": "gpt", "value": "old hello"}, {"from": "human", "value": "And?"},
                       {"from": "gpt", "value": "old and"}]},
    {"messages": [user("Prompt only, no answer yet")]},
    {"messages": [user("FLAKY question"), assistant("old")]},
    {"messages": [user("LONG question"), assistant("old")]},
]
FAILING_ROWS = [{"messages": [user("FAIL always")]}, {"messages": [user("REJECT me")]},
                {"messages": [user("EMPTY reply")]}]


def write_input(path, extra_lines=()) -> str:
    with open(path, "w") as f:
        for row in GOOD_ROWS + FAILING_ROWS:
            f.write(json.dumps(row) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return str(path)


def run(stub, input_path, out, *extra) -> dict:
    return regenerate.main(["--input", input_path, "--out", str(out), "--base-url", stub.url,
                            "--model", "stub-model", "--concurrency", "4", "--max-retries", "3",
                            "--backoff", "0.001", "--max-tokens", "64", *extra])


def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_rewritten(row: dict, original: dict):
    """User and system turns kept in order; every answer is the stub's answer to the
    regenerated history before it; a conversation ending with a user turn got an answer."""
    before = chat.normalize_row(original)
    after = row["messages"]
    kept = [m for m in after if m["role"] != "assistant"]
    assert kept == [m for m in before if m["role"] != "assistant"]
    ends_with_user = before[-1]["role"] != "assistant"
    expected_answers = sum(m["role"] == "assistant" for m in before) + ends_with_user
    answers = [i for i, m in enumerate(after) if m["role"] == "assistant"]
    assert len(answers) == expected_answers and after[-1]["role"] == "assistant"
    for i in answers:
        assert after[i]["content"] == canned_answer(after[:i])


def test_server_backend_rewrites_every_turn_with_retries_and_accounting(stub, tmp_path, capsys):
    duplicate = json.dumps(GOOD_ROWS[0])
    input_path = write_input(tmp_path / "in.jsonl", [duplicate, "{not json"])
    out = tmp_path / "regen.jsonl"

    summary = run(stub, input_path, out)

    rows = read_rows(out)
    assert summary["total"] == len(GOOD_ROWS) + len(FAILING_ROWS)
    assert summary["ok"] == len(rows) == len(GOOD_ROWS)
    assert summary["failures"] == {"http_500": 1, "http_400": 1, "empty_answer": 1}
    assert summary["failed"] == len(FAILING_ROWS)
    assert summary["ok"] + summary["failed"] + summary["skipped_existing"] + summary["remaining"] \
        == summary["total"]
    assert summary["skipped_existing"] == summary["remaining"] == 0
    assert summary["invalid"] == {"malformed_json": 1} and summary["duplicates"] == 1
    assert summary["rows_read"] == summary["total"] + 1 + 1
    assert summary["truncated"] == 1

    by_source = {row["source"]: row for row in rows}
    for line, original in enumerate(GOOD_ROWS, start=1):
        row = by_source[f"{input_path}:{line}"]
        check_rewritten(row, original)
        assert row["truncated"] == ("LONG" in json.dumps(original))
    assert len({row["id"] for row in rows}) == len(rows)

    errors = {e["source"]: e for e in read_rows(tmp_path / "regen.errors.jsonl")}
    first_failing = len(GOOD_ROWS) + 1
    assert errors[f"{input_path}:{first_failing}"]["reason"] == "http_500"
    assert errors[f"{input_path}:{first_failing + 1}"]["reason"] == "http_400"
    assert errors[f"{input_path}:{first_failing + 2}"]["reason"] == "empty_answer"
    assert stub.attempts_for("FAIL") == 1 + 3      # first try + --max-retries
    assert stub.attempts_for("REJECT") == 1        # a 400 is not retried
    assert stub.attempts_for("EMPTY") == 1
    assert stub.attempts_for("FLAKY") == 3         # 500, 429, then the answer
    assert all(r["model"] == "stub-model" and r["temperature"] == 0.0 and r["max_tokens"] == 64
               and r["chat_template_kwargs"] == {"enable_thinking": False} for r in stub.requests)
    assert stub.max_in_flight >= 2
    assert json.loads((tmp_path / "regen.summary.json").read_text()) == summary
    progress = capsys.readouterr().err.split("\r")[-1]  # the bar's last state, on stderr
    assert re.match(rf"conversations: 100%.* {summary['total']}/{summary['total']} \[.*conv/s, failed=3\]", progress)


def test_resume_after_interruption_loses_and_duplicates_nothing(stub, tmp_path):
    input_path = write_input(tmp_path / "in.jsonl")
    out = tmp_path / "regen.jsonl"
    total = len(GOOD_ROWS) + len(FAILING_ROWS)

    first = run(stub, input_path, out, "--max-rows", "4", "--concurrency", "1")
    assert first["ok"] == 4 and first["remaining"] == total - 4
    first_rows = read_rows(out)
    # a crash in the middle of writing a row leaves a partial last line
    with open(out, "a") as f:
        f.write(json.dumps({"id": "x", "source": "y", "messages": []})[:20])

    requests_before = len(stub.requests)
    second = run(stub, input_path, out)
    assert second["skipped_existing"] == 4
    assert second["ok"] + second["failed"] == total - 4 and second["failed"] == len(FAILING_ROWS)
    rows = read_rows(out)  # every line parses: the partial line is gone
    assert rows[:4] == first_rows
    assert len(rows) == len(GOOD_ROWS) == len({row["id"] for row in rows})
    done_prompts = {m["content"] for row in first_rows for m in row["messages"] if m["role"] == "user"}
    asked_again = {r["messages"][-1]["content"] for r in stub.requests[requests_before:]}
    assert not done_prompts & asked_again

    third = run(stub, input_path, out)  # only the failed rows are tried again
    assert third["skipped_existing"] == len(GOOD_ROWS) and third["ok"] == 0
    assert third["failed"] == len(FAILING_ROWS)
    assert read_rows(out) == rows

    with pytest.raises(SystemExit, match="other settings"):
        run(stub, input_path, out, "--temperature", "0.7")


@pytest.mark.parametrize("flag, value", [("--concurrency", "0"), ("--batch-size", "0"), ("--max-tokens", "0"),
                                         ("--timeout", "0"), ("--max-retries", "-1")])
def test_flags_that_cannot_work_are_refused(flag, value, capsys):
    with pytest.raises(SystemExit):  # --concurrency 0 started no worker and waited for ever
        regenerate.parse_args(["--input", "in.jsonl", "--out", "out.jsonl", "--model", "m", flag, value])
    assert flag in capsys.readouterr().err


def test_an_out_that_is_not_an_output_is_refused_before_anything_is_written(stub, tmp_path):
    input_path = write_input(tmp_path / "chat.jsonl")
    before = (tmp_path / "chat.jsonl").read_bytes()
    with pytest.raises(SystemExit, match="chat.jsonl:1: not an output row"):
        run(stub, input_path, tmp_path / "chat.jsonl")
    assert [p.name for p in tmp_path.iterdir()] == ["chat.jsonl"]
    assert (tmp_path / "chat.jsonl").read_bytes() == before


@pytest.mark.parametrize("header, seconds", [
    ("3", 3.0), ("1e9", answer_server.MAX_BACKOFF), ("inf", answer_server.MAX_BACKOFF), ("nan", 0.0), ("-5", 0.0),
    ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0), (None, 0.0)])
def test_retry_after_is_a_bounded_wait(header, seconds):  # 0: the exponential backoff alone decides
    assert answer_server.retry_after_seconds(header) == seconds


def test_a_retry_waits_as_long_as_the_servers_retry_after(stub, tmp_path):
    input_path = write_rows(tmp_path / "in.jsonl", [{"messages": [user("PACED question")]}])
    summary = run(stub, input_path, tmp_path / "regen.jsonl")  # --backoff 0.001: the header decides
    assert summary["ok"] == 1 and stub.attempts_for("PACED") == 2
    first, second = stub.arrivals
    assert second - first >= PACED_SECONDS


def server_backend(stub, stop=None, **settings) -> answer_server.ServerBackend:
    settings = regeneration.RegenerateSettings(input=[], out="", base_url=stub.url, model="m", **settings)
    return answer_server.ServerBackend(settings, stop or threading.Event())


@pytest.mark.parametrize("marker", ["HANG", "TRICKLE"])
def test_a_reply_slower_than_the_timeout_is_cut_off_in_time(stub, marker):
    backend = server_backend(stub, timeout=0.2, max_retries=1, backoff=0.001)
    release = threading.Timer(5, stub.released.set)  # with no timeout, the test fails here, not hangs
    release.start()
    started = time.monotonic()
    try:
        with pytest.raises(regeneration.RowFailed) as failure:
            backend.answer([user(f"{marker} question")])
    finally:
        release.cancel()
    assert failure.value.reason == "connection" and stub.attempts_for(marker) == 2
    assert time.monotonic() - started < 2  # two tries of 0.2 s


def test_a_stop_ends_the_wait_between_retries(stub):
    stop = threading.Event()
    backend = server_backend(stub, stop, max_retries=1, backoff=30.0)
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    with pytest.raises(regeneration.Stopped):
        backend.answer([user("FAIL always")])
    assert time.monotonic() - started < 2 and stub.attempts_for("FAIL") == 1


def test_thinking_answers_keep_the_reasoning_inline(stub, tmp_path):
    input_path = tmp_path / "in.jsonl"
    input_path.write_text(json.dumps({"messages": [user("Hi")]}) + "\n")
    out = tmp_path / "regen.jsonl"
    summary = run(stub, str(input_path), out, "--thinking", "--system-prompt", "Be kind.")
    assert summary["ok"] == 1
    (row,) = read_rows(out)
    sent = [{"role": "system", "content": "Be kind."}, user("Hi")]
    assert row["messages"][:2] == sent
    assert row["messages"][2]["content"] == chat.join_reasoning("thinking about Hi", canned_answer(sent))
    assert stub.requests[0]["chat_template_kwargs"] == {"enable_thinking": True}


def greedy_reference(model, tokenizer, prompt: str, max_new_tokens: int) -> tuple[str, bool]:
    """One prompt, no padding, an explicit argmax loop: what batched generate must reproduce."""
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    new = []
    for _ in range(max_new_tokens):
        with torch.no_grad():
            token = int(model(ids).logits[0, -1].argmax())
        if token == tokenizer.eos_token_id:
            return tokenizer.decode(new, skip_special_tokens=True), False
        new.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokenizer.decode(new, skip_special_tokens=True), True


def test_local_backend_matches_unbatched_greedy_decoding(tmp_path):
    target_dir = save_tiny_tokenizer(tmp_path / "target")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = random_qwen3(vocab_size=len(tokenizer), num_hidden_layers=2)
    # Tie the end-of-turn logit to another token's so that, with this seed, some answers stop,
    # some hit --max-tokens and some are empty (every outcome is checked below).
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] = 3.0 * model.lm_head.weight[183]
    model.save_pretrained(target_dir)
    rows = [
        {"messages": [user("Hi")]},
        {"messages": [user("Hello world"), assistant("old"), user("And of Germany?"), assistant("old")]},
        {"messages": [user("The quick brown fox jumps over the lazy dog.")]},
        {"messages": [user("What is the capital of France?")]},
    ]
    input_path = tmp_path / "in.jsonl"
    input_path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "regen.jsonl"

    summary = regenerate.main(["--input", str(input_path), "--out", str(out), "--backend", "local",
                               "--target", str(target_dir), "--batch-size", "3", "--max-tokens", "6"])

    finished = {row["source"]: row for row in read_rows(out)}
    failed = {e["source"]: e["reason"] for e in read_rows(tmp_path / "regen.errors.jsonl")}
    assert summary["ok"] + summary["failed"] == summary["total"] == len(rows)
    assert len(finished) == summary["ok"] and len(failed) == summary["failed"]
    outcomes = set()
    for line, original in enumerate(rows, start=1):
        source = f"{input_path}:{line}"
        if source in failed:  # its first answer was empty
            first_prompt = chat_template.render_prompt(tokenizer, original["messages"][:1], enable_thinking=False)
            assert greedy_reference(model, tokenizer, first_prompt, 6)[0] == ""
            assert failed[source] == "empty_answer"
            outcomes.add("empty")
            continue
        row = finished[source]
        assert [m for m in row["messages"] if m["role"] == "user"] == \
            [m for m in original["messages"] if m["role"] == "user"]
        truncated_any = False
        for i, message in enumerate(row["messages"]):
            if message["role"] == "assistant":
                prompt = chat_template.render_prompt(tokenizer, row["messages"][:i], enable_thinking=False)
                expected, truncated = greedy_reference(model, tokenizer, prompt, 6)
                assert message["content"] == expected
                truncated_any |= truncated
                outcomes.add("truncated" if truncated else "stopped")
        assert row["truncated"] == truncated_any
    assert outcomes == {"empty", "truncated", "stopped"}


def test_a_stop_ends_local_generation_at_the_next_token(tmp_path):
    target_dir = save_tiny_tokenizer(tmp_path / "target")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = random_qwen3(vocab_size=len(tokenizer), num_hidden_layers=1)
    model.generation_config.suppress_tokens = [tokenizer.eos_token_id]  # every answer runs to --max-tokens
    model.save_pretrained(target_dir)
    out = tmp_path / "regen.jsonl"
    args = regenerate.parse_args(["--input", "in.jsonl", "--out", str(out), "--backend", "local",
                                  "--target", str(target_dir), "--max-tokens", "20000"])
    stop = threading.Event()
    jobs = [regeneration.Job(str(i), f"in:{i}", "g", [user(f"Question {i}?")]) for i in range(4)]
    recorder = regeneration.Recorder(out, len(jobs))
    threading.Timer(0.5, stop.set).start()  # the signal, while the first batch generates
    started = time.monotonic()
    regeneration.run_local(LocalBackend(args, stop), jobs, recorder, batch_size=2, stop=stop)
    recorder.close()
    assert time.monotonic() - started < 5  # 20000 tokens take a minute
    assert out.read_text() == "" and recorder.counts == {}  # cut answers are not written


def test_local_batches_stay_full_whatever_the_number_of_turns(tmp_path):
    """A conversation that is done gives its place in the batch to the next one at once: one of
    three turns and four of one take 4 generate calls of 2, 2, 2, 1 (not 2, 1, 1, 2, 1)."""
    calls = []

    class Backend:
        def prompt(self, history):
            return json.dumps(history)

        def generate(self, prompts):
            calls.append(len(prompts))
            return [(f"re: {json.loads(p)[-1]['content']}", False) for p in prompts]

    long = regeneration.Job("long", "in:0", "g", [user("a"), assistant(""), user("b"), assistant(""), user("c")])
    jobs = [long] + [regeneration.Job(str(i), f"in:{i}", "g", [user(f"q{i}")]) for i in range(1, 5)]
    out = tmp_path / "regen.jsonl"
    recorder = regeneration.Recorder(out, len(jobs))
    regeneration.run_local(Backend(), jobs, recorder, batch_size=2, stop=threading.Event())
    recorder.close()
    assert calls == [2, 2, 2, 1]
    rows = {row["id"]: row["messages"] for row in read_rows(out)}
    assert [m["content"] for m in rows["long"]] == ["a", "re: a", "b", "re: b", "c", "re: c"]
    assert all(rows[str(i)] == [user(f"q{i}"), assistant(f"re: q{i}")] for i in range(1, 5))


# --- odd rows, a misbehaving server, signals ------------------------------------------------------

def write_rows(path, rows) -> str:
    """Rows are objects (dumped) or raw JSON lines."""
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


def test_misbehaving_replies_are_retried_then_failed_and_the_run_goes_on(stub, tmp_path):
    markers = ["NULLMSG", "PARTS", "BADREASON", "NOTJSON", "HANG", "CUT200", "STUCK500", "TRICKLE"]
    rows = [{"messages": [user(f"{marker} question")]} for marker in markers]
    rows += [{"messages": [user("NULLONCE question")]}, {"messages": [user("Plain question")]}]
    input_path = write_rows(tmp_path / "in.jsonl", rows)
    out = tmp_path / "regen.jsonl"

    summary = run(stub, input_path, out, "--timeout", "0.3", "--max-retries", "2")

    assert summary["ok"] == 2 and summary["failed"] == len(markers)
    assert summary["failures"] == {"bad_response": 4, "connection": 3, "http_500": 1}
    errors = {e["source"]: e["reason"] for e in read_rows(tmp_path / "regen.errors.jsonl")}
    reasons = {"HANG": "connection", "CUT200": "connection", "STUCK500": "http_500", "TRICKLE": "connection"}
    assert errors == {f"{input_path}:{i}": reasons.get(marker, "bad_response")
                      for i, marker in enumerate(markers, start=1)}
    for marker in markers:
        assert stub.attempts_for(marker) == 3  # first try + --max-retries
    assert stub.attempts_for("NULLONCE") == 2
    answered = {row["source"]: row for row in read_rows(out)}[f"{input_path}:{len(markers) + 1}"]
    assert answered["messages"][-1]["content"] == canned_answer([user("NULLONCE question")])


def test_odd_rows_reach_the_writer_repaired_and_no_prompt_is_empty(stub, tmp_path):
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    input_path = write_rows(tmp_path / "in.jsonl", [
        '{"messages": [{"role": "user", "content": "Hi \\ud83d there"}]}',
        {"messages": [assistant("Welcome! Ask me anything."), user("What is 2+2?"), assistant("old")]},
        {"messages": [user("Weather?"), {"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "content": "sunny"}, assistant("Sunny.")]},
        {"messages": [user("SURR please")]},
        {"messages": [assistant("Only me.")]},
    ])
    out = tmp_path / "regen.jsonl"

    summary = run(stub, input_path, out)

    assert summary["ok"] == 3 and summary["failed"] == 0
    assert summary["invalid"] == {"tool_turns": 1, "no_user_turn": 1}
    assert summary["leading_assistant_dropped"] == 1
    rows = {row["source"]: row for row in map(json.loads, out.read_bytes().decode("utf-8").splitlines())}
    assert rows[f"{input_path}:1"]["messages"][0]["content"] == "Hi \ufffd there"
    assert rows[f"{input_path}:2"]["messages"][0] == user("What is 2+2?")
    assert rows[f"{input_path}:4"]["messages"][-1]["content"] == "bad \ufffd end"
    assert all(r["messages"] and r["messages"][0]["role"] == "user" for r in stub.requests)


def test_a_file_name_that_is_not_utf8_reaches_both_writers(stub, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    with open(os.fsencode(data) + b"/caf\xe9.jsonl", "w") as f:  # an old archive's file name
        f.write(json.dumps({"messages": [user("Hi")]}) + "\n" + json.dumps({"messages": [user("FAIL me")]}) + "\n")
    out = tmp_path / "regen.jsonl"

    summary = run(stub, str(data), out)

    label = str(data / "caf\ufffd.jsonl")
    assert summary["ok"] == summary["failed"] == 1
    (row,) = read_rows(out)
    assert row["source"] == f"{label}:1" and row["group"] == f"{label}#1"
    assert [e["source"] for e in read_rows(tmp_path / "regen.errors.jsonl")] == [f"{label}:2"]


def test_rows_carry_their_group(stub, tmp_path):
    input_path = write_rows(tmp_path / "in.jsonl", [
        {"group": "lib/json/decoder.py", "messages": [user("Question 1?")]},
        {"id": "conv-9", "messages": [user("Question 2?")]},
        {"messages": [user("Question 3?")]},
    ])
    out = tmp_path / "regen.jsonl"
    run(stub, input_path, out)
    groups = {row["source"]: row["group"] for row in read_rows(out)}
    assert groups == {f"{input_path}:1": "lib/json/decoder.py", f"{input_path}:2": f"{input_path}#conv-9",
                      f"{input_path}:3": f"{input_path}#3"}


def test_a_directory_input_never_reads_the_output_or_its_side_files(stub, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_rows(data / "chat.jsonl", [{"messages": [user(f"Question {i}?")]} for i in range(3)])
    out = data / "regen.jsonl"
    first = run(stub, str(data), out)
    (data / "old.errors.jsonl").write_text(json.dumps({"id": "x", "reason": "http_500"}) + "\n")
    (data / "more.jsonl.gz").write_bytes(b"\x1f\x8b")  # not read, but said
    second = run(stub, str(data), out)
    assert first["rows_read"] == second["rows_read"] == 3 and first["ok"] == 3
    assert second["skipped_existing"] == 3 and second["invalid"] == {}
    assert first["unread_files"] == [] and second["unread_files"] == [str(data / "more.jsonl.gz")]
    assert len(read_rows(out)) == 3


def test_answers_that_arrive_while_stopping_are_written_and_the_queue_is_dropped(tmp_path):
    """In process, so that the moment of the signal is exact: the second answer arrives after the
    signal, while the first is being written; the third conversation was only queued."""
    stop, first_written, asked = threading.Event(), threading.Event(), []

    class Backend:
        def answer(self, history):
            question = history[-1]["content"]
            asked.append(question)
            if question == "second":
                first_written.wait(5)
                stop.set()  # the signal
            return f"re: {question}", False

    class SlowRecorder(regeneration.Recorder):
        def ok(self, job, rewrite):
            super().ok(job, rewrite)
            first_written.set()
            time.sleep(0.3)

    jobs = [regeneration.Job(q, f"in:{i}", "g", [user(q)]) for i, q in enumerate(["first", "second", "third"])]
    out = tmp_path / "regen.jsonl"
    recorder = SlowRecorder(out, len(jobs))
    answer_server.run_server(Backend(), jobs, recorder, concurrency=1, stop=stop)
    recorder.close()
    time.sleep(0.2)  # a worker that went on would ask the third question now
    assert [row["id"] for row in read_rows(out)] == ["first", "second"]
    assert asked == ["first", "second"]


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_writes_what_arrived_cancels_the_queue_and_exits_in_seconds(stub, tmp_path, signum):
    fast, slow = 4, 4
    input_path = write_rows(tmp_path / "in.jsonl", [{"messages": [user(f"Question {i}?")]} for i in range(fast)]
                            + [{"messages": [user(f"SLOW question {i}")]} for i in range(slow)])
    out = tmp_path / "regen.jsonl"
    command = [sys.executable, os.path.join(REPO, "data", "regenerate.py"), "--input", input_path,
               "--out", str(out), "--base-url", stub.url, "--model", "stub-model", "--concurrency", "2",
               "--max-tokens", "64"]
    proc = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (out.exists() and out.read_text().count("\n") == fast):
            time.sleep(0.05)
        while stub.attempts_for("SLOW") < 2:  # both workers wait on a slow answer
            time.sleep(0.05)
        proc.send_signal(signum)
        sent = time.monotonic()
        output, _ = proc.communicate(timeout=10)
        assert time.monotonic() - sent < 5, output
    finally:
        proc.kill()
        stub.released.set()
    assert proc.returncode == 130, output
    summary = json.loads((tmp_path / "regen.summary.json").read_text())
    assert summary["interrupted"] and summary["ok"] == fast and summary["remaining"] == slow
    assert len(read_rows(out)) == fast
    time.sleep(0.2)
    assert stub.attempts_for("SLOW") == 2  # the queued ones were never sent

    resumed = run(stub, input_path, out)
    assert resumed["skipped_existing"] == fast and resumed["ok"] == slow and not resumed["interrupted"]
    assert len({row["id"] for row in read_rows(out)}) == fast + slow
