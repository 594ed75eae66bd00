"""Feature calibrations: what the drafter reads in place of the target's features, to tell a broken
recipe from a slow one (`objective.feature_calibration`; docs/results.md, "Calibrations").

- `none`: the target's features, as served (the default; every other value is a diagnostic).
- `zeros`: every feature zero. The drafter then sees only the block's embeddings, so its slot 1 can
  at best learn what the anchor token alone predicts (bench/floor.py's anchor column); a run that
  does not reach it there is broken in the drafter, its optimiser or its loss, not in the features.
- `oracle`: each context position j carries the target's features of position j+2, so the block
  anchored at p reads (at its last context position, p-1) the target's state at p+1, the position of
  slot 1's label, whose input is that label. This leaks the answer on purpose: slot 1 must then
  rise fast, which shows that the feature path (fc, hidden_norm, KV injection, the block mask's
  context rule) carries what the target computes to the block.

Training and evaluation during training apply the same calibration, so held-out metrics measure
the drafter the run trains. A drafter trained under a calibration is a diagnostic, not a drafter to
serve (eval/ddtree_accept.py serves it on the target's real features).
"""
import torch

FEATURE_CALIBRATIONS = ("none", "zeros", "oracle")
ORACLE_LEAD = 2  # the block at p reads context up to p-1: the features of p+1 sit two positions ahead


def calibrated_features(features: torch.Tensor, calibration: str) -> torch.Tensor:
    """`features` [b, T, K*H] as `calibration` (one of FEATURE_CALIBRATIONS) replaces them."""
    if calibration == "none":
        return features
    if calibration == "zeros":
        return torch.zeros_like(features)
    if calibration == "oracle":  # position j reads j+2's features; the last two positions have none to read
        return torch.cat([features[:, ORACLE_LEAD:], torch.zeros_like(features[:, :ORACLE_LEAD])], dim=1)
    raise ValueError(f"objective.feature_calibration={calibration!r} is not one of {', '.join(FEATURE_CALIBRATIONS)}")
