import json

import pytest
import torch
from torch import nn

from conftest import make_drafter
from drafter.errors import ConfigError
from drafter.infra import cpu_layout
from drafter.infra.cpu_layout import serve_column_major_, serving_layout
from drafter.target_model.model import random_qwen3
from eval import ddtree_accept
from tiny_tokenizer import save_tiny_tokenizer


def test_column_major_keeps_values_parameters_and_ties_and_the_logits():
    model = random_qwen3(vocab_size=384, seed=3)
    model.tie_weights()
    ids = torch.randint(0, 384, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    parameters = {name: (param, param.detach().clone()) for name, param in model.named_parameters()}
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]

    assert serve_column_major_(model) == len(linears)
    for name, param in model.named_parameters():
        assert param is parameters[name][0] and torch.equal(param, parameters[name][1]), name
    for module in linears:
        out_features, in_features = module.weight.shape
        assert module.weight.stride() == (1, out_features), module
    if model.config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-5, atol=1e-5)
    assert serve_column_major_(model) == 0  # already column-major: nothing transposed back


@pytest.mark.parametrize("setting, column", [("row", False), ("column", True), ("Column ", True)])
def test_the_override_decides_without_a_probe(monkeypatch, setting, column):
    monkeypatch.setenv(cpu_layout.OVERRIDE, setting)
    monkeypatch.setattr(cpu_layout, "probed", lambda *a: pytest.fail("probed despite the override"))
    assert serving_layout(random_qwen3(vocab_size=384, seed=3), torch.float32).column is column


def test_a_bad_override_is_one_line_naming_the_variable(monkeypatch):
    monkeypatch.setenv(cpu_layout.OVERRIDE, "transposed")
    with pytest.raises(ConfigError, match=f"{cpu_layout.OVERRIDE}=transposed: use row or column"):
        serving_layout(random_qwen3(vocab_size=384, seed=3), torch.float32)


def fake_linear_seconds(times: dict):
    """cpu_layout.linear_seconds reading its time from `times` by (layout, rows)."""
    return lambda x, weight: times["row" if weight.is_contiguous() else "column", x.shape[0]]


@pytest.mark.parametrize("verify_row, verify_column, one_row, one_column, column", [
    (0.60, 0.33, 0.20, 0.20, True),   # the AVX-512 box's fp32: verify 1.8x faster, one row a tie
    (0.60, 0.55, 0.20, 0.20, False),  # a gain within the noise
    (0.60, 0.33, 0.20, 0.23, False),  # faster verify bought with slower plain decoding
    (0.57, 0.59, 0.20, 0.19, False),  # AVX2 kernels: a tie
])
def test_the_probe_serves_column_major_only_where_verify_gains_and_one_row_does_not_lose(
        monkeypatch, verify_row, verify_column, one_row, one_column, column):
    monkeypatch.delenv(cpu_layout.OVERRIDE)
    monkeypatch.setattr(cpu_layout, "linear_seconds", fake_linear_seconds({
        ("row", cpu_layout.VERIFY_ROWS): verify_row, ("column", cpu_layout.VERIFY_ROWS): verify_column,
        ("row", 1): one_row, ("column", 1): one_column}))
    cpu_layout.probed.cache_clear()
    model = random_qwen3(vocab_size=384, seed=3)
    layout = serving_layout(model, torch.float32)
    cpu_layout.probed.cache_clear()
    assert layout.column is column
    mlp = max((m.weight for m in model.modules() if isinstance(m, nn.Linear)
               and m is not model.get_output_embeddings()), key=torch.Tensor.numel)
    assert f"by a {mlp.shape[0]}x{mlp.shape[1]} float32 weight" in layout.reason  # the largest decoder weight
    assert layout.reason.startswith(f"weights {'column' if column else 'row'}-major")


def test_the_eval_serves_column_major_losslessly_and_says_so(tmp_path, monkeypatch):
    target_dir = save_tiny_tokenizer(tmp_path / "target")
    target = random_qwen3(vocab_size=384, seed=3)
    target.save_pretrained(target_dir)
    make_drafter(target, block_size=4, target_path=str(target_dir),
                 chat_template_kwargs={"enable_thinking": False}).save_pretrained(tmp_path / "ckpt" / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("What is 2+2?", "def add(a, b):")))
    threads = torch.get_num_threads()
    outputs, changed = {}, []
    monkeypatch.setattr(ddtree_accept, "serve_column_major_", lambda m: changed.append(serve_column_major_(m)))
    for layout in ("row", "column"):
        monkeypatch.setenv(cpu_layout.OVERRIDE, layout)
        results = ddtree_accept.main(["--ckpt", str(tmp_path / "ckpt"), "--bench", str(prompts), "--budgets", "4",
                                      "--max-new-tokens", "10", "--threads", "1", "--save-samples",
                                      "--out", str(tmp_path / layout / "results.json")])
        torch.set_num_threads(threads)
        assert results["config"]["weight_layout"] == layout
        assert len(changed) == (2 if layout == "column" else 0) and all(changed)  # the target and the drafter
        methods = results["benchmarks"]["prompts"]["methods"]
        assert {m: s["lossless"] for m, s in methods.items()} == dict.fromkeys(methods, "yes")
        outputs[layout] = [s["output_ids"] for s in methods["ar"]["samples"]]
    assert outputs["column"] == outputs["row"]
