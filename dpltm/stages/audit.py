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
    return report
