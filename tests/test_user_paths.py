"""Paths and flags as users type them: `--cfg v3.yaml` and the repo's ds_configs found from any working
directory (a SLURM script that cds to scratch), a missing file named with every path tried, and the
eval taking the training overrides it shares (`target.tp_size=4`)."""
from pathlib import Path

import pytest

from drafter.errors import ConfigError
from drafter.infra.deepspeed_engine import deepspeed_config
from drafter.infra.repo_paths import REPO, find_in_repo, repo_candidates
from drafter.training.run_config import config_and_world, load_config
from eval import ddtree_accept


def test_the_repo_is_the_directory_holding_train_py():
    assert REPO == Path(__file__).resolve().parents[1] and (REPO / "train.py").is_file()


def test_a_bare_config_name_is_found_under_configs_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert find_in_repo("toy.yaml", "configs", "--cfg toy.yaml") == REPO / "configs" / "toy.yaml"
    assert find_in_repo("configs/toy.yaml", "configs", "--cfg") == REPO / "configs" / "toy.yaml"  # the repo root
    cfg = load_config("v3.yaml", ["data.path=/x"])
    assert cfg.run.name.startswith("v3") and cfg.target.path == "Qwen/Qwen3-8B"


def test_the_path_as_given_comes_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "toy.yaml").write_text("x: 1\n")  # shadows the repo's configs/toy.yaml
    assert find_in_repo("toy.yaml", "configs", "--cfg toy.yaml") == tmp_path / "toy.yaml"
    assert repo_candidates("toy.yaml", "configs") == [tmp_path / "toy.yaml", REPO / "configs" / "toy.yaml",
                                                      REPO / "toy.yaml"]
    assert repo_candidates(str(tmp_path / "a.yaml"), "configs") == [tmp_path / "a.yaml"]  # absolute: only itself


def test_run_from_the_repo_root_no_path_is_tried_twice(monkeypatch):
    monkeypatch.chdir(REPO)
    assert repo_candidates("x.yaml", "configs") == [REPO / "x.yaml", REPO / "configs" / "x.yaml"]


def test_the_ds_config_resolves_against_the_repo_and_the_run_records_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config("v3.yaml", ["data.path=/x"])  # v3.yaml writes ds_configs/zero2.json
    assert cfg.train.ds_config == str(REPO / "ds_configs" / "zero2.json")
    assert cfg.run.out_dir == "runs/v3"  # outputs stay where the user runs
    bare = load_config("v3.yaml", ["data.path=/x", "train.ds_config=zero3.json"])
    assert bare.train.ds_config == str(REPO / "ds_configs" / "zero3.json")
    ds = deepspeed_config("ds_configs/zero2.json", cfg, world_size=8, bf16=True, hidden_size=4096, on_cpu=False)
    assert ds["zero_optimization"]["stage"] == 2  # read from the repo by any caller (data/plan.py)


def test_a_missing_config_names_every_path_tried_and_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    expected = (f"--cfg v4.yaml: not found; tried {tmp_path}/v4.yaml, {REPO}/configs/v4.yaml, {REPO}/v4.yaml "
                f"(working directory {tmp_path})")
    with pytest.raises(ConfigError) as error:
        load_config("v4.yaml")
    assert str(error.value) == expected
    with pytest.raises(SystemExit) as exited:  # what train.py and data/features.py print: one line
        config_and_world("v4.yaml")
    assert exited.value.code == f"config error: {expected}"


def test_a_missing_ds_config_names_every_path_tried(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as error:
        load_config("v3.yaml", ["data.path=/x", "train.ds_config=zero9.json"])
    assert str(error.value) == (f"train.ds_config=zero9.json: not found; tried {tmp_path}/zero9.json, "
                                f"{REPO}/ds_configs/zero9.json, {REPO}/zero9.json (working directory {tmp_path})")
    cfg = load_config("v3.yaml", ["data.path=/x", "train.ds_config=zero9.json", "train.engine=fsdp"])
    assert cfg.train.ds_config == "zero9.json"  # FSDP reads no JSON: nothing to find


def parse(*flags):
    return ddtree_accept.parse_args(["--ckpt", "x", *flags])


def test_the_eval_takes_the_training_overrides_it_shares():
    args = parse("target.tp_size=4", "target.path=/models/qwen", "target.dtype=bf16")
    assert (args.tp, args.target, args.dtype) == (4, "/models/qwen", "bfloat16")
    assert parse("target.dtype=fp32").dtype == "float32"
    assert (parse().tp, parse().dtype, parse().target) == (1, "auto", None)  # the flags' defaults
    assert parse("--tp", "4", "target.tp_size=4").tp == 4  # the same value twice is fine
    assert parse("--tp", "2").tp == 2  # the flag stays


@pytest.mark.parametrize("flags, message", [
    (["train.max_steps=5"], "train.max_steps=5: not an override this script takes; it takes target.tp_size, "
                            "target.path, target.dtype"),
    (["--tp", "2", "target.tp_size=4"], "--tp 2 and target.tp_size=4 disagree"),
    (["--target", "/a", "target.path=/b"], "--target /a and target.path=/b disagree"),
    (["target.tp_size=four"], "target.tp_size=four: target.tp_size takes an integer"),
    (["target.dtype=fp16"], "target.dtype=fp16: target.dtype takes one of"),
    (["target.tp_size=0"], "--tp must be >= 1"),
])
def test_the_eval_refuses_an_override_in_one_line(flags, message, capsys):
    with pytest.raises(SystemExit) as exited:
        parse(*flags)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
