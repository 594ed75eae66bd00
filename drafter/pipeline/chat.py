"""Chat data: reading conversation files, normalising their shapes, rendering, and the loss mask.

Shared by `data/prepare.py` (tokenise + loss mask), `data/regenerate.py` (the target rewrites the
answers) and prompt formatting for evaluation, so that all three see a conversation the same way.

Input rows (one JSON object each) come in these shapes; all become a list of
`{"role": "system"|"user"|"assistant"|"tool", "content": str}` messages:
  ShareGPT     {"conversations": [{"from": "human"|"gpt"|"system"|"user"|"assistant", "value": str}]}
  OpenAI       {"messages": [{"role": ..., "content": str | [{"type": "text", "text": str}, ...]}]}
               (also UltraChat-200k and Nemotron-Post-Training v1/v2, whose other columns such as
               `reasoning`, `category` are ignored; an assistant `reasoning_content` string
               is folded into the content as a leading `<think>` block). Tool use in the OpenAI
               shape is kept: an assistant turn's `tool_calls` (normalised to
               `[{"type": "function", "function": {"name", "arguments"}}]`, content may be empty)
               and `tool` turns (`function` is an alias), which the target's chat template renders.
  UltraChat    {"data": [user, assistant, user, ...]} (alternating strings)
  Llama-Nemotron {"input": str | messages, "output": str, "system_prompt": str (optional)}

Reasons a row is dropped (stable strings; counted in prepare's stats.json and regenerate's summary):
  encoding               a JSONL line, or a string of a parquet row, that is not valid UTF-8
  malformed_json         a JSONL line that does not parse as JSON
  nesting_too_deep       a row nested deeper than MAX_NESTING (100) lists and objects
  not_a_conversation     a row that is not an object or holds no conversation in a known shape
  unknown_role           a turn whose role is not system/user/assistant/tool (or an alias of one)
  non_string_content     a turn whose content is neither a string nor a list of text parts
  empty_content          a turn whose content is empty or blank (for an assistant: its answer)
  bad_tool_call          an assistant `tool_calls` entry without a function name, or with arguments
                         that are neither a string nor an object JSON can write
  tools_unsupported      tool calls or tool turns that the target's chat template does not render
  tool_turns             tool calls or tool turns: regenerate cannot run the tools (regenerate)
  special_token_text     an answer or tool call holding the text of a special token (a literal
                         `<|im_end|>`), which would become a turn boundary mid-answer (prepare)
  extra_think_tags       an answer with more than one `<think>` or `</think>` tag (prepare)
  unclosed_think         an answer whose `<think>` is never closed: reasoning cut short (prepare;
                         kept, without its closing token, in a `truncated` row with --thinking)
  no_assistant_turn      nothing to supervise (prepare)
  no_user_turn           nothing to answer (regenerate)
  template_error         the tokenizer's chat template raised on the conversation
  span_not_found         an assistant answer could not be located in the rendered conversation
  too_long               more than --max-length tokens, without --truncate (prepare)
  too_little_supervision fewer than 2 consecutive supervised tokens (prepare)
  loop                   with --drop-loops: an answer whose tail repeats a short n-gram (prepare)

Reading files into rows: chat_files.py. Rendering with the target's chat template and the loss mask:
chat_template.py.
"""
import json
from typing import Any

ROLE_ALIASES = {
    "system": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "model": "assistant",
    "tool": "tool", "function": "tool",
}
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class BadRow(Exception):
    """A row that cannot be used; `reason` is one of the stable strings in the module docstring."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def normalize_row(row: Any) -> list[dict[str, str]]:
    """The row's conversation as `[{"role", "content"}]` with canonical roles; raises BadRow."""
    if not isinstance(row, dict):
        raise BadRow("not_a_conversation", f"a {type(row).__name__}, not an object")
    if isinstance(row.get("conversations"), list):
        turns = row["conversations"]
    elif isinstance(row.get("messages"), list):
        turns = row["messages"]
    elif isinstance(row.get("data"), list):
        turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": text}
                 for i, text in enumerate(row["data"])]
    elif "input" in row and "output" in row:
        turns = _input_output_turns(row)
    else:
        raise BadRow("not_a_conversation", "no conversations/messages/data/input+output field")
    if not turns:
        raise BadRow("not_a_conversation", "empty conversation")
    return [normalize_turn(turn) for turn in turns]


def _input_output_turns(row: dict) -> list:
    prompt = row["input"]
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not isinstance(turns, list):
        raise BadRow("not_a_conversation", "`input` is neither a string nor a list of messages")
    system = row.get("system_prompt")
    head = [{"role": "system", "content": system}] if isinstance(system, str) and system.strip() else []
    return head + turns + [{"role": "assistant", "content": row["output"]}]


def normalize_turn(turn: Any) -> dict:
    if not isinstance(turn, dict):
        raise BadRow("not_a_conversation", f"a turn is a {type(turn).__name__}, not an object")
    # `or`: a parquet schema merged from both spellings holds None in the unused pair of columns
    raw_role = turn.get("role") or turn.get("from")
    role = ROLE_ALIASES.get(raw_role.lower()) if isinstance(raw_role, str) else None
    if role is None:
        raise BadRow("unknown_role", repr(raw_role))
    raw_content = turn.get("content") if turn.get("content") is not None else turn.get("value")
    tool_calls = turn.get("tool_calls") if role == "assistant" else None
    if role == "tool" or (tool_calls and raw_content is None):
        raw_content = "" if raw_content is None else raw_content  # a call or a result may be empty
    content = content_text(raw_content)
    reasoning = turn.get("reasoning_content")
    if role == "assistant" and isinstance(reasoning, str) and reasoning.strip():
        content = join_reasoning(reasoning, content)
    if role == "tool":
        return {"role": "tool", "content": content}
    if tool_calls:
        return {"role": "assistant", "content": content, "tool_calls": normalize_tool_calls(tool_calls)}
    body = split_reasoning(content)[1] if role == "assistant" else content
    if not body.strip():
        raise BadRow("empty_content", f"{role} turn")
    return {"role": role, "content": content}


def normalize_tool_calls(calls: Any) -> list[dict]:
    """OpenAI `tool_calls` as `[{"type": "function", "function": {"name", "arguments"}}]`, the
    arguments kept as given (a JSON string or an object); raises BadRow("bad_tool_call")."""
    if not isinstance(calls, list):
        raise BadRow("bad_tool_call", f"tool_calls is a {type(calls).__name__}, not a list")
    normalized = []
    for call in calls:
        function = call.get("function", call) if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", {}) if isinstance(function, dict) else None
        if not (isinstance(name, str) and name.strip()) or not is_json_text_or_object(arguments):
            raise BadRow("bad_tool_call", json.dumps(call, default=str)[:100])
        normalized.append({"type": "function", "function": {"name": name, "arguments": arguments}})
    return normalized


def is_json_text_or_object(arguments: Any) -> bool:
    """A string, or an object that JSON can write (a parquet column may hold dates or bytes)."""
    if not isinstance(arguments, (str, dict)):
        return False
    try:
        json.dumps(arguments)
    except (TypeError, ValueError):
        return False
    return True


def uses_tools(messages: list[dict]) -> bool:
    return any(m["role"] == "tool" or "tool_calls" in m for m in messages)


def content_text(content: Any) -> str:
    """A message content as text: a string, or the text parts of an OpenAI content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            for part in content):
        return "\n".join(part["text"] for part in content)
    raise BadRow("non_string_content", type(content).__name__)


def split_reasoning(content: str) -> tuple[str | None, str]:
    """(reasoning, answer) of an assistant content; reasoning is None without a `</think>`."""
    if THINK_CLOSE not in content:
        return None, content
    head, _, answer = content.rpartition(THINK_CLOSE)
    return head.split(THINK_OPEN)[-1].strip(), answer


def join_reasoning(reasoning: str, answer: str) -> str:
    """The inline form of a reasoning + answer pair, as Qwen3-style templates parse it."""
    return f"{THINK_OPEN}\n{reasoning.strip()}\n{THINK_CLOSE}\n\n{answer.lstrip()}"


def with_system_prompt(messages: list[dict], system_prompt: str | None) -> list[dict]:
    """Prepend `system_prompt` unless it is empty or the conversation has its own system turn."""
    if not system_prompt or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": system_prompt}] + messages
