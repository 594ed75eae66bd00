"""Rewrite the assistant turns of chat data with the target itself (the DFlash data recipe).

    # any OpenAI-compatible server (vLLM, SGLang) serving the target
    python data/regenerate.py --input chat.jsonl --out artifacts/regen/chat.jsonl \\
        --base-url http://127.0.0.1:8000/v1 --model Qwen/Qwen3-8B --concurrency 64 --no-thinking
    # small local targets (the toy world, the tests): transformers generate, batched
    python data/regenerate.py --input chat.jsonl --out artifacts/regen/chat.jsonl --backend local --target PATH

Conversations are read with the same readers and shapes as `data/prepare.py` (see
`drafter/pipeline/chat.py`). Turn by turn, every assistant turn is replaced by the target's answer to the
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
the exit status is 130. A second signal stops at once. The work is the library's
(`drafter/synthesis/answers.py` runs it); this is its command line.
"""
import argparse
import sys

from drafter.synthesis.regeneration import RegenerateSettings
from drafter.errors import UserError, model_path_problem
from drafter.synthesis.answers import regenerate


def parse_args(argv=None) -> RegenerateSettings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True,
                        help="JSONL/JSON/parquet files, directories of them, or hub dataset names")
    parser.add_argument("--out", required=True, help="output JSONL (appended to on resume)")
    parser.add_argument("--backend", choices=["server", "local"], default=RegenerateSettings.backend)
    parser.add_argument("--base-url", default=RegenerateSettings.base_url,
                        help="OpenAI-compatible API root (server backend)")
    parser.add_argument("--model", default=None, help="model name sent to the server")
    parser.add_argument("--target", default=None, help="model path (local backend)")
    parser.add_argument("--device", default=RegenerateSettings.device, help="local backend device")
    parser.add_argument("--dtype", default=RegenerateSettings.dtype, help="local backend dtype")
    parser.add_argument("--batch-size", type=int, default=RegenerateSettings.batch_size,
                        help="local backend prompts per generate")
    parser.add_argument("--concurrency", type=int, default=RegenerateSettings.concurrency,
                        help="server requests in flight")
    parser.add_argument("--max-retries", type=int, default=RegenerateSettings.max_retries)
    parser.add_argument("--backoff", type=float, default=RegenerateSettings.backoff, help="first retry delay, seconds")
    parser.add_argument("--timeout", type=float, default=RegenerateSettings.timeout,
                        help="seconds a request may take, the whole reply included")
    parser.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=False,
                        help="enable_thinking for the chat template (default: off)")
    parser.add_argument("--system-prompt", default=None,
                        help="system turn added to conversations that have none")
    parser.add_argument("--temperature", type=float, default=RegenerateSettings.temperature)
    parser.add_argument("--max-tokens", type=int, default=RegenerateSettings.max_tokens)
    parser.add_argument("--seed", type=int, default=RegenerateSettings.seed, help="local backend sampling seed")
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
    return RegenerateSettings(**vars(args))


def main(argv=None) -> dict:
    settings = parse_args(argv)
    try:
        return regenerate(settings)
    except UserError as error:
        sys.exit(str(error))


if __name__ == "__main__":
    sys.exit(130 if main()["interrupted"] else 0)
