"""A feature store at run time: its rows read by their tokens in place of the target's forward
(FeatureStore, StoreFeatures), the rows a hybrid run computes appended to it (StoreCache), and what the
drafter reads of the target from it (its head and config). The store's files, identity and refusals:
drafter/pipeline/feature_store_format.py."""
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from drafter.pipeline.feature_store_format import (CACHE_PATTERN, HEAD, INDEX, TARGET_DIR, FeatureStoreError, decode,
                                                   encode, identity_digest, read_index, row_key, shard_problem,
                                                   shard_tensors, write_shard)

CACHE_FLUSH_BYTES = 256 * 2**20  # a hybrid run appends its computed rows to the store in files of about this


@dataclass(frozen=True)
class StoredRow:
    file: int
    start: int
    end: int


class FeatureStore:
    """A complete store, every shard checked, and the cache shards hybrid runs appended to it;
    `row(key, length)` gives a row's features and the target's labels it holds."""

    def __init__(self, directory: str):
        self.directory = Path(directory)
        self.index = read_index(directory)
        self.identity = self.index["identity"]
        if not self.index.get("complete"):
            raise FeatureStoreError(f"{self.directory / INDEX}: the dump has not finished; run data/features.py "
                                    "again with the same arguments to resume it")
        self.digest = identity_digest(self.identity)
        self.files, self.rows = [], {}
        for shard in self.index["shards"]:
            self.add_file(self.directory / shard["file"], shard["first_row"], shard["rows"])
        # appended whole or not at all (a .tmp name until then): a file of this name that is not whole is refused
        self.cache_files = sorted(self.directory.glob(CACHE_PATTERN))
        for path in self.cache_files:
            self.add_file(path)
        self.layer_ids = list(self.identity["layer_ids"])
        self.dtype_name = self.identity["dtype"]
        self.target_labels = self.identity.get("target_labels", "none")
        self.width = len(self.layer_ids) * self.index["hidden_size"]

    def add_file(self, path: Path, first: int | None = None, rows: int | None = None):
        """Read a shard's keys (first None: a cache shard); rows already held keep their first place."""
        if problem := shard_problem(path, self.digest, first, rows):
            raise FeatureStoreError(f"feature store shard {path}: {problem}")
        handle = safe_open(str(path), framework="pt")
        offsets, keys = handle.get_tensor("offsets").tolist(), handle.get_tensor("keys").tolist()
        for i, key in enumerate(keys):
            self.rows.setdefault(key, StoredRow(len(self.files), offsets[i], offsets[i + 1]))
        self.files.append(handle)

    def row(self, key: int, length: int):
        """(features [length, K*H], the target's labels there or None) of the row with this key, decoded
        (fp8: to fp32), or None when the store does not hold it."""
        row = self.rows.get(key)
        if row is None or row.end - row.start != length:
            return None
        handle, span = self.files[row.file], slice(row.start, row.end)
        fp8 = self.dtype_name == "fp8"
        features = decode(handle.get_slice("features")[span],
                          handle.get_slice("feature_scales")[span] if fp8 else None)
        labels = None
        if self.target_labels == "full":
            labels = decode(handle.get_slice("final")[span], handle.get_slice("final_scales")[span] if fp8 else None)
        elif self.target_labels == "argmax":
            labels = handle.get_slice("next_tokens")[span].long()
        return features, labels

    def features(self, input_ids: torch.Tensor, lengths, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return StoreFeatures([self], dtype)(input_ids, self.layer_ids, lengths)[0]


class StoreCache:
    """The rows a hybrid run computes (data.features_cache), appended to `store` as shards of their own
    (cache-<writer>-<n>.safetensors), each written whole (a temporary name, fsync, rename: a kill leaves
    at most a .tmp no reader opens) once about CACHE_FLUSH_BYTES are buffered, and at `flush`. Each
    process writes its own files under a random writer id, so ranks, and runs, append at once with
    nothing shared to update; readers find the files by name. An append that cannot be written (a full
    disk, a read-only store) is said once and the run goes on appending nothing more."""

    def __init__(self, store: FeatureStore):
        self.store, self.writer, self.count = store, secrets.token_hex(6), 0
        self.buffered, self.held, self.bytes, self.failed = [], set(), 0, False

    def add(self, key: int, features: torch.Tensor, final, next_tokens):
        """A row as the store holds it: features [L, K*H], and the target's final hidden states [L, H]
        or its argmax [L] where the store holds them (else None)."""
        if key in self.held or key in self.store.rows:
            return
        self.held.add(key)
        self.buffered.append((key, features.cpu(), None if final is None else final.cpu(),
                              None if next_tokens is None else next_tokens.cpu()))
        self.bytes += features.numel() * features.element_size()
        if self.bytes >= CACHE_FLUSH_BYTES:
            self.flush()

    def flush(self):
        if not self.buffered or self.failed:
            return
        keys, features, finals, next_tokens = zip(*self.buffered)
        lengths = [len(f) for f in features]
        offsets = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int64)
        store = self.store
        tensors = shard_tensors(torch.cat(features), torch.cat(finals) if finals[0] is not None else None,
                                torch.cat(next_tokens) if next_tokens[0] is not None else None, offsets,
                                torch.tensor(keys, dtype=torch.int64), store.dtype_name, len(store.layer_ids))
        path = store.directory / f"cache-{self.writer}-{self.count:05d}.safetensors"
        try:
            write_shard(path, tensors, {"identity": store.digest, "cache": self.writer})
        except FeatureStoreError as error:
            self.failed, self.buffered = True, []
            print(f"warning: data.features_cache: {str(error).split(';')[0]}; this run appends no more rows "
                  "(the store is as it was)", file=sys.stderr, flush=True)
            return
        self.count += 1
        self.buffered, self.bytes = [], 0
        store.add_file(path)


class StoreFeatures:
    """TargetFeatures' interface over feature stores (data.features, and data.eval_features for the
    rows of data.eval_path): what micro_step and evaluate call for a batch's (features [b, T, K*H] in
    `dtype`, the target's labels `labels` reads (labels_needed): None; its final hidden states [b, T, H]
    (full); or its argmax next tokens [b, T] (argmax)), zeros past each row's length. A row no store
    holds is computed by `generate` (the target's TargetFeatures; hybrid mode), rounded as the first
    store holds it, and given to `cache` (a StoreCache) when there is one; without `generate` it is
    refused, named by its tokens. `next_tokens` (final hidden states [n, H] -> the target's argmax [n],
    `lm_head.target_next_tokens` over the run's head) turns final hidden states into argmax labels."""

    def __init__(self, stores: list[FeatureStore], dtype: torch.dtype, labels: str = "none", generate=None,
                 next_tokens=None, cache: StoreCache | None = None):
        self.stores, self.dtype, self.labels = stores, dtype, labels
        self.generate, self.next_tokens, self.cache = generate, next_tokens, cache
        self.group = generate.group if generate is not None else None  # generation's (hybrid only)

    def __call__(self, input_ids, layer_ids, lengths=None):
        if input_ids is None:
            return None, None
        for store in self.stores:
            if list(layer_ids) != store.layer_ids:
                raise FeatureStoreError(f"{store.directory}: layer_ids: the store has {store.layer_ids}, "
                                        f"the drafter reads {list(layer_ids)}")
        lengths = lengths.tolist() if torch.is_tensor(lengths) else list(lengths)
        features = torch.zeros((*input_ids.shape, self.stores[0].width), dtype=self.dtype)
        labels = self._empty_labels(input_ids)
        ids, missing = input_ids.cpu(), []
        for i, length in enumerate(lengths):
            tokens = ids[i, :length].numpy()
            key = row_key(tokens)
            found = next(((store, row) for store in self.stores if (row := store.row(key, length)) is not None), None)
            if found is not None:
                store, (row_features, row_labels) = found
                features[i, :length] = row_features
                if labels is not None:
                    labels[i, :length] = self._as_read(row_labels, store.target_labels)
            elif self.generate is None:
                raise FeatureStoreError(f"{', '.join(str(s.directory) for s in self.stores)}: no row with these "
                                        f"{length} tokens (first {tokens[:8].tolist()}): the store was written for "
                                        "another dataset (data.features_missing=generate computes such rows with "
                                        "the target)")
            else:
                missing.append(i)
        if missing:  # the feature pass gives a row the same bits whatever else its batch holds
            self._compute(input_ids, layer_ids, lengths, missing, features, labels)
        return features.to(input_ids.device), None if labels is None else labels.to(input_ids.device)

    def _empty_labels(self, input_ids):
        if self.labels == "full":
            return torch.zeros((*input_ids.shape, self.stores[0].index["hidden_size"]), dtype=self.dtype)
        return torch.zeros(input_ids.shape, dtype=torch.long) if self.labels == "argmax" else None

    def _as_read(self, row_labels, held: str):
        """A stored row's labels as this run reads them (a store's final hidden states, for argmax labels,
        through the run's head)."""
        if self.labels == "argmax" and held == "full":
            return self.next_tokens(row_labels.to(self.dtype)).cpu()
        return row_labels

    def _compute(self, input_ids, layer_ids, lengths, missing, features, labels):
        """The rows `missing` of the batch through the target, rounded as the first store holds them (its
        dtype; its argmax from the target's own final hidden states, as the dump computes it)."""
        store = self.stores[0]
        computed, final = self.generate(input_ids[missing], layer_ids, [lengths[i] for i in missing])
        for j, i in enumerate(missing):
            length = lengths[i]
            row, row_final = computed[j, :length].cpu(), None if final is None else final[j, :length].cpu()
            features[i, :length] = decode(*encode(row, store.dtype_name, len(store.layer_ids)))
            next_tokens = None
            if row_final is not None and (store.target_labels == "argmax" or self.labels == "argmax"):
                next_tokens = self.next_tokens(row_final.to(self.dtype)).cpu()
            if labels is not None:
                if self.labels == "full":
                    labels[i, :length] = decode(*encode(row_final, store.dtype_name, 1))
                elif store.target_labels == "full":  # argmax read as _as_read reads the stored rows
                    labels[i, :length] = self._as_read(decode(*encode(row_final, store.dtype_name, 1)), "full")
                else:
                    labels[i, :length] = next_tokens
            if self.cache is not None:
                self.cache.add(row_key(input_ids[i, :length].cpu().numpy()), row,
                               row_final if store.target_labels == "full" else None,
                               next_tokens if store.target_labels == "argmax" else None)

    def flush(self):
        if self.cache is not None:
            self.cache.flush()

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
