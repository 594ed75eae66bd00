"""The server backend of a regeneration: chat completions from any OpenAI-compatible server (vLLM,
SGLang) serving the target, `concurrency` requests in flight, over httpx2 with tenacity's retries.

Requests are retried with exponential backoff and jitter (longer where a Retry-After asks for it) on
429, 5xx (its body cut short or not), connection errors, timeouts (the timeout bounds the whole reply,
so a server that trickles bytes times out too) and replies that are not a well-formed chat
completion; other 4xx fail the row at once. A stop ends the waits between retries.
"""
import json
import queue
import threading
import time
import traceback

import httpx2
import tenacity

from drafter.pipeline import chat, chat_files
from drafter.synthesis.regeneration import Job, Recorder, RegenerateSettings, Rewrite, RowFailed, Stopped

MAX_BACKOFF = 60.0  # seconds


class ServerBackend:
    """Chat completions over an OpenAI-compatible HTTP API, one client shared by the worker threads."""

    def __init__(self, settings: RegenerateSettings, stop: threading.Event):
        self.url = settings.base_url.rstrip("/") + "/chat/completions"
        self.body = {"model": settings.model, "temperature": settings.temperature,
                     "max_tokens": settings.max_tokens,
                     "chat_template_kwargs": {"enable_thinking": settings.thinking}}
        self.timeout, self.stop = settings.timeout, stop
        self.client = httpx2.Client(timeout=settings.timeout,
                                    limits=httpx2.Limits(max_connections=settings.concurrency))
        self.backoff = tenacity.wait_exponential_jitter(multiplier=settings.backoff, max=MAX_BACKOFF,
                                                        jitter=settings.backoff)
        self.retrying = tenacity.Retrying(retry=tenacity.retry_if_exception_type(RetryableError),
                                          stop=tenacity.stop_after_attempt(settings.max_retries + 1),
                                          wait=self._wait, sleep=self._sleep, reraise=True)

    def answer(self, history: list[dict]) -> tuple[str, bool]:
        """(answer, truncated) for `history`; raises RowFailed once retries are exhausted, Stopped
        when the run stops."""
        if self.stop.is_set():
            raise Stopped
        request = json.dumps(self.body | {"messages": history}).encode()  # a lone surrogate escaped
        try:
            return self.retrying(lambda: parse_completion(self._post(request)))
        except RetryableError as error:
            raise RowFailed(error.reason, error.detail) from error

    def _wait(self, state: tenacity.RetryCallState) -> float:
        """The backoff, or the server's Retry-After where that is longer."""
        return max(state.outcome.exception().retry_after, self.backoff(state))

    def _sleep(self, seconds: float) -> None:
        if self.stop.wait(seconds):
            raise Stopped

    def _post(self, request: bytes):
        deadline = time.monotonic() + self.timeout
        try:
            with self.client.stream("POST", self.url, content=request,
                                    headers={"Content-Type": "application/json"}) as response:
                check_status(response, deadline)
                payload = read_within(response, deadline)
        except httpx2.RequestError as error:  # refused, cut short, timed out
            raise RetryableError("connection", str(error)) from error
        try:
            return chat_files.parse_json(payload.decode("utf-8"))[0]
        except (ValueError, RecursionError) as error:  # not UTF-8, not JSON
            raise RetryableError("bad_response", payload[:200].decode("utf-8", "replace")) from error


def read_within(response: httpx2.Response, deadline: float) -> bytes:
    """The whole body, or httpx2.ReadTimeout once `deadline` (time.monotonic) passes: httpx2's
    timeout bounds each read alone, so a server that trickles bytes would hold a worker for ever."""
    chunks = []
    for chunk in response.iter_bytes():
        chunks.append(chunk)
        if time.monotonic() > deadline:
            raise httpx2.ReadTimeout(f"the reply took longer than --timeout ({sum(map(len, chunks))} bytes so far)")
    return b"".join(chunks)


def check_status(response: httpx2.Response, deadline: float) -> None:
    """RetryableError for a 429 or 5xx, RowFailed for any other status that is not a success. The
    detail is the start of the body, or says it could not be read (a 500 stays retryable)."""
    if response.is_success:
        return
    try:
        detail = read_within(response, deadline)[:200].decode("utf-8", "replace")
    except httpx2.RequestError as unreadable:
        detail = f"(body unreadable: {unreadable!r})"
    reason = f"http_{response.status_code}"
    if response.status_code == 429 or response.status_code >= 500:
        raise RetryableError(reason, detail, retry_after_seconds(response.headers.get("Retry-After")))
    raise RowFailed(reason, detail)


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
