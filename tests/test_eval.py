import inspect
import json
import os
import re
import subprocess
import sys
from datetime import timedelta

import datasets
import pytest
from torch.distributed import distributed_c10d as dist_c10d

from conftest import make_drafter
from drafter.pipeline.benchmarks import REASON_BOXED, load_jsonl, load_prompts
from drafter.serving import eval_report
from drafter.target_model.model import random_qwen3
from drafter.training.checkpoint import drafter_dir
from drafter.target_model.tensor_parallel import form_tp_group
from eval import ddtree_accept
from tiny_tokenizer import save_tiny_tokenizer

PROMPTS = [
    {"prompt": "What is the capital of France?"},
    {"turns": ["Hello world, how are you today?", "And tomorrow?"]},
    {"messages": [{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "def add(a, b):"}]},
]


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """The eval sets torch's threads (--threads); give the next test the ones it had."""
    threads = ddtree_accept.torch.get_num_threads()
    yield
    ddtree_accept.torch.set_num_threads(threads)


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
        "--budgets", "2,8", "--max-new-tokens", "14", "--out", str(out), "--save-samples", "--threads", "1"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    assert results["config"]["target"] == str(checkpoint / "target")
    methods = results["benchmarks"]["prompts"]["methods"]
    assert list(methods) == ["ar", "hf", "dflash", "ddtree@2", "ddtree@8"]  # hf: transformers' generate

    reference = methods["ar"]["samples"]
    assert [(s["source"].rsplit(":", 1)[1], s["turn"]) for s in reference] == [
        ("1", 0), ("2", 0), ("2", 1), ("3", 0)]
    assert len(reference[2]["prompt_ids"]) > len(reference[1]["prompt_ids"])  # turn 2 sees turn 1
    assert results["config"]["sampling"] == "match" and results["config"]["tie_tolerance"] > 0
    for name, summary in methods.items():  # hf too: its tokens are ar's
        assert summary["lossless"] == "yes" and summary["divergence_rate"] == 0
        assert summary["divergences"] == []
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
    assert methods["ar"]["break_even_tau"] == pytest.approx(1)
    for summary in methods.values():  # a method breaks even where its tau equals its time per step in ar tokens
        assert summary["break_even_tau"] * summary["speedup"] == pytest.approx(summary["tau_pooled"])
    margins = [m for s in reference for m in s["margins"]]
    assert len(margins) == sum(len(s["output_ids"]) for s in reference) and min(margins) >= 0
    share = results["benchmarks"]["prompts"]["near_tie_share"]
    assert share == sum(m < results["config"]["tie_tolerance"] for m in margins) / len(margins)
    assert methods["ddtree@8"]["stage_ms_per_step"]["tree_build"] > 0

    bench = results["benchmarks"]["prompts"]
    hf_time = methods["hf"]["time_per_output_token"]
    assert isinstance(bench["ar_over_hf"], float) and bench["ar_over_hf"] > 0
    assert bench["ar_over_hf"] == pytest.approx(methods["ar"]["time_per_output_token"] / hf_time)
    assert methods["hf"]["speedup_over_hf"] == pytest.approx(1)
    assert methods["ddtree@8"]["speedup_over_hf"] == pytest.approx(hf_time / methods["ddtree@8"]["time_per_output_token"])
    speculative = {m: s["speedup"] for m, s in methods.items() if m not in ("ar", "hf")}
    assert bench["best_method"] == max(speculative, key=speculative.get)
    spread = methods["ddtree@8"]["speedup_per_response"]  # each response against ar's on its prompt
    per_response = sorted(ar["decode_seconds"] * len(ours["output_ids"]) / (ours["decode_seconds"] * len(ar["output_ids"]))
                          for ours, ar in zip(methods["ddtree@8"]["samples"], reference))
    assert spread["responses"] == 4 and (spread["min"], spread["max"]) == pytest.approx((per_response[0], per_response[-1]))
    assert spread["min"] <= spread["q1"] <= spread["median"] <= spread["q3"] <= spread["max"]
    assert methods["ar"]["speedup_per_response"]["median"] == pytest.approx(1)
    config = results["config"]
    assert (config["threads"], config["world_size"], config["regime"]) == (1, 1, "one stream, 1 thread")
    assert config["dtype"] == "torch.float32" and config["cpu_capability"] and config["hf_baseline"] is True

    captured = capsys.readouterr()
    assert "| prompts | ddtree@8 |" in captured.out and "| prompts | hf |" in captured.out
    assert f"speed: one stream, 1 thread, torch.float32, CPU capability {config['cpu_capability']}" in captured.out
    assert f"prompts: best method {bench['best_method']}, " in captured.out
    assert f"our ar takes {bench['ar_over_hf']:.2f}x its time per token, tokens as ar's: yes" in captured.out
    progress = captured.err.split("\r")[-1]  # the bar's last state: 3 prompts x 5 methods
    # tqdm writes the rate as run/s, or s/run when a run takes over a second (a loaded machine)
    assert re.match(r"prompts: 100%.* 15/15 \[.*(run/s|s/run), method=ddtree@8\]", progress), progress
    assert (out.parent / "results_tau_hist.png").stat().st_size > 0
    assert (out.parent / "results_budget.png").stat().st_size > 0


def test_answers_of_the_prefill_token_alone_report_no_tau(checkpoint):
    """--max-new-tokens 1 (or a target whose first token stops every answer): no verify step, so no
    tau and no break-even tau, and the report is still written."""
    out = checkpoint / "one_token.json"
    results = ddtree_accept.main(["--ckpt", str(checkpoint / "ckpt"), "--bench", str(checkpoint / "prompts.jsonl"),
                                  "--budgets", "2", "--max-new-tokens", "1", "--out", str(out), "--threads", "1"])
    methods = results["benchmarks"]["prompts"]["methods"]
    assert all(s["output_tokens"] == 4 and s["tau_pooled"] is None and s["break_even_tau"] is None
               for s in methods.values())
    assert out.is_file()


def test_check_public_reports_the_public_loop_step_by_step(checkpoint, tmp_path, capsys):
    """--check-public N: the public dflash 0.1.0 loop on the first N prompts' first turns decodes as
    ours at every step, and the report says so, with each loop's tau; it is refused where it cannot
    compare greedy decodes on one whole target."""
    pytest.importorskip("dflash.model")
    results = ddtree_accept.main([
        "--ckpt", str(checkpoint / "ckpt"), "--bench", str(checkpoint / "prompts.jsonl"), "--budgets", "2",
        "--max-new-tokens", "14", "--out", str(tmp_path / "results.json"), "--check-public", "2", "--threads", "1"])
    check = results["benchmarks"]["prompts"]["public_check"]
    assert results["config"]["check_public"] == 2
    assert (check["prompts"], check["identical"], check["verdict"]) == (2, 2, "yes")
    prompts = checkpoint / "prompts.jsonl"
    assert [row["source"] for row in check["per_prompt"]] == [f"{prompts}:1", f"{prompts}:2"]
    first_turns = results["benchmarks"]["prompts"]["methods"]["dflash"]
    assert check["tau"] == check["public_tau"] and check["score_gap"] < 1e-4
    assert all(row["steps"] >= 1 and row["difference"] is None for row in check["per_prompt"])
    assert first_turns["responses"] == 4  # the check reruns only first turns, outside the method rows
    assert "the public dflash 0.1.0 loop on 2 prompts: 2 identical step for step" in capsys.readouterr().out
    for flags in (["--check-public", "1", "--temperature", "0.7"], ["--check-public", "1", "--tp", "2"],
                  ["--check-public", "-1"]):
        with pytest.raises(SystemExit):
            ddtree_accept.parse_args(["--ckpt", "x"] + flags)


def test_check_public_without_the_dflash_package_is_one_line_before_any_model_loads(monkeypatch, capsys):
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "dflash" else find_spec(name, *a))
    with pytest.raises(SystemExit):
        ddtree_accept.parse_args(["--ckpt", "no/such/checkpoint", "--check-public", "1"])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.endswith("dflash package, which is not installed: pip install --no-deps dflash==0.1.0")


def test_target_flag_overrides_the_recorded_target(checkpoint, tmp_path):
    target = random_qwen3(vocab_size=384, seed=3)
    drafter = make_drafter(target, block_size=4, target_path="no/such/target")
    drafter.save_pretrained(tmp_path / "drafter_only")
    args = ddtree_accept.parse_args(["--ckpt", str(tmp_path / "drafter_only"),
                                     "--target", str(checkpoint / "target"), "--budgets", "4"])
    target_path = ddtree_accept.target_path_of(args)
    assert target_path == str(checkpoint / "target")
    evaluator = ddtree_accept.Evaluator(args, ddtree_accept.torch.device("cpu"), target_path, form_tp_group(1))
    assert evaluator.enable_thinking is False and [str(m) for m in evaluator.methods] == ["ar", "hf", "dflash", "ddtree@4"]


def test_hf_baseline_decodes_greedily_whatever_the_target_s_generation_config(checkpoint):
    """hf is transformers' generate on ar's ids: a generation_config that samples, or penalises repeats,
    does not change its greedy tokens. It runs at temperature 0 only, unless left out."""
    args = ddtree_accept.parse_args(["--ckpt", str(checkpoint / "ckpt"), "--budgets", "4"])
    evaluator = ddtree_accept.Evaluator(args, ddtree_accept.torch.device("cpu"), ddtree_accept.target_path_of(args),
                                        form_tp_group(1))
    config = evaluator.target.generation_config
    config.do_sample, config.temperature, config.top_p, config.repetition_penalty = True, 0.6, 0.5, 5.0
    ids = evaluator.prompt_ids([{"role": "user", "content": PROMPTS[0]["prompt"]}])
    hf = evaluator.generate("hf", ids, 12)
    ar = evaluator.generate(ddtree_accept.Method("ar"), ids, 12)
    assert hf.output_ids == ar.output_ids and len(hf.output_ids) == 12 and hf.decode_seconds > 0
    assert evaluator.target.generation_config is config and config.repetition_penalty == 5.0  # given back
    for flags, on in [([], True), (["--temperature", "0.7"], False), (["--no-hf-baseline"], False)]:
        assert ddtree_accept.parse_args(["--ckpt", "x"] + flags).hf_baseline is on, flags
    with pytest.raises(SystemExit):
        ddtree_accept.parse_args(["--ckpt", "x", "--hf-baseline", "--temperature", "0.7"])


def test_threads_beyond_the_node_s_share_stop_eval_in_one_line(checkpoint, tmp_path):
    for requested in ("10000", "0"):
        with pytest.raises(SystemExit) as stopped:
            ddtree_accept.main(["--ckpt", str(checkpoint / "ckpt"), "--threads", requested,
                                "--out", str(tmp_path / "r.json")])
        message = str(stopped.value.code)
        assert message.startswith(f"error: --threads {requested}: this node has {os.cpu_count()} cores for 1 local")
        assert "\n" not in message
    assert not (tmp_path / "r.json").exists()


def test_best_method_is_the_fastest_lossless_speculative_one():
    methods = {"ar": {"speedup": 1.0, "lossless": "yes"}, "hf": {"speedup": 3.0, "lossless": "yes"},
               "dflash": {"speedup": 2.5, "lossless": "no"}, "ddtree@8": {"speedup": 0.7, "lossless": "ties-only"},
               "ddtree@16": {"speedup": 0.6, "lossless": "yes"}, "ddtree@32": {"speedup": None, "lossless": None}}
    assert eval_report.best_method(methods) == "ddtree@8"
    assert eval_report.best_method({"ar": methods["ar"], "hf": methods["hf"]}) is None


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
        drafter_dir(str(tmp_path))


def record(source, turn, output_ids, margins=()):
    return {"source": source, "turn": turn, "output_ids": output_ids, "acceptance_lengths": [1],
            "decode_seconds": 1.0, "stage_seconds": {}, "margins": list(margins)}


def test_a_prompt_diverges_once_and_divergences_say_where():
    """Turn 2 of a prompt follows the method's own turn-1 answer: after turn 1 diverged it is not
    compared (counted once). Each divergence names the position, both tokens and the margin."""
    reference = [record("a", 0, [1, 2, 3], [5.0, 0.1, 4.0]), record("a", 1, [4, 5], [5.0, 5.0]),
                 record("b", 0, [6, 7, 8], [5.0, 5.0, 3.0])]
    tie = [record("a", 0, [1, 9, 9]), record("a", 1, [9, 9]), record("b", 0, [6, 7, 8])]
    summary = eval_report.summarize(tie, reference, greedy=True, save_samples=False, tie_tolerance=0.25)
    assert summary["divergences"] == [{"source": "a", "turn": 0, "position": 1, "reference_token": 2,
                                       "token": 9, "margin": 0.1, "tie": True}]
    assert summary["divergence_rate"] == 0.5 and summary["lossless"] == "ties-only"
    bug = [record("a", 0, [1, 2, 3]), record("a", 1, [4, 5]), record("b", 0, [6, 7, 0])]
    summary = eval_report.summarize(bug, reference, greedy=True, save_samples=False, tie_tolerance=0.25)
    assert [(d["source"], d["position"], d["tie"]) for d in summary["divergences"]] == [("b", 2, False)]
    assert summary["lossless"] == "no"
    assert eval_report.summarize(bug, reference, greedy=False, save_samples=False)["lossless"] is None


# ---------------------------------------------------------------------------------------------
# Benchmarks from local copies, unbiased subsets
# ---------------------------------------------------------------------------------------------

GSM8K_ROWS = [{"question": f"Question number {i}?", "answer": f"#### {i}"} for i in range(150)]


def test_named_benchmark_from_a_local_copy_gives_the_hub_prompts(tmp_path, monkeypatch):
    """gsm8k=DIR (save_to_disk) and gsm8k=FILE.jsonl (the hub rows) give exactly the prompts that
    loading the hub split gives: the same fixed shuffle, count and format."""
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.Dataset.from_list(GSM8K_ROWS))
    _, from_hub = load_prompts("gsm8k")
    datasets.Dataset.from_list(GSM8K_ROWS).save_to_disk(str(tmp_path / "saved"))
    as_dict = datasets.DatasetDict({"test": datasets.Dataset.from_list(GSM8K_ROWS)})
    as_dict.save_to_disk(str(tmp_path / "dict"))
    jsonl = tmp_path / "gsm8k_rows.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in GSM8K_ROWS))
    assert len(from_hub) == 128 and from_hub[0].turns[0].endswith(REASON_BOXED)
    assert [p.turns for p in from_hub] != [[r["question"] + REASON_BOXED] for r in GSM8K_ROWS[:128]]
    for local in (tmp_path / "saved", tmp_path / "dict", jsonl):
        name, prompts = load_prompts(f"gsm8k={local}", max_samples=40)
        assert name == "gsm8k" and prompts == from_hub[:40]


def test_local_copy_errors_name_the_path_and_reason(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"problem": "no question column"}) + "\n")
    with pytest.raises(ValueError, match=f"gsm8k={rows}: .*'question'.*columns: problem"):
        load_prompts(f"gsm8k={rows}")
    rows.write_text(json.dumps({"question": "q"}) + "\n{broken\n")
    with pytest.raises(ValueError, match=f"{rows}:2: not valid JSON"):
        load_prompts(f"gsm8k={rows}")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(GSM8K_ROWS)}).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(ValueError, match="no 'test' split"):
        load_prompts(f"gsm8k={tmp_path / 'd'}")
    with pytest.raises(ValueError, match="no such file"):
        load_prompts(f"gsm8k={tmp_path / 'missing'}")
    with pytest.raises(ValueError, match="not a file, nor NAME"):
        load_prompts("gsm9k")
    with pytest.raises(ValueError, match="no path after"):
        load_prompts("gsm8k=")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a directory written by datasets.save_to_disk"):
        load_prompts(f"gsm8k={tmp_path / 'empty'}")


def test_multi_turn_benchmark_from_a_local_copy(tmp_path):
    rows = [{"prompt": [f"first {i}", f"second {i}"], "category": "x"} for i in range(90)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "mt"))
    name, prompts = load_prompts(f"mt-bench={tmp_path / 'mt'}")
    assert name == "mt-bench" and len(prompts) == 80
    for prompt in prompts:
        row = prompt.turns[0].split()[1]
        assert prompt.turns == [f"first {row}", f"second {row}"]


def test_max_samples_of_a_prompt_file_is_a_seeded_shuffle(tmp_path):
    """Not the file's first N lines (a biased subset), the same subset every time."""
    path = tmp_path / "a=b.jsonl"  # an "=" in a file name is not NAME=PATH
    path.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(60)))
    name, subset = load_prompts(str(path), max_samples=12)
    lines = [int(p.source.rsplit(":", 1)[1]) for p in subset]
    assert name == "a=b" and len(set(lines)) == 12 and lines != list(range(1, 13))
    assert max(lines) > 30
    assert load_prompts(str(path), max_samples=12)[1] == subset
    assert len(load_prompts(str(path))[1]) == 60 and len(load_prompts(str(path), max_samples=99)[1]) == 60


def test_ranks_gather_on_a_cpu_group_with_the_flag_s_timeout(monkeypatch):
    """The ranks that finish first wait for the slowest in the one gather: the process group is a
    CPU (gloo) one whose timeout is --gather-timeout, not a backend's default (NCCL: 10 minutes,
    which an uneven share of long generations outlasts)."""
    created = []
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(ddtree_accept.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(ddtree_accept.dist, "init_process_group", lambda *a, **k: created.append((a, k)))
    monkeypatch.setattr(ddtree_accept.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(ddtree_accept.dist, "get_world_size", lambda: 2)
    args = ddtree_accept.parse_args(["--ckpt", "x", "--gather-timeout", "90"])
    assert ddtree_accept.setup_distributed(args.gather_timeout)[:2] == (1, 2)
    [(positional, keywords)] = created
    group = inspect.signature(dist_c10d.init_process_group).bind(*positional, **keywords).arguments
    assert group["backend"] == "gloo" and group["timeout"] == timedelta(minutes=90)


@pytest.mark.slow
def test_two_ranks_gather_the_same_report_and_so_does_a_tp2_target(checkpoint, tmp_path):
    """torchrun with 2 ranks and uneven shares (3 prompts): rank 0 gathers every rank's records
    once, in prompt order, and reports what one process reports. With --tp 2 the two ranks hold one
    sharded copy of the target and decode every prompt together: the same tokens, the same tau."""
    common = ["--ckpt", str(checkpoint / "ckpt"), "--bench", str(checkpoint / "prompts.jsonl"),
              "--budgets", "4", "--max-new-tokens", "8", "--save-samples"]
    single = ddtree_accept.main(common + ["--out", str(tmp_path / "single.json"), "--threads", "1"])
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    for tp in (1, 2):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "eval/ddtree_accept.py", *common, "--tp", str(tp), "--out",
                               str(tmp_path / f"tp{tp}.json")], check=True, env=env, capture_output=True, text=True)
        assert len(re.findall(r"prompts: 100%", proc.stderr)) == 1  # rank 0's progress alone
        two = json.loads((tmp_path / f"tp{tp}.json").read_text())
        assert two["config"]["world_size"] == 2 and two["config"]["tp_size"] == tp
        assert two["config"]["regime"] == ("throughput, 2 ranks x 1 thread" if tp == 1 else
                                           "one stream, tensor-parallel over 2 ranks x 1 thread")
        assert ("hf" in two["benchmarks"]["prompts"]["methods"]) == (tp == 1)  # skipped with a note under --tp 2
        assert (two["config"]["hf_note"] is None) == (tp == 1)
        for method, summary in single["benchmarks"]["prompts"]["methods"].items():
            if method == "hf" and tp == 2:
                continue
            theirs = two["benchmarks"]["prompts"]["methods"][method]
            assert [(s["source"], s["turn"], s["output_ids"], s["acceptance_lengths"]) for s in theirs["samples"]] == [
                (s["source"], s["turn"], s["output_ids"], s["acceptance_lengths"]) for s in summary["samples"]]
            assert theirs["lossless"] == "yes" and theirs["tau"] == summary["tau"]


def test_flags_that_cannot_work_stop_eval_with_one_line_before_any_model_loads(checkpoint, tmp_path, capsys):
    ckpt = str(checkpoint / "ckpt")
    moved = make_drafter(random_qwen3(vocab_size=384, seed=3), block_size=4, target_path=str(tmp_path / "gone" / "t"))
    moved.save_pretrained(tmp_path / "moved")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"architectures": ["DFlashDraftModel"], ')  # cut short
    unrecorded = json.loads((tmp_path / "moved" / "config.json").read_text())
    (tmp_path / "unrecorded").mkdir()
    (tmp_path / "unrecorded" / "config.json").write_text(json.dumps({**unrecorded, "dflash_config": None}))
    cases = [(["--ckpt", str(tmp_path / "nowhere")], "no DFlashDraftModel or DFlash2DraftModel config.json"),
             (["--ckpt", str(tmp_path / "moved")], f"records, {tmp_path}/gone/t: no such directory (pass --target)"),
             (["--ckpt", ckpt, "--target", "./no/target"], "--target ./no/target: no such directory"),
             (["--ckpt", ckpt, "--bench", str(tmp_path / "none.jsonl")], "none.jsonl"),
             (["--ckpt", ckpt, "--budgets", "8,x"], "--budgets '8,x': comma-separated positive integers"),
             (["--ckpt", ckpt, "--budgets", "16,8,16"], "--budgets 16,8,16: a budget is listed twice"),
             (["--ckpt", ckpt, "--bench", ","], "--bench names no benchmark"),
             (["--ckpt", ckpt, "--target", ""], "--target is empty"),
             (["--ckpt", str(tmp_path / "broken")], "broken/config.json: not a JSON config"),
             (["--ckpt", str(tmp_path / "unrecorded")], "records no dflash_config.target_path: pass --target")]
    for flags, message in cases:
        with pytest.raises(SystemExit) as stopped:
            ddtree_accept.main(flags + ["--out", str(tmp_path / "r.json")])
        said = str(stopped.value.code) + capsys.readouterr().err
        assert message in said and "Traceback" not in said, flags
    assert not (tmp_path / "r.json").exists()


def test_a_missing_local_target_directory_is_named_as_one_by_every_tool(tmp_path, capsys):
    """transformers calls a missing path of three parts a malformed hub id; each tool says it is missing."""
    from data import prepare, regenerate
    from drafter.target_model.model import TargetError, load_target, target_config
    missing = str(tmp_path / "world" / "target")
    for load in (lambda: load_target(missing, "cpu", ddtree_accept.torch.float32), lambda: target_config(missing, None)):
        with pytest.raises(TargetError, match=f"target {re.escape(missing)}: no such directory$"):
            load()
    (tmp_path / "weights.bin").write_text("")
    for path, reason in [(str(tmp_path / "weights.bin"), "not a directory"), ("~/model", "a leading '~' is not expanded")]:
        with pytest.raises(TargetError, match=re.escape(f"target {path}: {reason}")):
            target_config(path, None)
    for parse in (lambda: prepare.parse_args(["--input", "x.jsonl", "--target", missing, "--out", "o"]),
                  lambda: regenerate.parse_args(["--input", "x.jsonl", "--out", "o.jsonl", "--backend", "local",
                                                 "--target", missing])):
        with pytest.raises(SystemExit):
            parse()
        assert f"--target {missing}: no such directory" in capsys.readouterr().err
    assert prepare.parse_args(["--input", "x", "--target", "org/model", "--out", "o"]).target == "org/model"  # a hub id
