"""The server backend of a regeneration: chat completions from any OpenAI-compatible server (vLLM,
SGLang) serving the target, over HTTP with the standard library alone, `concurrency` requests in flight.

Requests are retried with exponential backoff and jitter on 429, 5xx (its body cut short or not),
connection errors, timeouts (the timeout bounds the whole reply, so a server that trickles bytes times
out too) and replies that are not a well-formed chat completion; other 4xx fail the row at once.
"""
import http.client
import itertools
import json
import queue
import random
import threading
import time
import traceback
import urllib.error
import urllib.request

from drafter.data import chat, chat_files
from drafter.data.regeneration import Job, Recorder, RegenerateSettings, Rewrite, RowFailed, Stopped

MAX_BACKOFF = 60.0  # seconds, before jitter


class ServerBackend:
    """One chat completion at a time per call, over an OpenAI-compatible HTTP API (stdlib only)."""

    def __init__(self, settings: RegenerateSettings, stop: threading.Event):
        self.url = settings.base_url.rstrip("/") + "/chat/completions"
        self.body = {"model": settings.model, "temperature": settings.temperature,
                     "max_tokens": settings.max_tokens,
                     "chat_template_kwargs": {"enable_thinking": settings.thinking}}
        self.max_retries, self.backoff, self.timeout = settings.max_retries, settings.backoff, settings.timeout
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


def rewrite_with_server(backend: ServerBackend, job: Job) -> Rewrite:
    rewrite = Rewrite(job.prompt)
    while not rewrite.done:
        rewrite.accept(*backend.answer(rewrite.history))
    return rewrite



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
