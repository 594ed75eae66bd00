import numpy as np
import pytest
import torch

from drafter.infra.host_sync import HostSyncCounter, HostSyncError, host_syncs

x = torch.arange(6.0)
mask = x > 2
counts = torch.tensor([1, 2])

SYNCS = {  # each would make a GPU wait for the host
    "item": lambda: x[0].item(),
    "int": lambda: int(counts[0]),
    "if any": lambda: 1 if mask.any() else 0,
    "format": lambda: f"{x[1]:.1f}",
    "nonzero": lambda: mask.nonzero(),
    "where with one argument": lambda: torch.where(mask),
    "boolean index": lambda: x[mask],
    "boolean assignment": lambda: x.clone().__setitem__(mask, 0.0),
    "masked_select": lambda: x.masked_select(mask),
    "repeat_interleave without output_size": lambda: torch.repeat_interleave(counts),
    "unique": lambda: torch.unique(counts),
    "equal": lambda: torch.equal(x, x),
    "tolist": lambda: x.tolist(),
    "cpu": lambda: x.cpu(),
    "numpy": lambda: np.asarray(x),
    "tensor from host data": lambda: torch.tensor([1, 2], device=x.device),
}
NO_SYNCS = {
    "arithmetic and reductions": lambda: (x * 2 + 1).sum().sqrt(),
    "topk, sort, gather": lambda: x.topk(3).indices.sort().values.gather(0, counts),
    "integer index": lambda: x[counts],
    "where with three arguments": lambda: torch.where(mask, x, 0.0),
    "repeat_interleave with output_size": lambda: torch.repeat_interleave(counts, output_size=3),
    "fill on the device": lambda: torch.full((), 5, device=x.device),
    "shape arithmetic": lambda: len(x) + x.shape[0],
    "copy to a device without waiting": lambda: x.to(x.device, non_blocking=True),
}


@pytest.mark.parametrize("name", SYNCS)
def test_counts_each_operation_that_waits(name):
    with HostSyncCounter() as counter:
        SYNCS[name]()
    assert len(counter.events) == 1, counter.events
    assert counter.events[0].endswith(f"{__file__}:{SYNCS[name].__code__.co_firstlineno}")


@pytest.mark.parametrize("name", NO_SYNCS)
def test_does_not_count_operations_that_stay_on_the_device(name):
    with HostSyncCounter() as counter:
        NO_SYNCS[name]()
    assert counter.events == []


def test_forbid_raises_at_the_first_sync_and_names_it():
    with pytest.raises(HostSyncError, match=r"aten.nonzero at .*test_host_sync.py"):
        with host_syncs("cpu", forbid=True):
            mask.nonzero()


def test_host_syncs_on_the_cpu_counts_with_the_counter():
    with host_syncs(torch.device("cpu")) as events:
        int(counts.sum())
        counts.sum()
    assert len(events) == 1 and events[0].startswith("aten._local_scalar_dense at ")
