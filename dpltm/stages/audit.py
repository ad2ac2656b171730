"""`dpltm audit`'s stage: `dpltm train`'s stage with an audit plan's canaries (dpltm.audit.run)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from dpltm.audit.run import AuditPlan
from dpltm.stages.train import stage_train


def stage_audit(cli: dict[str, Any], config: Path | None, ticket: Path | None, data_dir: Path | None, device: str,
                plan: AuditPlan, progress: bool, noise_seed: int | None = None,
                public_data: str | None = None) -> dict[str, Any]:
    """`dpltm train`'s stage with canaries: the same settings, ticket, data and checks; the model
    (trained on canaries) goes to a temporary file and is not kept."""
    with tempfile.TemporaryDirectory(prefix="dpltm-audit-") as scratch:
        report = stage_train(cli, config, ticket, False, False, data_dir, device, Path(scratch) / "audited.pt",
                             progress, public_data=public_data, noise_seed=noise_seed, audit=plan)
    report["audit"]["unaccounted"] = unaccounted_note(report["dataset"])
    return report


def unaccounted_note(dataset: str) -> str:
    """What an audit publishes that no ledger counts: it trains on the private records with DP, and its lower
    bound and test accuracy are outputs of that run (post-processing of it, so bounded by its ε), but the
    model is not kept and no checkpoint records the spend: a second audit, or a `train`, spends again."""
    return (f"not in any ledger: this audit trained with DP on the training records of {dataset}; its lower bound "
            "and test accuracy are outputs of that run (covered by its claimed ε), which no checkpoint records: "
            "count it in your own budget, or audit on public data")
