"""What changes with the optimizer step: the learning-rate multiplier and the feature-noise std.

    lr = cfg.optim.lr * lr_factor(cfg.optim, step, schedule_steps)
    std = noise_std(cfg.noise, step)
"""
import math

from drafter.config import NoiseConfig, OptimConfig


def lr_factor(optim: OptimConfig, step: int, total_steps: int) -> float:
    """Multiplier of the base lr at `step`: linear warmup over warmup_ratio, then cosine to min_lr_ratio."""
    warmup = max(1, math.ceil(optim.warmup_ratio * total_steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def noise_std(noise: NoiseConfig, step: int) -> float:
    """Feature-noise std at optimizer step `step` (0-based): linear start -> end over warmup_steps."""
    if noise.warmup_steps <= 0:
        return float(noise.end)
    frac = min(step / noise.warmup_steps, 1.0)
    return float(noise.start + (noise.end - noise.start) * frac)
