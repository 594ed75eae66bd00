"""The build check every drafter runs on its own config before any module is made: the widths its
layers are built from, each problem naming its field (a config written by hand, or by another tool,
fails here in one line instead of deep inside a projection)."""
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from drafter.errors import ConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")  # Qwen3RotaryEmbedding's own


def drafter_config_problems(config: Qwen3Config) -> list[str]:
    """What keeps the drafter's layers from being built from `config`'s own numbers, each naming its
    field: the projections are heads x head_dim wide, the KV heads are shared by groups of query
    heads, and the rotary (one flat set of Qwen3's types) turns the whole head."""
    widths = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    problems = [f"{key}={getattr(config, key, None)!r} must be a positive integer" for key in widths
                if not isinstance(getattr(config, key, None), int) or getattr(config, key) < 1]
    if problems:
        return problems
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    if heads % kv_heads:
        problems.append(f"num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}")
    if head_dim % 2:
        problems.append(f"head_dim={head_dim} is odd: the rotary turns pairs of dimensions")
    rope = config.rope_parameters or {}
    nested = sorted(key for key, value in rope.items() if isinstance(value, dict))
    if nested:
        problems.append(f"rope_parameters holds rotary sets {nested}: the drafter has one rotary")
    if rope.get("rope_type") not in ROPE_TYPES:
        problems.append(f"rope_parameters.rope_type={rope.get('rope_type')!r} is not one of {', '.join(ROPE_TYPES)}")
    if problems:
        return problems
    rotary_width = 2 * Qwen3RotaryEmbedding(config).inv_freq.numel()
    if rotary_width != head_dim:
        problems.append(f"rope_parameters give a rotary {rotary_width} wide for head_dim={head_dim} "
                        "(the drafter turns the whole head)")
    return problems


def check_drafter_config(config: Qwen3Config) -> None:
    """Raise ConfigError naming every field of `config` its layers cannot be built from."""
    problems = drafter_config_problems(config)
    if problems:
        target = (getattr(config, "dflash_config", None) or {}).get("target_model_type")
        raise ConfigError(f"drafter config (target {target}): " + "; ".join(problems))
