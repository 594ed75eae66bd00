import json

import pytest
import torch
from safetensors import safe_open

from conftest import MASK_ID, VARIANTS, make_drafter
from drafter.config import ConfigError
from drafter.config import DrafterVariant
from drafter.models import (DFlash2DraftModel, DFlashDraftModel, DraftCache, LayerAttention, layer_attention,
                            load_drafter)
from drafter.models.configure import drafter_config
from drafter.target_model.model import context_features, default_target_layer_ids, select_features


def test_default_layer_ids_match_reference_rule():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B (docs/design.md, "The DFlash drafter")
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(32, 2) == [1, 29]


def test_context_features_stop_after_last_needed_layer(target):
    ids = torch.randint(0, 250, (2, 17))
    called = []
    hooks = [layer.register_forward_hook(lambda m, i, o, n=n: called.append(n))
             for n, layer in enumerate(target.model.layers)]
    try:
        features = context_features(target, ids, [1, 3])
    finally:
        for h in hooks:
            h.remove()
    assert called == [0, 1, 2, 3]
    full = target(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(features, select_features(full, [1, 3]), rtol=0, atol=1e-5)


def test_config_records_everything_eval_needs(target, tmp_path):
    cfg = drafter_config(target.config, num_layers=3, block_size=16, mask_token_id=MASK_ID,
                         target_layer_ids=[0, 2, 4], target_path="some/target",
                         chat_template_kwargs={"enable_thinking": False})
    DFlashDraftModel(cfg).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["DFlashDraftModel"]
    assert saved["num_hidden_layers"] == 3 and saved["num_target_layers"] == 6
    assert saved["block_size"] == 16
    assert saved["dflash_config"] == {"target_layer_ids": [0, 2, 4], "mask_token_id": MASK_ID,
                                      "target_path": "some/target", "input_embedding_scale": 1.0,
                                      "target_model_type": "qwen3",
                                      "chat_template_kwargs": {"enable_thinking": False}}
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert "layers.2.self_attn.k_norm.weight" in names and "layers.0.mlp.gate_proj.weight" in names


def test_bad_layer_ids_and_mask_token_are_rejected_naming_the_keys(target):
    with pytest.raises(ConfigError, match=r"^drafter.target_layer_ids \[6\]: .* use layers 0..4$"):
        drafter_config(target.config, num_layers=1, block_size=8, mask_token_id=1, target_layer_ids=[6])
    with pytest.raises(ConfigError, match=r"^drafter.conv_group_size=7 does not divide .*; "
                                          r"drafter.mask_token_id=256 has no row "):
        drafter_config(target.config, num_layers=1, block_size=8, mask_token_id=256,
                       variant=DrafterVariant(arch="dflash2", conv_group_size=7))


_TWO_ROPE_SETS = {"main": {"rope_type": "default", "rope_theta": 1e4},
                  "compress": {"rope_type": "default", "rope_theta": 1.6e5}, "rope_type": "default", "rope_theta": 1e4}


@pytest.mark.parametrize("field, value, message", [
    ("num_key_value_heads", 3, "num_key_value_heads=3 does not divide num_attention_heads=4"),
    ("head_dim", 15, "head_dim=15 is odd"),
    ("head_dim", 0, "head_dim=0 must be a positive integer"),
    ("rope_parameters", _TWO_ROPE_SETS, r"rope_parameters holds rotary sets \['compress', 'main'\]"),
    ("rope_parameters", {"rope_type": "proportional", "rope_theta": 1e4}, "rope_type='proportional' is not one of"),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4, "partial_rotary_factor": 0.5},
     "rotary 8 wide for head_dim=16"),
])
def test_a_config_its_layers_cannot_follow_is_refused_at_build_time_naming_the_field(target, field, value, message):
    cfg = drafter_config(target.config, num_layers=1, block_size=8, mask_token_id=MASK_ID)
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=f"drafter config \\(target qwen3\\): .*{message}"):
        DFlashDraftModel(cfg)


def test_a_target_without_the_widths_the_drafter_takes_is_refused_by_name():
    """An attention-free family (Mamba) has no heads to take; a drafter config names what is missing."""
    from transformers import AutoConfig
    mamba = AutoConfig.for_model("mamba", hidden_size=64, num_hidden_layers=6, vocab_size=256)
    with pytest.raises(ValueError, match="target mamba: its config's num_attention_heads is None"):
        drafter_config(mamba, num_layers=1, block_size=8, mask_token_id=MASK_ID)


def test_a_target_with_several_rope_sets_gives_the_drafter_one():
    """DeepSeek-V4's `main` (sliding attention) and `compress` (compressors) sets: the drafter takes
    the main one, whole-head; Gemma 3's per-layer-type sets: the full-attention one."""
    from families import family_config
    v4 = drafter_config(family_config("deepseek_v4"), num_layers=1, block_size=8, mask_token_id=MASK_ID)
    assert v4.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    gemma = family_config("gemma3_text")
    full_theta = gemma.rope_parameters["full_attention"]["rope_theta"]
    assert full_theta != gemma.rope_parameters["sliding_attention"]["rope_theta"]
    drafter = drafter_config(gemma, num_layers=1, block_size=8, mask_token_id=MASK_ID)
    assert drafter.rope_parameters["rope_theta"] == full_theta

@pytest.mark.parametrize("variant", VARIANTS)
def test_public_dflash_package_loads_our_export_with_equal_logits(target, tmp_path, variant):
    """docs/design.md contracts 1 and 11: the z-lab `dflash` package loads the export of every variant
    (DFlash2 in its DFlash2DraftModel), reads each layer's window and causality as ours, and computes
    our logits and, for DFlash2, our selector chain (the context, 21 positions, is longer than every
    window)."""
    from dflash import model as public_model

    drafter = make_drafter(target, num_layers=2, block_size=8, variant=VARIANTS[variant])
    dflash2 = isinstance(drafter, DFlash2DraftModel)
    if dflash2:
        with torch.no_grad():  # pair scores as large as the logits' gaps: the selector re-ranks
            drafter.candidate_selector.successor_codebook.mul_(20)
    drafter.save_pretrained(tmp_path)
    public_class = public_model.DFlash2DraftModel if dflash2 else public_model.DFlashDraftModel
    public, loading = public_class.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    public.eval()
    assert not any(loading.values()), loading  # no missing, unexpected or mismatched weights
    assert public.target_layer_ids == drafter.target_layer_ids
    assert public.mask_token_id == MASK_ID and public.block_size == 8
    assert [(layer.self_attn.sliding_window, layer.self_attn.is_causal) for layer in public.layers] == \
        [(a.window, a.causal) for a in drafter.layer_attention]
    reloaded = load_drafter(tmp_path)
    assert type(reloaded) is type(drafter) and reloaded.layer_attention == drafter.layer_attention
    assert all(torch.equal(value, reloaded.state_dict()[name]) for name, value in drafter.state_dict().items())

    ids = torch.randint(0, 250, (3, 30), generator=torch.Generator().manual_seed(5))
    features = context_features(target, ids, drafter.target_layer_ids)
    block = torch.cat([ids[:, 21:22], torch.full((3, 7), MASK_ID)], 1)
    ours = drafter.draft_logits(target, features[:, :21], block, DraftCache())
    with torch.no_grad():
        hidden = public(target_hidden=features[:, :21], noise_embedding=target.model.embed_tokens(block),
                        position_ids=torch.arange(29)[None])[:, 1:]
    torch.testing.assert_close(ours, target.lm_head(hidden), rtol=1e-5, atol=1e-5)
    chain = drafter.draft_chain(target, features[:, :21], block, DraftCache())
    if dflash2:
        with torch.no_grad():
            theirs = public.propose(hidden, block[:, 0], target.lm_head, temperature=0.0)[0]
        assert torch.equal(chain, theirs)
        assert not torch.equal(chain, ours.argmax(-1))  # the selector re-ranked some slot
    else:
        assert torch.equal(chain, ours.argmax(-1))


@pytest.mark.parametrize("variant", VARIANTS)
def test_cache_keeps_context_only_and_matches_one_shot(target, variant):
    """Drafting with context added in pieces through the cache equals drafting with it all at once,
    though a sliding layer's cache keeps only what the next block can see."""
    drafter = make_drafter(target, variant=VARIANTS[variant])
    ids = torch.randint(0, 250, (1, 24))
    features = context_features(target, ids, drafter.target_layer_ids)
    block = torch.tensor([[int(ids[0, 20])] + [MASK_ID] * 7])
    one_shot = drafter.draft_logits(target, features[:, :20], block, DraftCache())
    cache = DraftCache()
    drafter.draft_logits(target, features[:, :9], torch.tensor([[int(ids[0, 9])] + [MASK_ID] * 7]), cache)
    assert cache.length == 9
    pieces = drafter.draft_logits(target, features[:, 9:20], block, cache)
    assert cache.length == 20
    torch.testing.assert_close(pieces, one_shot, rtol=1e-5, atol=1e-5)
    kept = [keys.shape[2] for keys in cache.keys]  # a sliding layer: the window - 1 before the next block
    assert kept == [20 if a.window is None else a.window - 1 for a in drafter.layer_attention]


def test_last_target_layer_is_refused_with_the_reason(target):
    """HF's hidden_states[L] is the last layer's output after the final norm (what serving reads);
    training captures the raw output. The two differ, so layer L-1 is refused, L-2 is fine."""
    ids = torch.randint(0, 250, (1, 12))
    raw = {}
    hook = target.model.layers[5].register_forward_hook(lambda m, args, out: raw.update(out=out))
    hidden_states = target(ids, output_hidden_states=True).hidden_states
    hook.remove()
    assert (hidden_states[6] - raw["out"]).abs().max() > 1.0  # what serving would read vs training
    for read in (lambda: select_features(hidden_states, [1, 5]), lambda: context_features(target, ids, [5])):
        with pytest.raises(ValueError, match=r"last layer \(5\).*use layers 0\.\.4"):
            read()  # a checkpoint from elsewhere with layer L-1: refused where features are read
    with pytest.raises(ValueError, match=r"last layer \(5\).*final norm.*0\.\.4"):
        drafter_config(target.config, num_layers=2, block_size=8, mask_token_id=MASK_ID,
                       target_layer_ids=[1, 5])
    cfg = drafter_config(target.config, num_layers=2, block_size=8, mask_token_id=MASK_ID,
                         target_layer_ids=[1, 4])
    assert cfg.dflash_config["target_layer_ids"] == [1, 4]
    torch.testing.assert_close(context_features(target, ids, [4]),
                               select_features(target(ids, output_hidden_states=True).hidden_states, [4]),
                               rtol=0, atol=1e-5)


def test_layer_attention_reads_the_config_as_dflash_does(target):
    """The public defaults: a sliding layer is causal and a full one is not, unless is_causal says
    otherwise for every layer; a variant without sliding layers writes no window."""
    def read(**variant):
        config = drafter_config(target.config, num_layers=2, block_size=8, mask_token_id=MASK_ID,
                                variant=DrafterVariant(**variant))
        return layer_attention(config), config
    mixed, config = read(layer_types=("full_attention", "sliding_attention"), sliding_window=4)
    assert mixed == [LayerAttention(None, False), LayerAttention(4, True)]
    assert config.layer_types == ["full_attention", "sliding_attention"] and config.sliding_window == 4
    assert not hasattr(config, "is_causal")
    assert read(layer_types=("full_attention", "sliding_attention"), sliding_window=4, causal=False)[0] == \
        [LayerAttention(None, False), LayerAttention(4, False)]
    full, config = read(causal=True)
    assert full == [LayerAttention(None, True)] * 2 and config.sliding_window is None


@pytest.mark.parametrize("variant,message", [
    (DrafterVariant(layer_types=("full_attention",)), "layer_types has 1 entries for 2 draft layers"),
    (DrafterVariant(layer_types=("full_attention", "sliding")), "each entry must be one of"),
    (DrafterVariant(layer_types=("sliding_attention",) * 2), "sliding_window must be set"),
    (DrafterVariant(layer_types=("sliding_attention",) * 2, sliding_window=0), "sliding_window=0 must be >= 1"),
    (DrafterVariant(sliding_window=8), "no layer_types entry is sliding_attention"),
    (DrafterVariant(arch="eagle"), "arch='eagle' is not one of dflash, dflash2"),
    (DrafterVariant(arch="dflash2", conv_group_size=24), "conv_group_size=24 does not divide the hidden size 64"),
    (DrafterVariant(arch="dflash2", selector_top_k=300), "selector_top_k=300 exceeds the vocabulary"),
    (DrafterVariant(arch="dflash2", conv_kernel_size=9), "conv_kernel_size=9 exceeds block_size=8"),
])
def test_bad_variants_are_refused_with_the_reason(target, variant, message):
    with pytest.raises(ValueError, match=message):
        drafter_config(target.config, num_layers=2, block_size=8, mask_token_id=MASK_ID, variant=variant)


def test_dflash2_starts_as_the_dflash_of_its_other_weights(target):
    """Identity-initialised convolutions: a new DFlash2 drafter computes what a DFlash drafter with
    its attention, MLP and fusion weights computes."""
    variant = DrafterVariant(arch="dflash2", selector_rank=8, selector_top_k=4)
    config = drafter_config(target.config, num_layers=2, block_size=8, mask_token_id=MASK_ID, variant=variant)
    torch.manual_seed(0)
    dflash2 = DFlash2DraftModel(config).eval()
    dflash = DFlashDraftModel(drafter_config(target.config, num_layers=2, block_size=8, mask_token_id=MASK_ID))
    shared = {k: v for k, v in dflash2.state_dict().items() if "conv" not in k and "selector" not in k}
    dflash.load_state_dict(shared)
    conv = dflash2.layers[0].attention_conv
    assert conv.base_kernel[:, 0].eq(1).all() and conv.base_kernel[:, 1:].eq(0).all()
    assert conv.kernel_projection.weight.eq(0).all()
    ids = torch.randint(0, 250, (2, 20), generator=torch.Generator().manual_seed(2))
    features = context_features(target, ids, dflash.target_layer_ids)
    block = torch.cat([ids[:, 12:13], torch.full((2, 7), MASK_ID)], 1)
    torch.testing.assert_close(dflash2.draft_logits(target, features[:, :12], block, DraftCache()),
                               dflash.draft_logits(target, features[:, :12], block, DraftCache()),
                               rtol=0, atol=1e-6)


def test_head_logits_hands_the_head_a_fresh_tensor_for_a_batch_of_one(target, drafter):
    """A block's slots 1..B-1 of one sequence are a view that torch calls contiguous (a size-1 batch
    dimension's stride is ignored) at a storage offset; in bf16 on the CPU such an input took a matmul
    path ~20x slower (bench/cpu_limits.py's drafter step), so the head gets a copy at offset 0."""
    seen = []
    head = target.get_output_embeddings()
    handle = head.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        hidden = torch.randn(1, 9, target.config.hidden_size)[:, 1:]
        assert hidden.is_contiguous() and hidden.storage_offset() > 0
        logits = drafter.head_logits(target, hidden)
    finally:
        handle.remove()
    (given,) = seen
    assert given.storage_offset() == 0 and given.stride() == torch.empty(given.shape).stride()
    torch.testing.assert_close(logits, head(hidden).float())
