"""The training step: anchors, blocks, the block mask, the drafter forward and the loss with its
metrics (objective.py; the losses themselves are drafter/losses/), and metrics as [sum, count]
tensors (metrics.py)."""
