"""ShareGPT conversations as chat prompts: each conversation's first user turn, dropped by reason, split
into training and bench by conversation (the parts of one conversation never straddle the split)."""
import hashlib
import re

BENCH_PERCENT = 5            # conversations whose id hashes below this go to the chat bench
MAX_PROMPT_CHARS = 1200      # long pastes cost a CPU prefill and leave little room for the answer
MIN_ASCII_SHARE = 0.95       # SmolLM2-135M writes English; other scripts get garbled answers


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
