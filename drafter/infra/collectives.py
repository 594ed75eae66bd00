"""The few collectives the trainer's own bookkeeping needs beyond the engines': agreeing on a flag and
summing a dict of metric tensors, on whichever device the process group moves tensors from."""
import torch
import torch.distributed as dist


def comm_device() -> torch.device:
    """Where collective tensors live: NCCL only moves GPU tensors."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def any_rank(flag: bool) -> bool:
    """True when `flag` holds on some rank (a collective)."""
    value = torch.tensor([1.0 if flag else 0.0], device=comm_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


def every_rank(flag: bool) -> bool:
    """True when `flag` holds on every rank (a collective)."""
    return not any_rank(not flag)


def all_reduce_sum(metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank's tensors summed, in float64 on the CPU, in one all-reduce."""
    names = sorted(metrics)
    flat = torch.cat([metrics[n].reshape(-1).double().to(comm_device()) for n in names])
    dist.all_reduce(flat)
    flat = flat.cpu()
    out, offset = {}, 0
    for n in names:
        size = metrics[n].numel()
        out[n] = flat[offset:offset + size].view(metrics[n].shape)
        offset += size
    return out
