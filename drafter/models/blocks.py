"""A drafter's blocks over a batch: the anchors, each anchor's block, the block mask (dense SDPA /
flex_attention) and the one drafter forward over every block of the batch. Training
(drafter/training/objective.py) and served tau's replay (drafter/serving/served.py) build blocks here.

One forward over a right-padded batch [b, T]:
  1. anchors: positions p that may start a block (`anchor_candidates`: x_p and x_{p+1} supervised),
     up to `num_anchors` per sequence drawn by training (`sample_anchors`);
  2. each anchor's block [x_p, MASK x (B-1)] at positions p..p+B-1, labels x_{p+k} at slot k
     (same-position labels; slot 0 gets no loss);
  3. all blocks of the batch in one drafter forward under the block mask: a block sees the context
     strictly before its anchor, its own block bidirectionally, nothing else (a sliding or causal
     layer, `models.layers.LayerAttention`, sees less of both).

What those calls share travels as two objects: a `FeatureBatch` (the rows and what the target computed
on them) and a `DraftingSetup` (the drafter, its target and how its blocks are run), the same for a
training step, a replay, served tau and decoding.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE, create_block_mask

from drafter.config import ObjectiveConfig
from drafter.losses.weights import position_weights
from drafter.models.layers import FlexMask, LayerAttention, compile_dynamic

ANCHOR_CANDIDATES = ("pair", "supervised")


@dataclass(frozen=True)
class FeatureBatch:
    """A right-padded batch of token rows and what the frozen target computed on them: what a training
    step, its attention check and a replay read together."""
    input_ids: torch.Tensor                   # [b, T]
    loss_mask: torch.Tensor                   # [b, T], 1 where a token is supervised
    features: torch.Tensor                    # [b, T, K*H] `target.context_features` of input_ids
    final_hidden: torch.Tensor | None = None  # [b, T, H] the target's final-normed states, or a feature
                                              # store's argmax [b, T] (objective.labels=target)

    def cut_to(self, window: slice) -> "FeatureBatch":
        """The same rows cut to the positions in `window`."""
        cut = lambda x: None if x is None else x[:, window]  # noqa: E731
        return FeatureBatch(cut(self.input_ids), cut(self.loss_mask), cut(self.features), cut(self.final_hidden))


@dataclass(frozen=True)
class DraftingSetup:
    """What stays fixed across the calls that run a drafter against its target: a training step, its
    attention check, served tau's replay and its generation (which decodes through `generate` with
    the setup's drafter, target and tree backend). `attention` is one of ATTENTION_KERNELS (see
    `attention_kernel`); `budgets` the DDTree budgets served tau measures, its trees built by
    `tree_backend`; a replay runs at most `blocks_per_forward` blocks through the drafter at once and
    keeps at most `chunk_bytes` of fp32 logits (a training step's chunks are its objective's)."""
    drafter: object
    target: object
    attention: str = "dense"
    budgets: tuple[int, ...] = ()
    tree_backend: str = "auto"
    blocks_per_forward: int = 2048
    chunk_bytes: int = 256 * 2**20


def anchor_candidates(loss_mask: torch.Tensor, candidates: str = "pair") -> torch.Tensor:
    """bool [b, T]: the positions that may anchor a block under `candidates` (see `sample_anchors`)."""
    if candidates not in ANCHOR_CANDIDATES:
        raise ValueError(f"anchor candidates {candidates!r} not in {ANCHOR_CANDIDATES}")
    mask = loss_mask.bool()
    allowed = mask.clone()
    if candidates == "pair":
        allowed[:, :-1] &= mask[:, 1:]
        allowed[:, -1] = False
    return allowed


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator,
                   anchors_per_batch: int | None = None, candidates: str = "pair"):
    """Up to `num_anchors` distinct anchors per sequence, sorted: (anchors [b, A], valid [b, A]).

    `candidates` (objective.anchor_candidates): "pair", the positions p with loss_mask[p] and
    loss_mask[p+1] (slot 1 is supervised), or "supervised", every p with loss_mask[p], as vLLM's
    speculators draws them (a span's last position then anchors a block with nothing to train: a
    drafter block spent). A = the largest count drawn in the batch; sequences with fewer candidates
    get `valid=False` filler anchors (position 0).
    `anchors_per_batch` caps A * b, so a batch of many short sequences costs the drafter no more than
    one of a few long ones (the sampler's token budget bounds the target, this bounds the drafter).
    A is read on the host: the one host synchronisation of a training step (the drafter's input
    shape depends on the data); the random scores come from `generator`'s device without a wait.
    """
    mask = loss_mask.bool()
    allowed = anchor_candidates(mask, candidates)
    scores = torch.rand(mask.shape, generator=generator, device=generator.device)
    scores = scores.to(mask.device, non_blocking=True).masked_fill(~allowed, -1.0)
    top_scores, anchors = scores.topk(anchor_count(allowed, num_anchors, anchors_per_batch), dim=1)
    valid = top_scores >= 0
    anchors = torch.where(valid, anchors, 0)
    order = torch.argsort(anchors + (~valid) * mask.shape[1], dim=1)  # valid first, ascending
    return anchors.gather(1, order), valid.gather(1, order)


def anchor_count(allowed: torch.Tensor, num_anchors: int, anchors_per_batch: int | None) -> int:
    """A, the anchors `sample_anchors` draws per sequence from the candidates `allowed` [b, T]."""
    if anchors_per_batch is not None:
        num_anchors = max(1, min(num_anchors, anchors_per_batch // allowed.shape[0]))
    return max(1, min(num_anchors, int(allowed.sum(1).max())))


def blocks_drawn(loss_mask: torch.Tensor, cfg: ObjectiveConfig) -> int:
    """How many blocks (valid anchors) `training_step` trains on a batch with this `loss_mask`,
    counted from the mask alone: on the host, from the CPU batch, with no device wait."""
    allowed = anchor_candidates(loss_mask, cfg.anchor_candidates)
    count = anchor_count(allowed, cfg.num_anchors, cfg.anchors_per_batch)
    return int(allowed.sum(1).clamp(max=count).sum())


@dataclass
class Blocks:
    """All anchors' blocks of a batch. Shapes [b, A, B] unless noted."""
    anchors: torch.Tensor   # [b, A] position of each block's slot 0
    valid: torch.Tensor     # [b, A] anchor exists
    ids: torch.Tensor       # drafter input: [x_p, MASK, ...]
    positions: torch.Tensor  # p + k
    labels: torch.Tensor    # x_{p+k}
    weights: torch.Tensor   # w_k where slot k is supervised (0 elsewhere and at k = 0)


# over six: anchors as drawn (training's sample, replay's chunk, a test's own) and a block shape without a drafter
def build_blocks(input_ids, loss_mask, anchors, valid, block_size: int, mask_token_id: int,
                 gamma: float) -> Blocks:
    """Blocks for `anchors`. A slot is supervised only if it lies inside the sequence and every slot
    from 1 up to it is supervised: a block never trains across the end of the sequence or of an
    assistant turn (missing slots get weight 0; the block itself is kept)."""
    b, T = input_ids.shape
    positions = anchors[..., None] + torch.arange(block_size, device=anchors.device)
    inside = positions < T
    gather_at = positions.clamp(max=T - 1).view(b, -1)
    labels = input_ids.gather(1, gather_at).view(positions.shape)
    supervised = loss_mask.bool().gather(1, gather_at).view(positions.shape) & inside
    supervised[..., 0] = True  # the anchor itself is supervised by construction
    supervised = supervised.long().cumprod(-1).bool() & valid[..., None]
    weights = position_weights(block_size, gamma, anchors.device) * supervised
    ids = torch.full_like(labels, mask_token_id)
    ids[..., 0] = labels[..., 0]
    return Blocks(anchors, valid, ids, positions, labels, weights)


def dense_block_mask(anchors: torch.Tensor, seq_len: int, block_size: int,
                     attention: LayerAttention = LayerAttention()) -> torch.Tensor:
    """Bool [b, 1, A*B, T + A*B] over keys [context (T) || blocks (A*B)], for a layer of `attention`."""
    num_keys = seq_len + anchors.shape[1] * block_size
    return attention.visible_keys(anchors, seq_len, block_size).dense(num_keys)


ATTENTION_KERNELS = ("dense", "flex", "flex_compiled")


def attention_kernel(setting: str, device: torch.device | str) -> str:
    """The kernel `objective.attention` selects on `device`: "auto" is flex_compiled on CUDA and dense
    elsewhere. dense: SDPA under a materialised bool mask; flex: eager flex_attention (materialises
    the scores: tests, debugging); flex_compiled: compiled block mask and fused flex kernel."""
    if setting == "auto":
        return "flex_compiled" if torch.device(device).type == "cuda" else "dense"
    if setting not in ATTENTION_KERNELS:
        raise ValueError(f"objective.attention={setting!r}: expected auto or one of "
                         f"{', '.join(ATTENTION_KERNELS)}")
    return setting


_compiled_create_block_mask = compile_dynamic(create_block_mask)


def flex_block_mask(anchors: torch.Tensor, seq_len: int, block_size: int, compiled: bool,
                    attention: LayerAttention = LayerAttention()) -> FlexMask:
    """The same mask as `dense_block_mask`, for flex_attention. Compiled, the dense mask is never
    built; the key intervals are closure tensors, so new lengths and anchor counts are symbolic
    sizes, not constants baked into the compiled graph."""
    b, num_blocks = anchors.shape
    mask_mod = attention.visible_keys(anchors, seq_len, block_size).mask_mod()
    make = _compiled_create_block_mask if compiled else create_block_mask
    block_mask = make(mask_mod, B=b, H=None, Q_LEN=num_blocks * block_size,
                      KV_LEN=seq_len + num_blocks * block_size, device=anchors.device)
    return FlexMask(block_mask, compiled)


def drafter_hidden(drafter, target, features, blocks: Blocks, attention: str) -> torch.Tensor:
    """The drafter's final-normed states for every block slot: [b, A, B, H]; `attention` is one of
    ATTENTION_KERNELS (see `attention_kernel`).

    Compiled flex works on tiles of 128 queries and keys, and torch.compile specialises a size of 1:
    one query tile, one key tile, one anchor or one sequence would each compile once more. So the
    compiled path pads the blocks with filler blocks (anchor 0, outputs dropped) to more than one
    tile: batches of two or more sequences compile once for all lengths and anchor counts, and
    batches of one sequence once more.
    """
    b, T, _ = features.shape
    num_blocks, block_size = blocks.ids.shape[1:]
    anchors, ids, positions = blocks.anchors, blocks.ids, blocks.positions
    if attention == "flex_compiled":
        filler = max(0, _DEFAULT_SPARSE_BLOCK_SIZE // block_size + 1 - num_blocks)
        anchors, ids, positions = (F.pad(x, (0, 0) * (x.dim() - 2) + (0, filler))
                                   for x in (anchors, ids, positions))
    block_embeds = drafter.embed_block(target, ids).to(features.dtype)
    ctx_positions = torch.arange(T, device=features.device)[None].expand(b, -1)
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention {attention!r} not in {ATTENTION_KERNELS}")
    masks = {}
    for layer in set(drafter.layer_attention):
        if attention == "dense":
            masks[layer] = dense_block_mask(anchors, T, block_size, layer)
        else:
            masks[layer] = flex_block_mask(anchors, T, block_size, attention == "flex_compiled", layer)
    return drafter(block_embeds, positions, features, ctx_positions, masks)[:, :num_blocks]
