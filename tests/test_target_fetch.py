"""A hub target fetched once per node (drafter/target_model/model.py `fetch_target`) and loaded on the rank's
device (`load_target`): on two CPU ranks over gloo, with a local directory standing in for the hub,
only local rank 0 downloads, the other waits for it and both load the same weights; a download that
fails on rank 0 stops both ranks with the same one line, neither left waiting; on the CPU the target
loads as `from_pretrained` alone loads it, and on a GPU straight onto that device."""
import hashlib
import json
import os
import shutil
import time
from datetime import timedelta
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, AutoTokenizer

from drafter.errors import UserError
from drafter.target_model import model
from drafter.target_model.model import TargetFetchError, fetch_target, load_target, random_qwen3
from runs import free_port
from tiny_tokenizer import save_tiny_tokenizer

HUB_ID = "someone/tiny-qwen3"


def publish(directory: Path) -> Path:
    """The hub repository's files: a random Qwen3 with its tokenizer, and files no target reads."""
    random_qwen3(seed=3).save_pretrained(directory)
    save_tiny_tokenizer(directory)
    (directory / "README.md").write_text("a model card")
    (directory / "pytorch_model.bin").write_bytes(b"the same weights, pickled")
    return directory


def fake_snapshot_download(hub: Path, cache: Path, log: Path, fail: str | None):
    """huggingface_hub.snapshot_download over `hub`: copies the files `allow_patterns` matches into
    `cache` (slowly, so that a rank that does not wait finds nothing), or with `local_files_only`
    only finds them there; every call is logged to `log`."""
    def snapshot_download(repo_id, allow_patterns=None, local_files_only=False, **kwargs):
        with log.open("a") as out:
            out.write(json.dumps({"repo_id": repo_id, "local_files_only": local_files_only}) + "\n")
        if local_files_only:
            if not (cache / "done").is_file():
                raise FileNotFoundError(f"{repo_id} is not in the cache")
            return str(cache)
        if fail:
            raise OSError(fail)
        time.sleep(1)
        cache.mkdir(parents=True, exist_ok=True)
        for file in hub.iterdir():
            if any(fnmatch(file.name, pattern) for pattern in allow_patterns):
                shutil.copy(file, cache / file.name)
        (cache / "done").touch()
        return str(cache)
    return snapshot_download


def weights_digest(target) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(target.state_dict().items()):
        digest.update(name.encode() + tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def rank_main(rank: int, port: int, tmp: Path, fail: str | None):
    """One of two ranks of one node: fetch the hub target, load it, write what happened to rank<r>.json."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    import huggingface_hub
    huggingface_hub.snapshot_download = fake_snapshot_download(tmp / "hub", tmp / "cache", tmp / f"calls{rank}.jsonl",
                                                               fail)
    try:
        files = fetch_target(HUB_ID)
        AutoTokenizer.from_pretrained(files)  # the tokenizer came with the weights
        outcome = {"files": files, "weights": weights_digest(load_target(files, "cpu", torch.float32))}
    except UserError as error:
        outcome = {"error": type(error).__name__, "message": str(error)}
    (tmp / f"rank{rank}.json").write_text(json.dumps(outcome))
    dist.destroy_process_group()


def run_two_ranks(tmp: Path, fail: str | None = None, timeout: float = 240) -> list[dict]:
    """rank_main on two spawned processes; a rank still running after `timeout` seconds fails the test."""
    publish(tmp / "hub")
    context = mp.start_processes(rank_main, args=(free_port(), tmp, fail), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"a rank still runs {timeout} s after the start: it hangs")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [json.loads((tmp / f"rank{rank}.json").read_text()) for rank in range(2)]


def calls(tmp: Path, rank: int) -> list[dict]:
    path = tmp / f"calls{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow  # two spawned processes
def test_only_local_rank_0_fetches_and_both_ranks_load_the_same_weights(tmp_path):
    outcomes = run_two_ranks(tmp_path)
    assert [call["local_files_only"] for call in calls(tmp_path, 0)] == [False]  # one download
    assert calls(tmp_path, 1) and all(call["local_files_only"] for call in calls(tmp_path, 1))  # after it
    assert all(call["repo_id"] == HUB_ID for rank in (0, 1) for call in calls(tmp_path, rank))
    assert outcomes[0] == outcomes[1] and outcomes[0]["files"] == str(tmp_path / "cache")
    assert outcomes[0]["weights"] == weights_digest(random_qwen3(seed=3))
    fetched = {path.name for path in (tmp_path / "cache").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= fetched
    assert not fetched & {"README.md", "pytorch_model.bin"}  # safetensors there: no pickled copy


@pytest.mark.slow  # two spawned processes
def test_a_fetch_that_fails_on_rank_0_stops_both_ranks_with_one_line(tmp_path):
    outcomes = run_two_ranks(tmp_path, fail="503 Service Unavailable\n<html>the hub is down</html>")
    assert outcomes[0] == outcomes[1]
    assert outcomes[0]["error"] == "TargetFetchError" and "\n" not in outcomes[0]["message"]
    assert outcomes[0]["message"] == (f"target {HUB_ID}: could not fetch its files from the hub "
                                      "(OSError: 503 Service Unavailable)")
    assert not calls(tmp_path, 1)  # rank 1 never went looking for files that are not there


def test_without_a_world_a_hub_id_is_fetched_and_a_local_path_is_read_where_it_is(tmp_path, monkeypatch):
    import huggingface_hub
    publish(tmp_path / "hub")
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        fake_snapshot_download(tmp_path / "hub", tmp_path / "cache", tmp_path / "calls.jsonl", None))
    assert fetch_target(HUB_ID) == str(tmp_path / "cache")
    assert fetch_target(str(tmp_path / "hub")) == str(tmp_path / "hub") and fetch_target(None) is None
    assert len((tmp_path / "calls.jsonl").read_text().splitlines()) == 1
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        fake_snapshot_download(tmp_path / "hub", tmp_path / "cache", tmp_path / "calls.jsonl", "no"))
    with pytest.raises(TargetFetchError, match=rf"^target {HUB_ID}: could not fetch its files from the hub "
                                                r"\(OSError: no\)$"):
        fetch_target(HUB_ID)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_cpu_the_target_loads_as_from_pretrained_alone_loads_it(tmp_path, dtype):
    random_qwen3(seed=5).save_pretrained(tmp_path)
    loaded = load_target(str(tmp_path), "cpu", dtype)
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=dtype)
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    assert not hasattr(loaded, "hf_device_map")  # no device map on the CPU
    expected = reference.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert tensor.device.type == "cpu" and tensor.dtype == expected[name].dtype == dtype
        assert torch.equal(tensor, expected[name]), name


def test_on_a_gpu_the_weights_are_read_straight_onto_it(tmp_path, monkeypatch):
    """A device map of the rank's one device, for either model class (no GPU needed: the call is caught)."""
    random_qwen3().save_pretrained(tmp_path)
    seen = []

    def from_pretrained(path, **kwargs):
        seen.append(kwargs)
        raise ValueError("Unrecognized configuration class" if len(seen) == 1 else "caught")
    monkeypatch.setattr(model.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(model.AutoModelForImageTextToText, "from_pretrained", from_pretrained)
    with pytest.raises(ValueError, match="caught"):
        load_target(str(tmp_path), torch.device("cuda", 3), torch.bfloat16)
    assert seen == [{"dtype": torch.bfloat16, "device_map": {"": torch.device("cuda", 3)}}] * 2
