"""A tiny byte-level BPE tokenizer with a Qwen3-style chat template, built in process for the tests.

`save_tiny_tokenizer(dir)` writes a directory that `AutoTokenizer.from_pretrained(dir)` loads, so the
CLIs under test see it exactly as they would see a real target's tokenizer. The template follows
the Qwen3 conventions that matter for the loss mask: `<|im_start|>role\\n ... <|im_end|>\\n` turns, an
optional system turn, reasoning kept only for assistant turns after the last user turn (earlier
ones are rendered without their `<think>` block), an empty `<think>\\n\\n</think>\\n\\n` inserted for
those later turns when they carry no reasoning, and `enable_thinking=False` adding that empty block
to the generation prompt.
"""
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
THINK_TOKENS = ["<think>", "</think>"]  # added, not special: decoding keeps them, like Qwen3

CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set answer = m.content -%}{%- set thought = '' -%}"
    "{%- if '</think>' in answer -%}"
    "{%- set thought = answer.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set answer = answer.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_user -%}{{- '<think>\\n' + thought + '\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- answer + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, how are you today?",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "What is the capital of France? The capital of France is Paris.",
    "Let me think step by step: 2 + 2 = 4, and 4 * 3 = 12. The answer is 12.",
    "You are a helpful assistant. Answer briefly and precisely.",
    "Bonjour! Ça va? Grüße aus München. 日本語のテキスト。",
]


def build_tiny_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on a fixed corpus (deterministic) and wrap it with the chat template."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps a token's leading space in its offsets, as Qwen's tokenizer does.
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tokenizer.add_tokens(THINK_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", mask_token="<|mask|>",
                                   chat_template=CHAT_TEMPLATE)


def save_tiny_tokenizer(directory: str | Path) -> Path:
    """Write the tiny tokenizer to `directory` (created if needed) and return the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer().save_pretrained(directory)
    return directory
