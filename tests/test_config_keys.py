"""The keys a config may write: the shipped YAMLs list only what changes the resolved config, and a key
the schema does not have (or a value it refuses) is one line naming where it was written (the file, or
the file and the command-line override) and the key."""
import re
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from drafter.config import ConfigError
from drafter.nested import flatten
from drafter.training.run_config import load_config

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted(path.stem for path in (REPO / "configs").glob("*.yaml"))
REQUIRED = {"v3": ["data.path=/x"]}  # a shipped config that leaves a required key to the command line


def without(tree: dict, dotted: str) -> dict:
    """`tree` with the key at the dotted path `dotted` left out."""
    head, _, rest = dotted.partition(".")
    if not rest:
        return {key: value for key, value in tree.items() if key != head}
    return {**tree, head: without(tree[head], rest)}


def resolved(tree: dict, path: Path, overrides: list[str]) -> dict | str:
    """The config `tree`, written at `path`, as load_config resolves it, or why it refuses it."""
    path.write_text(yaml.safe_dump(tree))
    try:
        return OmegaConf.to_container(load_config(str(path), overrides))
    except ConfigError as error:
        return str(error)


@pytest.mark.parametrize("name", SHIPPED)
def test_a_shipped_config_lists_only_keys_that_change_the_resolved_config(name, tmp_path):
    written = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())
    path, overrides = tmp_path / f"{name}.yaml", REQUIRED.get(name, [])  # the same stem: the same run name
    whole = resolved(written, path, overrides)
    assert isinstance(whole, dict), whole
    defaults = [key for key in flatten(written) if resolved(without(written, key), path, overrides) == whole]
    assert not defaults, f"configs/{name}.yaml writes schema defaults (drafter/config.py): {defaults}"


@pytest.mark.parametrize("text, overrides, refusal", [
    ("optim:\n  lrr: 1.0\n", [], "{path}: bad config key 'optim.lrr': Key 'lrr' not in 'OptimConfig'"),
    ("drafter:\n  selector_alpha: 1.0\n", [],  # an objective key under another section
     "{path}: bad config key 'drafter.selector_alpha': Key 'selector_alpha' not in 'DrafterConfig'"),
    ("optimm:\n  lr: 1.0\n", [], "{path}: bad config key 'optimm': Key 'optimm' not in 'Config'"),
    ("", ["optim.lr=1e-3", "optim.lrr=1"],
     "{path}: override optim.lrr=1: bad config key 'optim.lrr': Key 'lrr' not in 'OptimConfig'"),
    ("", ["optim.lr=abc"], "{path}: override optim.lr=abc: bad config key 'optim.lr': Value 'abc'"),
])
def test_a_key_or_value_the_schema_refuses_is_one_line_naming_where_it_was_written(text, overrides, refusal,
                                                                                   tmp_path):
    path = tmp_path / "user.yaml"
    path.write_text("target:\n  path: /t\ndata:\n  path: /d\n" + text)
    with pytest.raises(ConfigError) as refused:
        load_config(str(path), overrides)
    assert re.match(re.escape(refusal.format(path=path)), str(refused.value)) and "\n" not in str(refused.value)
