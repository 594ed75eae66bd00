"""Starting the drafter's layers from the target's (drafter/models/from_target.py): the copied layers
hold the target's weights, and the context path is started so that the first drafter layer reads,
at every context position, exactly the keys and values its target layer computes there."""
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, Qwen2Config

from drafter.errors import ConfigError
from drafter.models import new_drafter
from drafter.models.configure import drafter_config
from drafter.models.from_target import start_layers_from_target, suggested_layers
from drafter.target_model.model import decoder_layers, input_embedding_scale, random_qwen3
from drafter.target_model.tensor_parallel import TPGroup, shard_target


def target_and_drafter(layer_ids=(1, 4)):
    target = random_qwen3(num_hidden_layers=6)
    with torch.no_grad():  # norms of ones would hide a norm not copied
        for name, param in target.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    config = drafter_config(target.config, num_layers=2, block_size=4, mask_token_id=255,
                            target_layer_ids=list(layer_ids), input_embedding_scale=input_embedding_scale(target))
    return target, new_drafter(config, target.lm_head.weight, seed=0)


def test_copied_layers_hold_the_target_layers_weights_and_the_rest_is_untouched():
    target, drafter = target_and_drafter()
    fresh_norm = drafter.norm.weight.clone()
    line = start_layers_from_target(drafter, target, [2, 3])
    layers = decoder_layers(target)
    for drafter_layer, target_id in zip(drafter.layers, [2, 3]):
        for name, tensor in drafter_layer.state_dict().items():
            assert torch.equal(tensor, layers[target_id].state_dict()[name]), name
    assert torch.equal(drafter.norm.weight, fresh_norm)  # the final norm keeps the head's scale rule
    assert "copied" in line and "self_attn.q_proj.weight" in line


def test_a_bf16_target_starts_an_fp32_drafter():
    """As on a GPU: the frozen target in bf16, the drafter's master weights in fp32. The copy is exact and
    the same-function check compares like with like, not bf16 rounding against fp32."""
    target, drafter = target_and_drafter()
    target = target.to(torch.bfloat16)
    start_layers_from_target(drafter, target, [2, 3])
    assert drafter.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    assert torch.equal(drafter.layers[0].self_attn.q_proj.weight,
                       decoder_layers(target)[2].self_attn.q_proj.weight.float())


def test_the_first_layer_reads_its_target_layers_context_keys_and_values():
    """Target layer 2 reads layer 1's output; with layers_from_target starting at 2 and feature
    layer 1 first, the drafter's fc + hidden_norm + k/v projections give layer 2's own k and v."""
    target, drafter = target_and_drafter(layer_ids=(1, 4))
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    start_layers_from_target(drafter, target, suggested_layers([1, 4], 2))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
        features = torch.cat([hidden[1 + 1], hidden[4 + 1]], dim=-1)
        ctx = drafter.hidden_norm(drafter.fc(features))
        layer2 = decoder_layers(target)[2]
        normed = layer2.input_layernorm(hidden[2])
        attn = drafter.layers[0].self_attn
        torch.testing.assert_close(attn.v_proj(ctx), layer2.self_attn.v_proj(normed), rtol=0, atol=1e-6)
        torch.testing.assert_close(attn.k_proj(ctx), layer2.self_attn.k_proj(normed), rtol=0, atol=1e-6)


def test_layer_ids_that_do_not_fit_are_refused_by_key():
    target, drafter = target_and_drafter()
    with pytest.raises(ConfigError, match=r"drafter.layers_from_target=\[2\]: one target layer per drafter layer"):
        start_layers_from_target(drafter, target, [2])
    with pytest.raises(ConfigError, match=r"\[6\] not layers of a target of 6 layers"):
        start_layers_from_target(drafter, target, [2, 6])


def test_a_target_sharded_by_tensor_parallelism_is_refused_naming_the_weight():
    """A tp member holds a share of each projection: copying only what still matches (the norms) would
    start a drafter that is neither fresh nor the target's."""
    target, drafter = target_and_drafter()
    shard_target(target, TPGroup([0, 1], 0, None))
    with pytest.raises(ConfigError, match=r"target layer 2's self_attn.q_proj.weight is \[32, 64\], the drafter's "
                                          r"\[64, 64\] \(a target sharded by target.tp_size"):
        start_layers_from_target(drafter, target, [2, 3])


def family_target_and_drafter(config):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        target = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # a trained norm's weights are not the init's
        for name, param in target.named_parameters():
            if "norm" in name or "bias" in name:
                param.uniform_(0.5, 1.5)
    text = target.config.get_text_config()
    drafter_cfg = drafter_config(text, num_layers=2, block_size=4, mask_token_id=255, target_layer_ids=[1, 4],
                                 input_embedding_scale=input_embedding_scale(target))
    return target, new_drafter(drafter_cfg, target.get_output_embeddings().weight, seed=0)


@pytest.mark.parametrize("config, module", [
    (Gemma3TextConfig(vocab_size=256, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128), "self_attn.q_norm"),
    (Qwen2Config(vocab_size=256, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128), "self_attn.q_proj"),
])
def test_a_target_layer_that_computes_otherwise_with_the_same_weights_is_refused(config, module):
    """Gemma's norms scale by (1 + w) and Qwen2's q/k/v projections add a bias the drafter has not: the
    same weights would not make the target's layer."""
    target, drafter = family_target_and_drafter(config)
    with pytest.raises(ConfigError, match=rf"target layer 2's {re.escape(module)} \(\w+\) computes otherwise"):
        start_layers_from_target(drafter, target, [2, 3])
