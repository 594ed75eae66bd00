"""A sampler's planned batches loaded and collated: `make_loader` reads each planned batch in worker
processes (drafter/pipeline/sampler.py plans them) and prefetches on a thread whose queue depth can be
read at any time; `collate` right-pads a batch's rows."""
import queue
import signal
import threading
from typing import Iterator, Sequence

import numpy as np
import torch

from drafter.pipeline.sampler import PAD_MULTIPLE, BucketSampler, PlannedBatch, padded_length

PAD_TOKEN_ID = 0  # any id works: padded positions are masked out of attention and loss


def collate(rows: Sequence[dict], bucket: int, max_length: int | None = None,
            pad_multiple: int = PAD_MULTIPLE) -> dict:
    """Right-pad rows {input_ids, loss_mask} to T = longest row rounded up to pad_multiple (never
    beyond max_length unless a row is longer). Returns LongTensors input_ids, loss_mask (0 on
    padding), attention_mask [b, T], lengths [b], and the int bucket id."""
    lengths = [len(row["input_ids"]) for row in rows]
    for i, row in enumerate(rows):
        if len(row["loss_mask"]) != lengths[i]:
            raise ValueError(f"batch row {i}: input_ids has {lengths[i]} tokens, loss_mask {len(row['loss_mask'])}")
    width = int(padded_length(max(lengths), pad_multiple, max_length))
    input_ids = torch.full((len(rows), width), PAD_TOKEN_ID, dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, length) in enumerate(zip(rows, lengths)):
        input_ids[i, :length] = torch.as_tensor(row["input_ids"], dtype=torch.long)
        loss_mask[i, :length] = torch.as_tensor(row["loss_mask"], dtype=torch.long)
        attention_mask[i, :length] = 1
    return {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention_mask,
            "lengths": torch.tensor(lengths, dtype=torch.long), "bucket": bucket}


class _PlannedBatchDataset(torch.utils.data.Dataset):
    """Item i = the i-th planned batch of one rank, read and collated (in a worker process)."""

    def __init__(self, dataset, batches: list[PlannedBatch], lengths: np.ndarray, max_length: int):
        self.dataset, self.batches, self.lengths, self.max_length = dataset, batches, lengths, max_length

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict:
        step, bucket, indices = self.batches[i]
        rows = [self.dataset[int(index)] for index in indices]
        for index, row in zip(indices, rows):
            if len(row["input_ids"]) != self.lengths[index]:
                raise ValueError(f"dataset row {index}: {len(row['input_ids'])} tokens but the plan's "
                                 f"length is {self.lengths[index]}; lengths and dataset disagree")
        return {**collate(rows, bucket, self.max_length), "step": step}


def _fill_queue(source: Iterator, ready: queue.Queue, stop: threading.Event) -> None:
    """Move batches from `source` into `ready` until exhausted or stopped; an error is queued
    in place of the batch that raised it."""

    def put(item) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    try:
        for batch in source:
            if not put(batch):
                return
    except Exception as error:
        put(error)


class PrefetchLoader:
    """Iterates a DataLoader on a background thread into a bounded queue, so the batches ready
    for the training loop can be counted at any time (`queue_depth`). Loading errors are raised
    in the consumer. `close()` (or leaving a `with` block) stops it early."""

    def __init__(self, loader: torch.utils.data.DataLoader, depth: int):
        self._remaining = len(loader)
        self._ready: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._source = iter(loader)  # workers start here, in the calling thread
        self._thread = threading.Thread(target=_fill_queue, args=(self._source, self._ready, self._stop),
                                        daemon=True)
        self._thread.start()

    def queue_depth(self) -> int:
        """Batches loaded and waiting to be consumed on this rank."""
        return self._ready.qsize()

    def __len__(self) -> int:
        return self._remaining

    def __iter__(self) -> "PrefetchLoader":
        return self

    def __next__(self) -> dict:
        if self._remaining == 0:
            raise StopIteration
        item = self._ready.get()
        if isinstance(item, Exception):
            self.close()
            raise item
        self._remaining -= 1
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._remaining = 0
        self._source = None  # drops the DataLoader iterator, which shuts its workers down

    def __enter__(self) -> "PrefetchLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self._stop.set()


def _ignore_stop_signals(worker_id: int) -> None:
    """Workers leave SIGTERM / SIGINT to the training process, which finishes its step, saves and
    then shuts them down; a launcher signalling the whole process tree must not kill them first."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


# over six: the rows, the sampler's plan and where to resume it, and the DataLoader's three settings
def make_loader(dataset, sampler: BucketSampler, epoch: int, start_step: int = 0, num_workers: int = 2,
                prefetch_factor: int = 4, pin_memory: bool = False) -> PrefetchLoader:
    """This rank's collated batches of `epoch` from `start_step`, in plan order, each a dict of
    collate()'s tensors plus `bucket` and `step`. Rows come from `dataset[i]` ({input_ids,
    loss_mask}), read by `num_workers` processes (0: by the prefetch thread) each up to
    `prefetch_factor` batches ahead; up to `prefetch_factor` more wait in the observable queue."""
    batches = list(sampler.batches_for_rank(epoch, start_step))
    source = _PlannedBatchDataset(dataset, batches, sampler.lengths, sampler.max_length)
    loader = torch.utils.data.DataLoader(source, batch_size=None, shuffle=False, num_workers=num_workers,
                                         prefetch_factor=prefetch_factor if num_workers else None,
                                         pin_memory=pin_memory, worker_init_fn=_ignore_stop_signals)
    return PrefetchLoader(loader, prefetch_factor)
