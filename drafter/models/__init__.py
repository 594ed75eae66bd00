"""Drafter architectures, registered by name (config `drafter.arch`) and by export class name (the
`architectures` of an exported config.json, as the serving stacks pick a class).

Each architecture is one model class in its own file, `dflash.py` and `dflash2.py`, keeping the
interface `DraftModel` spells out; nothing outside this package asks which one it holds. A third
architecture is a new file here and one entry in `ARCHITECTURES`. Beside them: a drafter's blocks
over a batch and its forward over them (blocks.py), its config from the target's (configure.py) and
the mask token it drafts with (mask_token.py).
"""
from typing import ClassVar, Protocol

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from drafter.errors import ConfigError
from drafter.models.dflash import DFlashDraftModel
from drafter.models.dflash2 import CandidateSelector, DFlash2DraftModel
from drafter.models.draft_vocab import DraftVocab
from drafter.models.layers import DraftCache, LayerAttention, compiled_graph_count, layer_attention
from drafter.tree.ddtree import DraftTree

__all__ = ["ARCHITECTURES", "CandidateSelector", "DFlash2DraftModel", "DFlashDraftModel", "DraftCache", "DraftModel",
           "LayerAttention", "ServedDrafter", "architecture", "compiled_graph_count", "drafter_class",
           "drafter_from_state_dict", "is_drafter_config", "layer_attention", "load_drafter"]

ARCHITECTURES: dict[str, type[DFlashDraftModel]] = {cls.arch: cls for cls in (DFlashDraftModel, DFlash2DraftModel)}


class ServedDrafter(Protocol):
    """What the decode loop and replayed tau ask of a drafter: a real one, or a stand-in whose
    proposals are known (the replay drafters of tests and bench/gpu_check.py)."""
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    drafts_marginals: bool  # its chain is its marginals' argmax (what rejection sampling assumes)

    def draft_states(self, target, ctx_features, block_ids, cache: DraftCache, depth: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def draft_chain(self, target, ctx_features, block_ids, cache: DraftCache) -> torch.Tensor: ...

    def block_trees(self, hidden, logits, roots, budget: int, backend: str = "auto") -> DraftTree: ...


class DraftModel(ServedDrafter, Protocol):
    """A registered architecture: served as above, and also trained, sharded and exported."""
    arch: ClassVar[str]
    variant_keys: ClassVar[tuple[str, ...]]

    def forward(self, block_embeds, block_positions, features, ctx_positions, masks, cache=None
                ) -> torch.Tensor: ...

    def auxiliary_loss(self, hidden, blocks, head_weight, chunk_rows: int): ...

    def shard_units(self) -> list[nn.Module]: ...

    def head_weight(self, target) -> torch.Tensor: ...  # the target's head, or its draft vocabulary's rows

    def head_logits(self, target, hidden) -> torch.Tensor: ...

    def chain_picks(self, hidden, logits, predecessors) -> torch.Tensor: ...

    def chain_top(self, hidden, logits, predecessors, k: int = 2) -> tuple[torch.Tensor, torch.Tensor]: ...


def architecture(name: str) -> type[DFlashDraftModel]:
    """The class registered as `drafter.arch` = `name`."""
    if name not in ARCHITECTURES:
        raise ValueError(f"drafter.arch={name!r} is not one of {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def export_classes() -> dict[str, type[DFlashDraftModel]]:
    """The registered classes by their export name (config.json's `architectures`), read live."""
    return {cls.__name__: cls for cls in ARCHITECTURES.values()}


def drafter_class(config: Qwen3Config) -> type[DFlashDraftModel]:
    """The class a drafter config is for, by its `architectures` (as the serving stacks pick it);
    a config that names none of ours is DFlash, as `dflash` 0.1.0 reads it."""
    by_export_name = export_classes()
    named = [by_export_name[name] for name in (config.architectures or []) if name in by_export_name]
    return named[0] if named else DFlashDraftModel


def new_drafter(config: Qwen3Config, head_weight: torch.Tensor, seed: int,
                draft_vocab: DraftVocab | None = None) -> DFlashDraftModel:
    """A fresh drafter of `config` (transformers' init from `seed`: the same weights on every rank) for
    a target whose LM head is `head_weight` [V, H], with its head cut to `draft_vocab` when one is given
    (`config.draft_vocab_size` words). Its final norm is set to `initial_norm_scale` of the head it
    trains and drafts through: the whole head, or the draft vocabulary's K rows of it (the commonest
    words' rows need not have the whole head's norm, and those are the logits the loss sees)."""
    torch.manual_seed(seed)
    drafter = drafter_class(config)(config)
    if draft_vocab is not None:
        drafter.set_draft_vocab(draft_vocab)
    head = head_weight if draft_vocab is None else draft_vocab.head(head_weight)
    with torch.no_grad():
        drafter.norm.weight.fill_(initial_norm_scale(head))
    return drafter


def initial_norm_scale(head_weight: torch.Tensor) -> float:
    """1 / the RMS row norm of the LM head: a unit-RMS state of random direction then scores every word
    with unit std. The drafter's logits are the frozen head on its final norm's output, and at
    transformers' unit norm they start far too large: SmolLM2-135M's first loss was ~45 nats against
    ln V = 10.8 (gradient norm ~420; ~18 and ~97 at this scale), and on the tests' target a unit norm
    kept a drafter from learning even what its anchor token predicts (docs/results.md, "Calibrations").
    Rounded, so that every rank computes the same value whatever its kernels' reduction order."""
    rms_row_norm = head_weight.detach().float().pow(2).sum(-1).mean().sqrt().item()
    return float(f"{1.0 / max(rms_row_norm, 1e-6):.4g}")


def is_drafter_config(config_dict: dict) -> bool:
    """Whether an exported config.json (as a dict) is one of our architectures'."""
    return bool(export_classes().keys() & set(config_dict.get("architectures") or []))


def load_drafter(directory, **kwargs) -> DFlashDraftModel:
    """An exported drafter directory, of any registered architecture (`from_pretrained` kwargs pass
    through); a draft vocabulary table it cannot use is a ConfigError naming the directory."""
    drafter = drafter_class(Qwen3Config.from_pretrained(directory)).from_pretrained(directory, **kwargs)
    if drafter.draft_vocab is not None and (problem := drafter.draft_vocab.problem()):
        raise ConfigError(f"{directory}: the draft vocabulary table (d2t, t2d) of model.safetensors: {problem}")
    return drafter


def drafter_from_state_dict(config: Qwen3Config, state_dict: dict[str, torch.Tensor]) -> DFlashDraftModel:
    """A plain (unsharded) drafter on the CPU holding `state_dict`, built without a random init first."""
    with torch.device("meta"):
        drafter = drafter_class(config)(config)
    drafter.to_empty(device="cpu")
    drafter.load_state_dict(state_dict)
    drafter.rotary_emb = Qwen3RotaryEmbedding(config)  # its buffers are not in state dicts
    return drafter
