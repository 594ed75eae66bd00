"""Regeneration: the assistant turns of chat data rewritten by the target, resumably (the DFlash data
recipe; `data/regenerate.py` is its command line and its docstring the user's view).

Conversations are read with the readers and shapes prepare uses (`drafter/pipeline/chat.py`). Turn by turn,
every assistant turn is replaced by the target's answer to the history so far; a conversation that ends
with a user turn gets an answer appended. What is here knows no backend: the conversations to rewrite
(`load_jobs`, `Rewrite`), the resumable output and its side files (`Recorder`, `completed_ids`,
`check_settings`), the batched loop a local target runs (`run_local`), the signal handling and the
summary. The server backend is `answer_server.py`; the local one is `answers.py`, which also runs the
whole regeneration.
"""
import hashlib
import itertools
import json
import signal
import sys
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from drafter.pipeline import chat, chat_files
from drafter.pipeline.datasets import DataError
from drafter.infra.progress import progress_bar

EXAMPLES_PER_REASON = 5


@dataclass(frozen=True)
class RegenerateSettings:
    """What to regenerate, and how (data/regenerate.py's flags, named as its flags are)."""
    input: list[str]           # files, directories of them, or hub dataset names
    out: str                   # the output JSONL, appended to on resume
    backend: str = "server"    # "server" (an OpenAI-compatible API) or "local" (transformers generate)
    base_url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None   # the model name sent to the server
    target: str | None = None  # the model path (local backend)
    device: str = "cpu"
    dtype: str = "float32"
    batch_size: int = 8        # local backend: conversations per generate call
    concurrency: int = 32      # server backend: requests in flight
    max_retries: int = 5
    backoff: float = 1.0       # the first retry's delay, seconds
    timeout: float = 600.0     # seconds a request may take, the whole reply included
    thinking: bool = False     # enable_thinking for the chat template
    system_prompt: str | None = None  # a system turn for conversations that have none
    temperature: float = 0.0
    max_tokens: int = 2048
    seed: int = 0              # local backend sampling seed
    max_rows: int | None = None  # stop after this many new conversations (smoke runs)

    def recorded(self) -> dict:
        """The settings an output is written with (OUT.settings.json): resuming with others is refused."""
        return {key: getattr(self, key) for key in
                ("backend", "model", "target", "thinking", "system_prompt", "temperature", "max_tokens")}


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
                raise DataError(f"{path}:{line_number}: not an output row ({error}); "
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
            raise DataError(f"{out} was written with other settings ({', '.join(changed)}); "
                            "use another --out or the same settings")
    path.write_text(json.dumps(settings, indent=2) + "\n")



# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------

def run_local(backend, todo: list[Job], recorder: Recorder, batch_size: int,
              stop: threading.Event) -> None:
    """Up to `batch_size` conversations at a time (`backend`: `prompt(history) -> str`, raising RowFailed,
    and `generate(prompts) -> [(answer, truncated)]`), each generate call answering the next turn of
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


def summarize(jobs: Jobs, todo: list[Job], recorder: Recorder, interrupted: bool, inputs: list[str]) -> dict:
    """OUT.summary.json: ok + failed + skipped_existing + remaining == total."""
    return {
        "total": len(jobs.todo),
        "ok": recorder.counts["ok"],
        "failed": recorder.counts["failed"],
        "skipped_existing": len(jobs.todo) - len(todo),
        "remaining": len(todo) - recorder.counts["ok"] - recorder.counts["failed"],
        "interrupted": interrupted,
        "failures": dict(recorder.failures),
        "truncated": recorder.counts["truncated"],
        "rows_read": jobs.rows,
        "invalid": dict(jobs.invalid),
        "invalid_examples": jobs.examples,
        "duplicates": jobs.duplicates,
        "leading_assistant_dropped": jobs.leading_assistant_dropped,
        "unread_files": chat_files.unread_files(inputs),
    }


def report(summary: dict, jobs: Jobs) -> None:
    """The summary in one JSON line (stdout), the invalid rows' first sources and the unread files (stderr)."""
    print(json.dumps({k: v for k, v in summary.items() if k not in ("invalid_examples", "unread_files")}))
    for reason, sources in jobs.examples.items():
        print(f"invalid {jobs.invalid[reason]} {reason}: e.g. {', '.join(sources)}", file=sys.stderr)
    if summary["unread_files"]:
        print(f"not read: {len(summary['unread_files'])} files in the input directories that are not "
              f"{'/'.join(chat_files.FILE_SUFFIXES)}: e.g. {', '.join(summary['unread_files'][:EXAMPLES_PER_REASON])}",
              file=sys.stderr)
