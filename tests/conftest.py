import os

import pytest
import torch

torch.set_num_threads(int(os.environ.get("TEST_TORCH_THREADS", "1")))

from drafter.model import DFlashDraftModel, drafter_config  # noqa: E402
from drafter.target import random_qwen3  # noqa: E402

MASK_ID = 255


def randomize_(module: torch.nn.Module, seed: int, scale: float = 0.2) -> torch.nn.Module:
    """Random values for every parameter, norms included, so that a wrongly wired weight shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            noise = torch.randn(param.shape, generator=gen) * scale
            param.copy_(1.0 + noise if "norm" in name else noise)
    return module


def make_drafter(target, num_layers=2, block_size=8, seed=1, **kw) -> DFlashDraftModel:
    cfg = drafter_config(target.config, num_layers=num_layers, block_size=block_size,
                         mask_token_id=MASK_ID, **kw)
    return randomize_(DFlashDraftModel(cfg), seed).eval()


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """An uninterrupted two-rank ZeRO-2 run through the deepspeed launcher: 24 steps, saves every 6."""
    from runs import run_to_end, write_run
    tmp = tmp_path_factory.mktemp("reference")
    cfg = write_run(tmp)
    out = run_to_end(cfg)
    return tmp, cfg, out


@pytest.fixture(scope="session")
def target():
    return randomize_(random_qwen3(vocab_size=256, num_hidden_layers=6), seed=0, scale=0.3)


@pytest.fixture()
def drafter(target):
    return make_drafter(target)
