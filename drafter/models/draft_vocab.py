"""A draft vocabulary (`drafter.draft_vocab_size` = K): the drafter's LM head cut to the target head's
rows of the K commonest tokens of the training answers.

The drafter's logits are the frozen target's LM head on its states; that head (V words) dominates
both the training step (rows x V x H) and the served draft step. With a draft vocabulary the head is
the target head's K rows, a gather of frozen weights: nothing new is trained. The table is stored as
the serving stacks know it from EAGLE-3, as two buffers of the exported checkpoint:

    d2t [K] long   draft-to-target offsets: draft id i is target id i + d2t[i]
    t2d [V] bool   which target ids are in the draft vocabulary

The draft ids keep the target ids' order (target_ids ascending), so t2d's running count maps a target
id to its draft id. Serving drafts over the K words and maps its picks back to target ids; the target
verifies over its full vocabulary, so decoding stays lossless. Training cannot predict a label outside
the K words; like EAGLE-3, its loss is over the in-vocabulary labels only (an out-of-vocabulary slot
weighs 0 in the loss), while the metrics count such a label as a miss, so held-out accuracy compares
with the full head's. Every objective runs on the K rows alike: with objective.labels=target the
teacher is the target's distribution over the K words, renormalised (EAGLE-3 distils the same way),
and the weights and block losses read out-of-vocabulary slots as unsupervised.
"""
from dataclasses import dataclass, replace

import numpy as np
import torch

from drafter.errors import ConfigError

NOT_IN_VOCAB = -1  # a metric label that no drafted token equals


def commonest_tokens(counts: np.ndarray, k: int) -> torch.Tensor:
    """The K commonest token ids by `counts` [V], ties going to the lower id (so tokens never seen
    come last, by id), sorted ascending [K]."""
    if not 1 <= k <= len(counts):
        raise ConfigError(f"drafter.draft_vocab_size={k} must be between 1 and the target's vocab_size {len(counts)}")
    commonest = np.argsort(-counts, kind="stable")[:k]  # stable: equal counts stay in id order
    return torch.from_numpy(np.sort(commonest))


def answer_vocab(counts: np.ndarray, k: int) -> tuple["DraftVocab", str]:
    """The draft vocabulary of the K commonest supervised tokens of the training answers, whose
    `counts` [V] per token id the pipeline layer reads (`drafter.pipeline.datasets.supervised_token_counts`), and a
    line saying how much of them it covers."""
    vocab_size = len(counts)
    target_ids = commonest_tokens(counts, k)
    covered = int(counts[target_ids.numpy()].sum())
    line = (f"draft vocabulary: the {k} commonest of the target's {vocab_size} tokens, "
            f"{covered / max(1, counts.sum()):.1%} of the {int(counts.sum())} supervised training tokens "
            "(the others are left out of the loss and count as misses)")
    return DraftVocab.of(target_ids, vocab_size), line


@dataclass(frozen=True)
class DraftVocab:
    """The draft-to-target table of K target ids (ascending) in a vocabulary of V."""
    target_ids: torch.Tensor  # [K] long
    in_vocab: torch.Tensor    # [V] bool (t2d)

    @classmethod
    def of(cls, target_ids: torch.Tensor, vocab_size: int) -> "DraftVocab":
        in_vocab = torch.zeros(vocab_size, dtype=torch.bool, device=target_ids.device)
        in_vocab[target_ids] = True
        return cls(target_ids, in_vocab)

    @classmethod
    def from_buffers(cls, d2t: torch.Tensor, t2d: torch.Tensor) -> "DraftVocab":
        return cls(torch.arange(len(d2t), device=d2t.device) + d2t, t2d)

    def buffers(self) -> dict[str, torch.Tensor]:
        """{"d2t", "t2d"}: the table as the checkpoint stores it (module docstring)."""
        return {"d2t": self.target_ids - torch.arange(len(self.target_ids), device=self.target_ids.device),
                "t2d": self.in_vocab}

    @property
    def size(self) -> int:
        return len(self.target_ids)

    def problem(self) -> str | None:
        """What makes a stored table unusable (ids not ascending, out of range, t2d disagreeing), or None."""
        ids = self.target_ids
        if len(ids) and (ids.min() < 0 or ids.max() >= len(self.in_vocab)):
            return f"d2t maps draft ids outside the target's {len(self.in_vocab)} ids"
        if (ids[1:] <= ids[:-1]).any():
            return "d2t's target ids are not strictly ascending"
        if int(self.in_vocab.sum()) != len(ids) or not self.in_vocab[ids].all():
            return "t2d does not mark exactly d2t's target ids"
        return None

    def head(self, weight: torch.Tensor) -> torch.Tensor:
        """The draft head [K, H]: the target head's rows of the draft words."""
        return weight.index_select(0, self.target_ids.to(weight.device))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.target_ids.to(draft_ids.device)[draft_ids]

    def to_draft(self, target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft ids, in vocabulary) of `target_ids`; an id outside the vocabulary gets draft id 0."""
        in_vocab = self.in_vocab.to(target_ids.device)
        draft_index = in_vocab.long().cumsum(0) - 1
        inside = in_vocab[target_ids]
        return torch.where(inside, draft_index[target_ids], 0), inside

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., K] as logits over the target's V ids, -inf outside the draft vocabulary
        (a proposal distribution for rejection sampling)."""
        full = logits.new_full((*logits.shape[:-1], len(self.in_vocab)), -torch.inf)
        return full.index_copy_(-1, self.target_ids.to(logits.device), logits)


@dataclass(frozen=True)
class VocabBlocks:
    """A batch's blocks (models.blocks.Blocks) as a drafter's head sees them: in draft ids with a draft
    vocabulary (module docstring: the loss leaves out-of-vocabulary labels out, the metrics count
    them as misses), the blocks themselves without one."""
    loss: object                   # labels in draft ids (0 outside), out-of-vocabulary slots weighing 0
    metrics: object                # labels in draft ids (NOT_IN_VOCAB outside), the original weights
    in_vocab: torch.Tensor | None  # [b, A, B] bool; None: no draft vocabulary

    def misses(self, ranks: torch.Tensor) -> torch.Tensor:
        """The loss kernel's label ranks [rows] of slots 1..B-1, an out-of-vocabulary label ranked last."""
        if self.in_vocab is None:
            return ranks
        return torch.where(self.in_vocab[..., 1:].reshape(-1), ranks, torch.iinfo(ranks.dtype).max)

    def out_of_vocab(self) -> dict[str, torch.Tensor]:
        """{"out_of_vocab": [sum, count]}: the share of supervised slots whose label the head lacks."""
        if self.in_vocab is None:
            return {}
        supervised = (self.metrics.weights[..., 1:] > 0).float()
        outside = (~self.in_vocab[..., 1:]).float() * supervised
        return {"out_of_vocab": torch.stack([outside.sum(), supervised.sum()])}


def vocab_blocks(blocks, vocab: DraftVocab | None) -> VocabBlocks:
    """`blocks` for a drafter whose head is `vocab`'s (None: the target's whole head)."""
    if vocab is None:
        return VocabBlocks(blocks, blocks, None)
    labels, in_vocab = vocab.to_draft(blocks.labels)
    return VocabBlocks(replace(blocks, labels=labels, weights=blocks.weights * in_vocab),
                       replace(blocks, labels=torch.where(in_vocab, labels, NOT_IN_VOCAB)), in_vocab)
