"""Prepared datasets for training: loading data/prepare.py outputs, checked up front, and the
held-out split."""
import hashlib
import json
import warnings
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc

from drafter.pipeline.splits import split_holdout
from drafter.errors import UserError

TRAINING_COLUMNS = ["input_ids", "loss_mask", "length"]


class DataError(UserError, ValueError):
    """A prepared dataset that training cannot use, named with the reason (a user error, not a bug)."""


def load_prepared(path: str, vocab_size: int) -> datasets.Dataset:
    """A data/prepare.py output, checked up front (columns, lengths, token ids) so that bad data stops
    the run at start-up with the row named, not hours in."""
    try:
        dataset = datasets.load_from_disk(path)
    except FileNotFoundError as error:  # datasets' words for a directory that holds no saved dataset
        raise DataError(f"{path}: {error} (make it with data/prepare.py)") from None
    except IndexError:  # datasets cannot read back a dataset saved with no rows
        raise DataError(f"{path}: a saved dataset with no rows (data/prepare.py keeps at least one)") from None
    missing = set(TRAINING_COLUMNS) - set(dataset.column_names)
    if missing:
        raise DataError(f"{path}: missing columns {sorted(missing)} (make it with data/prepare.py)")
    table = dataset.data.table
    ids_len = pc.list_value_length(table.column("input_ids")).to_numpy(zero_copy_only=False)
    mask_len = pc.list_value_length(table.column("loss_mask")).to_numpy(zero_copy_only=False)
    length = table.column("length").to_numpy()
    for what, bad in (("length column != len(input_ids)", length != ids_len),
                      ("len(loss_mask) != len(input_ids)", mask_len != ids_len)):
        if bad.any():
            raise DataError(f"{path}: row {int(np.flatnonzero(bad)[0])}: {what} ({int(bad.sum())} rows)")
    flat_ids = pc.list_flatten(table.column("input_ids")).to_numpy(zero_copy_only=False)
    bad = (flat_ids < 0) | (flat_ids >= vocab_size)
    if bad.any():
        rows = pc.list_parent_indices(table.column("input_ids")).to_numpy(zero_copy_only=False)[bad]
        raise DataError(f"{path}: row {int(rows[0])}: token id {int(flat_ids[bad][0])} outside the target "
                         f"vocabulary [0, {vocab_size}) ({len(np.unique(rows))} rows)")
    return dataset


def token_ids_in(prepared: list[datasets.Dataset], vocab_size: int) -> np.ndarray:
    """bool [vocab_size]: which token ids occur in the `input_ids` of the datasets, every row of the
    tables under them counted (a held-out split's rows included)."""
    seen = np.zeros(vocab_size, dtype=bool)
    for dataset in prepared:
        for chunk in dataset.data.table.column("input_ids").chunks:
            seen[np.unique(pc.list_flatten(chunk).to_numpy(zero_copy_only=False))] = True
    return seen


def token_occurs(prepared: list[datasets.Dataset], token_id: int) -> bool:
    """Whether `token_id` occurs in the `input_ids` of the datasets (one id: a scan, no sort)."""
    return any(pc.any(pc.equal(pc.list_flatten(chunk), token_id)).as_py()
               for dataset in prepared for chunk in dataset.data.table.column("input_ids").chunks)


def supervised_token_counts(prepared: list[datasets.Dataset], vocab_size: int) -> np.ndarray:
    """int64 [vocab_size]: how often each token id is supervised (its `input_ids` where `loss_mask`) in
    the datasets: each dataset's own rows (a split's), not the whole table under it, a record batch at
    a time."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for dataset in prepared:
        for batch in dataset.select_columns(["input_ids", "loss_mask"]).with_format("arrow").iter(batch_size=4096):
            ids = pc.list_flatten(batch["input_ids"]).to_numpy()
            supervised = pc.list_flatten(batch["loss_mask"]).to_numpy().astype(bool)
            counts += np.bincount(ids[supervised], minlength=vocab_size)[:vocab_size]
    return counts


def check_prepared_thinking(path: str, chat_template_kwargs) -> None:
    """Raise DataError when the dataset at `path` was prepared with another enable_thinking than the
    training config's `target.chat_template_kwargs` (the drafter would learn text the target does
    not write when served); warn when the dataset does not record it (not made by data/prepare.py,
    or by a version before the record)."""
    stats_path = Path(path) / "stats.json"
    try:
        prepared = json.loads(stats_path.read_text())["settings"]["chat_template_kwargs"]["enable_thinking"]
    except (OSError, ValueError, KeyError, TypeError):
        warnings.warn(f"{path}: no settings.chat_template_kwargs.enable_thinking in {stats_path}, so thinking "
                      "on/off cannot be checked against the config; rerun data/prepare.py to record it",
                      stacklevel=2)
        return
    configured = dict(chat_template_kwargs or {}).get("enable_thinking")
    if prepared != configured:
        raise DataError(f"{path} was prepared with enable_thinking={prepared} ({stats_path}) but the config has "
                         f"target.chat_template_kwargs.enable_thinking={configured}: the drafter would learn text "
                         "the target does not write when served; prepare the data again or fix the config")


def row_groups(dataset: datasets.Dataset, path: str) -> np.ndarray:
    """The `group` of every row, or one group per row (with a warning) for a dataset without them."""
    if "group" in dataset.column_names:
        return np.asarray(dataset["group"], dtype=object)
    warnings.warn(f"{path}: no 'group' column (prepared before groups were recorded): the eval split "
                  "holds out random rows, which may share documents with training rows", stacklevel=2)
    return np.arange(len(dataset))


def content_fingerprint(dataset: datasets.Dataset) -> str:
    """A short hash of the rows' input_ids and loss_mask, in order: two runs evaluated on the same
    held-out rows share it, whatever directory or build the rows came from."""
    digest = hashlib.sha256()
    table = dataset.select_columns(["input_ids", "loss_mask"]).with_format("arrow")[:]  # the selected rows only
    for column in ("input_ids", "loss_mask"):
        values = table.column(column).combine_chunks()
        digest.update(np.asarray(pc.list_value_length(values)).astype(np.int64).tobytes())
        digest.update(np.asarray(values.flatten()).astype(np.int64).tobytes())  # flatten: a slice's own values
    return digest.hexdigest()[:16]


def load_datasets(data_cfg, vocab_size: int, chat_template_kwargs):
    """(train, eval) prepared datasets with input_ids / loss_mask / length columns. Thinking is
    checked against `chat_template_kwargs` (the config's target.chat_template_kwargs); without
    data.eval_path the eval split holds out whole groups (see splits.split_holdout)."""
    paths = {"data.path": data_cfg.path, "data.eval_path": data_cfg.eval_path}
    for key, path in paths.items():
        local = None if path is None or "://" in path else Path(path).expanduser()  # as load_from_disk reads it
        if local is not None and not local.is_dir():
            reason = "not a directory" if local.exists() else "no such directory"
            raise DataError(f"{key}={path}: {reason} (make it with data/prepare.py)")
    for path in filter(None, paths.values()):
        check_prepared_thinking(path, chat_template_kwargs)
    train = load_prepared(data_cfg.path, vocab_size)
    if data_cfg.eval_path:
        return (train.select_columns(TRAINING_COLUMNS),
                load_prepared(data_cfg.eval_path, vocab_size).select_columns(TRAINING_COLUMNS))
    train_rows, eval_rows = split_holdout(row_groups(train, data_cfg.path), data_cfg.eval_fraction, data_cfg.seed)
    train = train.select_columns(TRAINING_COLUMNS)
    return train.select(train_rows), train.select(eval_rows)
