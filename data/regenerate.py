"""Rewrite the assistant turns of chat data with the target itself (the DFlash data recipe).

    # any OpenAI-compatible server (vLLM, SGLang) serving the target
    python data/regenerate.py --input chat.jsonl --out regen/chat.jsonl \\
        --base-url http://127.0.0.1:8000/v1 --model Qwen/Qwen3-8B --concurrency 64 --no-thinking
    # small local targets (the toy world, the tests): transformers generate, batched
    python data/regenerate.py --input chat.jsonl --out regen/chat.jsonl --backend local --target PATH

Conversations are read with the same readers and shapes as `data/prepare.py` (see
`drafter/data/chat.py`). Turn by turn, every assistant turn is replaced by the target's answer to the
history so far (system and user turns kept, earlier answers already regenerated); a conversation
that ends with a user turn gets an answer appended. Reasoning returned separately by the server
(`reasoning_content`) is kept inline as a leading `<think>` block.

Output (`--out`, JSONL): one `{"id", "source", "group", "messages", "truncated"}` row per
conversation, in the OpenAI messages shape that prepare reads; `truncated` says an answer hit
--max-tokens; `group` is the input row's group (`chat_files.row_group`: its `group` field, else its file
and conversation id), which prepare keeps for the held-out split. `id` hashes the prompt side of the
conversation, so identical prompts are done once. Assistant turns before the first user turn answer
nothing and are left out (counted as `leading_assistant_dropped`); conversations with tool calls or
tool turns are not regenerated (invalid `tool_turns`: the tools cannot be run here). Rows are
appended and flushed one at a time; a restart skips the ids already written and drops a partial last
line left by a crash, so nothing is duplicated or lost. Side files next to it (never read as input):
  OUT.errors.jsonl    rows that failed after retries, this run: {"id", "source", "reason", "detail"}
  OUT.summary.json    accounting: ok + failed + skipped_existing + remaining == total
                      (total = distinct valid conversations; invalid rows counted by reason;
                      unread_files: files in input directories that are not data files)
  OUT.settings.json   generation settings; resuming with different ones is refused

Server requests are retried with exponential backoff and jitter on 429, 5xx (its body cut short or
not), connection errors, timeouts (--timeout bounds the whole reply, so a server that trickles bytes
times out too) and replies that are not a well-formed chat completion (a body that is not JSON or
cut short, `message: null`, content or reasoning that is not a string); other 4xx fail the row at
once. A failed row is written to OUT.errors.jsonl and tried again by the next run; an unexpected
error in one row fails that row only (`internal_error`). Ctrl-C or SIGTERM stops the run within
seconds: every answer already received is written, queued conversations are not started, requests
in flight are abandoned (the next run does them), the summary is written (`interrupted: true`) and
the exit status is 130. A second signal stops at once.
"""
import argparse
import hashlib
import http.client
import itertools
import json
import queue
import random
import signal
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from drafter.data import chat, chat_files, chat_template
from drafter.errors import model_path_problem
from drafter.infra.progress import progress_bar

EXAMPLES_PER_REASON = 5
MAX_BACKOFF = 60.0  # seconds, before jitter


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True,
                        help="JSONL/JSON/parquet files, directories of them, or hub dataset names")
    parser.add_argument("--out", required=True, help="output JSONL (appended to on resume)")
    parser.add_argument("--backend", choices=["server", "local"], default="server")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                        help="OpenAI-compatible API root (server backend)")
    parser.add_argument("--model", default=None, help="model name sent to the server")
    parser.add_argument("--target", default=None, help="model path (local backend)")
    parser.add_argument("--device", default="cpu", help="local backend device")
    parser.add_argument("--dtype", default="float32", help="local backend dtype")
    parser.add_argument("--batch-size", type=int, default=8, help="local backend prompts per generate")
    parser.add_argument("--concurrency", type=int, default=32, help="server requests in flight")
    parser.add_argument("--max-retries", type=int, default=5)
    parser.add_argument("--backoff", type=float, default=1.0, help="first retry delay, seconds")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds a request may take, the whole reply included")
    parser.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=False,
                        help="enable_thinking for the chat template (default: off)")
    parser.add_argument("--system-prompt", default=None,
                        help="system turn added to conversations that have none")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0, help="local backend sampling seed")
    parser.add_argument("--max-rows", type=int, default=None,
                        help="stop after this many new conversations (smoke runs)")
    args = parser.parse_args(argv)
    if args.backend == "server" and not args.model:
        parser.error("--model is required with --backend server")
    if args.backend == "local" and not args.target:
        parser.error("--target is required with --backend local")
    if args.backend == "local" and (problem := model_path_problem(args.target)):
        parser.error(f"--target {args.target}: {problem}")
    for flag in ("concurrency", "batch_size", "max_tokens"):  # 0 workers would wait for ever
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.timeout <= 0 or args.backoff < 0 or args.max_retries < 0:
        parser.error("--timeout must be positive, --backoff and --max-retries at least 0")
    return args


# ---------------------------------------------------------------------------------------------
# Conversations to rewrite
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Job:
    id: str
    source: str
    group: str
    prompt: list[dict]  # the conversation with assistant contents blanked: only their places matter


@dataclass
class Jobs:
    todo: list[Job]
    invalid: Counter
    examples: dict
    duplicates: int
    rows: int
    leading_assistant_dropped: int = 0


def load_jobs(inputs: list[str], system_prompt: str | None, exclude: tuple[str, ...] = ()) -> Jobs:
    """Distinct valid conversations of `inputs` (files in `exclude` left out), in order; invalid
    rows counted by reason."""
    jobs = Jobs([], Counter(), {}, 0, 0)
    seen = set()
    for raw in chat_files.read_rows(inputs, exclude):
        jobs.rows += 1
        try:
            if raw.reason:
                raise chat.BadRow(raw.reason)
            messages = chat.with_system_prompt(chat.normalize_row(raw.value), system_prompt)
            if chat.uses_tools(messages):
                raise chat.BadRow("tool_turns")
            first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
            if first_user is None:
                raise chat.BadRow("no_user_turn")
        except chat.BadRow as bad:
            jobs.invalid[bad.reason] += 1
            bucket = jobs.examples.setdefault(bad.reason, [])
            if len(bucket) < EXAMPLES_PER_REASON:
                bucket.append(raw.source)
            continue
        leading_answers = [i for i, m in enumerate(messages[:first_user]) if m["role"] == "assistant"]
        jobs.leading_assistant_dropped += bool(leading_answers)
        prompt = [m if m["role"] != "assistant" else {"role": "assistant", "content": ""}
                  for i, m in enumerate(messages) if i not in leading_answers]
        job_id = hashlib.sha256(json.dumps(prompt, sort_keys=True).encode()).hexdigest()[:24]
        if job_id in seen:
            jobs.duplicates += 1
            continue
        seen.add(job_id)
        jobs.todo.append(Job(job_id, raw.source, chat_files.row_group(raw), prompt))
    return jobs


class Rewrite:
    """A conversation being rewritten: `history` is what the target answers next."""

    def __init__(self, prompt: list[dict]):
        self.pending = list(prompt)
        self.history: list[dict] = []
        self.truncated = False
        self._copy_until_answer()

    def _copy_until_answer(self):
        while self.pending and self.pending[0]["role"] != "assistant":
            self.history.append(self.pending.pop(0))

    @property
    def done(self) -> bool:
        return not self.pending and self.history[-1]["role"] == "assistant"

    def accept(self, answer: str, truncated: bool) -> None:
        if self.pending:
            self.pending.pop(0)  # the original assistant turn this answer replaces
        self.history.append({"role": "assistant", "content": answer})
        self.truncated |= truncated
        self._copy_until_answer()


class RowFailed(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


class Stopped(Exception):
    """The run is stopping (a signal): the row is neither done nor failed."""


# ---------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------

class ServerBackend:
    """One chat completion at a time per call, over an OpenAI-compatible HTTP API (stdlib only)."""

    def __init__(self, args: argparse.Namespace, stop: threading.Event):
        self.url = args.base_url.rstrip("/") + "/chat/completions"
        self.body = {"model": args.model, "temperature": args.temperature,
                     "max_tokens": args.max_tokens,
                     "chat_template_kwargs": {"enable_thinking": args.thinking}}
        self.max_retries, self.backoff, self.timeout = args.max_retries, args.backoff, args.timeout
        self.stop = stop

    def answer(self, history: list[dict]) -> tuple[str, bool]:
        """(answer, truncated) for `history`; raises RowFailed once retries are exhausted, Stopped
        when the run stops."""
        request = json.dumps(self.body | {"messages": history}).encode()
        for attempt in itertools.count():
            if self.stop.is_set():
                raise Stopped
            try:
                return parse_completion(self._post(request))
            except RetryableError as error:
                if attempt >= self.max_retries:
                    raise RowFailed(error.reason, error.detail) from error
                delay = min(MAX_BACKOFF, self.backoff * 2 ** attempt) * random.uniform(0.5, 1.5)
                self.stop.wait(max(error.retry_after, delay))

    def _post(self, body: bytes):
        request = urllib.request.Request(self.url, data=body,
                                         headers={"Content-Type": "application/json"})
        deadline = time.monotonic() + self.timeout
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                payload = read_until(response, deadline)
        except urllib.error.HTTPError as error:
            detail = error_detail(error)
            if error.code == 429 or error.code >= 500:
                raise RetryableError(f"http_{error.code}", detail,
                                     retry_after_seconds(error.headers.get("Retry-After"))) from error
            raise RowFailed(f"http_{error.code}", detail) from error
        except (urllib.error.URLError, OSError, http.client.HTTPException) as error:  # refused, cut, timeout
            raise RetryableError("connection", str(error)) from error
        try:
            return chat_files.parse_json(payload.decode("utf-8"))[0]
        except (ValueError, RecursionError) as error:  # not UTF-8, not JSON
            raise RetryableError("bad_response", payload[:200].decode("utf-8", "replace")) from error


def read_until(response, deadline: float) -> bytes:
    """The whole body, or TimeoutError once `deadline` (time.monotonic) passes: the socket timeout
    bounds each wait, so a server that trickles bytes would otherwise hold a worker for ever."""
    chunks = []
    while chunk := response.read1(1 << 16):
        chunks.append(chunk)
        if time.monotonic() > deadline:
            raise TimeoutError(f"the reply took longer than --timeout ({sum(map(len, chunks))} bytes so far)")
    if response.length:  # the connection closed before Content-Length bytes came
        raise http.client.IncompleteRead(b"".join(chunks), response.length)
    return b"".join(chunks)


def error_detail(error: urllib.error.HTTPError) -> str:
    """The start of an error reply's body; a body cut short or never sent says so instead (it
    must not turn a retryable 500 into a failed row)."""
    try:
        return error.read(200).decode("utf-8", "replace")
    except (OSError, http.client.HTTPException) as unreadable:
        return f"(body unreadable: {unreadable!r})"


class RetryableError(Exception):
    def __init__(self, reason: str, detail: str, retry_after: float = 0.0):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail, self.retry_after = reason, detail, retry_after


def retry_after_seconds(header: str | None) -> float:
    """A server's Retry-After in seconds, capped at MAX_BACKOFF; 0 (our own backoff) for the date
    form and for values that are not a positive number ("nan" would have skipped the backoff)."""
    try:
        seconds = float(header) if header else 0.0
    except ValueError:
        return 0.0
    return min(seconds, MAX_BACKOFF) if seconds > 0 else 0.0


def parse_completion(response) -> tuple[str, bool]:
    """The answer text of a chat completion (reasoning inline) and whether it hit max_tokens.
    A reply that is not a well-formed completion raises RetryableError("bad_response")."""
    choices = response.get("choices") if isinstance(response, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        raise RetryableError("bad_response", f"no choices[0].message object: {json.dumps(response)[:200]}")
    content = message.get("content")
    reasoning = next((message[key] for key in ("reasoning_content", "reasoning")
                      if message.get(key) is not None), "")
    if not isinstance(content, (str, type(None))) or not isinstance(reasoning, str):
        raise RetryableError("bad_response", f"content or reasoning is not a string: {json.dumps(message)[:200]}")
    content = content or ""
    answer = chat.join_reasoning(reasoning, content) if reasoning.strip() else content
    if not answer.strip():
        raise RowFailed("empty_answer", json.dumps(response)[:200])
    return answer, choice.get("finish_reason") == "length"


class LocalBackend:
    """Batched `model.generate` on a local HF target (left padding); greedy at temperature 0. A
    generate call ends at the next token once `stop` is set."""

    def __init__(self, args: argparse.Namespace, stop: threading.Event):
        import torch
        from transformers import AutoTokenizer, StoppingCriteria, StoppingCriteriaList

        from drafter.target.model import load_target

        class UntilStopped(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.full((len(input_ids),), stop.is_set(), device=input_ids.device)

        self.tokenizer = AutoTokenizer.from_pretrained(args.target, padding_side="left")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = load_target(args.target, args.device, getattr(torch, args.dtype))
        self.enable_thinking, self.max_tokens = args.thinking, args.max_tokens
        self.sampling = {"do_sample": True, "temperature": args.temperature} \
            if args.temperature > 0 else {"do_sample": False}
        self.eos_ids = sorted({self.tokenizer.eos_token_id} | set(self._config_eos_ids()))
        self.until_stopped = StoppingCriteriaList([UntilStopped()])
        torch.manual_seed(args.seed)

    def _config_eos_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    def prompt(self, history: list[dict]) -> str:
        try:
            return chat_template.render(self.tokenizer, history, self.enable_thinking, add_generation_prompt=True)
        except chat.BadRow as bad:
            raise RowFailed(bad.reason, str(bad)) from bad

    def generate(self, prompts: list[str]) -> list[tuple[str, bool]]:
        """(answer, truncated) per prompt."""
        import torch

        batch = self.tokenizer(prompts, add_special_tokens=False, padding=True,
                               return_tensors="pt").to(self.model.device)
        with torch.no_grad():
            output = self.model.generate(**batch, max_new_tokens=self.max_tokens,
                                         eos_token_id=self.eos_ids,
                                         pad_token_id=self.tokenizer.pad_token_id,
                                         stopping_criteria=self.until_stopped, **self.sampling)
        new_tokens = output[:, batch["input_ids"].shape[1]:]
        stopped = torch.isin(new_tokens, torch.tensor(self.eos_ids, device=new_tokens.device)).any(1)
        texts = self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
        return [(text, not bool(ended)) for text, ended in zip(texts, stopped)]


def rewrite_with_server(backend: ServerBackend, job: Job) -> Rewrite:
    rewrite = Rewrite(job.prompt)
    while not rewrite.done:
        rewrite.accept(*backend.answer(rewrite.history))
    return rewrite


# ---------------------------------------------------------------------------------------------
# Resumable output
# ---------------------------------------------------------------------------------------------

def completed_ids(path: Path) -> set[str]:
    """Ids already in the output. A partial last line (a crash mid-write) is cut off the file."""
    ids, good_end = set(), 0
    if not path.exists():
        return ids
    with open(path, "rb") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):
                break
            try:
                ids.add(json.loads(line)["id"])
            except (ValueError, KeyError, TypeError) as error:
                raise SystemExit(f"{path}:{line_number}: not an output row ({error}); "
                                 "refusing to resume over it") from error
            good_end += len(line)
    if good_end != path.stat().st_size:
        print(f"{path}: dropping a partial last line ({path.stat().st_size - good_end} bytes)")
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return ids


class Recorder:
    """Appends finished rows (flushed each) and failures, keeps the accounting and shows the
    progress of this run's `todo` conversations (stderr)."""

    def __init__(self, out: Path, todo: int):
        self.rows = open(out, "a", encoding="utf-8")
        self.errors = open(side_file(out, "errors.jsonl"), "w", encoding="utf-8")
        self.counts = Counter()
        self.failures = Counter()
        self.progress = progress_bar(total=todo, desc="conversations", unit="conv")

    def ok(self, job: Job, rewrite: Rewrite) -> None:
        row = {"id": job.id, "source": job.source, "group": job.group, "messages": rewrite.history,
               "truncated": rewrite.truncated}
        self.rows.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.rows.flush()
        self.counts["ok"] += 1
        self.counts["truncated"] += rewrite.truncated
        self.progress.update()

    def record(self, job: Job, outcome: "Rewrite | RowFailed") -> None:
        self.ok(job, outcome) if isinstance(outcome, Rewrite) else self.failed(job, outcome)

    def failed(self, job: Job, failure: RowFailed) -> None:
        row = {"id": job.id, "source": job.source, "reason": failure.reason, "detail": failure.detail}
        self.errors.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.errors.flush()
        self.counts["failed"] += 1
        self.failures[failure.reason] += 1
        self.progress.set_postfix(failed=self.counts["failed"], refresh=False)
        self.progress.update()

    def close(self) -> None:
        self.progress.close()
        self.rows.close()
        self.errors.close()


def side_file(out: Path, suffix: str) -> Path:
    return out.with_name(f"{out.stem}.{suffix}")


def check_settings(out: Path, settings: dict) -> None:
    """Refuse to resume an output made with other generation settings (it would mix two)."""
    path = side_file(out, "settings.json")
    if out.exists() and path.exists():
        previous = json.loads(path.read_text())
        if previous != settings:
            changed = sorted(k for k in settings.keys() | previous.keys()
                             if settings.get(k) != previous.get(k))
            raise SystemExit(f"{out} was written with other settings ({', '.join(changed)}); "
                             "use another --out or the same settings")
    path.write_text(json.dumps(settings, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------

def run_server(backend: ServerBackend, todo: list[Job], recorder: Recorder, concurrency: int,
               stop: threading.Event) -> None:
    """`concurrency` daemon threads rewrite the queued conversations; the main thread alone writes.
    Once `stop` is set nothing new starts, and what has arrived is written without waiting for the
    requests in flight (daemon threads do not hold up the process's exit)."""
    queued, results = queue.Queue(), queue.Queue()
    for job in todo:
        queued.put(job)

    def work():
        while not stop.is_set():
            try:
                job = queued.get_nowait()
            except queue.Empty:
                return
            try:
                outcome = rewrite_with_server(backend, job)
            except Stopped:
                return
            except RowFailed as failure:
                outcome = failure
            except Exception as error:  # a bug or an unforeseen reply: this row fails, the run goes on
                detail = "".join(traceback.format_exception_only(error)).strip()
                outcome = RowFailed("internal_error", detail[:300])
            results.put((job, outcome))

    for _ in range(min(concurrency, len(todo))):
        threading.Thread(target=work, daemon=True).start()
    received = 0
    while received < len(todo) and not stop.is_set():
        try:
            recorder.record(*results.get(timeout=0.2))
            received += 1
        except queue.Empty:
            continue
    while not results.empty():  # stopping: what has already arrived is written
        recorder.record(*results.get_nowait())


def run_local(backend: LocalBackend, todo: list[Job], recorder: Recorder, batch_size: int,
              stop: threading.Event) -> None:
    """Up to `batch_size` conversations at a time, each generate call answering the next turn of
    every one of them; a conversation that is done (or failed) gives its place to the next queued
    one at once, so that the batch stays full whatever the number of turns. Once `stop` is set the
    generate call in progress ends (its answers are cut: not written) and no new one starts."""
    queued, active = iter(todo), {}
    while True:
        for job in itertools.islice(queued, batch_size - len(active)):
            active[job.id] = (job, Rewrite(job.prompt))
        if not active or stop.is_set():
            return
        prompts = {}
        for job_id, (job, rewrite) in list(active.items()):
            try:
                prompts[job_id] = backend.prompt(rewrite.history)
            except RowFailed as failure:
                recorder.failed(job, failure)
                del active[job_id]
        answers = backend.generate(list(prompts.values())) if prompts else []
        if stop.is_set():
            return
        for job_id, (answer, truncated) in zip(prompts, answers):
            job, rewrite = active[job_id]
            if not answer.strip():
                recorder.failed(job, RowFailed("empty_answer", "the target ended its turn at once"))
                del active[job_id]
                continue
            rewrite.accept(answer, truncated)
            if rewrite.done:
                recorder.ok(job, rewrite)
                del active[job_id]


class StopOnSignal:
    """Within the block, a first SIGINT or SIGTERM sets the event it yields (the run winds down in
    seconds, writing what it has); a second one raises KeyboardInterrupt."""

    def __init__(self):
        self.event = threading.Event()
        self.previous = {}

    def _handle(self, signum, frame):
        if self.event.is_set():
            raise KeyboardInterrupt
        print(f"{signal.Signals(signum).name}: writing the answers received and stopping "
              "(signal again to stop at once)", file=sys.stderr, flush=True)
        self.event.set()

    def __enter__(self) -> threading.Event:
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self.event

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    try:
        jobs = load_jobs(args.input, args.system_prompt, exclude=(str(out),))
    except chat_files.InputError as error:
        sys.exit(f"stopped, nothing written: {error}")
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {key: getattr(args, key) for key in
                ("backend", "model", "target", "thinking", "system_prompt", "temperature", "max_tokens")}
    done = completed_ids(out)  # first: an --out that is not an output is refused before a side file is written
    check_settings(out, settings)
    todo = [job for job in jobs.todo if job.id not in done]
    this_run = todo[: args.max_rows] if args.max_rows is not None else todo
    recorder = Recorder(out, len(this_run))
    try:
        with StopOnSignal() as stop:
            if args.backend == "server":
                run_server(ServerBackend(args, stop), this_run, recorder, args.concurrency, stop)
            else:
                run_local(LocalBackend(args, stop), this_run, recorder, args.batch_size, stop)
    finally:
        recorder.close()
    summary = {
        "total": len(jobs.todo),
        "ok": recorder.counts["ok"],
        "failed": recorder.counts["failed"],
        "skipped_existing": len(jobs.todo) - len(todo),
        "remaining": len(todo) - recorder.counts["ok"] - recorder.counts["failed"],
        "interrupted": stop.is_set(),
        "failures": dict(recorder.failures),
        "truncated": recorder.counts["truncated"],
        "rows_read": jobs.rows,
        "invalid": dict(jobs.invalid),
        "invalid_examples": jobs.examples,
        "duplicates": jobs.duplicates,
        "leading_assistant_dropped": jobs.leading_assistant_dropped,
        "unread_files": chat_files.unread_files(args.input),
    }
    side_file(out, "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("invalid_examples", "unread_files")}))
    for reason, sources in jobs.examples.items():
        print(f"invalid {jobs.invalid[reason]} {reason}: e.g. {', '.join(sources)}", file=sys.stderr)
    if summary["unread_files"]:
        print(f"not read: {len(summary['unread_files'])} files in the input directories that are not "
              f"{'/'.join(chat_files.FILE_SUFFIXES)}: e.g. {', '.join(summary['unread_files'][:EXAMPLES_PER_REASON])}",
              file=sys.stderr)
    return summary


if __name__ == "__main__":
    sys.exit(130 if main()["interrupted"] else 0)
