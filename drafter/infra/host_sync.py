"""Host synchronisations: counting them on the CPU, catching them on CUDA.

On a GPU the host launches kernels ahead of the device. An operation that needs a value or a shape
from device memory (`.item()`, `int(t)`, `if t.any()`, `.tolist()`, `.cpu()`, `nonzero`, boolean-mask
indexing...) or a blocking host-to-device copy (`torch.tensor(x, device="cuda")`) makes the host wait
until the device has drained its queue, and the device then idles while the host catches up.

    with host_syncs(device) as syncs:      # CUDA: what CUDA reports; CPU: HostSyncCounter
        training_step(...)
    print(len(syncs), syncs)
    with host_syncs(device, forbid=True):  # raises at the first one
        ...

On a CPU nothing waits, so `HostSyncCounter` names the operations that would wait on a GPU. It sees
ops below autograd (a TorchDispatchMode) and tensor methods that never reach the dispatcher on the
CPU (a TorchFunctionMode). What it cannot see on a CPU: a `.to(device)` of a host tensor (on the CPU
it is a no-op) and the ops inside a higher-order op such as eager flex_attention; run code under it
eagerly, not compiled. On CUDA, `host_syncs` uses `torch.cuda.set_sync_debug_mode`, which catches
every synchronising copy and stream synchronisation.
"""
import traceback
import warnings
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops whose result needs device data on the host: a scalar read or a data-dependent shape
_READ_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim",
             "unique_consecutive", "equal", "allclose", "bincount"}
_INDEX_OPS = {"index", "index_put_", "_index_put_impl_", "index_put"}  # sync with bool-mask indices
_HOST_METHODS = {"tolist", "numpy", "cpu", "__array__"}  # device -> host copies of a whole tensor
_FACTORIES = {"tensor", "as_tensor"}  # with device=: host data copied to the device


class HostSyncError(RuntimeError):
    pass


def _caller() -> str:
    """file:line of the innermost frame outside torch and this module."""
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and frame.filename != __file__:
            return f"{frame.filename}:{frame.lineno}"
    return "?"


def _bool_indices(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


class _Ops(TorchDispatchMode):
    supports_higher_order_operators = True  # run them (their inner ops are not seen)

    def __init__(self, record):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "_opname", None) or getattr(func, "__name__", str(func))
        if (name in _READ_OPS or (name in _INDEX_OPS and _bool_indices(args))
                or (name == "repeat_interleave" and kwargs.get("output_size") is None)):
            self.record(f"aten.{name}")
        return func(*args, **kwargs)


class _Methods(TorchFunctionMode):
    def __init__(self, record):
        super().__init__()
        self.record = record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _HOST_METHODS or (name in _FACTORIES and kwargs.get("device") is not None):
            self.record(f"{name}()")
        return func(*args, **kwargs)


class HostSyncCounter:
    """Records each operation that would synchronise a GPU with the host, as "op at file:line", in
    `events`. With `forbid`, the first one raises HostSyncError instead."""

    def __init__(self, forbid: bool = False):
        self.forbid = forbid
        self.events: list[str] = []
        self._modes = (_Methods(self._record), _Ops(self._record))

    def _record(self, op: str) -> None:
        event = f"{op} at {_caller()}"
        if self.forbid:
            raise HostSyncError(f"host synchronisation: {event}")
        self.events.append(event)

    def __enter__(self) -> "HostSyncCounter":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


@contextmanager
def host_syncs(device: torch.device | str, forbid: bool = False):
    """Yields a list that gets one entry per host synchronisation inside the block. On CUDA these are
    what `torch.cuda.set_sync_debug_mode` reports (forbid: mode "error", the first one raises); on any
    other device, what HostSyncCounter counts (forbid: HostSyncError)."""
    if torch.device(device).type != "cuda":
        with HostSyncCounter(forbid) as counter:
            yield counter.events
        return
    previous = torch.cuda.get_sync_debug_mode()
    events: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("error" if forbid else "warn")
        try:
            yield events
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    events += [f"{w.message} at {w.filename}:{w.lineno}" for w in caught
               if "synchronizing CUDA operation" in str(w.message)]
