"""The DFlash training objective: one training forward over a batch's blocks (drafter/models/blocks.py:
anchors, blocks, the block mask, the drafter forward), the weighted loss and the training metrics.

loss = sum_k w_k CE_k / sum_k w_k with w_k = exp(-(k-1)/gamma), computed in row chunks so the full
anchors x block x vocab logits never exist at once (drafter/losses/: the target's labels, KL and TV,
prediction-dependent weights, the first-failure cut, the expected accepted lengths of a chain and of
a tree, each a registered component over one chunked LM-head kernel).
"""
import torch

from drafter.config import ObjectiveConfig, resolve_gamma
from drafter.losses import block_loss
from drafter.losses.lm_head import chunk_rows_for, logit_softcap
from drafter.models.blocks import DraftingSetup, FeatureBatch, build_blocks, drafter_hidden, sample_anchors
from drafter.models.draft_vocab import vocab_blocks
from drafter.training.metrics import block_metrics


def training_step(setup: DraftingSetup, batch: FeatureBatch, cfg: ObjectiveConfig, generator: torch.Generator):
    """One training forward of `setup.drafter` on `batch`: (loss, metrics). `cfg` is the config's
    objective section (drafter.config.ObjectiveConfig); the block size and mask token are the drafter's,
    the attention kernel the setup's (`attention_kernel` turns the config value into it). `metrics` maps
    names to [sum, count] tensors so that ranks and micro-batches can be summed before dividing (see
    `finalize_metrics`). cfg.labels == "target" needs `batch.final_hidden`. A drafter with a draft
    vocabulary (drafter/models/draft_vocab.py) is trained on its in-vocabulary labels; its metrics count
    the others as misses (`out_of_vocab`: their share of the supervised slots)."""
    drafter, target = setup.drafter, setup.target
    gamma = resolve_gamma(cfg.gamma, drafter.block_size)
    anchors, valid = sample_anchors(batch.loss_mask, cfg.num_anchors, generator, cfg.anchors_per_batch,
                                    cfg.anchor_candidates)
    blocks = build_blocks(batch.input_ids, batch.loss_mask, anchors, valid, drafter.block_size,
                          drafter.mask_token_id, gamma)
    hidden = drafter_hidden(drafter, target, batch.features, blocks, setup.attention)
    # Every slot after the anchor is a row (unsupervised ones weigh 0): static shapes, no host sync.
    head = drafter.head_weight(target)
    seen = vocab_blocks(blocks, drafter.draft_vocab)  # labels as the head's ids
    loss, ranks = block_loss(hidden, head, seen.loss, batch.final_hidden, cfg, logit_softcap(target))
    metrics = block_metrics(hidden.detach(), head, seen.metrics, seen.misses(ranks), cfg, generator)
    metrics.update(seen.out_of_vocab())
    auxiliary = drafter.auxiliary_loss(hidden, seen.loss, head, chunk_rows_for(head.shape[0], cfg.chunk_bytes))
    if auxiliary is not None:  # DFlash2's selector loss
        auxiliary_loss, auxiliary_metrics = auxiliary
        metrics.update(auxiliary_metrics)
        loss = loss + cfg.selector_alpha * auxiliary_loss
    metrics["loss"] = torch.stack([loss.detach(), loss.new_ones(())])
    return loss, metrics
