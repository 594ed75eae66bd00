"""Every target family the drafters are trained for (tests/families.py): the features are the target's
own hidden states, a drafter is configured for it and loads in the public `dflash` package with our
logits, and decoding reproduces the target's own greedy `generate` (ar, dflash, ddtree: a tree mask on
attention-only targets, a batch of the tree's paths through conv, recurrent and compressor layers)."""
import tempfile

import pytest
import torch
import torch.nn.functional as F

from conftest import MASK_ID, make_drafter
from drafter.models import DraftCache
from drafter.serving.decode import DecodeSettings, generate
from drafter.serving.testing import ReplayDrafter
from drafter.target_model.model import TargetError, context_features, decoder_layers, looped_layers, select_features
from families import FAMILIES, family_config, random_target

SLIDING = ("mistral", "gpt_oss", "gemma3_text", "gemma4_text", "olmo3")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return request.param, random_target(request.param)


def test_features_are_the_targets_own_hidden_states_and_stop_after_the_last_layer(family):
    """On 40 tokens (5 windows of 8): equal to the model's own `hidden_states`; the layers after the
    last needed one and the LM head never run."""
    name, target = family
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    layer_ids = [1, 3]
    with torch.no_grad():
        expected = select_features(target(ids, output_hidden_states=True).hidden_states, layer_ids)
    later = []
    hooks = [module.register_forward_hook(lambda *args: later.append(1))
             for module in (decoder_layers(target)[4], target.get_output_embeddings())]
    try:
        features = context_features(target, ids, layer_ids)
    finally:
        for hook in hooks:
            hook.remove()
    torch.testing.assert_close(features, expected, rtol=0, atol=0)
    assert later == [], f"{name}: layers past the last needed one ran"


def test_the_export_loads_in_dflash_with_our_logits(family):
    """drafter_config works for the family; the public DFlashDraftModel, given the same weights,
    context features and block (embedded its way: raw rows times input_embedding_scale), gives our
    draft logits."""
    dflash_model = pytest.importorskip("dflash.model")
    name, target = family
    drafter = make_drafter(target, num_layers=2, block_size=8)
    embedding = target.get_input_embeddings()
    # Gemma scales its embeddings by sqrt(hidden) in the module, Granite by embedding_multiplier in its forward
    scale = {"gemma3_text": 64 ** 0.5, "gemma4_text": 64 ** 0.5, "granite": 12.0}.get(name, 1.0)
    assert drafter.config.dflash_config["input_embedding_scale"] == pytest.approx(scale)
    with tempfile.TemporaryDirectory() as directory:
        drafter.save_pretrained(directory)
        public = dflash_model.DFlashDraftModel.from_pretrained(directory).eval()
    ids = torch.randint(0, 250, (1, 30), generator=torch.Generator().manual_seed(1))
    context, block = ids[:, :20], torch.full((1, 8), MASK_ID)
    block[0, 0] = ids[0, 20]
    features = context_features(target, context, drafter.target_layer_ids)
    ours = drafter.draft_logits(target, features, block, DraftCache())
    with torch.no_grad():
        noise = F.embedding(block, embedding.weight) * public.config.dflash_config["input_embedding_scale"]
        hidden = public(position_ids=torch.arange(28)[None], noise_embedding=noise, target_hidden=features,
                        past_key_values=dflash_model._make_cache(public.config), use_cache=True)[:, 1:]
        theirs = public.compute_logits(hidden, target.get_output_embeddings())
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_decoding_reproduces_the_targets_own_greedy_generate(family):
    """ar, dflash and ddtree@16 against the target's `generate`, 12 prompt tokens + 40 new (past the
    window of 8), with a random drafter and one that drafts the answer but for a decoy at every 4th
    position (partial acceptance, rollback, a tree branch taken). A tree through conv, recurrent or
    compressor layers, or chunked attention, is verified as a batch of its paths."""
    name, target = family
    prompt = torch.randint(0, 250, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = target.generate(prompt, max_new_tokens=40, min_new_tokens=40, do_sample=False)[0, 12:].tolist()
    assert generate(target, prompt, 40).output_ids == expected
    drafter = make_drafter(target, num_layers=1, block_size=8)
    for proposer in (drafter, ReplayDrafter(drafter, prompt[0].tolist() + expected)):
        result = generate(target, prompt, 40, drafter=proposer, settings=DecodeSettings("dflash"))
        assert result.output_ids == expected, f"{name} dflash"
        result = generate(target, prompt, 40, drafter=proposer, settings=DecodeSettings("ddtree", 16))
        assert result.output_ids == expected, f"{name} ddtree"
    assert 40 / len(result.acceptance_lengths) > 3  # the replayed drafts were accepted


def test_a_hybrid_target_restores_its_recurrent_state_after_a_rejected_draft(monkeypatch):
    """The recompute stage runs exactly when a draft is partly rejected, and without it the
    rejected drafts would stay in the recurrent state."""
    target = random_target("qwen3_5_text")
    prompt = torch.randint(0, 250, (1, 12), generator=torch.Generator().manual_seed(3))
    expected = generate(target, prompt, 40).output_ids
    oracle = ReplayDrafter(make_drafter(target, num_layers=1, block_size=8), prompt[0].tolist() + expected)
    result = generate(target, prompt, 40, drafter=oracle, settings=DecodeSettings("dflash"))
    assert result.output_ids == expected and result.stage_seconds["recompute"] > 0


def test_a_family_whose_cached_forward_restarts_its_state_is_refused_by_name():
    """Jamba's Mamba layers ignore the cached state on a multi-token forward, which every verify is:
    the speculative methods refuse it before any work; ar (one token a step) is exact."""
    target = random_target("jamba")
    prompt = torch.randint(0, 250, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = target.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, 12:].tolist()
    assert generate(target, prompt, 12).output_ids == expected
    for method, budget in (("dflash", None), ("ddtree", 4)):
        with pytest.raises(TargetError, match="jamba: its forward over several new tokens"):
            generate(target, prompt, 12, drafter=make_drafter(target), settings=DecodeSettings(method, budget))


def test_a_hyper_connection_target_gives_the_mean_of_its_streams():
    """DeepSeek-V4's layers output 4 residual streams [b, T, 4, H]; a feature is their mean. A layer
    output of any other rank is refused naming the family."""
    target = random_target("deepseek_v4")
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        streams = target(ids, output_hidden_states=True).hidden_states
    assert streams[2].shape == (1, 12, 4, 64)
    expected = torch.cat([streams[2].mean(dim=2), streams[4].mean(dim=2)], dim=-1)
    torch.testing.assert_close(context_features(target, ids, [1, 3]), expected, rtol=0, atol=0)
    hook = decoder_layers(target)[1].register_forward_hook(lambda module, args, output: output[..., None])
    try:
        with pytest.raises(TargetError, match=r"deepseek_v4: a decoder layer's output has shape \(1, 12, 4, 64, 1\)"):
            context_features(target, ids, [1, 3])
    finally:
        hook.remove()


def test_a_looped_layer_is_refused_as_a_feature_layer_by_name():
    """Dory runs its looped layer (4) twice per forward: it has no single output to read, and a
    features-only forward would stop after its first pass."""
    target = random_target("dory")
    assert looped_layers(target) == [4]
    ids = torch.zeros((1, 4), dtype=torch.long)
    with pytest.raises(TargetError, match=r"dory: target_layer_ids \[4\] run several times per forward"):
        context_features(target, ids, [1, 4])


def test_a_target_without_readable_decoder_layers_is_refused_by_name():
    target = random_target("llama")
    target.model.layers = torch.nn.ModuleList(list(target.model.layers)[:3])  # not the config's 6
    with pytest.raises(TargetError, match="llama.*no list of its 6 decoder layers"):
        context_features(target, torch.zeros(1, 4, dtype=torch.long), [1])


@pytest.mark.slow
def test_a_hybrid_family_end_to_end(tmp_path):
    """A Qwen3.5-style hybrid (Gated DeltaNet + attention) target directory: train.py under torchrun
    prints the memory of a path-batch verify at start-up, trains, evaluates (replayed tau_dflash and
    tau_ddtree@16) and generates (gen_tau_dflash and gen_tau_ddtree@16, the tree as a batch of its
    paths), the export is evaluated by
    eval/ddtree_accept.py (dflash and ddtree generated, lossless, timed), and data/regenerate.py
    --backend local writes the target's answers."""
    import json
    import subprocess
    import sys

    import yaml

    from eval import ddtree_accept
    from runs import REPO, records, run_to_end, write_run
    from tiny_tokenizer import save_tiny_tokenizer

    target_dir = save_tiny_tokenizer(tmp_path / "target")
    random_target("qwen3_5_text", vocab_size=384).save_pretrained(target_dir)
    cfg_path = write_run(tmp_path, max_steps=6, eval_every=6, save_every=6, generate_every=6,
                         generate_max_new_tokens=6)
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["target"] = {"path": str(target_dir)}
    cfg_path.write_text(yaml.safe_dump(cfg))
    out = run_to_end(cfg_path, launcher="torchrun")
    assert "ddtree@16 on qwen3_5_text as a batch of paths at" in out  # its memory, planned at start-up
    run_dir = tmp_path / "run"
    evaluation, generation = records(run_dir, "eval")[-1], records(run_dir, "generate")[-1]
    assert evaluation["tau_dflash"] >= 1 and evaluation["tau_ddtree@16"] >= evaluation["tau_dflash"]
    assert generation["gen_tau_dflash"] >= 1 and generation["gen_tau_ddtree@16"] >= 1
    exported = json.loads((run_dir / "checkpoints" / "latest" / "drafter" / "config.json").read_text())
    assert exported["dflash_config"]["target_model_type"] == "qwen3_5_text"

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is the capital of France?"}) + "\n")
    results = ddtree_accept.main(["--ckpt", str(run_dir / "checkpoints" / "latest"), "--bench", str(prompts),
                                  "--budgets", "4", "--max-new-tokens", "10", "--out", str(tmp_path / "r.json")])
    methods = results["benchmarks"]["prompts"]["methods"]
    assert methods["dflash"]["lossless"] == "yes" and not methods["dflash"]["replayed"]
    assert methods["ddtree@4"]["lossless"] == "yes" and not methods["ddtree@4"]["replayed"]
    assert methods["ddtree@4"]["speedup"] is not None and results["config"]["tree_verify_refusal"] is None

    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "Hello world"}]}) + "\n")
    out = tmp_path / "regen.jsonl"
    done = subprocess.run([sys.executable, str(REPO / "data" / "regenerate.py"), "--input", str(chats),
                           "--out", str(out), "--backend", "local", "--target", str(target_dir),
                           "--max-tokens", "8"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(out.read_text().splitlines()[0])["messages"][-1]
    assert answer["role"] == "assistant" and answer["content"]


def test_a_multimodal_checkpoint_loads_through_its_wrapper(tmp_path):
    """Kimi-K2.5 (a DeepSeek-V3 text model in a vision-language wrapper that transformers maps to
    image-text-to-text only) loads as that wrapper; its decoder layers, embedding and head are found."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from drafter.target_model.model import load_target
    config = AutoConfig.for_model("kimi_k25", text_config=family_config("deepseek_v3").to_dict(),
                                  vision_config=dict(num_hidden_layers=1, hidden_size=32, intermediate_size=32,
                                                     num_attention_heads=2))
    AutoModelForImageTextToText.from_config(config).save_pretrained(tmp_path)
    target = load_target(str(tmp_path), "cpu", torch.float32)
    ids = torch.randint(0, 250, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = select_features(target(input_ids=ids, output_hidden_states=True).hidden_states, [1, 3])
    torch.testing.assert_close(context_features(target, ids, [1, 3]), expected, rtol=0, atol=0)


def test_eval_replays_what_a_target_cannot_verify(tmp_path):
    """On Jamba (no exact multi-token verify) eval/ddtree_accept.py reports ar, and dflash and ddtree
    replayed on ar's text, instead of stopping."""
    import json

    from eval import ddtree_accept
    from tiny_tokenizer import save_tiny_tokenizer
    target_dir = save_tiny_tokenizer(tmp_path / "target")
    target = random_target("jamba", vocab_size=384)
    target.save_pretrained(target_dir)
    make_drafter(target, block_size=4, target_path=str(target_dir)).save_pretrained(tmp_path / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is the capital of France?"}) + "\n")
    results = ddtree_accept.main(["--ckpt", str(tmp_path / "drafter"), "--bench", str(prompts), "--budgets", "4",
                                  "--max-new-tokens", "8", "--out", str(tmp_path / "r.json")])
    methods = results["benchmarks"]["prompts"]["methods"]
    assert not methods["ar"]["replayed"] and methods["ar"]["lossless"] == "yes"
    assert methods["dflash"]["replayed"] and methods["ddtree@4"]["replayed"]
    assert methods["dflash"]["steps"] > 0 and methods["dflash"]["tau"] >= 1
    assert "jamba" in results["config"]["verify_refusal"]
