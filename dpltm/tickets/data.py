"""The data a ticket set was made on, loaded again as generation saw it (no Lightning: the noise-aware
choice and the checks of a ticket's origin use it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dpltm.data.types import DatasetSplits
from dpltm.errors import DpltmUserError


def reload_ticket_data(ticket: dict[str, Any], data_dir: Path | None,
                       device: str | torch.device = "cpu") -> DatasetSplits:
    """The tickets' own data, loaded again as generation saw it (same split, seed and hold-out), on `device`.
    `ticket` is a winner (its `source` names the ticket set's data) or a ticket set itself."""
    from dpltm.data import load_dataset

    origin = ticket.get("source", ticket)
    source, config = origin["data"], origin.get("config", {})
    settings = config.get("data", {}) if isinstance(config, dict) else {}
    data = load_dataset(source["dataset"], split=source["split"], data_dir=data_dir,
                        val_fraction=settings.get("val_fraction", 0.1), seed=config.get("seed", 0), device=device)
    if data.fingerprint != source.get("fingerprint"):
        raise DpltmUserError(f"--public-tickets cannot be checked: the tickets' data ({source['dataset']}, "
                             f"{source['split']} split) no longer matches its fingerprint in the ticket file")
    return data
