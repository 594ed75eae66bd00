"""The offline feature store: the target's context features of every row of a prepared dataset, written
once by data_tools/features.py and read by training (`data.features=DIR`) in place of the target's forward.

    DIR/index.json                          identity, plan, shards (written first; "complete" at the end)
    DIR/shard-00000-of-00004.safetensors    rows [first, first + rows) of the dataset, in order:
        features [tokens, K*H]   each row's real positions, rows one after another
        offsets  [rows + 1]      int64: row i is features[offsets[i]:offsets[i + 1]]
        keys     [rows]          int64: the row's token key (`row_key`), by which training finds it
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from drafter.data.datasets import DataError

INDEX = "index.json"
HEAD = "head.safetensors"
TARGET_DIR = "target"
FORMAT = 1
STORE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
# what a dump writes into its directory; anything else there is someone else's
OWN_FILES = (INDEX, HEAD, TARGET_DIR, "run.lock")


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


def store_identity(cfg, dataset, layer_ids: list[int], dtype: str, feature_code: str) -> dict:
    """The store's identity for the run config `cfg` over `dataset`, its features computed by the code
    whose hash is `feature_code` (the target's `feature_code_version`); the dump records it, training
    compares every field it can know."""
    random = OmegaConf.to_container(cfg.target.random) if cfg.target.random is not None else None
    return {"target.path": cfg.target.path, "target.random": random,
            **target_file_identity(cfg.target.path, random),
            "target.chat_template_kwargs": OmegaConf.to_container(cfg.target.chat_template_kwargs),
            "dataset": dataset_fingerprint(dataset), "dataset_rows": len(dataset),
            "data.max_length": cfg.data.max_length, "layer_ids": [int(i) for i in layer_ids], "dtype": dtype,
            "feature_code": feature_code}


# ----------------------------------------------------------------------------- checking a shard

def shard_problem(path: Path, identity: str, first: int, rows: int) -> str | None:
    """Why the shard at `path` is not a whole shard of rows [first, first + rows) of this store, or None."""
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
    if (meta.get("first_row"), meta.get("rows")) != (str(first), str(rows)):
        return f"holds rows from {meta.get('first_row')} ({meta.get('rows')} rows), not from {first} ({rows})"
    return None


def write_shard(path: Path, features: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor, metadata: dict):
    """Write to a temporary name, flush to disk, then rename: a crash never leaves a shard that reads as whole.
    A disk that fills removes the temporary file and says so."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file({"features": features.contiguous(), "offsets": offsets, "keys": keys}, str(tmp), metadata=metadata)
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
    except FileNotFoundError:
        raise FeatureStoreError(f"data.features={directory}: no {INDEX} there (write the store with "
                                "data_tools/features.py)") from None
    except ValueError as error:
        raise FeatureStoreError(f"{path}: not JSON ({error})") from None
    if index.get("format") != FORMAT:
        raise FeatureStoreError(f"{path}: store format {index.get('format')}, this code reads {FORMAT}")
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
    hold any of its rows)."""
    import datasets
    expected = store_identity(cfg, datasets.load_from_disk(OmegaConf.select(cfg, data_key)), layer_ids,
                              DTYPE_NAMES.get(dtype, str(dtype)), feature_code)
    if store.identity.get("data.max_length", 0) >= cfg.data.max_length:  # it holds every row the run reads
        expected["data.max_length"] = None
    if cfg.data.features_missing == "generate":
        expected.update({"dataset": None, "dataset_rows": None, "data.max_length": None})
    for field, value in expected.items():
        if value is not None and store.identity.get(field) != value:
            key = f" ({CONFIG_KEYS[field]})".replace("data.path", data_key) if field in CONFIG_KEYS else ""
            setting = "data.features" if data_key == "data.path" else "data.eval_features"
            return (f"{setting}={store.directory} does not match this run: {field}{key}: the store has "
                    f"{store.identity.get(field)!r}, this run {value!r}")
    return None


@dataclass(frozen=True)
class StoredRow:
    shard: int
    start: int
    end: int


class FeatureStore:
    """A complete store, every shard checked; `features(input_ids, lengths)` gives a batch's
    features [b, T, K*H] (zeros past each row's length, where features are never read)."""

    def __init__(self, directory: str):
        self.directory = Path(directory)
        self.index = read_index(directory)
        self.identity = self.index["identity"]
        if not self.index.get("complete"):
            raise FeatureStoreError(f"{self.directory / INDEX}: the dump has not finished; run data_tools/features.py "
                                    "again with the same arguments to resume it")
        digest = identity_digest(self.identity)
        self.files, self.rows = [], {}
        for number, shard in enumerate(self.index["shards"]):
            path = self.directory / shard["file"]
            if problem := shard_problem(path, digest, shard["first_row"], shard["rows"]):
                raise FeatureStoreError(f"feature store shard {path}: {problem}")
            handle = safe_open(str(path), framework="pt")
            offsets, keys = handle.get_tensor("offsets").tolist(), handle.get_tensor("keys").tolist()
            for i, key in enumerate(keys):
                self.rows.setdefault(key, StoredRow(number, offsets[i], offsets[i + 1]))
            self.files.append(handle)
        self.layer_ids = list(self.identity["layer_ids"])
        self.dtype = STORE_DTYPES[self.identity["dtype"]]
        self.width = len(self.layer_ids) * self.index["hidden_size"]

    def row_features(self, key: int, length: int) -> torch.Tensor | None:
        """The features [length, K*H] of the row with this key, or None when the store does not hold it."""
        row = self.rows.get(key)
        if row is None or row.end - row.start != length:
            return None
        return self.files[row.shard].get_slice("features")[row.start:row.end]

    def features(self, input_ids: torch.Tensor, lengths) -> torch.Tensor:
        return batch_features([self], input_ids, lengths)


def batch_features(stores: list[FeatureStore], input_ids: torch.Tensor, lengths,
                   generate=None, layer_ids=None) -> torch.Tensor:
    """A batch's features [b, T, K*H] from the first of `stores` that holds each row (zeros past each
    row's length, where features are never read). A row none holds is computed by `generate` (the
    target's feature pass, TargetFeatures) when given, else refused, named by its tokens."""
    out = torch.zeros((*input_ids.shape, stores[0].width), dtype=stores[0].dtype)
    ids, missing = input_ids.cpu(), []
    for i, length in enumerate(lengths.tolist() if torch.is_tensor(lengths) else lengths):
        tokens = ids[i, :length].numpy()
        key = row_key(tokens)
        row = next((f for f in (store.row_features(key, length) for store in stores) if f is not None), None)
        if row is not None:
            out[i, :length] = row
        elif generate is None:
            raise FeatureStoreError(f"{', '.join(str(s.directory) for s in stores)}: no row with these {length} "
                                    f"tokens (first {tokens[:8].tolist()}): the store was written for another "
                                    "dataset (data.features_missing=generate computes such rows with the target)")
        else:
            missing.append(i)
    if missing:  # the feature pass gives a row the same bits whatever else its batch holds
        computed, _ = generate(input_ids[missing], layer_ids, [int(lengths[i]) for i in missing])
        out[missing] = computed.to(out.dtype).cpu()
    return out.to(input_ids.device)


class StoreFeatures:
    """TargetFeatures' interface over feature stores (data.features, and data.eval_features for the
    rows of data.eval_path): what micro_step and evaluate call for a batch's features (no final hidden
    states: a store holds none)."""

    def __init__(self, stores: list[FeatureStore], generate=None):
        self.stores, self.generate = stores, generate  # generate: TargetFeatures, for rows no store holds
        self.group = generate.group if generate is not None else None  # generation's (hybrid only)

    def __call__(self, input_ids, layer_ids, lengths=None):
        if input_ids is None:
            return None, None
        for store in self.stores:
            if list(layer_ids) != store.layer_ids:
                raise FeatureStoreError(f"{store.directory}: layer_ids: the store has {store.layer_ids}, "
                                        f"the drafter reads {list(layer_ids)}")
        return batch_features(self.stores, input_ids, lengths, self.generate, layer_ids), None

    def most_in_group(self, count: int) -> int:
        return count


class StoredHead(nn.Module):
    """What the drafter reads of the target when the features come from a store: its config, input
    embedding (with the target's embedding scale) and LM head, from the store's head.safetensors."""

    def __init__(self, config, embedding: torch.Tensor, lm_head: torch.Tensor, embed_scale: float):
        super().__init__()
        from transformers import GenerationConfig
        self.config = config
        self.generation_config = GenerationConfig.from_model_config(config)
        self.embed_tokens = nn.Embedding.from_pretrained(embedding, freeze=True)
        if embed_scale != 1.0:
            self.embed_tokens.embed_scale = embed_scale
        self.lm_head = nn.Linear(lm_head.shape[1], lm_head.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(lm_head, requires_grad=False)
        self.eval()

    def get_input_embeddings(self):
        return self.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    @property
    def device(self):
        return self.lm_head.weight.device

    @property
    def dtype(self):
        return self.lm_head.weight.dtype


def load_stored_head(directory: str, device, dtype: torch.dtype) -> StoredHead:
    from transformers import AutoConfig
    path = Path(directory) / HEAD
    if not path.is_file():
        raise FeatureStoreError(f"feature store {path}: missing")
    with safe_open(str(path), framework="pt") as f:
        embedding, lm_head = f.get_tensor("embedding"), f.get_tensor("lm_head")
        scale = float(f.metadata().get("input_embedding_scale", "1.0"))
    config = AutoConfig.from_pretrained(str(Path(directory) / TARGET_DIR))
    return StoredHead(config, embedding.to(dtype), lm_head.to(dtype), scale).to(device)


def store_model_config(directory: str):
    """The target's model config as the dump saved it (training from a store reads no target files)."""
    from transformers import AutoConfig
    path = Path(directory) / TARGET_DIR
    if not (path / "config.json").is_file():
        raise FeatureStoreError(f"feature store {path / 'config.json'}: missing")
    return AutoConfig.from_pretrained(str(path))
