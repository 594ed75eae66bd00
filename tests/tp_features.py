"""Run under torchrun (CPU, gloo) by test_tensor_parallel.py: every rank holds its own batch (its own
shape), computes its features and final hidden states (distillation's) through a target sharded over
the world (a dense Qwen3 and a Qwen3-MoE) and through the whole target, and writes the differences and
its weight bytes to <out>/rank<r>.json. Then the two ranks, one group, generate with a trained drafter
on the sharded dense target (`generation_tau`, summed over the group as train.py all-reduces it), once
within the time budget and once with rank 1 arriving late and the budget shorter than its delay."""
import copy
import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from conftest import train_on_greedy_text
from drafter.metric_sums import finalize_metrics
from drafter.models.blocks import DraftingSetup
from drafter.serving.served import PromptShare, generation_tau
from drafter.target_model.model import context_features, features_and_final_hidden, freeze, random_qwen3
from drafter.target_model.tensor_parallel import TargetFeatures, form_tp_group, shard_target

WIDTHS = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, intermediate_size=128)
LAYERS = [0, 2]


def random_moe():
    torch.manual_seed(0)
    config = Qwen3MoeConfig(**WIDTHS, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            mlp_only_layers=[1], attn_implementation="sdpa", tie_word_embeddings=False)
    return freeze(Qwen3MoeForCausalLM(config))


def weight_bytes(target) -> int:
    return sum(p.numel() * p.element_size() for p in target.get_decoder().layers.parameters())


def summary(out: dict[str, torch.Tensor]) -> dict[str, float]:
    """finalize_metrics of generation_tau's [sum, count] pairs, and the counts."""
    return {**finalize_metrics(out), **{f"{name}_count": float(value[1]) for name, value in out.items()}}


def group_sum(out: dict[str, torch.Tensor], group) -> dict[str, float]:
    """`summary` of the outputs summed over the group, as train.py all-reduces them."""
    summed = {name: value.clone() for name, value in out.items()}
    for name in sorted(summed):
        dist.all_reduce(summed[name], group=group.group)
    return summary(summed)


def generation_report(whole, group) -> dict:
    """Served tau of the sharded group against the whole target's, and a budget one member overruns."""
    trained = train_on_greedy_text(whole)  # the same drafter on both ranks (seeded, deterministic)
    prompts = trained.prompts[:4].tolist()
    settings = dict(max_new_tokens=16, stop_token_ids=())
    on_whole = DraftingSetup(trained.drafter, whole, budgets=(4,))
    expected = generation_tau(on_whole, prompts, max_seconds=600, **settings)
    sharded = shard_target(copy.deepcopy(whole), group)
    share = PromptShare.of(group, dist.get_world_size())
    on_shards = DraftingSetup(trained.drafter, sharded, budgets=(4,))
    got = generation_tau(on_shards, prompts, share, max_seconds=600, **settings)
    if group.index == 1:
        time.sleep(3.0)  # rank 1's clock starts 3 s after rank 0's: only rank 0's says time is up
    late = generation_tau(on_shards, prompts, share, max_seconds=2.5, **settings)
    return {"expected": summary(expected), "sharded": group_sum(got, group), "late": group_sum(late, group),
            "reported_nothing": all(not value.any() for value in got.values())}


def main(out_dir: str):
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a member left waiting fails the test
    torch.set_num_threads(1)
    rank = dist.get_rank()
    group = form_tp_group(dist.get_world_size())
    shape = [(2, 24), (3, 17)][rank]  # different batches, different shapes
    ids = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(rank))
    report = {}
    dense = random_qwen3(initializer_range=0.3, attention_bias=True, **WIDTHS)  # a row-parallel bias too
    for param in (p for n, p in sorted(dense.named_parameters()) if n.endswith("bias")):  # initialised to 0
        param.data = torch.randn(param.shape, generator=torch.Generator().manual_seed(1))
    for name, whole in (("dense", dense), ("moe", random_moe())):
        sharded = shard_target(copy.deepcopy(whole), group)
        features = TargetFeatures(sharded, group, torch.device("cpu"))
        expected = context_features(whole, ids, LAYERS)
        got, no_final = features(ids, LAYERS)
        alone, _ = features(ids if rank == 0 else None, LAYERS)  # rank 1 has no batch this time
        expected_features, expected_final = features_and_final_hidden(whole, ids, LAYERS)
        distilled, final = TargetFeatures(sharded, group, torch.device("cpu"), final_hidden=True)(ids, LAYERS)
        report[name] = {"max_diff": (got - expected).abs().max().item(), "scale": expected.abs().max().item(),
                        "alone_diff": (alone - expected).abs().max().item() if rank == 0 else None,
                        "alone_is_none": alone is None, "no_final": no_final is None,
                        "distill_features_diff": (distilled - expected_features).abs().max().item(),
                        "final_diff": (final - expected_final).abs().max().item(),
                        "final_scale": expected_final.abs().max().item(),
                        "whole_layer_bytes": weight_bytes(whole), "sharded_layer_bytes": weight_bytes(sharded)}
    report["generation"] = generation_report(dense, group)
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
