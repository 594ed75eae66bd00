"""The library's folders are layers (docs/design.md "Layers"): a module imports only from its own
layer and the layers below it, and no library module imports an entry point (train.py, a
command-line script) or a test. Every import is
read from the source with `ast`: module level, inside functions and under TYPE_CHECKING alike."""
import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARY = REPO / "drafter"

# Bottom to top. A module's layer is the first entry its dotted name starts with. target_model and
# pipeline share a level and may not import each other: they are two layers of the same height (as are
# tree and synthesis).
LAYERS = [
    ("base", 0, ("drafter.errors", "drafter.nested", "drafter.config", "drafter.metric_sums")),
    ("infra", 1, ("drafter.infra",)),
    ("target_model", 2, ("drafter.target_model",)),
    ("pipeline", 2, ("drafter.pipeline",)),
    ("tree", 3, ("drafter.tree",)),
    ("synthesis", 3, ("drafter.synthesis",)),
    ("losses", 4, ("drafter.losses",)),
    ("models", 5, ("drafter.models",)),
    ("serving", 6, ("drafter.serving",)),
    ("training", 7, ("drafter.training",)),
]
ENTRY_POINTS = ("train", "data", "eval", "bench", "tests")  # train.py, the command lines, the tests


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> tuple[str, int] | None:
    if module == "drafter":  # the package's own (empty) __init__.py
        return LAYERS[0][:2]
    for name, level, prefixes in LAYERS:
        if any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes):
            return name, level
    return None


def imports(path: Path, source: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement in `source` (the file at `path`), at any
    depth. `from a import b` counts as a.b where a.b is a module of the library, else as a."""
    tree = ast.parse(source, filename=str(path))
    package = module_name(path).split(".")[:None if path.name == "__init__.py" else -1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the file's package
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                is_module = (REPO / Path(*sub.split("."))).with_suffix(".py").exists() or \
                    (REPO / Path(*sub.split(".")) / "__init__.py").exists()
                found.append((node.lineno, sub if is_module else base))
    return sorted(set(found))


def library_files() -> list[Path]:
    return sorted(LIBRARY.rglob("*.py"))


def layering_problems(path: Path, source: str) -> list[str]:
    """What in `source`, the module at `path`, imports against the layer order."""
    here = layer_of(module_name(path))
    where = path.relative_to(REPO)
    if here is None:
        return [f"{where}: in no layer (add its folder to LAYERS and to docs/design.md)"]
    problems = []
    for line, module in imports(path, source):
        if module.split(".")[0] in ENTRY_POINTS:
            problems.append(f"{where}:{line}: library layer {here[0]} imports the entry point {module}")
            continue
        there = layer_of(module)
        if there is None or there[0] == here[0]:
            continue
        if there[1] >= here[1]:
            problems.append(f"{where}:{line}: layer {here[0]} imports {module} of layer {there[0]}, "
                            f"which is {'beside' if there[1] == here[1] else 'above'} it")
    return problems


def test_every_library_module_imports_only_its_layer_and_those_below():
    files = library_files()
    assert len(files) > 30 and {layer_of(module_name(p))[0] for p in files} == {name for name, _, _ in LAYERS}
    problems = [problem for path in files for problem in layering_problems(path, path.read_text())]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("source, problem", [
    ("from drafter.serving.decode import generate\n",
     "1: layer models imports drafter.serving.decode of layer serving, which is above it"),
    ("def f():\n    from drafter.serving import served\n",
     "2: layer models imports drafter.serving.served of layer serving, which is above it"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from drafter.training.objective import x\n",
     "3: layer models imports drafter.training.objective of layer training, which is above it"),
    ("from ..serving import decode\n", "1: layer models imports drafter.serving.decode of layer serving, which is above it"),
    ("import eval.ddtree_accept\n", "1: library layer models imports the entry point eval.ddtree_accept"),
    ("def f():\n    from train import step_generator\n", "2: library layer models imports the entry point train"),
    ("from drafter.losses.lm_head import top_logprobs\nfrom . import layers\n", None),
])
def test_an_import_against_the_order_is_named_with_its_file_line_and_layers(source, problem):
    """The check itself: an upward import at each depth a module can hold one, relative imports, a
    script import; imports from below and from its own layer pass."""
    problems = layering_problems(LIBRARY / "models" / "probe.py", source)
    assert problems == ([f"drafter/models/probe.py:{problem}"] if problem else [])


def test_target_model_and_pipeline_are_side_by_side():
    assert layering_problems(LIBRARY / "target_model" / "probe.py",
                             "from drafter.pipeline.datasets import token_occurs\n") == \
        ["drafter/target_model/probe.py:1: layer target_model imports drafter.pipeline.datasets of layer pipeline, "
         "which is beside it"]
    assert layering_problems(LIBRARY / "pipeline" / "probe.py", "import drafter.target_model.model\n") == \
        ["drafter/pipeline/probe.py:1: layer pipeline imports drafter.target_model.model of layer target_model, "
         "which is beside it"]
