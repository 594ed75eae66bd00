"""The frozen target LLM: loading, and feature capture from the chosen layers only.

Layer id `i` means "the output of decoder layer i", which is `hidden_states[i + 1]` of the HF tuple
(index 0 is the embedding output). Training never runs the layers after the last one it needs, and
never computes LM-head logits over the sequence; distillation (objective.labels=target) runs them all
(`features_and_final_hidden`) and computes the target's logits chunk by chunk inside the loss.
"""
import torch
from torch import nn
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.masking_utils import create_causal_mask


def load_target(path: str, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """Load a HF causal LM frozen: eval mode, no grad, in `dtype` on `device`."""
    target = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return freeze(target.to(device))


def freeze(target: nn.Module) -> nn.Module:
    target.eval()
    target.requires_grad_(False)
    return target


def random_qwen3_config(vocab_size: int = 256, hidden_size: int = 64, num_hidden_layers: int = 6,
                        num_attention_heads: int = 4, num_key_value_heads: int = 2, head_dim: int = 16,
                        intermediate_size: int = 128, **config_kwargs) -> Qwen3Config:
    return Qwen3Config(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                       num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                       head_dim=head_dim, intermediate_size=intermediate_size, tie_word_embeddings=False,
                       attn_implementation="sdpa", **config_kwargs)


def random_qwen3(seed: int = 0, **config_kwargs) -> Qwen3ForCausalLM:
    """A randomly initialised Qwen3 target (fp32, frozen) of `random_qwen3_config(**config_kwargs)`:
    the tests' and the GPU check's target."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        target = Qwen3ForCausalLM(random_qwen3_config(**config_kwargs))
    return freeze(target)


def target_config(path: str | None, random: dict | None):
    """The target's (text) config without loading its weights."""
    if path is None:
        return random_qwen3_config(**{k: v for k, v in (random or {}).items() if k != "seed"})
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(path).get_text_config()


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spaced from 1 to L-3 (one draft layer: L//2), as the DFlash reference chooses."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def check_feature_layers(layer_ids: list[int], num_layers: int) -> None:
    """Raise ValueError unless every layer id is one of the target's layers but the last. HF's
    hidden_states[L] is the last layer's output after the final norm, which is what serving loops
    read; training reads the raw output, and serving stacks differ on which one they capture, so
    that layer is refused rather than trained on features the drafter will not be served. Checked
    when a drafter is configured and wherever features are read (checkpoints made elsewhere)."""
    if not all(0 <= i < num_layers - 1 for i in layer_ids):
        raise ValueError(f"target_layer_ids {list(layer_ids)}: serving stacks read the target's last layer "
                         f"({num_layers - 1}) after the final norm and training before it, and a target of "
                         f"{num_layers} layers has none past it; use layers 0..{num_layers - 2}")


def select_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """Concatenate the outputs of `layer_ids` from a full forward's `hidden_states` tuple: [b, T, K*H]."""
    check_feature_layers(layer_ids, len(hidden_states) - 1)
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


@torch.no_grad()
def context_features(target: nn.Module, input_ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """Features of `layer_ids` for every position, [b, T, K*H], running only layers 0..max(layer_ids).

    Sequences are right-padded; with a causal mask the real positions never see the padding, so no
    padding mask is needed (features at padded positions are garbage and must not be read).
    """
    body = target.get_decoder()
    check_feature_layers(layer_ids, len(body.layers))
    hidden = body.embed_tokens(input_ids)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
    # no position_ids: every row is one sequence at 0..T-1, and looking for packed ones reads the device
    mask = create_causal_mask(config=body.config, inputs_embeds=hidden, attention_mask=None,
                              past_key_values=None)
    rope = body.rotary_emb(hidden, positions)
    wanted = set(layer_ids)
    captured = {}
    for i, layer in enumerate(body.layers[: max(layer_ids) + 1]):
        hidden = layer(hidden, attention_mask=mask, position_embeddings=rope, position_ids=positions)
        if i in wanted:
            captured[i] = hidden
    return torch.cat([captured[i] for i in layer_ids], dim=-1)


@torch.no_grad()
def features_and_final_hidden(target: nn.Module, input_ids: torch.Tensor,
                              layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(features of `layer_ids` [b, T, K*H], the final-normed last hidden state [b, T, H]): what
    distillation needs, the target's LM head input at every position, from one forward of the
    target's own decoder with the chosen layers' outputs captured by hooks. The features are those
    of `context_features`; the LM-head logits over the sequence are never computed here."""
    body = target.get_decoder()
    check_feature_layers(layer_ids, len(body.layers))
    captured = {}

    def capture(index):
        def hook(module, args, output):
            captured[index] = output[0] if isinstance(output, tuple) else output
        return hook

    handles = [body.layers[i].register_forward_hook(capture(i)) for i in layer_ids]
    try:
        final = body(input_ids=input_ids, use_cache=False).last_hidden_state
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat([captured[i] for i in layer_ids], dim=-1), final
