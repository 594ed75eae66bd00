"""The toy world's tokenizer: byte-level BPE trained on the corpus, with Qwen3's special tokens and a
Qwen3-style chat template (`build_tokenizer`). Built by `data/toy.py`; the tests' tiny tokenizer and
the benchmarks' small targets are built by it too."""
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = [PAD_TOKEN, "<|im_start|>", EOS_TOKEN, MASK_TOKEN]
# Atomic but not special (as in Qwen3): they survive decode(skip_special_tokens=True).
THINK_TOKENS = ["<think>", "</think>"]

# GPT-2's split, except that a run of newlines (with the spaces before it) is a piece of its own:
# indentation never merges with the line break before it, so a prompt that ends with "\n" (as the
# chat template's headers do) ends on the same token boundary as the training text.
PRETOKENIZE_PATTERN = (r"'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+"
                       r"|\s*[\r\n]+|[^\S\r\n]+(?!\S)|[^\S\r\n]+")

# Qwen3's conventions: an assistant turn after the last user turn opens with a think block (empty
# when its content carries no `<think>...</think>` reasoning) and earlier assistant turns drop their
# reasoning; the generation prompt gets the empty think block only with enable_thinking=False.
# So with thinking off, a rendered conversation starts with the rendered prompt of its last answer.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('unknown role: ' + message['role']) -}}"
    "{%- elif message['role'] == 'system' and not loop.first -%}"
    "{{- raise_exception('a system message must come first') -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{%- set answer = message['content'] -%}"
    "{%- set reasoning = '' -%}"
    "{%- if '</think>' in answer -%}"
    "{%- set reasoning = answer.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set answer = answer.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_user -%}"
    "{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- answer + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def build_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on texts and wrap it with the chat template and special tokens.

    len(tokenizer) == vocab_size, the think tokens included. Every byte is in the base alphabet,
    so any string round-trips through encode and decode.
    """
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    # Offsets keep a token's leading space, as Qwen's tokenizer does (loss masks map spans by them).
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(THINK_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        mask_token=MASK_TOKEN,
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.add_tokens(THINK_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
