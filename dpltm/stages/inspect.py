"""`dpltm inspect`: what a dpltm file holds, as a JSON-able summary and as tables.

Ticket sets, winners and private tickets, models (a `TrainedModel`: its privacy statement computed from
the ledger it carries), library runs and safetensors exports. Files written before
dpltm.data.release's rule may carry a fingerprint of private data: `warn` is told so.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Show = Callable[[Any], None]
"""Prints the summary as tables on a rich console."""


def inspect_file(path: Path, warn: Callable[[str], None]) -> tuple[dict[str, Any], Show]:
    """(the summary `--json` prints, the function that prints it as tables)."""
    from dpltm.artefacts import TicketSet, TrainedModel, Winner
    from dpltm.checkpoint import load_artefact
    from dpltm.data.release import PRIVATE_FINGERPRINT_WARNING, carries_private_fingerprint
    from dpltm.export import (
        EXPORT_TEXT_KEYS,
        SUFFIX,
        USER_MODEL,
        check_digest,
        load_exported,
        private_fingerprints,
        read_metadata,
    )
    from dpltm.ticket_views import (
        print_export,
        print_model,
        print_run,
        print_tickets,
        print_winner,
        run_summary,
        tickets_json,
    )

    def warn_if(found: list[str]) -> None:  # files written before dpltm.data.release's rule
        if found:
            warn(f"warning: {path} {PRIVATE_FINGERPRINT_WARNING} ({', '.join(found)}); `dpltm export` drops it")

    if path.suffix == SUFFIX:
        metadata = read_metadata(path)
        if json.loads(metadata["architecture"]).get("kind") != USER_MODEL:
            load_exported(path, metadata)  # its tensors checked as `predict` checks them: refused alike
        else:
            check_digest(path)  # a library run's export: its tensors are the user's network's, not rebuilt here
        exported = {"kind": "export", **{k: (v if k in EXPORT_TEXT_KEYS else json.loads(v))
                                         for k, v in metadata.items()}}
        warn_if(["data"] if carries_private_fingerprint(exported.get("data")) else [])
        return exported, functools.partial(print_export, exported)
    artefact = load_artefact(path, ("tickets", "ticket", "model", "run"))
    if isinstance(artefact, TicketSet):
        return tickets_json(artefact, file_header=True), functools.partial(print_tickets, artefact)
    if isinstance(artefact, Winner):
        winner = artefact
        private_data = winner.is_private_ticket and carries_private_fingerprint(winner.source_data)
        warn_if(["source.data"] if private_data else [])
        summary = {"kind": "winner", "round": winner.round, "density": winner.density,
                   "layer_density": winner.layer_density, "val_accuracy": winner.val_accuracy,
                   "selection": winner.selection, "source": winner.source_data, "privacy": winner.privacy_view,
                   "architecture": winner.architecture, "dpltm_version": winner.dpltm_version,
                   "environment": winner.environment,
                   "public_weights": winner.public_weights is not None,  # can `train --rewind public` start here
                   "rewind_step": winner.rewind_step}  # --rewind K
        return summary, functools.partial(print_winner, winner)
    if not isinstance(artefact, TrainedModel):  # a library run's checked body
        summary = run_summary(artefact)
        return summary, functools.partial(print_run, summary)
    trained = artefact
    warn_if(private_fingerprints(trained))
    ledger = trained.privacy.ledger
    summary = {"kind": "model", "architecture": trained.architecture, "dataset": trained.dataset,
               "test_accuracy": trained.test_accuracy, "val_accuracy": trained.val_accuracy,
               "epochs_run": trained.epochs_run, "steps": trained.outcome.steps,
               "released_weights": trained.outcome.released_weights, "ticket": trained.ticket,
               "ledger": trained.privacy.ledger_report, "statement": ledger.statement(),
               "dpltm_version": trained.dpltm_version, "environment": trained.environment}
    return summary, functools.partial(print_model, trained)
