"""The offline feature store: the target's context features of every row of a prepared dataset, written
once by data/features.py and read by training (`data.features=DIR`) in place of the target's forward.

    DIR/index.json                          identity, plan, shards (written first; "complete" at the end)
    DIR/shard-00000-of-00004.safetensors    rows [first, first + rows) of the dataset, in order:
        features [tokens, K*H]   each row's real positions, rows one after another
        offsets  [rows + 1]      int64: row i is features[offsets[i]:offsets[i + 1]]
        keys     [rows]          int64: the row's token key (`row_key`), by which training finds it
        feature_scales [tokens, K]  fp8 stores: each token's scale per layer (value = stored x scale)
        final [tokens, H]        --target-labels full: the target's final-normed last hidden state
        (final_scales [tokens, 1] with fp8), from which training computes its whole distribution
        next_tokens [tokens]     --target-labels argmax: int32, the target's argmax at each position
    DIR/cache-<writer>-<n>.safetensors      rows a hybrid run computed (data.features_cache), as a shard
    DIR/head.safetensors                    the target's input embedding and LM head (what the drafter reads)
    DIR/target/                             the target's config (and tokenizer), so training needs no target files
    DIR/run.lock                            held by a dump while it writes (drafter/infra/run_lock.py)

A batch's rows are found by their tokens (`row_key`), not by their place in a split: the sampler,
buckets, held-out split and every objective run as they do online, and a row whose tokens the store
does not hold is refused by name instead of being given another row's features. Each shard is written
to a temporary name and renamed when whole, and carries the store's identity in its metadata: a
resumed dump keeps the shards that check out, and training refuses a truncated or missing one.
"""
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from drafter.pipeline.datasets import DataError

INDEX = "index.json"
HEAD = "head.safetensors"
TARGET_DIR = "target"
FORMAT = 1
STORE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}  # of the training dtypes
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
# what of the target's labels a store holds: none; the argmax at each position (objective.labels=target
# with the hard-label losses); or its final hidden state, its whole distribution through the stored LM head
TARGET_LABELS = ("none", "argmax", "full")
# what a dump, or a run appending to the store, writes into its directory; anything else is someone else's
OWN_FILES = (INDEX, HEAD, TARGET_DIR, "run.lock")
CACHE_PATTERN = "cache-*.safetensors"


class FeatureStoreError(DataError):
    """A store that does not match the run, or is not whole: named by its file or field."""

    def __init__(self, message: str, per_rank: bool = False):
        super().__init__(message)
        self.per_rank = per_rank  # raised by one rank alone (its own shard): each rank says its own


def row_key(tokens) -> int:
    """A row's key: 8 bytes of blake2b over its token ids as int64."""
    data = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64)).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def dataset_fingerprint(dataset) -> str:
    """sha256 of a dataset's token ids and row lengths, read column chunk by chunk."""
    digest = hashlib.sha256()
    column = dataset.data.table.column("input_ids")
    for chunk in column.chunks:
        digest.update(pc.list_value_length(chunk).to_numpy(zero_copy_only=False).astype(np.int64).tobytes())
        digest.update(pc.list_flatten(chunk).to_numpy(zero_copy_only=False).astype(np.int64).tobytes())
    return digest.hexdigest()[:16]


def shard_name(index: int, count: int) -> str:
    return f"shard-{index:05d}-of-{count:05d}.safetensors"


def identity_digest(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def file_digest(paths: list[Path], edge_bytes: int | None = None) -> str | None:
    """sha256 of the files' names, sizes and bytes (with `edge_bytes`: only the first and last that many
    of each, a cheap fingerprint of large weight files); None when there are none."""
    if not paths:
        return None
    digest = hashlib.sha256()
    for path in sorted(paths):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            if edge_bytes is None or size <= 2 * edge_bytes:
                digest.update(f.read())
            else:
                digest.update(f.read(edge_bytes))
                f.seek(size - edge_bytes)
                digest.update(f.read())
    return digest.hexdigest()[:16]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
                   "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model")


def target_file_identity(path: str | None, random: dict | None) -> dict:
    """What identifies the target from its files alone (None where this machine cannot tell: a hub id,
    or a target whose files are not here): its config, weights (the first and last MiB of each weight
    file) and tokenizer with its chat template. A random target is its `random` settings."""
    if path is None:
        return {"target_config_sha256": hashlib.sha256(json.dumps(random or {}, sort_keys=True).encode()).hexdigest()[:16],
                "target_weights": None, "tokenizer_sha256": None}
    local = Path(path)
    if not local.is_dir():
        return {"target_config_sha256": None, "target_weights": None, "tokenizer_sha256": None}
    weights = [p for p in local.iterdir() if p.suffix in (".safetensors", ".bin")]
    return {"target_config_sha256": file_digest([local / "config.json"] if (local / "config.json").is_file() else []),
            "target_weights": file_digest(weights, edge_bytes=2**20),
            "tokenizer_sha256": file_digest([local / name for name in TOKENIZER_FILES if (local / name).is_file()])}


def store_identity(cfg, dataset, layer_ids: list[int], dtype: str, feature_code: str,
                   target_labels: str = "none") -> dict:
    """The store's identity for the run config `cfg` over `dataset`, its features computed by the code
    whose hash is `feature_code` (the target's `feature_code_version`), holding `target_labels` (one of
    TARGET_LABELS); the dump records it, training compares every field it can know."""
    random = OmegaConf.to_container(cfg.target.random) if cfg.target.random is not None else None
    return {"target.path": cfg.target.path, "target.random": random,
            **target_file_identity(cfg.target.path, random),
            "target.chat_template_kwargs": OmegaConf.to_container(cfg.target.chat_template_kwargs),
            "dataset": dataset_fingerprint(dataset), "dataset_rows": len(dataset),
            "data.max_length": cfg.data.max_length, "layer_ids": [int(i) for i in layer_ids], "dtype": dtype,
            "feature_code": feature_code, "target_labels": target_labels}


# ----------------------------------------------------------------------------- a shard's values

def token_bytes(layers: int, hidden: int, dtype: str, target_labels: str) -> int:
    """A stored token's bytes: its features (fp8: one byte a value, a 4-byte scale a layer) and the
    target's labels (full: its final hidden state, stored as one more layer; argmax: an int32)."""
    def values(groups: int) -> int:
        return groups * hidden * STORE_DTYPES[dtype].itemsize + (4 * groups if dtype == "fp8" else 0)
    return values(layers) + {"none": 0, "argmax": 4, "full": values(1)}[target_labels]


def encode(values: torch.Tensor, dtype: str, groups: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(`values` [tokens, groups x H] as a store of `dtype` holds them, their scales or None). fp8: each
    token's values of each group (a layer) divided by its scale, their largest magnitude / FP8_MAX (so
    that nothing saturates), with the scales [tokens, groups] in fp32 beside them."""
    if dtype != "fp8":
        return values.to(STORE_DTYPES[dtype]), None
    grouped = values.float().view(values.shape[0], groups, -1)
    scales = grouped.abs().amax(-1) / FP8_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return (grouped / scales[..., None]).to(torch.float8_e4m3fn).view(values.shape), scales


def decode(values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """What `encode` stored, back as values (fp32 from fp8; as stored otherwise)."""
    if scales is None:
        return values
    return (values.float().view(values.shape[0], scales.shape[1], -1) * scales[..., None]).view(values.shape)


# over six: one argument per tensor of the shard's file, and its dtype and layer count
def shard_tensors(features, final, next_tokens, offsets, keys, dtype: str, groups: int) -> dict:
    """The tensors of a shard of rows: their features [tokens, K*H] in the store's `dtype` (`groups` = K
    layers), the target's final hidden states [tokens, H] or its argmax [tokens] where the store holds
    them (else None), the rows' offsets and keys."""
    stored, scales = encode(features, dtype, groups)
    tensors = {"features": stored, "offsets": offsets, "keys": keys}
    if scales is not None:
        tensors["feature_scales"] = scales
    if final is not None:
        tensors["final"], final_scales = encode(final, dtype, 1)
        if final_scales is not None:
            tensors["final_scales"] = final_scales
    if next_tokens is not None:
        tensors["next_tokens"] = next_tokens.to(torch.int32)
    return tensors


# ----------------------------------------------------------------------------- checking a shard

def shard_problem(path: Path, identity: str, first: int | None, rows: int | None) -> str | None:
    """Why the shard at `path` is not a whole shard of rows [first, first + rows) of this store (first
    None: a cache shard, of any rows), or None."""
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if header_len <= 0 or 8 + header_len > size:
                return f"truncated ({size} bytes, header of {header_len})"
            header = json.loads(f.read(header_len))
    except (OSError, ValueError) as error:
        return f"unreadable ({error})"
    end = max((t["data_offsets"][1] for name, t in header.items() if name != "__metadata__"), default=0)
    if 8 + header_len + end != size:
        return f"truncated ({size} bytes of {8 + header_len + end})"
    meta = header.get("__metadata__", {})
    if meta.get("identity") != identity:
        return f"written by another dump (identity {meta.get('identity')}, this store's {identity})"
    if first is not None and (meta.get("first_row"), meta.get("rows")) != (str(first), str(rows)):
        return f"holds rows from {meta.get('first_row')} ({meta.get('rows')} rows), not from {first} ({rows})"
    return None


def write_shard(path: Path, tensors: dict, metadata: dict):
    """Write to a temporary name, flush to disk, then rename: a crash never leaves a shard that reads as whole.
    A disk that fills removes the temporary file and says so."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(tmp), metadata=metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise FeatureStoreError(f"{path}: could not be written ({error.strerror}); the complete shards are kept: "
                                "free space and run the dump again to resume", per_rank=True) from None
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- reading the store

def read_index(directory: str) -> dict:
    path = Path(directory) / INDEX
    try:
        index = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):  # nothing there, or a file, not a store's directory
        raise FeatureStoreError(f"data.features={directory}: no {INDEX} there (write the store with "
                                "data/features.py)") from None
    except ValueError as error:
        raise FeatureStoreError(f"{path}: not JSON ({error})") from None
    stored_format = index.get("format") if isinstance(index, dict) else None
    if stored_format != FORMAT:
        raise FeatureStoreError(f"{path}: store format {stored_format}, this code reads {FORMAT}")
    return index


def identity_mismatch(stored: dict, expected: dict) -> str | None:
    """'field: store value, run value' for the first field where `expected` (None: not known here)
    disagrees with the store's identity."""
    for field, value in expected.items():
        if value is not None and stored.get(field) != value:
            return f"{field}: the store has {stored.get(field)!r}, this run {value!r}"
    return None


# the config key behind an identity field, as a refusal names it
CONFIG_KEYS = {"layer_ids": "drafter.target_layer_ids", "dtype": "target.dtype", "dataset": "data.path",
               "dataset_rows": "data.path", "data.max_length": "data.max_length"}


def store_refusal(store: "FeatureStore", cfg, layer_ids: list[int], dtype: torch.dtype, feature_code: str,
                  data_key: str = "data.path") -> str | None:
    """Why a run of `cfg` (its drafter reading `layer_ids`, computing in `dtype`, its target's feature code
    hashing to `feature_code`) cannot train from
    `store`, the store of the dataset at `data_key` (data.path or data.eval_path), in one line naming the
    field and both values; None when it can. Fields this machine cannot know (a target whose files are
    not here) are not compared, nor, with data.features_missing=generate, the dataset (the store may
    hold any of its rows); a store grown by hybrid runs (data.features_cache) serves another dataset
    when it holds every row of it the run reads. The store's dtype is data.features_dtype's (null: the
    training dtype's). Whether it holds the target's labels the objective reads: `labels_refusal`."""
    import datasets
    dataset = datasets.load_from_disk(OmegaConf.select(cfg, data_key))
    asked = cfg.data.features_dtype or DTYPE_NAMES.get(dtype, str(dtype))
    expected = store_identity(cfg, dataset, layer_ids, asked, feature_code)
    expected["target_labels"] = None  # what it must hold: below
    if store.identity.get("data.max_length", 0) >= cfg.data.max_length:  # it holds every row the run reads
        expected["data.max_length"] = None
    if cfg.data.features_missing == "generate" or (store.cache_files and holds_every_row(store, dataset, cfg)):
        expected.update({"dataset": None, "dataset_rows": None, "data.max_length": None})
    setting = "data.features" if data_key == "data.path" else "data.eval_features"
    keys = {**CONFIG_KEYS, "dataset": data_key, "dataset_rows": data_key}
    if cfg.data.features_dtype:
        keys["dtype"] = "data.features_dtype"
    for field, value in expected.items():
        if value is not None and store.identity.get(field) != value:
            key = f" ({keys[field]})" if field in keys else ""
            return (f"{setting}={store.directory} does not match this run: {field}{key}: the store has "
                    f"{store.identity.get(field)!r}, this run {value!r}")
    return None


def labels_refusal(store: "FeatureStore", cfg, needed: str, setting: str = "data.features") -> str | None:
    """Why `store` cannot serve an objective that reads the target's labels `needed` (TARGET_LABELS:
    the losses' `labels_needed`), in one line naming target_labels; None when it can."""
    if needed == "none" or store.target_labels in (needed, "full"):
        return None
    why = (f"objective.loss={cfg.objective.loss}" if cfg.drafter.draft_vocab_size is None
           else f"drafter.draft_vocab_size={cfg.drafter.draft_vocab_size}")
    return (f"{setting}={store.directory} does not serve this objective: target_labels: the store holds "
            f"{store.target_labels!r}, objective.labels=target with {why} reads {needed!r} (dump the store "
            f"with data/features.py --target-labels {needed})")


def holds_every_row(store: "FeatureStore", dataset, cfg) -> bool:
    """Whether `store` holds every row of `dataset` a run of `cfg` reads (those up to data.max_length)."""
    for ids, length in zip(dataset["input_ids"], dataset["length"]):
        if length <= cfg.data.max_length and row_key(ids) not in store.rows:
            return False
    return True
