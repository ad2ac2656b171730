"""The data a ticket set was made on, loaded again as generation saw it (no Lightning: the noise-aware
choice and the checks of a ticket's origin use it)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dpltm.data.types import DatasetSplits
from dpltm.errors import DpltmUserError

if TYPE_CHECKING:
    from dpltm.artefacts import TicketSet, Winner


def reload_ticket_data(tickets: TicketSet | Winner, data_dir: Path | None,
                       device: str | torch.device = "cpu") -> DatasetSplits:
    """The tickets' own data, loaded again as generation saw it (same split, seed and hold-out), on `device`:
    that of a ticket set, or of the set a winner was selected from (its `source`)."""
    from dpltm.artefacts import TicketSet
    from dpltm.data import load_dataset

    if isinstance(tickets, TicketSet):
        source, config = tickets.data, tickets.config
    else:
        source, config = tickets.source_data, tickets.source.get("config", {})
    settings = config.get("data", {}) if isinstance(config, dict) else {}
    data = load_dataset(source["dataset"], split=source["split"], data_dir=data_dir,
                        val_fraction=settings.get("val_fraction", 0.1), seed=config.get("seed", 0), device=device)
    if data.fingerprint != source.get("fingerprint"):
        raise DpltmUserError(f"the tickets' data ({source['dataset']}, {source['split']} split) no longer matches "
                             "its fingerprint in the ticket file, so it cannot be checked for private records")
    return data


def data_to_check(ticket: Winner | None, private_dataset: str, assert_public: bool,
                  data_dir: Path | None) -> tuple[DatasetSplits | None, str | None]:
    """The tickets' own data, to check record by record that it holds no private training record
    (`dpltm.training.pipeline.ticket_origin`), and why it could not be had (None where it was).

    Reloaded for tickets asserted public (`--public-tickets`: a failure is refused) and for tickets
    made on another dataset (a failure becomes the guarantee's caveat: the tickets may travel without
    their data). Not for a private ticket (its warm-up is composed instead) nor same-data tickets (not
    DP end to end anyway)."""
    if ticket is None or ticket.is_private_ticket:
        return None, None
    same_name = ticket.dataset == private_dataset
    if same_name and not assert_public:
        return None, None
    try:
        return reload_ticket_data(ticket, data_dir), None
    except DpltmUserError as exc:
        if same_name:
            raise
        return None, str(exc)
