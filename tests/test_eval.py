import json

import pytest

from conftest import make_drafter
from drafter.benchmarks import load_jsonl
from drafter.target import random_qwen3
from eval import ddtree_accept
from tiny_tokenizer import save_tiny_tokenizer

PROMPTS = [
    {"prompt": "What is the capital of France?"},
    {"turns": ["Hello world, how are you today?", "And tomorrow?"]},
    {"messages": [{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "def add(a, b):"}]},
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A run checkpoint dir holding drafter/, whose config names a local target dir."""
    root = tmp_path_factory.mktemp("eval")
    target_dir = save_tiny_tokenizer(root / "target")
    target = random_qwen3(vocab_size=384, seed=3)
    target.save_pretrained(target_dir)
    drafter = make_drafter(target, block_size=4, target_path=str(target_dir),
                           chat_template_kwargs={"enable_thinking": False})
    drafter.save_pretrained(root / "ckpt" / "drafter")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return root


def test_report_from_a_run_checkpoint(checkpoint, capsys):
    out = checkpoint / "report" / "results.json"
    results = ddtree_accept.main([
        "--ckpt", str(checkpoint / "ckpt"), "--bench", str(checkpoint / "prompts.jsonl"),
        "--budgets", "2,8", "--max-new-tokens", "14", "--out", str(out), "--save-samples"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    assert results["config"]["target"] == str(checkpoint / "target")
    methods = results["benchmarks"]["prompts"]["methods"]
    assert list(methods) == ["ar", "dflash", "ddtree@2", "ddtree@8"]

    reference = methods["ar"]["samples"]
    assert [(s["source"].rsplit(":", 1)[1], s["turn"]) for s in reference] == [
        ("1", 0), ("2", 0), ("2", 1), ("3", 0)]
    assert len(reference[2]["prompt_ids"]) > len(reference[1]["prompt_ids"])  # turn 2 sees turn 1
    for name, summary in methods.items():
        assert summary["lossless"] is True and summary["divergence_rate"] == 0
        samples = summary["samples"]
        assert [s["output_ids"] for s in samples] == [s["output_ids"] for s in reference]
        assert [s["prompt_ids"] for s in samples] == [s["prompt_ids"] for s in reference]
        steps = [length for s in samples for length in s["acceptance_lengths"]]
        assert sum(summary["tau_histogram"]) == summary["steps"] == len(steps)
        assert summary["tau_pooled"] == pytest.approx(sum(steps) / len(steps))
        assert max(steps) <= 4 and len(summary["acceptance_by_depth"]) == max(steps) - 1
        assert summary["output_tokens"] == sum(len(s["output_ids"]) for s in samples)
        for s in samples:
            if len(s["output_ids"]) == 14:  # not stopped: every step's tokens + the prefill's
                assert sum(s["acceptance_lengths"]) + 1 == 14
    assert methods["ar"]["tau"] == 1 and methods["ar"]["speedup"] == pytest.approx(1)
    assert methods["ddtree@8"]["stage_ms_per_step"]["tree_build"] > 0

    printed = capsys.readouterr().out
    assert "| prompts | ddtree@8 |" in printed
    assert (out.parent / "results_tau_hist.png").stat().st_size > 0
    assert (out.parent / "results_budget.png").stat().st_size > 0


def test_target_flag_overrides_the_recorded_target(checkpoint, tmp_path):
    target = random_qwen3(vocab_size=384, seed=3)
    drafter = make_drafter(target, block_size=4, target_path="no/such/target")
    drafter.save_pretrained(tmp_path / "drafter_only")
    args = ddtree_accept.parse_args(["--ckpt", str(tmp_path / "drafter_only"),
                                     "--target", str(checkpoint / "target"), "--budgets", "4"])
    evaluator = ddtree_accept.Evaluator(args, ddtree_accept.torch.device("cpu"))
    assert evaluator.target_path == str(checkpoint / "target")
    assert evaluator.enable_thinking is False and evaluator.methods == ["ar", "dflash", "ddtree@4"]


def test_bad_prompt_lines_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    for line, reason in [("{not json", "not valid JSON"), ('{"text": "hi"}', '"prompt"'),
                         ('{"messages": [{"role": "assistant", "content": "x"}]}', "last message"),
                         ('["a"]', "JSON object")]:
        bad.write_text(json.dumps(PROMPTS[0]) + "\n" + line + "\n")
        with pytest.raises(ValueError, match=f"{bad}:2: .*{reason}"):
            load_jsonl(bad)


def test_ckpt_without_a_drafter_is_rejected(tmp_path):
    with pytest.raises(FileNotFoundError, match="no DFlashDraftModel"):
        ddtree_accept.drafter_dir(str(tmp_path))
