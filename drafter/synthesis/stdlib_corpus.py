"""The toy world's corpus and chat task: the Python standard library's own source, each file assigned
by a hash of its path to one of three disjoint sets (the target trains on "train" files, the prompts it
answers come from "prompt" files, the held-out bench prompts from "bench" files); the task, "Complete
this function:" after the lines before a function and its signature, answered with the body."""
import ast
import hashlib
import sysconfig
from pathlib import Path

import torch

# The toy target is a non-thinking model: its chats, and every prompt rendered for it, use thinking off.
ENABLE_THINKING = False
INSTRUCTION = "Complete this function:\n"

# Path parts that take a file out of the corpus: tests, the IDE, 2to3, installed packages, and
# files that are data rather than code (codec tables, pydoc's text dump, the build's sysconfig).
EXCLUDED_PARTS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__",
                  "encodings", "pydoc_data"}
EXCLUDED_NAME_PREFIXES = ("_sysconfigdata",)
SPLIT_PERCENT = {"train": 70, "prompt": 20, "bench": 10}


def stdlib_root() -> Path:
    """The directory holding the running interpreter's standard library source."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_corpus_files(root: Path) -> list[str]:
    """Sorted posix paths, relative to root, of the standard library's non-test Python files."""
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_PARTS.intersection(rel.parts) or rel.name.startswith(EXCLUDED_NAME_PREFIXES):
            continue
        files.append(rel.as_posix())
    return sorted(files)


def split_of(rel_path: str) -> str:
    """The set ("train", "prompt" or "bench") a file belongs to, fixed by a hash of its path."""
    bucket = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "big") % 100
    for name, percent in SPLIT_PERCENT.items():
        if bucket < percent:
            return name
        bucket -= percent
    raise AssertionError("SPLIT_PERCENT must sum to 100")


def split_corpus(files: list[str]) -> dict[str, list[str]]:
    """Group files by split_of, keeping each group in the given (sorted) order."""
    groups = {name: [] for name in SPLIT_PERCENT}
    for rel_path in files:
        groups[split_of(rel_path)].append(rel_path)
    return groups


def function_examples(source: str, context_lines: int, max_prompt_chars: int,
                      max_body_chars: int) -> list[tuple[str, str]]:
    """(head, body) pairs, one per function of a module whose pieces fit the size limits.

    head: up to context_lines lines before the function, then its decorators and signature;
    body: the rest of the function. Functions written on one line are skipped.
    """
    lines = source.splitlines(keepends=True)
    examples = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first_line = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        body_line = node.body[0].lineno - 1
        if body_line < node.lineno:
            continue
        head = "".join(lines[max(0, first_line - context_lines):body_line])
        body = "".join(lines[body_line:node.end_lineno])
        if len(head) <= max_prompt_chars and len(body) <= max_body_chars:
            examples.append((head, body))
    return examples


def completion_messages(head: str) -> list[dict]:
    """The chat prompt asking the target to write the body of the function that head opens."""
    return [{"role": "user", "content": INSTRUCTION + head}]


def pack_documents(tokenizer, documents: list[str], seq_len: int) -> torch.Tensor:
    """Tokenise documents, join them with the pad token as separator, cut into [n, seq_len] rows.

    The tail that does not fill a whole row is dropped.
    """
    stream = []
    for ids in tokenizer(documents, add_special_tokens=False)["input_ids"]:
        stream.extend(ids)
        stream.append(tokenizer.pad_token_id)
    n_rows = len(stream) // seq_len
    return torch.tensor(stream[: n_rows * seq_len], dtype=torch.long).view(n_rows, seq_len)


def training_documents(tokenizer, sources: list[str], example_limits: dict) -> list[str]:
    """Each source file as raw text, plus each of its functions as a rendered completion chat."""
    documents = list(sources)
    for source in sources:
        for head, body in function_examples(source, **example_limits):
            messages = completion_messages(head) + [{"role": "assistant", "content": body}]
            documents.append(tokenizer.apply_chat_template(
                messages, tokenize=False, enable_thinking=ENABLE_THINKING))
    return documents
