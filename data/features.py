"""Write the target's context features of a prepared dataset once, for training to read in place of the
target's forward (`data.features=DIR`; the format: drafter/pipeline/feature_store_format.py).

    python data/features.py --cfg configs/toy.yaml --data artifacts/toy/train_data --out artifacts/features/toy [--dtype fp32|bf16|fp8]
    torchrun --nproc_per_node 8 data/features.py --cfg configs/v3.yaml --data artifacts/qwen3-8b --out /fast/features
    deepspeed --num_gpus 8 data/features.py ...          # or srun: each rank writes its share of the shards

The features are those training reads: the drafter's target_layer_ids as the config resolves them (or
--layers), from training's own feature pass (drafter/target_model/tensor_parallel.py's TargetFeatures), for
every row up to data.max_length, and the target's labels the config's objective reads (--target-labels:
its argmax at each position, or its final hidden state, from which training computes its whole
distribution through the stored LM head). Before writing, the plan (tokens x layers x hidden x dtype bytes) and
the free disk are printed, and a store that will not fit is refused. A dump killed at any point resumes
when run again with the same arguments: whole shards that check out are kept, the rest rewritten. An
--out that holds files a dump does not write is refused (nothing there is touched), and so is a second
dump into a directory one is writing (the run lock).
"""
import argparse
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from safetensors.torch import save_file

from drafter.pipeline.datasets import check_prepared_thinking, load_prepared
from drafter.pipeline.feature_store_format import (DTYPE_NAMES, FORMAT, HEAD, INDEX, OWN_FILES, STORE_DTYPES,
                                                   TARGET_DIR, TARGET_LABELS, FeatureStoreError, identity_digest,
                                                   identity_mismatch, row_key, shard_name, shard_problem,
                                                   shard_tensors, store_identity, token_bytes, write_shard)
from drafter.errors import UserError
from drafter.pipeline.loader import collate
from drafter.infra.launch import set_cpu_threads
from drafter.infra.memory import size_text
from drafter.infra.progress import progress_bar
from drafter.infra.run_lock import hold_run_directory
from drafter.losses.divergences import labels_needed
from drafter.losses.lm_head import chunk_rows_for, logit_softcap, target_next_tokens
from drafter.models.configure import drafter_config
from drafter.target_model.model import compute_dtype, input_embedding_scale, load_target, random_qwen3
from drafter.target_model.tensor_parallel import TargetFeatures, feature_code_version, form_tp_group
from drafter.training.run_config import Launch, config_and_world

SHARD_BYTES = 2 * 2**30  # about this much of features per shard
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cfg", required=True, help="the training config (target, drafter and data sections)")
    parser.add_argument("--data", required=True, help="the prepared dataset (data/prepare.py): data.path")
    parser.add_argument("--out", required=True, help="the store's directory (new, or a dump of the same store to resume)")
    parser.add_argument("--dtype", choices=sorted(STORE_DTYPES), default="fp32",
                        help="fp32: training from the store equals training online, bit for bit; fp8: "
                             "float8_e4m3fn with a scale per token and layer")
    parser.add_argument("--target-labels", choices=TARGET_LABELS, default=None,
                        help="the target's labels to store: none, argmax (objective.labels=target with the "
                             "hard-label losses), full (also kl, tv and a draft vocabulary); default: what the "
                             "config's objective reads")
    parser.add_argument("--layers", type=int, nargs="+", help="drafter.target_layer_ids (default: the config's)")
    parser.add_argument("--shard-rows", type=int, help="rows per shard (default: about 2 GiB of features each)")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed
    parser.add_argument("overrides", nargs="*", help="key.sub=value")
    args = parser.parse_args(argv)
    overrides = [f"data.path={args.data}", *args.overrides]
    if args.layers:
        overrides.append(f"drafter.target_layer_ids=[{','.join(map(str, args.layers))}]")
    launch = config_and_world(args.cfg, overrides)
    cfg = launch.cfg
    try:
        if cfg.target.tp_size > 1:
            raise FeatureStoreError(f"target.tp_size={cfg.target.tp_size}: the dump runs the whole target on each "
                                    "rank, its rows split over them; set target.tp_size=1 (the store serves "
                                    "training at any tp size)")
        check_out_dir(Path(args.out))
        with hold_run_directory(args.out):
            dump(launch, args)
        return 0
    except UserError as error:  # a config, data, launch, target or directory the user chose
        if launch.rank == 0 or getattr(error, "per_rank", False):
            print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    finally:
        dist.destroy_process_group()


def check_out_dir(out: Path):
    """--out is new, empty, or a store's directory: anything a dump does not write refuses it."""
    if not out.exists():
        return
    if not out.is_dir():
        raise FeatureStoreError(f"--out {out}: not a directory")
    foreign = sorted(p.name for p in out.iterdir() if not is_own_file(p.name.removesuffix(".tmp")))
    if foreign:
        raise FeatureStoreError(f"--out {out} holds files a feature dump does not write ({', '.join(foreign[:3])}"
                                f"{', ...' if len(foreign) > 3 else ''}): give the store a directory of its own "
                                "(nothing was changed)")


def is_own_file(name: str) -> bool:
    """A dump's files, and the cache shards hybrid runs append (drafter/pipeline/feature_store_format.py)."""
    return (name in OWN_FILES or re.fullmatch(r"shard-\d{5}-of-\d{5}\.safetensors", name) is not None
            or re.fullmatch(r"cache-[0-9a-f]+-\d{5}\.safetensors", name) is not None)


def load_dump_target(cfg, device, dtype):
    """(the whole frozen target, its tokenizer or None for a random target)."""
    if cfg.target.path is None:
        return random_qwen3(**cfg.target.random).to(dtype).to(device), None
    from transformers import AutoTokenizer
    return load_target(cfg.target.path, device, dtype), AutoTokenizer.from_pretrained(cfg.target.path)


def shard_plan(lengths: np.ndarray, included: np.ndarray, bytes_per_token: int, shard_rows: int | None):
    """[(first row, rows)] covering the dataset in order."""
    if shard_rows is None:
        mean = max(1.0, float(lengths[included].mean()) if included.any() else 1.0)
        shard_rows = max(1, int(SHARD_BYTES // (mean * bytes_per_token)))
    return [(first, min(shard_rows, len(lengths) - first)) for first in range(0, len(lengths), shard_rows)]


def dump(launch: Launch, args):
    cfg, rank, world_size, device = launch.cfg, launch.rank, launch.world_size, launch.device
    out = Path(args.out)
    if device.type == "cpu":
        set_cpu_threads(cfg.train.threads_per_rank, world_size)
    dtype = compute_dtype(cfg.target.dtype, device)
    target_labels = args.target_labels or labels_needed(cfg.objective, cfg.drafter.draft_vocab_size is not None)
    check_prepared_thinking(cfg.data.path, cfg.target.chat_template_kwargs)
    target, tokenizer = load_dump_target(cfg, device, dtype)
    text = target.config.get_text_config()
    dataset = load_prepared(cfg.data.path, text.vocab_size)
    layer_ids = drafter_config(text, num_layers=cfg.drafter.num_layers, block_size=cfg.drafter.block_size,
                               mask_token_id=0, target_layer_ids=cfg.drafter.target_layer_ids,
                               variant=OmegaConf.to_object(cfg.drafter)).dflash_config["target_layer_ids"]
    identity = store_identity(cfg, dataset, layer_ids, args.dtype, feature_code_version(), target_labels)
    digest = identity_digest(identity)
    lengths = np.asarray(dataset["length"])
    included = lengths <= cfg.data.max_length
    bytes_per_token = token_bytes(len(layer_ids), text.hidden_size, args.dtype, target_labels)
    shards = shard_plan(lengths, included, bytes_per_token, args.shard_rows)
    names = [shard_name(i, len(shards)) for i in range(len(shards))]
    done = [shard_problem(out / name, digest, first, rows) is None for name, (first, rows) in zip(names, shards)]
    head_bytes = (text.vocab_size * text.hidden_size * 2) * dtype.itemsize
    tokens = int(lengths[included].sum())
    todo_bytes = sum(int(lengths[first:first + rows][included[first:first + rows]].sum()) * bytes_per_token
                     for (first, rows), whole in zip(shards, done) if not whole) + head_bytes
    free = shutil.disk_usage(out).free
    if rank == 0:
        labels = {"none": "", "argmax": " + the target's argmax 4 B",
                  "full": f" + the target's final hidden state {text.hidden_size}"}[target_labels]
        print(f"feature store {out}: {included.sum():,} rows, {tokens:,} tokens x ({len(layer_ids)} layers "
              f"{layer_ids} x {text.hidden_size} hidden{labels}) in {args.dtype} = {bytes_per_token:,} B a token, "
              f"{size_text(tokens * bytes_per_token)} + embedding and LM head {size_text(head_bytes)}, in "
              f"{len(shards)} shards ({sum(done)} already whole); {(~included).sum()} rows over data.max_length="
              f"{cfg.data.max_length} left out; to write {size_text(todo_bytes)}, free on its disk {size_text(free)}",
              flush=True)
    if todo_bytes > free:
        raise FeatureStoreError(f"--out {out}: the store needs {size_text(todo_bytes)} more and its disk has "
                                f"{size_text(free)} free: free space or choose another --out")
    index = {"format": FORMAT, "identity": identity, "hidden_size": text.hidden_size, "complete": False,
             "shards": [{"file": name, "first_row": first, "rows": rows} for name, (first, rows) in zip(names, shards)]}
    if rank == 0:
        start_index(out, index)
        write_head(out, target, tokenizer, dtype)
    dist.barrier()
    head = target.get_output_embeddings().weight
    writer = ShardWriter(dataset, included, TargetFeatures(target, form_tp_group(1), device,
                                                           final_hidden=target_labels != "none"),
                         layer_ids, args.dtype, target_labels, cfg.data.tokens_per_batch, digest,
                         partial(target_next_tokens, head_weight=head, softcap=logit_softcap(target),
                                 chunk_rows=chunk_rows_for(head.shape[0], cfg.objective.chunk_bytes)))
    for i in range(rank, len(shards), world_size):  # what a killed dump of this store left half written
        (out / (names[i] + ".tmp")).unlink(missing_ok=True)
    mine = [i for i in range(rank, len(shards), world_size) if not done[i]]
    rows_todo = sum(int(included[shards[i][0]:sum(shards[i])].sum()) for i in mine)
    bar = progress_bar(total=rows_todo, desc=f"rank {rank} features", unit="row", enabled=rank == 0)
    started, written_tokens = time.perf_counter(), 0
    for i in mine:
        first, rows = shards[i]
        written_tokens += writer.write(out / names[i], first, rows, bar)
        bar.set_postfix_str(f"{written_tokens / (time.perf_counter() - started):,.0f} tokens/s", refresh=False)
    bar.close()
    dist.barrier()
    if rank == 0:
        finish_index(out, index, digest)


def start_index(out: Path, index: dict):
    """Write the index (not complete); a directory holding another store's index is refused by field."""
    path = out / INDEX
    if path.exists():
        existing = json.loads(path.read_text())
        problem = identity_mismatch(existing.get("identity", {}), index["identity"])
        planned = [{k: shard[k] for k in ("file", "first_row", "rows")} for shard in existing.get("shards", [])]
        if problem is None and planned != index["shards"]:
            problem = "shards: another plan (--shard-rows or the dataset differ)"
        if problem:
            raise FeatureStoreError(f"--out {out} holds another feature store ({problem}); give this one its own "
                                    "directory (nothing was changed)")
    write_json(path, index)


def finish_index(out: Path, index: dict, digest: str):
    for shard in index["shards"]:
        if problem := shard_problem(out / shard["file"], digest, shard["first_row"], shard["rows"]):
            raise FeatureStoreError(f"{out / shard['file']}: {problem} after the dump")
        shard["bytes"] = (out / shard["file"]).stat().st_size
    write_json(out / INDEX, {**index, "complete": True})
    print(f"feature store {out}: complete ({len(index['shards'])} shards)", flush=True)


def write_json(path: Path, value: dict):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def write_head(out: Path, target, tokenizer, dtype):
    """The target's input embedding and LM head, its config and tokenizer: all training reads of it."""
    head = {"embedding": target.get_input_embeddings().weight.detach().cpu().contiguous(),
            "lm_head": target.get_output_embeddings().weight.detach().cpu().contiguous()}
    if head["embedding"].data_ptr() == head["lm_head"].data_ptr():  # tied: safetensors refuses shared memory
        head["lm_head"] = head["lm_head"].clone()
    tmp = out / (HEAD + ".tmp")
    save_file(head, str(tmp), metadata={"input_embedding_scale": str(input_embedding_scale(target)),
                                        "dtype": DTYPE_NAMES.get(dtype, str(dtype))})
    os.replace(tmp, out / HEAD)
    target.config.save_pretrained(out / TARGET_DIR)
    if tokenizer is not None:
        tokenizer.save_pretrained(out / TARGET_DIR)


@dataclass(frozen=True)
class ShardWriter:
    """What every shard of a dump is written with: the dataset and which of its rows the store holds,
    the target's feature pass (with its final hidden states where the store holds the target's
    labels), the layers, the store's dtype and target labels (TARGET_LABELS), the token budget of a
    batch, the store's identity digest, and the target's argmax of a final hidden state."""
    dataset: object
    included: np.ndarray
    features: TargetFeatures
    layer_ids: list
    dtype: str
    target_labels: str
    tokens_per_batch: int
    digest: str
    next_tokens: object

    @torch.no_grad()
    def write(self, path: Path, first: int, rows: int, bar) -> int:
        """The shard of rows [first, first + rows) (those up to data.max_length), batched by the token
        budget; returns the tokens written."""
        members = [first + i for i in range(rows) if self.included[first + i]]
        parts, finals, next_tokens, offsets, keys = [], [], [], [0], []
        for batch_rows in token_batches(members, self.dataset, self.tokens_per_batch):
            records = [self.dataset[r] for r in batch_rows]
            batch = collate(records, bucket=0)
            computed, final = self.features(batch["input_ids"].to(self.features.device), self.layer_ids,
                                            batch["lengths"])
            for j, record in enumerate(records):
                length = len(record["input_ids"])
                parts.append(computed[j, :length].cpu())
                if self.target_labels == "full":
                    finals.append(final[j, :length].cpu())
                elif self.target_labels == "argmax":
                    next_tokens.append(self.next_tokens(final[j, :length]).cpu())
                offsets.append(offsets[-1] + length)
                keys.append(row_key(record["input_ids"]))
            bar.update(len(batch_rows))
        hidden = self.features.target.config.get_text_config().hidden_size
        final = (torch.cat(finals) if finals else torch.zeros((0, hidden))) if self.target_labels == "full" else None
        argmax = (torch.cat(next_tokens) if next_tokens else torch.zeros(0)) if self.target_labels == "argmax" else None
        tensors = shard_tensors(torch.cat(parts) if parts else torch.zeros((0, len(self.layer_ids) * hidden)), final,
                                argmax, torch.tensor(offsets, dtype=torch.int64), torch.tensor(keys, dtype=torch.int64),
                                self.dtype, len(self.layer_ids))
        write_shard(path, tensors, {"identity": self.digest, "first_row": str(first), "rows": str(rows)})
        return offsets[-1]


def token_batches(members: list[int], dataset, tokens_per_batch: int):
    """Consecutive rows, as many as fit the token budget at their longest (one at least)."""
    lengths = dataset.select(members)["length"] if members else []
    batch, longest = [], 0
    for row, length in zip(members, lengths):
        if batch and (len(batch) + 1) * max(longest, length) > tokens_per_batch:
            yield batch
            batch, longest = [], 0
        batch.append(row)
        longest = max(longest, length)
    if batch:
        yield batch


if __name__ == "__main__":
    sys.exit(main())
