"""Tokenise chat data for drafter training: input_ids, loss_mask (assistant tokens only), length.

    python data/prepare.py --input chat.jsonl more.parquet owner/hub-dataset:train \\
        --target Qwen/Qwen3-8B --out prepared/v3 [--no-thinking] [--system-prompt TEXT] \\
        [--max-length 3072] [--truncate] [--last-turn-only] [--num-proc 8]

Inputs: JSONL, JSON (a list of rows), parquet files, directories of them, or hub dataset names; the
row shapes and the drop reasons are listed in `drafter/chat.py`. Bad rows never stop the run: each
is counted by reason and the first few are printed with their file and line.

Output: `datasets.load_from_disk(OUT)` has columns `input_ids`, `loss_mask` (0/1, int8) and
`length`; `OUT/stats.json` holds the kept count, drop counts and first examples per reason, length
figures and the settings (chat template choices included, for the training config);
`OUT/length_hist.png` the length histogram.

Two cached `datasets` stages: reading + normalising rows (keyed by the input files' paths, sizes
and mtimes) and tokenising (keyed by the rows, the tokenizer, the settings and this code), so a
re-run with the same inputs and settings does no work. Output order follows input order.
"""
import argparse
import functools
import hashlib
import json
import os
import shutil
import sys
from collections import Counter
from pathlib import Path

import datasets
import numpy as np

from drafter import chat

RAW_FEATURES = datasets.Features({
    "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
    "source": datasets.Value("string"),
    "reason": datasets.Value("string"),
})
TOKENIZED_FEATURES = datasets.Features({
    "input_ids": datasets.List(datasets.Value("int32")),
    "loss_mask": datasets.List(datasets.Value("int8")),
    "length": datasets.Value("int32"),
    "supervised": datasets.Value("int32"),
    "source": datasets.Value("string"),
    "reason": datasets.Value("string"),
})
OUTPUT_COLUMNS = ["input_ids", "loss_mask", "length"]
MIN_SUPERVISED_RUN = 2
EXAMPLES_PER_REASON = 5


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True,
                        help="JSONL/JSON/parquet files, directories of them, or hub dataset names")
    parser.add_argument("--target", required=True, help="target model path or hub id (its tokenizer)")
    parser.add_argument("--out", required=True, help="output directory (replaced atomically)")
    parser.add_argument("--system-prompt", default=None,
                        help="system turn added to conversations that have none")
    parser.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=False,
                        help="enable_thinking for the chat template (default: off)")
    parser.add_argument("--max-length", type=int, default=3072)
    parser.add_argument("--truncate", action="store_true",
                        help="keep the first --max-length tokens of longer samples (default: drop them)")
    parser.add_argument("--last-turn-only", action="store_true",
                        help="supervise only the last assistant turn (default: every assistant turn)")
    parser.add_argument("--num-proc", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--cache-dir", default=None, help="datasets cache (default: the HF cache)")
    return parser.parse_args(argv)


def conversation_rows(inputs: list[str]):
    """Generator for `Dataset.from_generator`: one record per input row, bad ones with a reason."""
    for raw in chat.read_rows(inputs):
        messages, reason = [], raw.reason or ""
        if not reason:
            try:
                messages = chat.normalize_row(raw.value)
            except chat.BadRow as bad:
                reason = bad.reason
        yield {"messages": messages, "source": raw.source, "reason": reason}


@functools.lru_cache(maxsize=None)
def load_tokenizer(target: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target)


def tokenize_row(row: dict, target: str, enable_thinking: bool, system_prompt: str | None,
                 max_length: int, truncate: bool, last_turn_only: bool) -> dict:
    """Map function: a normalised row -> input_ids, loss_mask, length, and a drop reason or ""."""
    result = {"input_ids": [], "loss_mask": [], "length": 0, "supervised": 0, "reason": row["reason"]}
    if result["reason"]:
        return result
    messages = row["messages"]
    assistant_turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant_turns:
        return result | {"reason": "no_assistant_turn"}
    # Turns after the last answer would only be unsupervised context.
    messages = chat.with_system_prompt(messages[: assistant_turns[-1] + 1], system_prompt)
    try:
        input_ids, loss_mask = chat.tokenize_conversation(load_tokenizer(target), messages,
                                                          enable_thinking, last_turn_only)
    except chat.BadRow as bad:
        return result | {"reason": bad.reason}
    if len(input_ids) > max_length:
        if not truncate:
            return result | {"reason": "too_long", "length": len(input_ids)}
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    if chat.longest_run(loss_mask) < MIN_SUPERVISED_RUN:
        return result | {"reason": "too_little_supervision", "length": len(input_ids)}
    return result | {"input_ids": input_ids, "loss_mask": loss_mask, "length": len(input_ids),
                     "supervised": sum(loss_mask)}


def digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def code_digest() -> str:
    """Changes whenever the reading or tokenising code changes, so stale caches are not reused."""
    return digest(*(Path(f).read_text() for f in (chat.__file__, __file__)))


def tokenizer_digest(tokenizer) -> str:
    return digest(tokenizer.backend_tokenizer.to_str(), tokenizer.chat_template)


def build(args: argparse.Namespace) -> tuple[datasets.Dataset, dict]:
    """The tokenised dataset (every row, dropped ones with their reason) and the settings used."""
    num_proc = args.num_proc if args.num_proc > 1 else None
    rows_fingerprint = digest(chat.input_signature(args.input), code_digest())
    try:
        raw = datasets.Dataset.from_generator(
            conversation_rows, gen_kwargs={"inputs": args.input}, features=RAW_FEATURES,
            cache_dir=args.cache_dir, fingerprint=rows_fingerprint)
    except ValueError as error:  # datasets' words for a generator that yielded nothing
        if "corresponds to no data" not in str(error):
            raise
        sys.exit(f"no rows to prepare in {', '.join(args.input)}: the input is empty")
    settings = {"target": args.target, "enable_thinking": args.thinking,
                "system_prompt": args.system_prompt, "max_length": args.max_length,
                "truncate": args.truncate, "last_turn_only": args.last_turn_only}
    tokenized = raw.map(
        tokenize_row, fn_kwargs=settings, remove_columns=["messages"], features=TOKENIZED_FEATURES,
        num_proc=num_proc,
        new_fingerprint=digest(rows_fingerprint, tokenizer_digest(load_tokenizer(args.target)),
                               settings, code_digest()),
        desc="tokenize")
    return tokenized, settings


def summarize(tokenized: datasets.Dataset, settings: dict, inputs: list[str]) -> tuple[dict, np.ndarray]:
    """stats.json content and the indices of kept rows."""
    reasons = np.asarray(tokenized.data.column("reason").to_pylist(), dtype=object)
    kept = np.flatnonzero(reasons == "")
    dropped = Counter(reasons[reasons != ""].tolist())
    examples = {}
    sources = tokenized.data.column("source")
    for index in np.flatnonzero(reasons != ""):
        bucket = examples.setdefault(reasons[index], [])
        if len(bucket) < EXAMPLES_PER_REASON:
            bucket.append(sources[int(index)].as_py())
    lengths = np.asarray(tokenized.data.column("length").to_pylist(), dtype=np.int64)[kept]
    supervised = np.asarray(tokenized.data.column("supervised").to_pylist(), dtype=np.int64)[kept]
    stats = {
        "kept": int(len(kept)),
        "dropped": dict(sorted(dropped.items())),
        "examples": dict(sorted(examples.items())),
        "rows": int(len(reasons)),
        "tokens": int(lengths.sum()),
        "supervised_tokens": int(supervised.sum()),
        "length": length_summary(lengths),
        # chat_template_kwargs spelled as the training config spells it
        "settings": settings | {
            "inputs": inputs, "chat_template_kwargs": {"enable_thinking": settings["enable_thinking"]}},
    }
    return stats, kept


def length_summary(lengths: np.ndarray) -> dict:
    if len(lengths) == 0:
        return {}
    quantiles = np.percentile(lengths, [50, 90, 99])
    return {"min": int(lengths.min()), "mean": round(float(lengths.mean()), 1),
            "p50": int(quantiles[0]), "p90": int(quantiles[1]), "p99": int(quantiles[2]),
            "max": int(lengths.max())}


def plot_lengths(lengths: np.ndarray, max_length: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(lengths, bins=min(100, max(1, len(np.unique(lengths)))))
    ax.axvline(max_length, color="red", linestyle="--", label=f"max length {max_length}")
    ax.set_xlabel("tokens per sample")
    ax.set_ylabel("samples")
    ax.set_title(f"{len(lengths)} samples, {int(lengths.sum())} tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_output(dataset: datasets.Dataset, stats: dict, out: Path) -> None:
    """Write to a sibling temp directory, then swap it in: a crash never leaves a half-written OUT."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    dataset.save_to_disk(str(tmp))
    (tmp / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    plot_lengths(np.asarray(dataset["length"], dtype=np.int64), stats["settings"]["max_length"],
                 tmp / "length_hist.png")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def report(stats: dict) -> None:
    print(f"kept {stats['kept']} of {stats['rows']} rows; {stats['tokens']} tokens, "
          f"{stats['supervised_tokens']} supervised; length {stats['length']}")
    for reason, count in stats["dropped"].items():
        print(f"dropped {count} {reason}: e.g. {', '.join(stats['examples'][reason])}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the workers are the parallelism
    tokenized, settings = build(args)
    stats, kept = summarize(tokenized, settings, args.input)
    if stats["kept"] == 0:
        report(stats)
        sys.exit("no sample kept: see the drop reasons above")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_output(tokenized.select(kept).select_columns(OUTPUT_COLUMNS), stats, out)
    report(stats)
    print(f"wrote {out}")
    return stats


if __name__ == "__main__":
    main()
