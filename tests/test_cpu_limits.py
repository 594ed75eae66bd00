"""bench/cpu_limits.py: the floor arithmetic on made-up machine numbers, and one whole run on a tiny
random target with tiny sizes and very short timing."""
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import cpu_limits  # noqa: E402
from drafter.target_model.model import random_qwen3  # noqa: E402


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("cpu_limits") / "target"
    random_qwen3().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def config(tiny_target):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(tiny_target)


def test_floor_is_the_larger_of_memory_and_compute():
    cost = cpu_limits.Cost(weight_bytes=6e9, kv_bytes=4e9, flops=3e9)
    assert cpu_limits.floor_ms(cost, bandwidth_gbps=10.0, gflops=100.0) == (pytest.approx(1000.0), "memory")
    assert cpu_limits.floor_ms(cost, bandwidth_gbps=1000.0, gflops=1.0) == (pytest.approx(3000.0), "compute")


def test_one_token_floor_from_the_counts(config):
    """1 token, no context: every parameter once (the tiny target's embedding is untied: one row of
    it gathered, not all), 2 FLOPs per matmul weight; the floor is max(bytes / bw, flops / peak)."""
    text = config.get_text_config()
    shapes = cpu_limits.target_shapes(config)
    assert not shapes.tied
    cost = cpu_limits.target_cost(shapes, text, 1, 0, elem=4)
    embedding, hidden = text.vocab_size * text.hidden_size, text.hidden_size
    assert cost.weight_bytes == (shapes.params - embedding + hidden) * 4
    assert cost.kv_bytes == 0
    layers, heads, _, head_dim = cpu_limits.attention_dims(text)
    lm_head = text.vocab_size * hidden
    assert shapes.linear["lm_head"] == lm_head
    assert cost.flops == 2 * sum(shapes.linear.values()) + 4 * layers * heads * head_dim
    bandwidth, gflops = 3.0, 0.5
    expected = max(cost.bytes / (bandwidth * 1e9), cost.flops / (gflops * 1e9)) * 1e3
    assert cpu_limits.floor_ms(cost, bandwidth, gflops)[0] == pytest.approx(expected)


def test_tied_head_is_read_whole_once(config):
    from transformers import AutoConfig
    tied = AutoConfig.from_pretrained(config.name_or_path, tie_word_embeddings=True)
    shapes_tied, shapes = cpu_limits.target_shapes(tied), cpu_limits.target_shapes(config)
    assert shapes_tied.tied
    text = config.get_text_config()
    embedding = text.vocab_size * text.hidden_size
    assert shapes_tied.params == shapes.params - embedding
    assert cpu_limits.target_cost(shapes_tied, text, 1, 0, 2).weight_bytes == shapes_tied.params * 2


def test_verify_floor_grows_with_k_and_context(config):
    text = config.get_text_config()
    shapes = cpu_limits.target_shapes(config)
    costs = [cpu_limits.target_cost(shapes, text, k, 64, 4) for k in (1, 5, 9, 17, 33)]
    floors = [cpu_limits.floor_ms(c, 5.0, 0.2)[0] for c in costs]
    assert all(b >= a for a, b in zip(floors, floors[1:]))
    assert floors[-1] > floors[0]  # compute-bound at 0.2 GFLOPS: k counts
    assert costs[-1].flops > 33 * 2 * sum(shapes.linear.values())
    assert cpu_limits.target_cost(shapes, text, 1, 64, 4).kv_bytes > 0


def test_reduced_vocab_drafter_floor_is_below_the_full(config):
    full = cpu_limits.drafter_cost(config, 2, 16, None, 64, 4)
    cut = cpu_limits.drafter_cost(config, 2, 16, 64, 64, 4)
    hidden = config.hidden_size
    assert full.weight_bytes - cut.weight_bytes == (config.vocab_size - 64) * hidden * 4
    assert full.flops - cut.flops == 2 * 15 * (config.vocab_size - 64) * hidden
    for bw, gf in ((1.0, 1000.0), (1000.0, 0.1)):
        assert 0 < cpu_limits.floor_ms(cut, bw, gf)[0] < cpu_limits.floor_ms(full, bw, gf)[0]


def test_whole_run_writes_every_row(tiny_target, tmp_path):
    out = tmp_path / "limits.json"
    threads = torch.get_num_threads()
    try:
        result = cpu_limits.main([
            "--target", str(tiny_target), "--dtype", "fp32", "--threads", "1", "--context", "16",
            "--ks", "1", "5", "--draft-vocab", "64", "128", "--bandwidth-mib", "4", "--mm-rows", "1", "9",
            "--square", "64", "--min-run-time", "0.01", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    saved = json.loads(out.read_text())
    whats = [r["what"] for r in saved["rows"]]
    targets = ["target forward, 1 token", "target verify, k=1 at ctx 16", "target verify, k=5 at ctx 16"]
    assert whats == [w for t in targets for w in (t, "  HF " + t)] + [
        "drafter step, V=256", "drafter step, K=64", "drafter step, K=128"]
    for r in saved["rows"]:
        assert r["floor_ms"] > 0 and r["bound"] in ("memory", "compute")
        assert r["measured"]["median_ms"] > 0 and r["ratio_to_floor"] > 0
        assert ("ratio_to_hf" in r) == (r["what"].startswith("target"))
    assert set(saved["machine"]) == {"1", "2"}
    for m in saved["machine"].values():
        assert m["bandwidth"]["read"]["best_rate"] > 0
        assert set(m["matmul"]) == {"fp32", "bf16"} and m["matmul"]["bf16"]["peak_gflops"] > 0
    assert saved["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert len(result["rows"]) == len(saved["rows"])
