"""data/toy.py pieces at tiny sizes: tokenizer, chat template, corpus split, examples, training."""
import json

import pytest
import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from data import toy
from drafter.pipeline import chat, chat_template
from drafter.pipeline.benchmarks import load_jsonl
from drafter.synthesis import stdlib_corpus, toy_tokenizer, world

STDLIB_SAMPLE = ["textwrap.py", "shlex.py", "bisect.py", "colorsys.py"]
VOCAB = 400


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [(stdlib_corpus.stdlib_root() / name).read_text(encoding="utf-8") for name in STDLIB_SAMPLE]


@pytest.fixture(scope="module")
def tokenizer(texts):
    return toy_tokenizer.build_tokenizer(texts, VOCAB)


@pytest.fixture(scope="module")
def saved_tokenizer(tokenizer, tmp_path_factory):
    directory = tmp_path_factory.mktemp("toy_tokenizer")
    tokenizer.save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)


def tiny_model(tokenizer, seed=0, layers=2) -> Qwen3ForCausalLM:
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         intermediate_size=64, tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).eval()


# --- tokenizer and chat template -----------------------------------------------------------------

def test_tokenizer_size_special_tokens_and_round_trip(saved_tokenizer):
    tok = saved_tokenizer
    assert len(tok) == VOCAB
    assert (tok.eos_token, tok.pad_token, tok.mask_token) == ("<|im_end|>", "<|endoftext|>", "<|mask|>")
    for token in toy_tokenizer.SPECIAL_TOKENS + toy_tokenizer.THINK_TOKENS:
        assert tok.convert_ids_to_tokens(tok(token, add_special_tokens=False)["input_ids"]) == [token]
    assert len({tok.convert_tokens_to_ids(t) for t in toy_tokenizer.SPECIAL_TOKENS + toy_tokenizer.THINK_TOKENS}) == 6
    for text in ["def f(x):\n    return x  # ok\n\n\tz = '''é ✓ 日本'''\n", "   \n\n", "\x00\x7f"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text


def test_saved_tokenizer_encodes_like_the_built_one(tokenizer, saved_tokenizer, texts):
    sample = texts[0][:3000] + "<|im_start|>user\n<think>x</think><|im_end|>"
    assert saved_tokenizer(sample)["input_ids"] == tokenizer(sample)["input_ids"]
    assert saved_tokenizer.chat_template == toy_tokenizer.CHAT_TEMPLATE


def render(tok, messages, **kwargs) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "Complete this function:\ndef f():"}
ANSWER = {"role": "assistant", "content": "    return 1\n"}


def test_chat_template_turns_and_generation_prompt(saved_tokenizer):
    text = render(saved_tokenizer, [SYSTEM, USER], add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    f"<|im_start|>user\n{USER['content']}<|im_end|>\n<|im_start|>assistant\n")
    assert render(saved_tokenizer, [USER]).endswith("<|im_end|>\n")
    with pytest.raises(Exception, match="system message must come first"):
        render(saved_tokenizer, [USER, SYSTEM])


def test_thinking_flag_only_changes_the_generation_prompt(saved_tokenizer):
    on = render(saved_tokenizer, [USER], add_generation_prompt=True, enable_thinking=True)
    off = render(saved_tokenizer, [USER], add_generation_prompt=True, enable_thinking=False)
    assert off == on + "<think>\n\n</think>\n\n"
    assert render(saved_tokenizer, [USER], add_generation_prompt=True) == on
    full = render(saved_tokenizer, [USER, ANSWER], enable_thinking=False)
    assert full == off + ANSWER["content"] + "<|im_end|>\n"
    assert render(saved_tokenizer, [USER, ANSWER], enable_thinking=True) == full


def test_reasoning_is_kept_for_the_last_answer_only(saved_tokenizer):
    thought = {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nok"}
    text = render(saved_tokenizer, [USER, thought, USER, thought])
    first, last = text.split("<|im_start|>assistant\n")[1:]
    assert first.startswith("ok<|im_end|>")
    assert last.startswith("<think>\nhmm\n</think>\n\nok<|im_end|>")


def test_loss_mask_of_a_toy_conversation_covers_the_answer(saved_tokenizer):
    ids, mask = chat_template.tokenize_conversation(saved_tokenizer, [SYSTEM, USER, ANSWER],
                                           enable_thinking=False)
    supervised = saved_tokenizer.decode([i for i, bit in zip(ids, mask) if bit])
    assert supervised.endswith("return 1\n<|im_end|>")
    assert "<think>" not in supervised and "Be brief" not in supervised


# --- corpus ----------------------------------------------------------------------------------------

def test_corpus_listing_excludes_tests_and_data_files(tmp_path):
    kept = ["a.py", "pkg/mod.py", "pkg/sub/x.py"]
    dropped = ["test/test_a.py", "pkg/tests/t.py", "idlelib/i.py", "lib2to3/l.py",
               "site-packages/s.py", "__pycache__/c.py", "encodings/cp1.py", "pydoc_data/topics.py",
               "_sysconfigdata__linux.py", "notes.txt"]
    for rel in kept + dropped:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    assert stdlib_corpus.list_corpus_files(tmp_path) == sorted(kept)


def test_stdlib_split_is_disjoint_deterministic_and_order_free():
    files = stdlib_corpus.list_corpus_files(stdlib_corpus.stdlib_root())
    assert len(files) > 300 and not any("/test/" in f or f.startswith("test/") for f in files)
    groups = stdlib_corpus.split_corpus(files)
    assert set(groups) == {"train", "prompt", "bench"}
    assert sum(map(len, groups.values())) == len(files)
    assert all(groups.values())
    assert set().union(*map(set, groups.values())) == set(files)
    assert groups == stdlib_corpus.split_corpus(list(files))
    reordered = stdlib_corpus.split_corpus(sorted(files, reverse=True))
    assert {k: set(v) for k, v in reordered.items()} == {k: set(v) for k, v in groups.items()}
    assert len(groups["train"]) > len(groups["prompt"]) > len(groups["bench"])


SOURCE = '''import os


def one_liner(): return 1


class Box:
    """A box."""

    @property
    def size(self):
        """Its size."""
        return 3

    def grow(self, by,
             twice=False):
        def step(n):
            return n + by
        return step(step(0)) if twice else step(0)
'''


def test_function_examples_split_head_and_body():
    examples = stdlib_corpus.function_examples(SOURCE, context_lines=2, max_prompt_chars=1000, max_body_chars=1000)
    heads = {head.splitlines()[-1].strip(): (head, body) for head, body in examples}
    assert set(heads) == {"def size(self):", "twice=False):", "def step(n):"}
    head, body = heads["def size(self):"]
    assert head == '    """A box."""\n\n    @property\n    def size(self):\n'
    assert body == '        """Its size."""\n        return 3\n'
    for head, body in examples:
        assert head + body in SOURCE
    grow_head, grow_body = heads["twice=False):"]
    assert grow_body.endswith("return step(step(0)) if twice else step(0)\n")
    limited = stdlib_corpus.function_examples(SOURCE, context_lines=2, max_prompt_chars=1000, max_body_chars=40)
    assert [body for _, body in limited] == ["            return n + by\n"]


def test_sample_in_order_is_a_seeded_ordered_subset():
    items = list(range(100))
    picked = world.sample_in_order(items, 10, seed=3)
    assert len(set(picked)) == 10 and picked == sorted(picked)
    assert picked == world.sample_in_order(items, 10, seed=3) != world.sample_in_order(items, 10, seed=4)
    assert world.sample_in_order(items[:5], 10, seed=3) == items[:5]


def test_prompt_and_bench_files_are_read_by_the_pipeline(tmp_path):
    root = tmp_path / "lib"
    root.mkdir()
    (root / "m.py").write_text(SOURCE)
    corpus = {"stdlib": str(root), "splits": {"prompt": ["m.py"], "bench": ["m.py"]}}
    (tmp_path / "corpus.json").write_text(json.dumps(corpus))
    toy.step_prompts(tmp_path)
    toy.step_bench(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        assert row["group"] == "m.py"  # the source file: the held-out split keeps it together
        messages = chat.normalize_row(row)
        assert [m["role"] for m in messages] == ["user"]
        assert messages[0]["content"].startswith(stdlib_corpus.INSTRUCTION)
    bench = load_jsonl(tmp_path / "bench.jsonl")
    assert [p.turns[0] for p in bench] == [r["messages"][0]["content"] for r in rows]


# --- training pieces -------------------------------------------------------------------------------

def test_pack_documents_separates_and_drops_the_tail(tokenizer):
    docs = ["a = 1\n", "b = 2\n"]
    ids = [tokenizer(d, add_special_tokens=False)["input_ids"] for d in docs]
    stream = ids[0] + [tokenizer.pad_token_id] + ids[1] + [tokenizer.pad_token_id]
    rows = stdlib_corpus.pack_documents(tokenizer, docs, seq_len=3)
    assert rows.shape == (len(stream) // 3, 3)
    assert rows.flatten().tolist() == stream[: rows.numel()]


def test_training_documents_add_a_chat_per_function(tokenizer):
    documents = stdlib_corpus.training_documents(tokenizer, [SOURCE], toy.EXAMPLE_LIMITS)
    assert documents[0] == SOURCE
    chats = documents[1:]
    assert len(chats) == 3
    for text in chats:
        assert text.startswith("<|im_start|>user\n" + stdlib_corpus.INSTRUCTION)
        assert "<|im_start|>assistant\n<think>\n\n</think>\n\n" in text and text.endswith("<|im_end|>\n")


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    lrs = [toy.lr_at(step, 100, 1.0, 10) for step in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert toy.lr_at(100, 100, 1.0, 10) == pytest.approx(0.1)


def test_train_target_lowers_the_loss_deterministically(tokenizer, texts):
    rows = stdlib_corpus.pack_documents(tokenizer, texts[:1], seq_len=32)[:64]
    before = toy.mean_loss(tiny_model(tokenizer), rows, batch_size=16)
    runs = []
    for _ in range(2):
        model = tiny_model(tokenizer)
        runs.append(toy.train_target(model, rows, steps=30, batch_size=8, peak_lr=1e-2, seed=0))
    assert runs[0] == runs[1]
    assert not model.training
    after = toy.mean_loss(model, rows, batch_size=16)
    assert after < before - 1.0


def test_distinct_ngram_share_scores_loops_low():
    assert toy.distinct_ngram_share([[1, 2, 3, 4, 5, 6]], n=4) == 1.0
    assert toy.distinct_ngram_share([[1, 2, 1, 2, 1, 2]], n=2) == pytest.approx(2 / 5)
    mixed = [[7, 7, 7, 7, 7], [1, 2, 3], [1, 2, 3, 4]]  # (1/2 + 1) / 2, the short one skipped
    assert toy.distinct_ngram_share(mixed, n=4) == pytest.approx(0.75)
    with pytest.raises(ValueError):
        toy.distinct_ngram_share([[1, 2]], n=4)


def test_force_removes_the_builds_outputs_and_nothing_else(tmp_path, monkeypatch):
    """--out may be a directory the user keeps other files in (even `.`): --force must not wipe it."""
    monkeypatch.setattr(toy.world, "run_stages", lambda out, stages: {})
    monkeypatch.setattr(toy, "step_report", lambda out: {"target": {}, "heldout_loss": 0, "distinct_4gram_share": 0})
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "corpus.json").write_text("{}")
    (tmp_path / "train_data").mkdir()
    (tmp_path / "regenerated.summary.json").write_text("{}")
    toy.main(["--out", str(tmp_path), "--force"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
