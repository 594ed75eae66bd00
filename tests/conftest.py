import os
from dataclasses import dataclass

import pytest
import torch

torch.set_num_threads(int(os.environ.get("TEST_TORCH_THREADS", "1")))
# dtype auto on the CPU is fp32 in every test, on any CPU (drafter/infra/cpu_dtype.py would otherwise pick
# bf16 where its probe finds bf16 fast): the pinned losses, bit-identical resumes and stores compared with
# online runs assume it. Set before anything runs, so the launched ranks and scripts inherit it too;
# tests/test_cpu_dtype.py sets its own.
os.environ["DRAFTER_CPU_BF16"] = "slow"
# and the served weights row-major as loaded (drafter/infra/cpu_layout.py's probe would otherwise decide);
# tests/test_cpu_layout.py sets its own.
os.environ["DRAFTER_CPU_WEIGHT_LAYOUT"] = "row"

from drafter.config import DrafterVariant
from drafter.models import DFlashDraftModel, drafter_class  # noqa: E402
from drafter.models.configure import drafter_config  # noqa: E402
from drafter.target_model.model import input_embedding_scale, random_qwen3  # noqa: E402

MASK_ID = 255

# Two-layer drafter variants (docs/design.md contract 11). The windows are shorter than the test contexts;
# "window_bidirectional"'s is shorter than the block too, so it cuts later block positions as well.
VARIANTS = {
    "full": DrafterVariant(),
    "sliding": DrafterVariant(layer_types=("sliding_attention", "full_attention"), sliding_window=5),
    "window_bidirectional": DrafterVariant(layer_types=("sliding_attention",) * 2, sliding_window=3,
                                           causal=False),
    "causal": DrafterVariant(causal=True),
    # the real world's drafter: the anchor's slot reads the context's last position alone
    "anchor_window": DrafterVariant(layer_types=("sliding_attention", "full_attention"), sliding_window=2),
    "dflash2": DrafterVariant(layer_types=("sliding_attention", "full_attention"), sliding_window=5,
                              arch="dflash2", conv_group_size=16, selector_rank=8, selector_top_k=4),
}


def randomize_(module: torch.nn.Module, seed: int, scale: float = 0.2) -> torch.nn.Module:
    """Random values for every parameter, norms included, so that a wrongly wired weight shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            noise = torch.randn(param.shape, generator=gen) * scale
            param.copy_(1.0 + noise if "norm" in name else noise)
    return module


def make_drafter(target, num_layers=2, block_size=8, seed=1, **kw) -> DFlashDraftModel:
    kw.setdefault("input_embedding_scale", input_embedding_scale(target))
    cfg = drafter_config(target.config, num_layers=num_layers, block_size=block_size,
                         mask_token_id=MASK_ID, **kw)
    return randomize_(drafter_class(cfg)(cfg), seed).eval()


def fit_drafter(drafter, target, input_ids, loss_mask, cfg, steps: int, lr: float) -> list[float]:
    """`steps` AdamW steps of the project's own training step (`training_step` on `context_features`,
    anchors seeded by the step): the losses. The drafter is left in eval mode."""
    from drafter.models.blocks import DraftingSetup, FeatureBatch
    from drafter.training.objective import training_step
    from drafter.target_model.model import context_features

    features = context_features(target, input_ids, drafter.target_layer_ids)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr)
    drafter.train()
    losses = []
    for step in range(steps):
        loss, _ = training_step(DraftingSetup(drafter, target, "dense"), FeatureBatch(input_ids, loss_mask, features),
                                cfg, torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    drafter.eval()
    return losses


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


@dataclass
class TrainedDrafter:
    """A drafter trained on the target's own greedy continuations of `prompts` [P, n]:
    `sequences` [P, n + new_tokens] are prompt + continuation, as the target's `ar` decoding writes them."""
    target: torch.nn.Module
    drafter: DFlashDraftModel
    prompts: torch.Tensor
    sequences: torch.Tensor


def train_on_greedy_text(target, variant: DrafterVariant = DrafterVariant()) -> TrainedDrafter:
    """A drafter of `variant` that has learned something, in a few seconds: 30 steps of the project's
    own training step (`training_step` on `context_features`) over the target's greedy continuations
    of 8 random prompts. Served on those prompts its tau is about 5 (DFlash, block 8); a random
    drafter's is 1."""
    from drafter.serving.decode import generate
    from drafter.config import ObjectiveConfig

    prompts = torch.randint(0, 250, (8, 8), generator=torch.Generator().manual_seed(20))
    sequences = torch.stack([torch.cat([p, torch.tensor(generate(target, p[None], 40).output_ids)])
                             for p in prompts])
    loss_mask = torch.zeros_like(sequences)
    loss_mask[:, prompts.shape[1]:] = 1
    drafter = make_drafter(target, num_layers=2, block_size=8, variant=variant)
    cfg = ObjectiveConfig(num_anchors=16, ddtree_budget=16)
    fit_drafter(drafter, target, sequences, loss_mask, cfg, steps=30, lr=1e-2)
    drafter.requires_grad_(False)
    return TrainedDrafter(target, drafter, prompts, sequences)


@pytest.fixture(scope="session")
def trained(target) -> TrainedDrafter:
    return train_on_greedy_text(target)


@pytest.fixture(scope="session")
def trained_sliding(target) -> TrainedDrafter:
    """As `trained`, with the "sliding" variant (a causal 5-position window, then a full layer)."""
    return train_on_greedy_text(target, VARIANTS["sliding"])


@pytest.fixture(scope="session")
def trained_dflash2(target) -> TrainedDrafter:
    """As `trained`, with the "dflash2" variant (convolutions, selector, a sliding layer)."""
    return train_on_greedy_text(target, VARIANTS["dflash2"])
