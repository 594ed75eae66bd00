"""Conversations rendered with the target's chat template, and the loss mask over their tokens.

Loss mask (which tokens the drafter learns to predict): for every assistant turn (or only the
last one), the answer text, any whitespace after it and the special token that closes the turn
(`<|im_end|>` for Qwen): at serving time the drafter must propose that token too. In a row that
data/regenerate.py marks `truncated` (an answer hit --max-tokens) no closing token is supervised:
the target never chose to end there. When the message carries reasoning
that the template renders, the span starts at its `<think>` tag, which the target generates
itself. A tool-call turn is supervised as the template renders it (its calls included). The
answer's indentation is supervised; its leading newlines are not (templates strip them, or they
cannot be told from the header's). Template text is never supervised: role headers, and the empty
`<think>\\n\\n</think>\\n\\n` that Qwen3 templates insert for thinking-off turns (at serving time it
is part of the prompt). Spans are found as character offsets in the rendered text and mapped to
tokens with the tokenizer's offset mapping: a token is supervised when its first character lies
inside a span (a token that merges template whitespace with the answer's first characters is
therefore not).
"""
import bisect
import functools
import json
import re

from drafter.pipeline.chat import BadRow, THINK_CLOSE, THINK_OPEN, split_reasoning, uses_tools, with_system_prompt

def render(tokenizer, messages: list[dict], enable_thinking: bool,
           add_generation_prompt: bool = False) -> str:
    """The conversation as text through the tokenizer's chat template; raises BadRow."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             enable_thinking=enable_thinking)
    except Exception as error:  # templates raise anything (jinja errors, "roles must alternate")
        raise BadRow("template_error", str(error)[:200]) from error


def render_prompt(tokenizer, messages: list[dict], enable_thinking: bool,
                  system_prompt: str | None = None) -> str:
    """The text a target is given to answer `messages` (which should end with a user turn)."""
    return render(tokenizer, with_system_prompt(messages, system_prompt), enable_thinking,
                  add_generation_prompt=True)


def prompt_token_ids(tokenizer, messages: list[dict], enable_thinking: bool) -> list[int]:
    """Token ids of `render_prompt` (the chat template adds any special tokens itself)."""
    return tokenizer(render_prompt(tokenizer, messages, enable_thinking), add_special_tokens=False).input_ids


@functools.lru_cache(maxsize=8)
def special_token_regex(tokenizer) -> re.Pattern:
    """One of the tokenizer's special added tokens (the turn closers among them)."""
    specials = {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
    return re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))


@functools.lru_cache(maxsize=8)
def turn_end_regex(tokenizer) -> re.Pattern:
    """Whitespace then one of the tokenizer's special added tokens (the turn closers)."""
    return re.compile(rf"\s*(?:{special_token_regex(tokenizer).pattern})")


def check_answers(tokenizer, messages: list[dict]) -> None:
    """Raise BadRow for answers whose text the template or tokenizer would read as structure: a
    special token's text, in the content or in a tool call (it would end the turn mid-answer), or
    more than one think tag."""
    specials = special_token_regex(tokenizer)
    for message in messages:
        if message["role"] != "assistant":
            continue
        calls = json.dumps(message.get("tool_calls", []), ensure_ascii=False)
        found = specials.search(message["content"]) or specials.search(calls)
        if found:
            raise BadRow("special_token_text", found.group())
        if message["content"].count(THINK_OPEN) > 1 or message["content"].count(THINK_CLOSE) > 1:
            raise BadRow("extra_think_tags")


def has_unclosed_reasoning(messages: list[dict]) -> bool:
    """Whether an answer opens a `<think>` block and never closes it: reasoning cut short, which
    no split can remove and after which the end of turn is false."""
    return any(m["role"] == "assistant" and THINK_OPEN in m["content"] and THINK_CLOSE not in m["content"]
               for m in messages)


def without_reasoning(messages: list[dict]) -> tuple[list[dict], bool]:
    """(messages with each assistant turn's `<think>` block removed, whether any held reasoning)."""
    stripped, removed = [], False
    for message in messages:
        reasoning, answer = split_reasoning(message["content"]) if message["role"] == "assistant" else (None, "")
        if reasoning is None:
            stripped.append(message)
            continue
        removed |= bool(reasoning)
        stripped.append(message | {"content": answer.lstrip("\n")})
    return stripped, removed


def find_answer(text: str, answer: str, start: int, turn_end: re.Pattern) -> tuple[int, int] | None:
    """[start, end) of the first `answer` at or after `start` that a turn closer follows; the end
    includes the closer. Requiring the closer keeps a short answer from matching inside a header."""
    found = text.find(answer, start)
    while found >= 0:
        closer = turn_end.match(text, found + len(answer))
        if closer:
            return found, closer.end()
        found = text.find(answer, found + 1)
    return None


def rendered_answer(tokenizer, messages: list[dict], index: int, enable_thinking: bool) -> str:
    """The answer of assistant turn `index` as the template renders it after the generation prompt
    (tool calls included), up to the turn closer and without a leading think block: the text the
    target writes for it. Raises BadRow("tools_unsupported") when the calls are not rendered."""
    prompt = render(tokenizer, messages[:index], enable_thinking, add_generation_prompt=True)
    through = render(tokenizer, messages[:index + 1], enable_thinking)
    closer = turn_end_regex(tokenizer).search(through, len(prompt))
    if not through.startswith(prompt) or closer is None:
        raise BadRow("tools_unsupported", "the tool-call turn does not follow the generation prompt")
    answer = split_reasoning(through[len(prompt):closer.start()])[1]
    for call in messages[index]["tool_calls"]:
        if call["function"]["name"] not in answer:
            raise BadRow("tools_unsupported", f"the template does not render the call to {call['function']['name']!r}")
    return answer


def assistant_spans(text: str, messages: list[dict], turn_end: re.Pattern,
                    answers: dict[int, str] | None = None, closers: bool = True) -> list[tuple[int, int]]:
    """Character spans [start, end) of the supervised part of each assistant turn in `text`.

    `answers` overrides the answer text of some turns (tool calls, as `rendered_answer` gives them);
    `closers=False` leaves each turn's closing whitespace and token out of its span. Walks the
    messages in order with a cursor past each located turn, so that an answer is never matched
    inside an earlier turn (a user turn quoting it, say).
    """
    spans, cursor = [], 0
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            content = message["content"].strip()
            found = text.find(content, cursor)
            if found >= 0:
                cursor = found + len(content)
            elif message["role"] == "tool":
                raise BadRow("tools_unsupported", "the template does not render a tool turn's content")
            continue
        reasoning, answer = split_reasoning(message["content"])
        answer = (answers or {}).get(index, answer)
        span = find_answer(text, answer.strip(), cursor, turn_end)
        if span is None:
            raise BadRow("span_not_found", answer.strip()[:60])
        start, end = span
        if not closers:
            end = start + len(answer.strip())
        # The answer's own indentation (code) is the target's output too, when the template kept it.
        indent = answer[: len(answer) - len(answer.lstrip())].rsplit("\n", 1)[-1]
        if indent and start - len(indent) >= cursor and text[start - len(indent):start] == indent:
            start -= len(indent)
        if reasoning:
            thought = text.find(reasoning, cursor, start)
            if thought >= 0:
                tag = text.rfind(THINK_OPEN, cursor, thought)
                start = tag if tag >= 0 else thought
        spans.append((start, end))
        cursor = span[1]
    return spans


def tokens_in_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """0/1 per token: 1 when the token's first character lies inside one of `spans`.
    `offsets` are a single sequence's (start, end) character offsets, so starts never decrease."""
    starts = [start for start, _ in offsets]
    mask = [0] * len(offsets)
    for span_start, span_end in spans:
        for i in range(bisect.bisect_left(starts, span_start), bisect.bisect_left(starts, span_end)):
            mask[i] = int(offsets[i][1] > offsets[i][0])
    return mask


def tokenize_conversation(tokenizer, messages: list[dict], enable_thinking: bool,
                          last_turn_only: bool = False, closers: bool = True) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a full conversation; raises BadRow (template_error,
    span_not_found, special_token_text, extra_think_tags, tools_unsupported). `closers=False`:
    no turn's closing token is supervised (a row whose answer was cut off)."""
    check_answers(tokenizer, messages)
    try:
        text = render(tokenizer, messages, enable_thinking)
        answers = {index: rendered_answer(tokenizer, messages, index, enable_thinking)
                   for index, message in enumerate(messages) if "tool_calls" in message}
    except BadRow as bad:
        if bad.reason == "template_error" and uses_tools(messages):
            raise BadRow("tools_unsupported", str(bad)) from bad
        raise
    spans = assistant_spans(text, messages, turn_end_regex(tokenizer), answers, closers)
    if last_turn_only:
        spans = spans[-1:]
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoding["input_ids"]), tokens_in_spans(encoding["offset_mapping"], spans)


def longest_supervised_run(mask: list[int]) -> int:
    """Length of the longest run of consecutive 1s."""
    return max(map(len, bytes(mask).split(b"\x00")))
