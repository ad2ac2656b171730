"""Device selection: one place that turns `--device` into a `torch.device`."""

from __future__ import annotations

import torch

from dpltm.errors import DpltmUserError


def resolve_device(name: str | None) -> torch.device:
    """`auto` picks CUDA when present; asking for an absent device is a user error."""
    name = (name or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DpltmUserError(f"unknown device '{name}' (use auto, cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DpltmUserError(f"device '{name}' requested but CUDA is not available here")
    # torch.device keeps the ordinal in 8 bits ("cuda:999" becomes cuda:-25): read it from the text
    ordinal = name.partition(":")[2]
    if device.type == "cuda" and ordinal and not (ordinal.isdigit() and int(ordinal) < torch.cuda.device_count()):
        raise DpltmUserError(f"device '{name}' requested but this machine has {torch.cuda.device_count()} CUDA "
                             f"device(s): cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if device.type not in ("cpu", "cuda", "mps"):
        raise DpltmUserError(f"unsupported device '{name}' (use auto, cpu, cuda or cuda:N)")
    return device


def require_cuda_for_graphs(device: torch.device) -> None:
    """`--cuda-graphs` captures CUDA graphs: refused, in one line, on any other device."""
    if device.type != "cuda":
        raise DpltmUserError("--cuda-graphs needs a CUDA device (--device cuda)")
