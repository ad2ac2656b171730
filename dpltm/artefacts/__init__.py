"""Typed artefacts of a run, one module each, every one a frozen dataclass whose `to_dict()` is its
checkpoint body and whose `from_dict(body, path)` checks that body and refuses a damaged file in one
line naming the file and the field:

- `TicketSet` ("tickets", dpltm.artefacts.ticket_set): the ticket set `dpltm generate` writes;
- `Winner` ("ticket", dpltm.artefacts.winner): the one ticket `select` or `generate --private` writes;
- `TrainedModel` ("model", dpltm.artefacts.trained_model): the network `dpltm train` writes, with one
  privacy record.

Privacy facts are stored once, as the DpEvents that ran plus their provenance; what reports and
statements say is computed from them. The checks they share and the format's version are in
dpltm.artefacts.format; the file layer (dpltm.checkpoint: `load_ticket_set`, `load_winner`,
`load_trained_model`) sits above these modules.
"""

from dpltm.artefacts.ticket_set import Phase1Record, RewindPoint, TicketRecord, TicketSet
from dpltm.artefacts.trained_model import MODEL_KEYS, PRIVACY_KEYS, Outcome, PrivacyRecord, TrainedModel
from dpltm.artefacts.winner import PrivateTicketRecord, Winner

__all__ = ["MODEL_KEYS", "PRIVACY_KEYS", "Outcome", "Phase1Record", "PrivacyRecord", "PrivateTicketRecord",
           "RewindPoint", "TicketRecord", "TicketSet", "TrainedModel", "Winner"]
