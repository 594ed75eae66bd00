"""Build the toy world: a small real Qwen3 target and the data a drafter needs, offline, on a CPU.

    python data/toy.py [--out artifacts/toy] [--force] [--threads 2]

The corpus is the Python standard library's own source. Each file is assigned by a hash of its path to
one of three disjoint sets: the target trains on "train" files, the chat prompts whose responses the
target regenerates come from "prompt" files, and the held-out bench prompts from "bench" files. The
chat task: the user gives the lines before a function and its signature ("Complete this function:"),
the assistant writes the body. The target is a non-thinking model (every prompt uses thinking off).
The corpus and the task are `drafter/synthesis/stdlib_corpus.py`, the tokenizer and its chat template
`drafter/synthesis/toy_tokenizer.py`; here are the sizes, the target's training and the stages.

Output (each step is skipped when its output exists; --force removes these outputs, and nothing else in
the directory, and rebuilds them all):
  corpus.json          the file lists of the three sets
  target/              tokenizer + Qwen3ForCausalLM (AutoTokenizer / AutoModelForCausalLM load it),
                       target/training.json: size, tokens, speed, final training loss
  prompts.jsonl        {"messages": [user turn], "group": source file} chats from the prompt files
  bench.jsonl          the same kind of chats from the bench files: the held-out prompts
  regenerated.jsonl    the target's own answers (data/regenerate.py, local backend, greedy)
  train_data/          data/prepare.py's tokenised drafter training set, answers that loop dropped
                       (--drop-loops); its group column is the source file, so a held-out split
                       (data.eval_fraction) holds out whole files
  bench_data/          the bench prompts with the target's greedy answers, prepared (loops kept): the
                       drafter's eval set, so replayed tau is the served tau of the bench prompts
  heldout.jsonl        NUM_HELDOUT further chats from the bench files (another draw, so it may share
                       prompts with bench.jsonl; none from a file the drafter trains on)
  heldout_data/        those prompts with the target's greedy answers, prepared: the eval set of
                       bench/variants.py, large enough to separate variants beyond seed noise
  report.json          held-out loss, distinct 4-gram share of the greedy bench answers, loop shares
"""

import argparse
import json
import math
import platform
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from drafter.pipeline.prepared import unwind_on_sigterm
from drafter.synthesis import world
from drafter.synthesis.stdlib_corpus import (completion_messages, function_examples, list_corpus_files,
                                             pack_documents, split_corpus, stdlib_root, training_documents)
from drafter.synthesis.toy_tokenizer import build_tokenizer


def lr_at(step: int, total_steps: int, peak_lr: float, warmup_steps: int) -> float:
    """Linear warmup to peak_lr, then cosine decay to a tenth of it at total_steps."""
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def train_target(model, rows: torch.Tensor, steps: int, batch_size: int, peak_lr: float,
                 seed: int, log_every: int = 0) -> list[float]:
    """Train a causal LM on rows [n, T] for a fixed number of steps; return the per-step losses.

    Batches walk a seeded permutation of the rows, reshuffled at each pass.
    """
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    warmup_steps = max(1, steps // 20)
    order = torch.empty(0, dtype=torch.long)
    losses = []
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        if len(order) < batch_size:
            order = torch.cat([order, torch.randperm(len(rows), generator=generator)])
        batch, order = rows[order[:batch_size]], order[batch_size:]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr, warmup_steps)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            elapsed = time.perf_counter() - start
            print(f"  step {step + 1}/{steps} loss {loss.item():.3f} "
                  f"{(step + 1) * batch.numel() / elapsed:.0f} tok/s", flush=True)
    model.eval()
    return losses


@torch.no_grad()
def mean_loss(model, rows: torch.Tensor, batch_size: int) -> float:
    """Mean next-token cross entropy of a causal LM over rows [n, T]."""
    total = 0.0
    for start in range(0, len(rows), batch_size):
        batch = rows[start:start + batch_size]
        total += model(input_ids=batch, labels=batch).loss.item() * len(batch)
    return total / len(rows)


def distinct_ngram_share(sequences: list[list[int]], n: int = 4) -> float:
    """Mean over sequences of (distinct n-grams / n-grams): 1.0 never repeats, loops score low.

    Sequences shorter than n are skipped.
    """
    shares = []
    for ids in sequences:
        ngrams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
        if ngrams:
            shares.append(len(set(ngrams)) / len(ngrams))
    if not shares:
        raise ValueError(f"no sequence has {n} tokens")
    return sum(shares) / len(shares)


# ---------------------------------------------------------------------------------------------
# The build
# ---------------------------------------------------------------------------------------------

SEED = 0
VOCAB_SIZE = 2048
EXAMPLE_LIMITS = {"context_lines": 4, "max_prompt_chars": 300, "max_body_chars": 600}
# On an idle 2-core machine (torch 2.13 CPU, 2 threads) a step takes 175-290 ms (7.1-11.7K tokens/s),
# so training takes 1.5-2.5 minutes (`make demo` must fit 25 minutes on a machine 4x slower). For a
# fixed time, many small steps of a small model gave a lower held-out loss here than fewer, larger
# steps or a wider model.
TARGET_CONFIG = {"hidden_size": 96, "num_hidden_layers": 6, "num_attention_heads": 3,
                 "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 288}
SEQ_LEN = 256
BATCH_SIZE = 8
TRAIN_STEPS = 500
PEAK_LR = 4e-3
HELDOUT_ROWS = 64
NUM_PROMPTS = 2000
MAX_NEW_TOKENS = 64
REGENERATE_BATCH_SIZE = 64
GENERATION = world.AnswerSettings(MAX_NEW_TOKENS, REGENERATE_BATCH_SIZE)
NUM_BENCH = 32
NUM_HELDOUT = 512
OUTPUTS = (["corpus.json", "target", "target.tmp", "prompts.jsonl", "bench.jsonl", "heldout.jsonl", "train_data",
            "bench_data", "heldout_data", "datasets_cache", "report.json"]
           + [name for answers in ("regenerated", "bench_answers", "heldout_answers")
              for name in world.answer_outputs(answers)])


def target_config(tokenizer) -> Qwen3Config:
    """The toy target's architecture (Qwen3, tied embeddings) for this tokenizer."""
    return Qwen3Config(vocab_size=len(tokenizer), max_position_embeddings=SEQ_LEN,
                       tie_word_embeddings=True, bos_token_id=None,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       **TARGET_CONFIG)


def read_texts(root: Path, rel_paths: list[str]) -> list[str]:
    return [(root / rel_path).read_text(encoding="utf-8") for rel_path in rel_paths]


def completion_heads(files: dict[str, str]) -> list[tuple[str, str]]:
    """(file, head) of every function example of `files` (relative path -> source text)."""
    return [(rel_path, head) for rel_path, text in files.items()
            for head, _ in function_examples(text, **EXAMPLE_LIMITS)]


def step_corpus(out: Path) -> None:
    root = stdlib_root()
    corpus = {"stdlib": str(root), "python": platform.python_version(),
              "splits": split_corpus(list_corpus_files(root))}
    (out / "corpus.json").write_text(json.dumps(corpus, indent=1) + "\n")


def split_files(out: Path, split: str) -> dict[str, str]:
    """Relative path -> text of the files of one set of the corpus recorded in out/corpus.json."""
    corpus = json.loads((out / "corpus.json").read_text())
    rel_paths = corpus["splits"][split]
    return dict(zip(rel_paths, read_texts(Path(corpus["stdlib"]), rel_paths)))


def split_texts(out: Path, split: str) -> list[str]:
    return list(split_files(out, split).values())


def step_target(out: Path) -> None:
    """Train the tokenizer and the target on the train files; save both to out/target."""
    train_texts = split_texts(out, "train")
    tokenizer = build_tokenizer(train_texts, VOCAB_SIZE)
    documents = training_documents(tokenizer, train_texts, EXAMPLE_LIMITS)
    rows = pack_documents(tokenizer, documents, SEQ_LEN)
    torch.manual_seed(SEED)
    model = Qwen3ForCausalLM(target_config(tokenizer))
    parameters = sum(p.numel() for p in model.parameters())
    print(f"target: {parameters / 1e6:.2f}M parameters, {TRAIN_STEPS} steps of {BATCH_SIZE}x{SEQ_LEN} "
          f"tokens from {rows.numel()} packed training tokens", flush=True)
    start = time.perf_counter()
    losses = train_target(model, rows, TRAIN_STEPS, BATCH_SIZE, PEAK_LR, SEED,
                          log_every=max(1, TRAIN_STEPS // 10))
    seconds = time.perf_counter() - start
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    tmp = out / "target.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    trained = TRAIN_STEPS * BATCH_SIZE * SEQ_LEN
    stats = {"parameters": parameters, "steps": TRAIN_STEPS, "tokens_trained": trained,
             "tokens_available": rows.numel(), "train_seconds": round(seconds, 1),
             "tokens_per_second": round(trained / seconds),
             "final_train_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4)}
    (tmp / "training.json").write_text(json.dumps(stats, indent=1) + "\n")
    tmp.rename(out / "target")


def chat_prompts(out: Path, split: str, count: int, seed: int = SEED) -> list[dict]:
    """`count` chat prompts from one set of files; the source file is the group (a held-out split
    keeps a file's functions together)."""
    heads = completion_heads(split_files(out, split))
    return [{"messages": completion_messages(head), "group": rel_path}
            for rel_path, head in world.sample_in_order(heads, count, seed)]


def step_prompts(out: Path) -> None:
    world.write_jsonl(out / "prompts.jsonl", chat_prompts(out, "prompt", NUM_PROMPTS))


def step_bench(out: Path) -> None:
    world.write_jsonl(out / "bench.jsonl", chat_prompts(out, "bench", NUM_BENCH))


def step_heldout(out: Path) -> None:
    world.write_jsonl(out / "heldout.jsonl", chat_prompts(out, "bench", NUM_HELDOUT, seed=SEED + 1))


def step_train_data(out: Path) -> None:
    world.answered_dataset(out, "prompts.jsonl", "regenerated.jsonl", "train_data", GENERATION,
                           drop_loops=True)


def step_bench_data(out: Path) -> None:
    world.answered_dataset(out, "bench.jsonl", "bench_answers.jsonl", "bench_data", GENERATION)


def step_heldout_data(out: Path) -> None:
    world.answered_dataset(out, "heldout.jsonl", "heldout_answers.jsonl", "heldout_data", GENERATION)


def step_report(out: Path) -> dict:
    """Held-out loss on the bench files' raw text, the diversity of the target's greedy bench answers
    and the share of answers that loop (prepare's rule)."""
    target_dir = out / "target"
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    heldout = pack_documents(tokenizer, split_texts(out, "bench"), SEQ_LEN)[:HELDOUT_ROWS]
    answers = [json.loads(line)["messages"] for line in (out / "bench_answers.jsonl").read_text().splitlines()]
    answer_ids = [tokenizer(m[-1]["content"], add_special_tokens=False)["input_ids"] for m in answers]
    report = {
        "target": json.loads((target_dir / "training.json").read_text()),
        "heldout_loss": round(mean_loss(model, heldout, BATCH_SIZE), 4),
        "heldout_tokens": heldout.numel(),
        "distinct_4gram_share": round(distinct_ngram_share(answer_ids, 4), 4),
        "loop_share": {name: loop_share(out / name) for name in ("train_data", "bench_data")},
        "bench_prompts": len(answers),
        "samples": [{"prompt": m[0]["content"], "answer": m[-1]["content"]} for m in answers[:3]],
    }
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def loop_share(dataset: Path) -> float:
    """Share of a prepared dataset's rows whose answer loops (dropped or kept with the flag)."""
    stats = json.loads((dataset / "stats.json").read_text())
    loops = stats["dropped"].get("loop", 0) + stats["flags"].get("loop", {}).get("rows", 0)
    return round(loops / stats["rows"], 4)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="artifacts/toy", help="output directory")
    parser.add_argument("--force", action="store_true", help="rebuild every step from scratch")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads (1 is steadier on a machine busy with other work)")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = world.open_out(Path(args.out), OUTPUTS, args.force)
    torch.set_num_threads(args.threads)
    stages = [  # (step, the output that marks it done: the step is skipped when it exists)
        (step_corpus, "corpus.json"),
        (step_target, "target"),
        (step_prompts, "prompts.jsonl"),
        (step_bench, "bench.jsonl"),
        (step_train_data, "train_data"),
        (step_bench_data, "bench_data"),
        (step_heldout, "heldout.jsonl"),
        (step_heldout_data, "heldout_data"),
    ]
    world.run_stages(out, stages)
    start = time.perf_counter()
    report = step_report(out)
    print(f"[report] done in {time.perf_counter() - start:.1f} s", flush=True)
    print(json.dumps({key: report[key] for key in ("target", "heldout_loss", "distinct_4gram_share")}))
    return report


if __name__ == "__main__":
    unwind_on_sigterm()  # a prepare stage killed half-way leaves no hidden temporary copy
    main()
