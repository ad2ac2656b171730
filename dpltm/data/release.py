"""What a released file may say about the data it was trained on (docs/privacy.md §8).

Released artefacts (model checkpoints, safetensors exports, private tickets) carry only DP
outputs and public facts. The data fingerprint (SHA-256 over the raw files' md5) is a
deterministic function of the records: for a user's own files a neighbouring dataset gives
another fingerprint, a membership oracle outside the privacy ledger. It is a public fact only
when every raw file matched its official published md5 (`Portion.official`): it then says no
more than "the official MNIST, this split, this seed". So a released file records

- the dataset name, split, validation fraction and seed (settings the user chose);
- the record counts (N, treated as public under add/remove adjacency);
- the fingerprint only for official files; otherwise null, with `USER_DATA_NOTE`.

Matching a released file to data (a private ticket to the data `train --ticket` loads, `predict`'s
"same settings as training") compares those settings and counts, and the fingerprint only where
the file has one (official files, or files written before this rule). We chose this over a
fingerprint kept in a private side file: a side file is one more secret to keep beside a file
meant to be shared, and is lost when only the ticket is copied; and nothing in the guarantee
rests on the match. Composing a private ticket's warm-up events with training on records it did
not see only overstates ε (a record seen by one phase is counted as seen by both); the check is
there to catch a changed split, seed or hold-out, which the settings and counts do.

Ticket sets from `dpltm generate` keep the full fingerprint (`DatasetSplits.ticket_set_summary`):
generation sees its data without privacy anyway, and the public-ticket overlap check and resuming
need it.
"""

from __future__ import annotations

from typing import Any

from dpltm.data.types import OFFICIAL_NOTE, USER_DATA_NOTE, DatasetSplits

PRIVATE_FINGERPRINT_WARNING = ("carries a fingerprint of its training data (a function of the private records "
                               "unless they are the official files; written by an older dpltm): do not publish it")
SETTINGS = ("dataset", "split", "seed", "val_fraction", "n_train", "n_val", "n_test")
"""What a released record and loaded data must agree on (each where the record has it)."""


def scrub(record: dict[str, Any]) -> dict[str, Any]:
    """A data record (from any file, old ones included) as a released file may carry it: the
    fingerprint is kept only where the record says its files were the official ones."""
    official = record.get("official_files") is True
    return {**record, "fingerprint": record.get("fingerprint") if official else None,
            "fingerprint_note": OFFICIAL_NOTE if official else USER_DATA_NOTE}


def scrub_ticket(ticket: dict[str, Any] | None, ticket_data_public: bool) -> dict[str, Any] | None:
    """A model file's record of its ticket. The ticket's data fingerprints (its source, and the
    noise-aware choice's data) stay only when that data is public (tickets from other data): tickets
    made on the private data itself would carry the private records' fingerprint."""
    if ticket is None or ticket_data_public:
        return ticket
    scrubbed = dict(ticket)
    if isinstance(ticket.get("source"), dict):
        scrubbed["source"] = scrub(ticket["source"])
    selection = ticket.get("selection")
    if isinstance(selection, dict) and isinstance(selection.get("noise_aware"), dict):
        choice = selection["noise_aware"]
        if isinstance(choice.get("public_data"), dict):
            choice = {**choice, "public_data": scrub(choice["public_data"])}
        scrubbed["selection"] = {**selection, "noise_aware": choice}
    return scrubbed


def carries_private_fingerprint(record: Any) -> bool:
    """Whether a data record holds a fingerprint not marked official (files written before this
    rule did): `inspect` warns, `export` drops it."""
    if not isinstance(record, dict):
        return False
    return record.get("fingerprint") is not None and record.get("official_files") is not True


def mismatch(recorded: dict[str, Any], data: DatasetSplits) -> str | None:
    """Why `data` is not the data `recorded` (a released data record) describes, or None.

    Settings and counts are compared where the record has them; the fingerprint only where the
    record has one (see the module docstring for why this suffices)."""
    loaded = data.summary()
    for key in SETTINGS:
        if recorded.get(key) is not None and loaded[key] is not None and recorded[key] != loaded[key]:
            return f"{key} {recorded[key]} in the file, {loaded[key]} in the data"
    if recorded.get("fingerprint") is not None and recorded["fingerprint"] != data.fingerprint:
        return "data fingerprint differs"
    return None
