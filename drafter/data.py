"""Prepared datasets for training: loading data/prepare.py outputs, checked up front, and the
held-out split."""
import datasets
import numpy as np
import pyarrow.compute as pc

from drafter.sampler import split_holdout


def load_prepared(path: str, vocab_size: int) -> datasets.Dataset:
    """A data/prepare.py output, checked up front (columns, lengths, token ids) so that bad data stops
    the run at start-up with the row named, not hours in."""
    dataset = datasets.load_from_disk(path)
    missing = {"input_ids", "loss_mask", "length"} - set(dataset.column_names)
    if missing:
        raise ValueError(f"{path}: missing columns {sorted(missing)} (make it with data/prepare.py)")
    table = dataset.data.table
    ids_len = pc.list_value_length(table.column("input_ids")).to_numpy(zero_copy_only=False)
    mask_len = pc.list_value_length(table.column("loss_mask")).to_numpy(zero_copy_only=False)
    length = table.column("length").to_numpy()
    for what, bad in (("length column != len(input_ids)", length != ids_len),
                      ("len(loss_mask) != len(input_ids)", mask_len != ids_len)):
        if bad.any():
            raise ValueError(f"{path}: row {int(np.flatnonzero(bad)[0])}: {what} ({int(bad.sum())} rows)")
    flat_ids = pc.list_flatten(table.column("input_ids")).to_numpy(zero_copy_only=False)
    bad = (flat_ids < 0) | (flat_ids >= vocab_size)
    if bad.any():
        rows = pc.list_parent_indices(table.column("input_ids")).to_numpy(zero_copy_only=False)[bad]
        raise ValueError(f"{path}: row {int(rows[0])}: token id {int(flat_ids[bad][0])} outside the target "
                         f"vocabulary [0, {vocab_size}) ({len(np.unique(rows))} rows)")
    return dataset


def load_datasets(data_cfg, vocab_size: int):
    """(train, eval) prepared datasets with input_ids / loss_mask / length columns."""
    train = load_prepared(data_cfg.path, vocab_size)
    if data_cfg.eval_path:
        return train, load_prepared(data_cfg.eval_path, vocab_size)
    train_rows, eval_rows = split_holdout(len(train), data_cfg.eval_fraction, data_cfg.seed)
    return train.select(train_rows), train.select(eval_rows)
