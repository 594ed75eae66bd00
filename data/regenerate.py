"""Rewrite the assistant turns of chat data with the target itself (the DFlash data recipe).

    # any OpenAI-compatible server (vLLM, SGLang) serving the target
    python data/regenerate.py --input chat.jsonl --out regen/chat.jsonl \\
        --base-url http://127.0.0.1:8000/v1 --model Qwen/Qwen3-8B --concurrency 64 --no-thinking
    # small local targets (the toy world, the tests): transformers generate, batched
    python data/regenerate.py --input chat.jsonl --out regen/chat.jsonl --backend local --target PATH

Conversations are read with the same readers and shapes as `data/prepare.py` (see
`drafter/chat.py`). Turn by turn, every assistant turn is replaced by the target's answer to the
history so far (system and user turns kept, earlier answers already regenerated); a conversation
that ends with a user turn gets an answer appended. Reasoning returned separately by the server
(`reasoning_content`) is kept inline as a leading `<think>` block.

Output (`--out`, JSONL): one `{"id", "source", "messages", "truncated"}` row per conversation, in
the OpenAI messages shape that prepare reads; `truncated` says an answer hit --max-tokens. `id`
hashes the prompt side of the conversation, so identical prompts are done once. Rows are appended
and flushed one at a time; a restart skips the ids already written and drops a partial last line
left by a crash, so nothing is duplicated or lost. Side files next to it:
  OUT.errors.jsonl    rows that failed after retries, this run: {"id", "source", "reason", "detail"}
  OUT.summary.json    accounting: ok + failed + skipped_existing + remaining == total
                      (total = distinct valid conversations; invalid rows counted by reason)
  OUT.settings.json   generation settings; resuming with different ones is refused

Server requests are retried with exponential backoff and jitter on 429, 5xx, connection errors and
unreadable replies; other 4xx fail the row at once. Failed rows are tried again by the next run.
"""
import argparse
import hashlib
import http.client
import itertools
import json
import random
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from drafter import chat

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
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
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
    return args


# ---------------------------------------------------------------------------------------------
# Conversations to rewrite
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Job:
    id: str
    source: str
    prompt: list[dict]  # the conversation with assistant contents blanked: only their places matter


@dataclass
class Jobs:
    todo: list[Job]
    invalid: Counter
    examples: dict
    duplicates: int
    rows: int


def load_jobs(inputs: list[str], system_prompt: str | None) -> Jobs:
    """Distinct valid conversations of `inputs`, in order; invalid rows counted by reason."""
    jobs = Jobs([], Counter(), {}, 0, 0)
    seen = set()
    for raw in chat.read_rows(inputs):
        jobs.rows += 1
        try:
            if raw.reason:
                raise chat.BadRow(raw.reason)
            messages = chat.with_system_prompt(chat.normalize_row(raw.value), system_prompt)
            if not any(m["role"] == "user" for m in messages):
                raise chat.BadRow("no_user_turn")
        except chat.BadRow as bad:
            jobs.invalid[bad.reason] += 1
            bucket = jobs.examples.setdefault(bad.reason, [])
            if len(bucket) < EXAMPLES_PER_REASON:
                bucket.append(raw.source)
            continue
        prompt = [m if m["role"] != "assistant" else {"role": "assistant", "content": ""}
                  for m in messages]
        job_id = hashlib.sha256(json.dumps(prompt, sort_keys=True).encode()).hexdigest()[:24]
        if job_id in seen:
            jobs.duplicates += 1
            continue
        seen.add(job_id)
        jobs.todo.append(Job(job_id, raw.source, prompt))
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


# ---------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------

class ServerBackend:
    """One chat completion at a time per call, over an OpenAI-compatible HTTP API (stdlib only)."""

    def __init__(self, args: argparse.Namespace):
        self.url = args.base_url.rstrip("/") + "/chat/completions"
        self.body = {"model": args.model, "temperature": args.temperature,
                     "max_tokens": args.max_tokens,
                     "chat_template_kwargs": {"enable_thinking": args.thinking}}
        self.max_retries, self.backoff, self.timeout = args.max_retries, args.backoff, args.timeout

    def answer(self, history: list[dict]) -> tuple[str, bool]:
        """(answer, truncated) for `history`; raises RowFailed once retries are exhausted."""
        request = json.dumps(self.body | {"messages": history}).encode()
        for attempt in itertools.count():
            try:
                return parse_completion(self._post(request))
            except RetryableError as error:
                if attempt >= self.max_retries:
                    raise RowFailed(error.reason, error.detail) from error
                delay = min(MAX_BACKOFF, self.backoff * 2 ** attempt) * random.uniform(0.5, 1.5)
                time.sleep(max(error.retry_after, delay))

    def _post(self, body: bytes) -> dict:
        request = urllib.request.Request(self.url, data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                payload = response.read()
        except urllib.error.HTTPError as error:
            detail = error.read()[:200].decode("utf-8", "replace")
            if error.code == 429 or error.code >= 500:
                raise RetryableError(f"http_{error.code}", detail,
                                     retry_after_seconds(error.headers.get("Retry-After"))) from error
            raise RowFailed(f"http_{error.code}", detail) from error
        except (urllib.error.URLError, OSError, http.client.HTTPException) as error:  # refused, cut
            raise RetryableError("connection", str(error)) from error
        try:
            return json.loads(payload)
        except ValueError as error:
            raise RetryableError("bad_response", payload[:200].decode("utf-8", "replace")) from error


class RetryableError(Exception):
    def __init__(self, reason: str, detail: str, retry_after: float = 0.0):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail, self.retry_after = reason, detail, retry_after


def retry_after_seconds(header: str | None) -> float:
    """A server's Retry-After in seconds (the date form is ignored), capped at MAX_BACKOFF."""
    try:
        return min(float(header), MAX_BACKOFF) if header else 0.0
    except ValueError:
        return 0.0


def parse_completion(response: dict) -> tuple[str, bool]:
    """The answer text of a chat completion (reasoning inline) and whether it hit max_tokens."""
    try:
        choice = response["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError) as error:
        raise RetryableError("bad_response", json.dumps(response)[:200]) from error
    content = message.get("content") or ""
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    answer = chat.join_reasoning(reasoning, content) if reasoning.strip() else content
    if not answer.strip():
        raise RowFailed("empty_answer", json.dumps(response)[:200])
    return answer, choice.get("finish_reason") == "length"


class LocalBackend:
    """Batched `model.generate` on a local HF target (left padding); greedy at temperature 0."""

    def __init__(self, args: argparse.Namespace):
        import torch
        from transformers import AutoTokenizer

        from drafter.target import load_target

        self.tokenizer = AutoTokenizer.from_pretrained(args.target, padding_side="left")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = load_target(args.target, args.device, getattr(torch, args.dtype))
        self.enable_thinking, self.max_tokens = args.thinking, args.max_tokens
        self.sampling = {"do_sample": True, "temperature": args.temperature} \
            if args.temperature > 0 else {"do_sample": False}
        self.eos_ids = sorted({self.tokenizer.eos_token_id} | set(self._config_eos_ids()))
        torch.manual_seed(args.seed)

    def _config_eos_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    def prompt(self, history: list[dict]) -> str:
        try:
            return chat.render(self.tokenizer, history, self.enable_thinking, add_generation_prompt=True)
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
                                         pad_token_id=self.tokenizer.pad_token_id, **self.sampling)
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
    """Appends finished rows (flushed each) and failures, and keeps the accounting."""

    def __init__(self, out: Path):
        self.rows = open(out, "a", encoding="utf-8")
        self.errors = open(side_file(out, "errors.jsonl"), "w", encoding="utf-8")
        self.counts = Counter()
        self.failures = Counter()

    def ok(self, job: Job, rewrite: Rewrite) -> None:
        row = {"id": job.id, "source": job.source, "messages": rewrite.history,
               "truncated": rewrite.truncated}
        self.rows.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.rows.flush()
        self.counts["ok"] += 1
        self.counts["truncated"] += rewrite.truncated

    def failed(self, job: Job, failure: RowFailed) -> None:
        row = {"id": job.id, "source": job.source, "reason": failure.reason, "detail": failure.detail}
        self.errors.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.errors.flush()
        self.counts["failed"] += 1
        self.failures[failure.reason] += 1

    def close(self) -> None:
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

def run_server(backend: ServerBackend, todo: list[Job], recorder: Recorder, concurrency: int) -> None:
    """A bounded window of conversations in flight; the main thread alone writes."""
    queue = iter(todo)
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        in_flight = {}

        def refill():
            while len(in_flight) < 2 * concurrency and (job := next(queue, None)) is not None:
                in_flight[pool.submit(rewrite_with_server, backend, job)] = job

        refill()
        try:
            while in_flight:
                finished, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                for future in finished:
                    job = in_flight.pop(future)
                    try:
                        recorder.ok(job, future.result())
                    except RowFailed as failure:
                        recorder.failed(job, failure)
                refill()
        except BaseException:  # Ctrl-C or a bug: start nothing new; finished rows are already saved
            for future in in_flight:
                future.cancel()
            raise


def run_local(backend: LocalBackend, todo: list[Job], recorder: Recorder, batch_size: int) -> None:
    """Batches of conversations advanced turn by turn: one generate call per turn index."""
    for start in range(0, len(todo), batch_size):
        active = {job.id: (job, Rewrite(job.prompt)) for job in todo[start:start + batch_size]}
        while active:
            prompts = {}
            for job_id, (job, rewrite) in list(active.items()):
                try:
                    prompts[job_id] = backend.prompt(rewrite.history)
                except RowFailed as failure:
                    recorder.failed(job, failure)
                    del active[job_id]
            answers = backend.generate(list(prompts.values())) if prompts else []
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


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {key: getattr(args, key) for key in
                ("backend", "model", "target", "thinking", "system_prompt", "temperature", "max_tokens")}
    check_settings(out, settings)
    jobs = load_jobs(args.input, args.system_prompt)
    done = completed_ids(out)
    todo = [job for job in jobs.todo if job.id not in done]
    this_run = todo[: args.max_rows] if args.max_rows is not None else todo
    recorder = Recorder(out)
    try:
        if args.backend == "server":
            run_server(ServerBackend(args), this_run, recorder, args.concurrency)
        else:
            run_local(LocalBackend(args), this_run, recorder, args.batch_size)
    finally:
        recorder.close()
    summary = {
        "total": len(jobs.todo),
        "ok": recorder.counts["ok"],
        "failed": recorder.counts["failed"],
        "skipped_existing": len(jobs.todo) - len(todo),
        "remaining": len(todo) - len(this_run),
        "failures": dict(recorder.failures),
        "truncated": recorder.counts["truncated"],
        "rows_read": jobs.rows,
        "invalid": dict(jobs.invalid),
        "invalid_examples": jobs.examples,
        "duplicates": jobs.duplicates,
    }
    side_file(out, "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "invalid_examples"}))
    for reason, sources in jobs.examples.items():
        print(f"invalid {jobs.invalid[reason]} {reason}: e.g. {', '.join(sources)}", file=sys.stderr)
    return summary


if __name__ == "__main__":
    main()
