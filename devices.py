"""Devices and processes, which a learner may skip: --device/--dtype, torchrun's process group
and its collectives (one process: no-ops), free memory."""

import os
import re
import sys
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import door


def check_free_memory(nbytes, device, what, todo):
    """A ModelError, before any large allocation, where `what` needs more than the free memory."""
    if torch.device(device).type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        meminfo = Path("/proc/meminfo")
        text = meminfo.read_text() if meminfo.is_file() else ""
        found = re.findall(r"MemAvailable:\s+(\d+)", text)
        # no /proc/meminfo (not Linux): no limit, a PiB
        free = 1024 * int(found[0]) if found else 2 ** 50
    if nbytes > free:
        raise door.ModelError(f"{what} needs about {nbytes / 2 ** 30:,.1f} GiB, more than the "
                         f"{free / 2 ** 30:.1f} GiB free on {device}; {todo}")


def pick_device(device="auto", dtype="auto"):
    """--device/--dtype -> (device, autocast); auto: cuda in bf16 autocast with TF32, else cpu fp32."""
    n = torch.cuda.device_count()
    known = ["cpu"] + [f"cuda:{i}" for i in range(n)]
    if torch.backends.mps.is_available():
        known.append("mps")
    if device == "auto":
        device = "cuda" if n else "cpu"
    # "cuda" is cuda:0
    if ("cuda:0" if device == "cuda" else device) not in known:
        raise door.ModelError(f"--device {device} is not a device of this machine; use one of auto, "
                         f"{', '.join(known)}")
    bf16 = dtype == "bfloat16" or (dtype == "auto" and device.startswith("cuda"))
    if not bf16:
        return device, nullcontext()
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return device, torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


def sync(device):
    """Wait for the device's queued work (for timing): a no-op on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    # (torch.accelerator would need torch 2.6)
    elif torch.device(device).type == "mps":
        torch.mps.synchronize()


def timed(device, fn, *args) -> float:
    """Seconds that fn(*args) takes, the device's queued work done before and after."""
    sync(device)
    t0 = time.perf_counter()
    fn(*args)
    sync(device)
    return time.perf_counter() - t0


def launch():
    """(RANK, WORLD_SIZE) of torchrun, (0, 1) under python; a ModelError for values it never sets."""
    rank = os.environ.get("RANK", "0")
    world = os.environ.get("WORLD_SIZE", "1")
    numbers = rank.isdecimal() and world.isdecimal() and int(rank) < int(world)
    rendezvous = {"RANK", "MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys()
    if not numbers or int(world) > 1 and not rendezvous:
        was = ", ".join(f"{k}={os.environ.get(k, 'unset')}" for k in ("RANK", "WORLD_SIZE"))
        raise door.ModelError(f"{was} are not a process of a torchrun launch (0 <= RANK < WORLD_SIZE, "
                         "with MASTER_ADDR and MASTER_PORT); start it with torchrun, or unset them")
    return int(rank), int(world)


def init_distributed(device):
    """Under torchrun, join the group (NCCL on cuda:LOCAL_RANK, else gloo), mute ranks > 0 -> device."""
    if launch()[1] == 1:
        return device
    cuda = device.startswith("cuda")
    if cuda:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        device_id = torch.device(device) if cuda else None
        dist.init_process_group(backend, timeout=timedelta(hours=6), device_id=device_id)
    if dist.get_rank() > 0:
        sys.stdout = open(os.devnull, "w")
    return device


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    """Rank 0: the process that prints and writes files."""
    return get_rank() == 0


def shard(items):
    """This process's share of a list: items rank, rank + N, ... of N processes."""
    return items[get_rank()::get_world_size()]


def all_gather(obj) -> list:
    """Every process's (picklable) obj, in rank order: [obj] in one process."""
    out = [obj] * get_world_size()
    if dist.is_initialized():
        dist.all_gather_object(out, obj)
    return out


def broadcast(obj, tensors=()):
    """Rank 0's (picklable) obj on every process; rank 0's `tensors` copied into each's, in place."""
    if dist.is_initialized():
        for t in tensors:
            dist.broadcast(t, src=0)
    return all_gather(obj)[0]


def from_main(fn):
    """fn() run by rank 0 alone, its (picklable) result on every process."""
    return broadcast(fn() if is_main() else None)


def all_mean(tensors):
    """Each tensor replaced in place by its mean over the processes: one all-reduce, one dtype."""
    if not dist.is_initialized() or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    means = (flat / get_world_size()).split([t.numel() for t in tensors])
    for t, mean in zip(tensors, means):
        t.copy_(mean.view_as(t))


def mean_grads(optim):
    """Each gradient of optim's parameters replaced by its mean over the processes."""
    all_mean([p.grad for g in optim.param_groups for p in g["params"] if p.grad is not None])


def barrier():
    if dist.is_initialized():
        dist.barrier()
