"""The mask token of drafter/models/mask_token.py on tokenizers built here with the special-token layouts of
real targets: SmolLM2 (every embedding row a token, its special tokens at the front), Llama 3 (the
vocabulary filled up by reserved special tokens) and Qwen3 (spare embedding rows past the tokenizer),
and train.py's one-line report when no token qualifies."""
import os
import subprocess
import sys

import datasets
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from drafter.config import ConfigError
from drafter.models.mask_token import ADDED_MASK, choose_mask_token
from drafter.target_model.model import random_qwen3
from runs import REPO, write_run
from tiny_tokenizer import build_tiny_tokenizer

WORDS = "user assistant hello world how are you the answer is yes no".split()  # no unknown word in the chats

SMOLLM2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>",
                    "<filename>", "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>",
                    "<jupyter_start>", "<jupyter_text>", "<jupyter_code>", "<jupyter_output>", "<jupyter_script>",
                    "<empty_output>"]
SMOLLM2_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
                    "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
                    "{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
                   *[f"<|reserved_special_token_{i}|>" for i in range(2, 6)]]
LLAMA3_TEMPLATE = ("{{ '<|begin_of_text|>' }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] "
                   "+ '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]


def word_level_tokenizer(tokens: list[str], specials: list[str], template: str, **named) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over `tokens` (in id order) whose `specials` (among them) are
    added special tokens, as in a real tokenizer.json; `named`: bos_token=..., eos_token=..."""
    model = Tokenizer(models.WordLevel({token: i for i, token in enumerate(tokens)}, unk_token=tokens[0]))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    model.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, **named)
    tokenizer.chat_template = template
    return tokenizer


def smollm2_shaped() -> PreTrainedTokenizerFast:
    return word_level_tokenizer(SMOLLM2_SPECIALS + WORDS, SMOLLM2_SPECIALS, SMOLLM2_TEMPLATE, bos_token="<|im_start|>",
                                eos_token="<|im_end|>", unk_token="<|endoftext|>", pad_token="<|im_end|>")


def llama3_shaped() -> PreTrainedTokenizerFast:
    return word_level_tokenizer(WORDS + LLAMA3_SPECIALS, LLAMA3_SPECIALS, LLAMA3_TEMPLATE,
                                bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")


def chat_data(tokenizer, *answers: str) -> datasets.Dataset:
    """Prepared-data rows: one chat per answer, rendered by the tokenizer's template."""
    rows = [tokenizer.apply_chat_template([{"role": "user", "content": "how are you"},
                                           {"role": "assistant", "content": answer}], tokenize=False)
            for answer in answers]
    return datasets.Dataset.from_dict({"input_ids": [tokenizer(text)["input_ids"] for text in rows]})


def test_smollm2_takes_the_first_special_token_that_neither_template_nor_data_use():
    tokenizer = smollm2_shaped()
    vocab = len(tokenizer)
    with pytest.raises(ConfigError, match="set drafter.mask_token_id"):  # without data nothing is known unused
        choose_mask_token(tokenizer, vocab)
    mask = choose_mask_token(tokenizer, vocab, [chat_data(tokenizer, "yes", "hello world")])
    assert (mask.id, mask.text) == (3, "<repo_name>")
    in_data = [chat_data(tokenizer, "yes"), chat_data(tokenizer, "the answer is <repo_name> <file_sep>")]
    assert choose_mask_token(tokenizer, vocab, in_data).text == "<reponame>"
    assert len(tokenizer) == vocab  # nothing added
    # a token the template writes only where this data does not go (here: with tools) is refused too
    tokenizer.chat_template = "{% if tools %}<repo_name>{% endif %}" + SMOLLM2_TEMPLATE
    assert choose_mask_token(tokenizer, vocab, [chat_data(tokenizer, "yes")]).text == "<reponame>"


def test_a_tokenizer_whose_every_token_is_used_asks_for_drafter_mask_token_id():
    tokenizer = smollm2_shaped()
    everything = chat_data(tokenizer, " ".join(SMOLLM2_SPECIALS[3:]))
    with pytest.raises(ConfigError, match="the chat template and the data leave unused; set drafter.mask_token_id"):
        choose_mask_token(tokenizer, len(tokenizer), [everything])


def test_llama3_takes_its_first_reserved_special_token_as_the_public_drafter():
    tokenizer = llama3_shaped()
    reserved_0 = len(WORDS) + 2  # 128002 in Llama 3's own vocabulary
    assert choose_mask_token(tokenizer, len(tokenizer)).id == reserved_0
    mask = choose_mask_token(tokenizer, len(tokenizer), [chat_data(tokenizer, "yes")])
    assert (mask.id, mask.text) == (reserved_0, "<|reserved_special_token_0|>")
    in_data = chat_data(tokenizer, "no <|reserved_special_token_0|>")
    assert choose_mask_token(tokenizer, len(tokenizer), [in_data]).text == "<|reserved_special_token_1|>"
    with pytest.raises(ConfigError, match="set drafter.mask_token_id"):  # no reserved token has an embedding row
        choose_mask_token(tokenizer, reserved_0)


def test_qwen3_adds_the_mask_at_the_first_spare_embedding_row():
    tokenizer = word_level_tokenizer(WORDS + QWEN3_SPECIALS, QWEN3_SPECIALS, SMOLLM2_TEMPLATE,
                                     eos_token="<|im_end|>", pad_token="<|endoftext|>")
    size = len(tokenizer)  # 151669 for Qwen3, whose embedding has 151936 rows
    mask = choose_mask_token(tokenizer, size + 8, [chat_data(tokenizer, "yes")])
    assert (mask.id, mask.text) == (size, ADDED_MASK)
    assert tokenizer.mask_token_id == size and len(tokenizer) == size + 1


def test_a_tokenizer_with_its_own_mask_token_keeps_it():
    tokenizer = build_tiny_tokenizer()  # the toy world's: <|mask|> among its tokens
    size, own = len(tokenizer), tokenizer.mask_token_id
    assert choose_mask_token(tokenizer, size + 16).id == own
    assert len(tokenizer) == size


def test_a_tokenizers_own_mask_token_that_the_data_contains_is_passed_over():
    tokenizer = build_tiny_tokenizer()
    size, own = len(tokenizer), tokenizer.mask_token_id
    in_data = datasets.Dataset.from_dict({"input_ids": [[1, 2, own, 4]]})
    assert choose_mask_token(tokenizer, size + 16, [in_data]).id == size  # <|MASK|> at the first spare row
    with pytest.raises(ConfigError, match="set drafter.mask_token_id"):  # no spare row, no other candidate
        choose_mask_token(build_tiny_tokenizer(), size, [in_data])


def test_train_py_reports_a_target_without_a_mask_token_in_one_line(tmp_path):
    """SmolLM2's layout, and prepared data (token ids 0..31) that contains every special token:
    train.py names drafter.mask_token_id instead of a traceback, before the drafter is built."""
    target_dir = tmp_path / "target"
    tokenizer = word_level_tokenizer(SMOLLM2_SPECIALS + [f"w{i}" for i in range(47)], SMOLLM2_SPECIALS,
                                     SMOLLM2_TEMPLATE, bos_token="<|im_start|>", eos_token="<|im_end|>")
    tokenizer.save_pretrained(target_dir)
    random_qwen3(vocab_size=len(tokenizer), num_hidden_layers=4).save_pretrained(target_dir)
    cfg = write_run(tmp_path)
    proc = subprocess.run([sys.executable, "train.py", "--cfg", str(cfg), f"target.path={target_dir}",
                           "target.random=null", "drafter.mask_token_id=null", "train.engine=fsdp"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: no mask token for this target: the tokenizer has none of its own, its 64 tokens fill" in proc.stderr
    assert "the chat template and the data leave unused; set drafter.mask_token_id" in proc.stderr
    assert "Traceback" not in proc.stderr
