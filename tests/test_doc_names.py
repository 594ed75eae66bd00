"""The names the docs write in backticks exist in the code: every `drafter.x.y` module path resolves,
every repository file path is in the checkout, every config key (`objective.loss`, `train.engine=fsdp`)
is in the schema, and every code-shaped name (`choices()`, `TrainerState`, `block_loss`,
`DFlash2DraftModel.block_trees`) occurs in the code. A rename that leaves a page behind fails here,
naming the page, the line and the name."""
import ast
import importlib
import re
from functools import cache
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from drafter.config import Config
from test_docs import checkout_files

REPO = Path(__file__).resolve().parents[1]
SOURCE_FOLDERS = ("drafter/", "tests/", "bench/", "eval/", "data/", "configs/", "ds_configs/", "docs/")
FILE_SUFFIXES = (".py", ".md", ".yaml", ".json", ".c", ".toml")
FILE_TYPES = ("py", "md", "txt", "yaml", "json", "jsonl", "gz", "parquet", "png", "c", "toml", "gguf", "pt",
              "safetensors")  # a bare name ending so is a file a tool writes (stats.json) or a file type
IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
DOTTED = re.compile(rf"{IDENTIFIER}(\.{IDENTIFIER})*")
# Names the pages write that are not this repo's code: other libraries' API, metric names the code
# builds with f-strings, and fields of files other tools write.
NOT_CODE_NAMES = {
    "Dataset.to_json", "DynamicCache", "glm_moe_dsa",  # datasets' and transformers' API, a hub model type
    "_attention_mask", "configs/qwen3-8b-dflash.json",  # in the public dflash package and SpecForge
    "acc_pos",  # a metric the code names f"{name}_pos" (training/metrics.py)
    "_2",  # the suffix of a split conversation's row ids
}
THIS_FILE = Path(__file__).name  # it writes stale names on purpose


def pages() -> list[str]:
    return [name for name in checkout_files(".md") if name == "README.md" or name.startswith("docs/")]


def backticked(text: str):
    """(line number, name) of every inline code span outside fenced blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            for span in re.findall(r"`([^`\n]+)`", line):
                yield number, span.strip()


@cache
def code_words() -> frozenset[str]:
    """Every identifier the repository's Python defines or uses, its string constants' words and its
    module names: what a code name in the docs must be one of."""
    words = set()
    for name in checkout_files(".py"):
        path = REPO / name
        if path.name == THIS_FILE:
            continue
        words |= set(path.with_suffix("").parts[-1:])
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                words |= set(re.findall(r"\w+", node.value))
            for field in ("id", "attr", "name", "arg", "asname", "module"):
                value = getattr(node, field, None)
                if isinstance(value, str):
                    words |= set(value.split("."))
    return frozenset(words)


@cache
def schema():
    return OmegaConf.structured(Config)


def config_key_problem(key: str) -> str | None:
    """Why `key` (section.field[.sub...]) is no key of the schema, or None. Below a dict-typed field
    (target.random, target.chat_template_kwargs) any sub-key is allowed."""
    node, parts = schema(), key.split(".")
    for depth, part in enumerate(parts):
        # keys(), not `in`: a mandatory field (data.path: ???) is not `in` its node
        if not OmegaConf.is_dict(node) or part not in node.keys():
            return f"{key} is no config key ({'.'.join(parts[:depth + 1])} is not in the schema)"
        field = OmegaConf.get_type(node, part)
        if field is dict or field is None or depth == len(parts) - 1:
            return None
        node = node[part]
    return None


def module_path_problem(name: str) -> str | None:
    """Why the dotted `drafter.…` name resolves to no module or attribute, or None."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        module = target
        for attribute in parts[cut:]:
            if not hasattr(target, attribute):
                return f"{name}: {'.'.join(parts[:cut])} has no {attribute}"
            target = getattr(target, attribute)
        home = getattr(getattr(module, parts[cut]), "__module__", None) if cut < len(parts) else None
        if cut < len(parts) and not hasattr(module, "__path__") and home and home != module.__name__:
            return f"{name}: {module.__name__} only imports it; it lives in {home}"  # a package may re-export
        return None
    return f"{name}: no such module"


def looks_like_code(name: str) -> bool:
    """A name with an underscore, a dot, or an inner capital: `block_loss`, `RESUMABLE_KEYS`,
    `TrainerState`. Plain lower-case words (`auto`, `ce`) are values, not checked here."""
    return "_" in name or "." in name or any(c.isupper() for c in name[1:]) or name.isupper() and len(name) > 1


def name_problem(span: str) -> str | None:
    """Why the backticked `span` names nothing in the code, or None (also for spans that are not names)."""
    if span in NOT_CODE_NAMES or span.startswith("-") or " " in span:
        return None
    if any(span.startswith(folder) for folder in SOURCE_FOLDERS):
        path = span.split("::")[0].split(":")[0].split("#")[0]
        if re.search(r"[<>*{}]|\.\.\.", path) or not (path.endswith(FILE_SUFFIXES) or path.endswith("/")):
            return None
        return None if (REPO / path).exists() else f"{path} is not in the checkout"
    if re.fullmatch(rf"[\w.-]*\.({'|'.join(FILE_TYPES)})", span):
        return None  # a bare file name: what a tool writes (stats.json, config.json) or a file type
    key, _, _ = span.partition("=")
    key = key.removeprefix("cfg.")
    call = re.fullmatch(rf"({DOTTED.pattern})\(.*\)", key)
    if call:
        key = call.group(1)
    if not DOTTED.fullmatch(key):
        return None
    parts = key.split(".")
    if len(parts) > 1 and parts[0] == "drafter" and ((REPO / "drafter" / parts[1]).is_dir() or
                                                     (REPO / "drafter" / f"{parts[1]}.py").is_file()):
        return module_path_problem(key)  # drafter.<module>...: code, not the drafter section's keys
    if len(parts) > 1 and parts[0] in schema():
        return config_key_problem(key)
    if "=" in span and not call:
        return None  # NAME=value: an environment variable or a flag's value
    if not (call or looks_like_code(key)):
        return None
    missing = [part for part in parts if part not in code_words()]
    return f"{key}: {', '.join(missing)} not in the code" if missing else None


def test_every_name_the_docs_write_in_backticks_exists_in_the_code():
    problems = []
    for page in pages():
        for number, span in backticked((REPO / page).read_text()):
            problem = name_problem(span)
            if problem:
                problems.append(f"{page}:{number}: `{span}`: {problem}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("span, problem", [
    ("CHOICES", "CHOICES: CHOICES not in the code"),
    ("objective.selector_loss", "objective.selector_loss is no config key (objective.selector_loss is not in the "
                                "schema)"),
    ("objective.loss=expected_tree", None),
    ("train.engine=fsdp", None),
    ("data.seed", None),
    ("data.sead", "data.sead is no config key (data.sead is not in the schema)"),
    ("stats.json", None),
    ("target.chat_template_kwargs.enable_thinking", None),
    ("drafter.mask_token_id", None),
    ("drafter.tree.ddtree.build_tree", None),
    ("drafter.serving.ddtree", "drafter.serving.ddtree: drafter.serving has no ddtree"),
    ("drafter.models.blocks.build_block", "drafter.models.blocks.build_block: drafter.models.blocks has no build_block"),
    ("drafter.training.objective.build_blocks", "drafter.training.objective.build_blocks: drafter.training.objective "
                                                "only imports it; it lives in drafter.models.blocks"),
    ("drafter.models.DraftTree", None),
    ("choices()", None),
    ("load_config(path)", None),
    ("rank_metrics_v2()", "rank_metrics_v2: rank_metrics_v2 not in the code"),
    ("drafter/training/run_config.py", None),
    ("drafter/infra/checkpoint.py", "drafter/infra/checkpoint.py is not in the checkout"),
    ("tests/test_layers.py::test_target_model_and_pipeline_are_side_by_side", None),
    ("HF_HUB_OFFLINE=1", None),
    ("auto", None),
    ("--cfg configs/toy.yaml", None),
])
def test_a_stale_name_is_told_from_a_live_one(span, problem):
    assert name_problem(span) == problem
