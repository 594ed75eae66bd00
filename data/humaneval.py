"""HumanEval's problems as a chat bench: each function's prompt in a request to complete it."""
import gzip
import json
from pathlib import Path

CODE_INSTRUCTION = ("Complete the following Python function. Answer with the whole function in one "
                    "```python code block.\n\n```python\n{prompt}```")


def humaneval_chats(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [{"messages": [{"role": "user", "content": CODE_INSTRUCTION.format(prompt=p["prompt"])}],
             "group": p["task_id"]} for p in problems]
