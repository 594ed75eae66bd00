"""A tiny version of the toy world's tokenizer (byte-level BPE, Qwen3-style chat template, mask
token), trained in process on a few sentences for the tests.

`save_tiny_tokenizer(dir)` writes a directory that `AutoTokenizer.from_pretrained(dir)` loads, so the
CLIs under test see it exactly as they would see a real target's tokenizer.
"""
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from drafter.synthesis.toy_tokenizer import build_tokenizer

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, how are you today?",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "What is the capital of France? The capital of France is Paris.",
    "Let me think step by step: 2 + 2 = 4, and 4 * 3 = 12. The answer is 12.",
    "You are a helpful assistant. Answer briefly and precisely.",
    "Bonjour! Ça va? Grüße aus München. 日本語のテキスト。",
]


def build_tiny_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    return build_tokenizer(_CORPUS * 4, vocab_size)


def save_tiny_tokenizer(directory: str | Path) -> Path:
    """Write the tiny tokenizer to `directory` (created if needed) and return the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer().save_pretrained(directory)
    return directory
