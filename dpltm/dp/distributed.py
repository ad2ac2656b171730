"""DP-SGD over several processes (Lightning DDP): the same mechanism as on one device.

Per step, with R ranks (docs/privacy.md §7, "Multi-device DP-SGD"):

* **Sampling.** Rank r Poisson-samples its shard {i : i ≡ r (mod R)} at rate q with its own
  generator. Every record lies in exactly one shard, so it joins the step's batch (the union of
  the ranks' batches) independently with probability q: the Poisson sample one device draws.
* **Clipping.** Each rank clips its records and sums them; the sums are all-reduced, giving the
  clipped sum over the union (a sum is a sum: no record is counted twice or dropped).
* **Noise, once.** Rank 0 alone adds one draw of N(0, σ²C²) to its clipped sum, before the
  all-reduce; the other ranks add none. The all-reduced sum, which every rank receives bit for
  bit, thus carries exactly one draw with the variance the accountant assumes, and every replica
  applies the same ĝ. (Drawing the same noise on every rank after the reduce would need
  generators that agree bit for bit across devices, which CUDA's do not promise across GPU
  models; independent N(0, σ²C²/R) per rank has the right variance but is exact only while no
  rank sees another's draw; full-scale noise on every rank is safe but R times too noisy.) Each
  epoch ends with a check that the replicas still agree.
* **Accounting.** The event is SelfComposed(PoissonSampled(q, Gaussian(σ)), T), unchanged: the
  ε of a run is the same on one device or many.

Only DP training runs over several devices (`dpltm train --devices N`); generation and the
non-private baseline run on one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from dpltm.errors import DpltmUserError
from dpltm.launch_env import env_rank

STRATEGIES = ("auto", "ddp")
"""`ddp` runs one process per device, launched by Lightning (`python -m dpltm.cli` re-run per
rank) or by torchrun/SLURM. Spawn-style strategies are refused: their workers' results (the
per-epoch history, the EMA) would not come back to the process that writes the checkpoint."""


@dataclass(frozen=True)
class Distribution:
    """How many processes train: `devices` per node times `num_nodes`."""

    devices: int = 1
    num_nodes: int = 1
    strategy: str = "auto"

    def __post_init__(self) -> None:
        if self.devices < 1 or self.num_nodes < 1:
            raise DpltmUserError(f"--devices and --num-nodes must be ≥ 1, got {self.devices} and {self.num_nodes}")
        if self.strategy not in STRATEGIES:
            raise DpltmUserError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def multi_process(self) -> bool:
        return self.world_size > 1


def _slurm_tasks() -> bool:
    """Whether SLURM launched this process as one of several tasks (Lightning's own test)."""
    return "SLURM_NTASKS" in os.environ and env_rank("SLURM_NTASKS") > 1 and "SLURM_PROCID" in os.environ


def is_main_process() -> bool:
    """Whether this process is rank 0 (it alone writes files and prints), as its launcher states it,
    before any process group exists.

    torchrun sets RANK; SLURM's srun SLURM_PROCID; Lightning's own launcher re-runs the command
    with LOCAL_RANK (and NODE_RANK on other nodes) set. The first process of a Lightning launch has
    none of them: rank 0.
    """
    if "RANK" in os.environ:
        return env_rank("RANK") == 0
    if _slurm_tasks():
        return env_rank("SLURM_PROCID") == 0
    return env_rank("LOCAL_RANK") == 0 and env_rank("NODE_RANK") == 0


def check_launch(distribution: Distribution) -> None:
    """Before any work: the environment must agree with --devices/--num-nodes. A rank variable
    left set on a one-process run would make it a silent non-zero rank (nothing written, nothing
    said); several nodes without a launcher would wait for the others forever."""
    if not distribution.multi_process and not is_main_process():
        names = [n for n in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID") if os.environ.get(n, "0") != "0"]
        shown = ", ".join(f"${n}={os.environ[n]}" for n in names) or "the environment"
        raise DpltmUserError(f"{shown} says this is not the first process of a multi-process run, but this "
                             "run has one process (--devices 1 --num-nodes 1): unset it, or pass --devices")
    if distribution.multi_process:
        check_master_port(os.environ.get("MASTER_PORT"))
        check_master_address(os.environ.get("MASTER_ADDR"))
    if distribution.num_nodes > 1 and "MASTER_ADDR" not in os.environ and not _slurm_tasks():
        raise DpltmUserError(f"--num-nodes {distribution.num_nodes}: start one process per node with a launcher "
                             "(torchrun, srun) that sets $MASTER_ADDR; run alone it would wait for the others forever")


def check_master_port(value: str | None) -> None:
    """$MASTER_PORT, where set, must be a TCP port: torch.distributed would fail on it in every process with a
    traceback, after the data was loaded."""
    if value is None:
        return
    text = value.strip()
    if not (text.isascii() and text.isdigit() and 0 < int(text) <= 65535):
        raise DpltmUserError(f"$MASTER_PORT={value!r} is not a TCP port (1-65535): set a free port, or unset it "
                             "and Lightning picks one")


def check_master_address(value: str | None) -> None:
    """$MASTER_ADDR, where set, must name a host this machine can resolve: torch.distributed would retry an
    unresolvable one forever, once a second, with a run already locked and started."""
    if value is None:
        return
    import socket

    try:
        socket.getaddrinfo(value.strip(), None)
    except (socket.gaierror, UnicodeError, ValueError) as exc:
        raise DpltmUserError(f"$MASTER_ADDR={value!r} does not resolve ({exc}): set the first node's address, or "
                             "unset it for a run on this machine") from None


def local_rank() -> int:
    """This process's rank on its node (its GPU's index)."""
    if "LOCAL_RANK" not in os.environ and _slurm_tasks():
        return env_rank("SLURM_LOCALID")
    return env_rank("LOCAL_RANK")


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity where the OS reports one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def local_device(device: torch.device, distribution: Distribution) -> torch.device:
    """Each rank trains on its own GPU (cuda:LOCAL_RANK); CPU ranks share the CPU.

    Checked before Lightning starts a process per device: more processes than this node has GPUs,
    or (gloo on the CPU) than it has cores, is refused in one line rather than started."""
    if not distribution.multi_process:
        return device
    if device.type == "cpu" and distribution.devices > available_cores():
        raise DpltmUserError(f"--devices {distribution.devices} on the CPU starts one gloo process per device; "
                             f"this machine has {available_cores()} core(s): use at most that many")
    if device.type != "cuda":
        return device
    if distribution.devices > torch.cuda.device_count():
        raise DpltmUserError(f"--devices {distribution.devices}: this node has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    local = local_rank()
    if local >= torch.cuda.device_count():
        raise DpltmUserError(f"--devices {distribution.devices}: this node has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", local)


def rank_sampling_seed(seed: int, rank: int) -> int:
    """The Poisson-sampling seed of `rank` (rank 0: seed + 1, what one device has always used);
    distinct seeds give the ranks distinct generator streams."""
    return (seed + 1 + rank * 0x9E3779B97F4A7C15) % 2**63


def shard(n: int, rank: int, world_size: int, device: torch.device | str = "cpu") -> Tensor | None:
    """The records rank `rank` samples from: {i : i ≡ rank (mod world_size)} (None: all)."""
    if world_size == 1:
        return None
    return torch.arange(rank, n, world_size, device=device)


def all_reduce_sum(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Sum every rank's tensors (in one flat all-reduce); a no-op without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensors
    names = list(tensors)
    flat = torch.cat([tensors[name].reshape(-1) for name in names])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    out: dict[str, Tensor] = {}
    offset = 0
    for name in names:
        size = tensors[name].numel()
        out[name] = flat[offset : offset + size].view_as(tensors[name])
        offset += size
    return out
