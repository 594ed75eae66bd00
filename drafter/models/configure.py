"""The drafter's config from the target's: the widths it must share with the target, the attention
shape and rotary it chooses where the target's do not apply (MLA, per-layer head dims, rope per
layer type), the drafter variant (`drafter.*`: sliding-window and causal layers, DFlash2), and what
`dflash_config` records so that a checkpoint serves and evaluates without flags. The modules that
this config builds live in `drafter/models/`."""

from huggingface_hub.errors import StrictDataclassError
from transformers import Qwen3Config

from drafter.config import DrafterVariant
from drafter.errors import ConfigError
from drafter.models import ARCHITECTURES
from drafter.models.checks import ROPE_TYPES, check_drafter_config
from drafter.target_model.model import default_target_layer_ids, feature_layer_problem



def _config_value(config, key: str, default=None):
    """config.key, or its global value where the config holds the key per layer (Gemma 4)."""
    try:
        value = getattr(config, key, default)
    except Exception:  # transformers: an attribute that differs per layer has no single value
        value = config.to_dict().get(key, default)
    return default if value is None else value


def _width(text_config, key: str) -> int:
    """A width the drafter must take from the target: one positive integer, or a ValueError naming
    the family and the field (an attention-free family has no heads; a per-layer list is no width)."""
    value = _config_value(text_config, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"target {getattr(text_config, 'model_type', None)}: its config's {key} is {value!r}, "
                         "not one positive width, and the drafter takes its own from it")
    return value


def drafter_attention_shape(text_config) -> dict:
    """The drafter's heads: the target's (query heads, KV heads, head dim) where its attention is
    ordinary multi-head attention; for MLA targets (DeepSeek-V3, Kimi) head dim = the target's value
    head dim, as many query heads as fill the hidden size, and at most 8 KV heads that divide them.
    A per-layer head dim (Gemma 4's global layers) gives way to the config's head_dim."""
    hidden, heads = _width(text_config, "hidden_size"), _width(text_config, "num_attention_heads")
    if _config_value(text_config, "kv_lora_rank"):  # multi-head latent attention
        head_dim = _config_value(text_config, "v_head_dim") or hidden // heads
        heads = max(1, hidden // head_dim)
        kv_heads = max(k for k in range(1, min(8, heads) + 1) if heads % k == 0)
        return {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim}
    kv_heads = _config_value(text_config, "num_key_value_heads", heads)
    head_dim = _config_value(text_config, "head_dim", hidden // heads)
    return {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim}


_ROPE_SETS = ("full_attention", "main")  # per layer type (Gemma 3, GPT-OSS ...); per branch (DeepSeek-V4)


def drafter_rope(text_config) -> dict:
    """The drafter's rotary: the target's rotary, or where the target has several rotary sets (per
    layer type, or DeepSeek-V4's `main` and `compress`) that of its full attention or main branch,
    applied to the whole head (partial-rotary and multimodal sections dropped), of a type
    Qwen3RotaryEmbedding computes; otherwise the default rotary at the target's base."""
    rope = dict(getattr(text_config, "rope_parameters", None) or {})
    sets = [key for key, value in rope.items() if isinstance(value, dict)]
    if sets:
        rope = dict(next((rope[key] for key in _ROPE_SETS if key in sets), {}))
    theta = rope.get("rope_theta", getattr(text_config, "rope_theta", 10000.0))
    if rope.get("rope_type", "default") not in ROPE_TYPES:
        return {"rope_type": "default", "rope_theta": theta}
    for key in ("partial_rotary_factor", "mrope_section", "mrope_interleaved"):
        rope.pop(key, None)
    return {**rope, "rope_type": rope.get("rope_type", "default"), "rope_theta": theta}


def drafter_widths(text_config) -> dict:
    """Everything of the drafter's Qwen3 config that comes from the target: the hidden size (which
    must match: the drafter reads the target's features and calls its embedding and LM head), the
    vocabulary, and the sizes the drafter takes over where the target has them (MLP width: the
    target's dense `intermediate_size` where it is one width, else 3x hidden; activation, norm eps,
    attention bias)."""
    from transformers.activations import ACT2FN

    hidden_act = getattr(text_config, "hidden_act", None)
    eps = next((getattr(text_config, k) for k in ("rms_norm_eps", "layer_norm_epsilon", "norm_eps")
                if getattr(text_config, k, None)), 1e-6)
    hidden = _width(text_config, "hidden_size")
    intermediate = _config_value(text_config, "intermediate_size")
    return {"hidden_size": hidden, "vocab_size": _width(text_config, "vocab_size"),
            **drafter_attention_shape(text_config),
            "intermediate_size": intermediate if isinstance(intermediate, int) and intermediate > 0 else 3 * hidden,
            "hidden_act": hidden_act if hidden_act in ACT2FN else "silu", "rms_norm_eps": float(eps),
            "max_position_embeddings": getattr(text_config, "max_position_embeddings", 32768),
            "attention_bias": bool(getattr(text_config, "attention_bias", False)),
            "rope_parameters": drafter_rope(text_config)}


# over six: keyword-only, one per field of the exported config.json and its dflash_config
def drafter_config(target_config, *, num_layers: int, block_size: int, mask_token_id: int,
                   target_layer_ids: list[int] | None = None, input_embedding_scale: float = 1.0,
                   variant: DrafterVariant = DrafterVariant(), draft_vocab_size: int | None = None,
                   **record) -> Qwen3Config:
    """A drafter config for any HF causal-LM target config (`drafter_widths`), of `variant`.

    `input_embedding_scale` is the target's embedding scale (`target.input_embedding_scale`): the
    block is embedded as raw embedding rows times it, at training and serving time alike. The
    drafter's logits are the target's LM head on its states, without the target's final soft-capping
    (tanh keeps the order, so argmax and the tree's top-k are the same; the drafter is trained on
    the uncapped logits). `record` lands in `dflash_config` (e.g. target_path, chat_template_kwargs)
    so that a checkpoint can be evaluated without flags. `draft_vocab_size` K cuts the LM head to K of
    the target's words (drafter/models/draft_vocab.py; the model's `set_draft_vocab` fills in which);
    None keeps the whole head and writes no key. Settings the target cannot take raise a
    ConfigError that names their `drafter.*` keys.
    """
    text_config = target_config.get_text_config()
    num_target_layers = text_config.num_hidden_layers
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(num_target_layers, num_layers)
    target_layer_ids = [int(i) for i in target_layer_ids]
    widths = drafter_widths(text_config)
    problems = variant.variant_problems(num_layers)
    arch = ARCHITECTURES.get(variant.arch)
    if arch is None:
        problems.append(f"arch={variant.arch!r} is not one of {', '.join(ARCHITECTURES)}")
    else:
        problems += arch.variant_problems(variant, widths["hidden_size"], widths["vocab_size"], block_size)
    layer_problem = feature_layer_problem(target_layer_ids, num_target_layers)
    if layer_problem:
        problems.append(layer_problem)
    if not 0 <= mask_token_id < text_config.vocab_size:
        problems.append(f"mask_token_id={mask_token_id} has no row in the target's embedding "
                        f"(vocab_size {text_config.vocab_size})")
    problems += draft_vocab_problems(draft_vocab_size, arch, widths["vocab_size"])
    if problems:
        raise ConfigError("; ".join(f"drafter.{problem}" for problem in problems))
    model_type = getattr(text_config, "model_type", None)
    try:  # Qwen3Config validates what it can itself (an odd head dim)
        config = Qwen3Config(
            **widths, num_hidden_layers=num_layers, num_target_layers=num_target_layers,
            block_size=block_size, tie_word_embeddings=False, **variant.config_fields(num_layers),
            architectures=[arch.__name__],
            **({} if draft_vocab_size is None else {"draft_vocab_size": int(draft_vocab_size)}),
            dflash_config={"target_layer_ids": target_layer_ids, "mask_token_id": int(mask_token_id),
                           "input_embedding_scale": float(input_embedding_scale), "target_model_type": model_type,
                           **arch.variant_dflash_config(variant), **record})
    except StrictDataclassError as error:
        raise ConfigError(f"drafter config (target {model_type}): {error.__cause__ or error}") from error
    check_drafter_config(config)
    return config


def draft_vocab_problems(draft_vocab_size: int | None, arch, vocab_size: int) -> list[str]:
    """What a draft vocabulary of `draft_vocab_size` words cannot do here, naming its key."""
    if draft_vocab_size is None:
        return []
    if isinstance(draft_vocab_size, bool) or not isinstance(draft_vocab_size, int) \
            or not 1 <= draft_vocab_size <= vocab_size:
        return [f"draft_vocab_size={draft_vocab_size!r} must be null or an integer from 1 to the target's "
                f"vocab_size {vocab_size}"]
    if arch is not None and not arch.takes_draft_vocab:
        return [f"draft_vocab_size={draft_vocab_size}: arch={arch.arch} drafts over the target's whole "
                "vocabulary (use arch=dflash or draft_vocab_size=null)"]
    return []
