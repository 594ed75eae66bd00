"""Tokenise chat data for drafter training: input_ids, loss_mask (assistant tokens only), length, group.

    python data/prepare.py --input chat.jsonl more.parquet owner/hub-dataset:train \\
        --target Qwen/Qwen3-8B --out artifacts/qwen3-8b [--no-thinking] [--system-prompt TEXT] \\
        [--max-length 3072] [--truncate] [--last-turn-only] [--drop-loops] [--num-proc 8]

Inputs: JSONL, JSON (a list of rows), parquet files, directories of them, or hub dataset names; the
row shapes and drop reasons are listed in `drafter/pipeline/chat.py`, the repairs in
`drafter/pipeline/chat_files.py`. Bad rows never stop the run: each is counted by reason and the first few
are printed with their file and line. A file that cannot be read as a whole (a `.json` list cut short,
say) stops the run naming it, before anything is written.

Thinking is one decision: with --no-thinking (the default) reasoning (`<think>` blocks) is removed
from every answer, so a conversation is rendered exactly as the serving template renders it with
enable_thinking=False; with --thinking the reasoning is kept and supervised. The choice is recorded
in OUT/stats.json (`settings.chat_template_kwargs`), which train.py checks against its config.

Rows of data/regenerate.py marked `truncated` (an answer hit --max-tokens) are kept without their
closing tokens supervised (flag `truncated`). An answer whose tail repeats a short n-gram is a loop
(flag `loop`; dropped with --drop-loops): its last 48 tokens (closing token excluded) hold at most 16
distinct 4-grams of their 45. A repeated n-gram of up to 16 tokens has exactly n distinct 4-grams;
the slack allows a few breaks (line wraps); answers shorter than 48 tokens never count.

Output: `datasets.load_from_disk(OUT)` has columns `input_ids`, `loss_mask` (0/1, int8), `length` and
`group` (the row's group for the held-out split: see `chat_files.row_group`); `OUT/stats.json` holds the
kept count, drop counts and first examples per reason, the flags of kept rows with examples, length
figures, the files of input directories that were not read (`unread_files`) and the settings, and
marks OUT as this tool's output: an existing --out without that mark is refused, one with it is
replaced atomically. `OUT/length_hist.png` is the length histogram.

Two cached `datasets` stages: reading + normalising rows (keyed by the input files' paths, sizes
and mtimes) and tokenising (keyed by the rows, the tokenizer, the settings and the code), so a
re-run with the same inputs and settings does no work. Output order follows input order. The work is
`drafter/pipeline/prepared.py`'s; this is its command line.
"""
import argparse
import os
import sys

from drafter.pipeline.prepared import PrepareSettings, prepare, unwind_on_sigterm
from drafter.errors import UserError, model_path_problem


def parse_args(argv=None) -> PrepareSettings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True,
                        help="JSONL/JSON/parquet files, directories of them, or hub dataset names")
    parser.add_argument("--target", required=True, help="target model path or hub id (its tokenizer)")
    parser.add_argument("--out", required=True,
                        help="output directory (new, or an earlier output of this tool: replaced atomically)")
    parser.add_argument("--system-prompt", default=None,
                        help="system turn added to conversations that have none")
    parser.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=False,
                        help="keep and supervise reasoning, rendered with enable_thinking=True "
                             "(default: --no-thinking, reasoning removed)")
    parser.add_argument("--max-length", type=int, default=PrepareSettings.max_length)
    parser.add_argument("--truncate", action="store_true",
                        help="keep the first --max-length tokens of longer samples (default: drop them)")
    parser.add_argument("--last-turn-only", action="store_true",
                        help="supervise only the last assistant turn (default: every assistant turn)")
    parser.add_argument("--drop-loops", action="store_true",
                        help="drop rows with an answer whose tail repeats a short n-gram (default: keep, counted)")
    parser.add_argument("--num-proc", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--cache-dir", default=None, help="datasets cache (default: the HF cache)")
    args = parser.parse_args(argv)
    if problem := model_path_problem(args.target):
        parser.error(f"--target {args.target}: {problem}")
    return PrepareSettings(**vars(args))


def main(argv=None) -> dict:
    settings = parse_args(argv)
    try:
        return prepare(settings)
    except UserError as error:
        sys.exit(str(error))


if __name__ == "__main__":
    unwind_on_sigterm()
    main()
