"""The token that fills the masked positions of a drafter's block (`dflash_config.mask_token_id`).

The drafter embeds its block through the frozen target's embedding, so the mask is one of the
target's embedding rows, and it must be one that no real context ever puts there: a token the
training data never contains. Unless `drafter.mask_token_id` names one, it is chosen in this order:

1. the tokenizer's own mask token, unless the training data contains it;
2. `<|MASK|>`, added at the first embedding row past the tokenizer's tokens (Qwen3: 151669, the
   public Qwen3 drafters' mask);
3. the first reserved placeholder among the added tokens (Llama 3 / 3.1: 128002,
   <|reserved_special_token_0|>, the public Llama 3.1 drafter's mask);
4. the first added special token that is not one of the tokenizer's named tokens (bos, eos, pad,
   ...), that the chat template does not write and that the training data never contains (SmolLM2:
   3, <repo_name>, a marker of its pretraining corpus);
5. none: a ConfigError that asks for drafter.mask_token_id.

An id given by hand is refused when the training data contains it.

The candidates of 3 and 4 must be absent from the data that is given; 4 is only taken with data.
"""
import re
from dataclasses import dataclass

from drafter.pipeline.datasets import token_ids_in, token_occurs
from drafter.errors import ConfigError

ADDED_MASK = "<|MASK|>"
RESERVED_NAME = re.compile(r"reserved|unused|place.?holder", re.IGNORECASE)
NAMED_TOKENS = ("bos_token_id", "eos_token_id", "unk_token_id", "sep_token_id", "pad_token_id", "cls_token_id")


@dataclass(frozen=True)
class MaskToken:
    id: int
    text: str
    source: str  # how it was chosen

    def line(self) -> str:
        return f"mask token: {self.id} {self.text} ({self.source})"


def choose_mask_token(tokenizer, vocab_size: int, data=()) -> MaskToken:
    """The mask token for a target of `vocab_size` embedding rows (rules in the module docstring).
    `data`: the training datasets (input_ids columns) whose tokens the mask must avoid. Rule 2 adds
    the token to `tokenizer`."""
    own = tokenizer.mask_token_id
    if own is not None and own < vocab_size and not (data and token_occurs(data, own)):
        return MaskToken(tokenizer.mask_token_id, tokenizer.mask_token, "the tokenizer's mask token")
    if len(tokenizer) < vocab_size:
        tokenizer.add_special_tokens({"mask_token": ADDED_MASK})
        return MaskToken(tokenizer.mask_token_id, ADDED_MASK,
                         f"added at the first of the target's {vocab_size - tokenizer.mask_token_id} embedding "
                         "rows past the tokenizer")
    unused = unused_added_tokens(tokenizer, vocab_size, data)
    reserved = [(i, text) for i, text, _ in unused if RESERVED_NAME.search(text)]
    if reserved:
        checked = ", absent from the data" if data else ""
        return MaskToken(*reserved[0], f"the first reserved placeholder token{checked}")
    spare = [(i, text) for i, text, special in unused if special]
    if data and spare:
        return MaskToken(*spare[0], "the first added special token that is not a named one (bos, eos, unk, pad, "
                                    "...), that the chat template does not write and the data never contains")
    raise ConfigError(
        f"no mask token for this target: the tokenizer has none of its own, its {len(tokenizer)} tokens fill the "
        f"target's {vocab_size} embedding rows, and no added token is a reserved placeholder or a special token that the "
        f"chat template {'and the data leave' if data else 'leaves'} unused; set drafter.mask_token_id to the id "
        "of a token that never occurs in the training data")


def check_given_mask_token(mask_token_id: int, data) -> None:
    """drafter.mask_token_id set by hand: refused when the training data contains it (its embedding
    would stand both for a masked slot and for that token)."""
    if token_occurs(data, mask_token_id):
        raise ConfigError(f"drafter.mask_token_id={mask_token_id} occurs in the training data: the drafter could "
                          "not tell a masked slot from that token; give the id of a token that never occurs "
                          "(or null to have one chosen)")


def unused_added_tokens(tokenizer, vocab_size: int, data) -> list[tuple[int, str, bool]]:
    """(id, text, special) of the tokenizer's added tokens, by id, that have an embedding row and
    that neither its named tokens, its chat template nor `data` use."""
    named = {getattr(tokenizer, name, None) for name in NAMED_TOKENS}
    template = tokenizer.chat_template or ""
    templates = "\n".join(template.values()) if isinstance(template, dict) else template
    in_data = token_ids_in(data, vocab_size) if data else None
    return [(i, token.content, token.special) for i, token in sorted(tokenizer.added_tokens_decoder.items())
            if i < vocab_size and i not in named and token.content not in templates
            and (in_data is None or not in_data[i])]
