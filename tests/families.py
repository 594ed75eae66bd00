"""Tiny random targets of every family the drafters are trained for, built in process from
transformers' own configs (no download): vocabulary 256, 6 layers, sliding window 8, weights spread
wide enough that greedy decoding has no near-ties to hide a bug behind."""
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from drafter.target_model.model import freeze

VOCAB, LAYERS, WINDOW = 256, 6, 8
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, intermediate_size=96, max_position_embeddings=512,
               tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None)
_SLIDING = ["sliding_attention", "full_attention"] * (LAYERS // 2)
_MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True)
_LINEAR = dict(layer_types=["linear_attention", "linear_attention", "full_attention"] * (LAYERS // 3),
               linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
               linear_num_key_heads=2, linear_num_value_heads=4)

FAMILIES = {
    "llama": {},
    "qwen3": {},
    "qwen3_moe": dict(_MOE, decoder_sparse_step=1),
    "glm4_moe": dict(_MOE),
    "lfm2": dict(layer_types=["conv", "full_attention"] * (LAYERS // 2), conv_L_cache=3,
                 block_auto_adjust_ff_dim=False, block_ff_dim=96, full_attn_idxs=None),
    "mistral": dict(sliding_window=WINDOW),
    "gpt_oss": dict(_MOE, sliding_window=WINDOW, layer_types=_SLIDING, attn_implementation="eager"),
    "gemma3_text": dict(sliding_window=WINDOW, layer_types=_SLIDING, query_pre_attn_scalar=16),
    "gemma4_text": dict(sliding_window=WINDOW, layer_types=_SLIDING, global_head_dim=32,
                        hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                        num_kv_shared_layers=0),
    "olmo3": dict(sliding_window=WINDOW, layer_types=_SLIDING),
    "deepseek_v3": dict(_MOE, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                        v_head_dim=16, num_key_value_heads=4, head_dim=8),
    "qwen3_next": dict(_MOE, **_LINEAR, shared_expert_intermediate_size=32),
    "qwen3_5_text": dict(_LINEAR),
    "qwen3_5_moe_text": dict(_MOE, **_LINEAR, shared_expert_intermediate_size=32),
    "nemotron_h": dict(layers_block_type=["mamba", "attention", "mlp"] * (LAYERS // 3), mamba_num_heads=4,
                       mamba_head_dim=16, ssm_state_size=8, n_groups=1, conv_kernel=4, chunk_size=8,
                       mamba_n_groups=1),
    "cohere2": dict(sliding_window=WINDOW, layer_types=_SLIDING),
    "granite": dict(embedding_multiplier=12.0, logits_scaling=2.0),
    "llama4_text": dict(attention_chunk_size=WINDOW, num_local_experts=2, interleave_moe_layer_step=2,
                        intermediate_size_mlp=96),
    # indexed sparse attention (DSA) on MLA; enough indexer heads that their relu scores do not tie
    "deepseek_v32": dict(_MOE, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                         v_head_dim=16, num_key_value_heads=4, head_dim=8, index_topk=6, index_head_dim=16,
                         index_n_heads=32),
    # hyper-connection streams; compressors of 4 (CSA) and 8 (HCA) positions, both emitting entries
    "deepseek_v4": dict(_MOE, sliding_window=WINDOW, compress_rates={"compressed_sparse_attention": 4,
                        "heavily_compressed_attention": 8}, attn_implementation="eager"),
    "falcon_h1": dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1,
                      mamba_chunk_size=8),
    # added in transformers 5.24
    "apertus1p5_text": {},
    "exaone": {},
    "sarvam_mla": dict(_MOE, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                       v_head_dim=16, num_key_value_heads=4),
    "sarvam_moe": dict(_MOE),
    "lara_mini": dict(_MOE, **dict(_LINEAR, layer_types=["linear_attention", "sliding_attention",
                                                         "full_attention"] * 2),
                      sliding_window=WINDOW, shared_expert_intermediate_size=32),
    # looped layers (4, twice per forward; refused as feature layers) after the layers the tests read
    "dory": dict(sliding_window=WINDOW, n_input_layers=4, n_output_layers=1, n_recurrent_loops=2),
    "inkling2_loop_text": dict(swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
                               sliding_window_size=WINDOW, d_rel=4, rel_extent=16, n_layers_per_attn_res_block=2,
                               loop_layer_index_start=4, loop_layer_index_end=6, loop_num_passes=2,
                               loop_gate_rank=4, n_routed_experts=4, num_experts_per_tok=2,
                               unpadded_vocab_size=VOCAB, attn_implementation="eager"),
}
# Jamba's Mamba restarts its scan on a multi-token forward over a cache: decoding must refuse it
UNSUPPORTED = {"jamba": dict(attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2,
                             num_experts=2, mamba_d_state=8, mamba_expand=2, use_mamba_kernels=False)}


def family_config(family: str, **extra):
    overrides = dict(_COMMON, **{**FAMILIES, **UNSUPPORTED}[family], **extra)
    attn = overrides.pop("attn_implementation", "sdpa")
    config = AutoConfig.for_model(family, **overrides)
    config._attn_implementation = attn
    return config


# nGPT squares its learned scales (Dory): drawn that wide, fp32 rounding alone moves its logits by units
SCALES = {"dory": 0.1}


def random_target(family: str, seed: int = 0, scale: float | None = None, **config) -> torch.nn.Module:
    """A frozen fp32 target of `family` (`config` overrides its tiny sizes) with every weight drawn
    N(0, scale^2) (norm weights 1 + that; scale 0.3 unless SCALES says otherwise), so that its
    logits are spread far apart."""
    scale = SCALES.get(family, 0.3) if scale is None else scale
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        target = AutoModelForCausalLM.from_config(family_config(family, **config))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in sorted(target.named_parameters()):
                noise = torch.randn(param.shape, generator=gen) * scale
                param.copy_(1.0 + noise if "norm" in name and "sink" not in name else noise)
    target.generation_config.eos_token_id = None
    return freeze(target)
