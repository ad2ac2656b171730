"""`dpltm audit`'s stage: `dpltm train`'s stage with an audit plan's canaries (dpltm.audit.run)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from dpltm import options as opt
from dpltm.artefacts.trained_model import TrainingReport
from dpltm.choices import Recipe, ThreatModel
from dpltm.errors import DpltmUserError
from dpltm.options import option
from dpltm.stages.train import TrainingRequest, stage_train

if TYPE_CHECKING:
    from dpltm.audit.run import AuditPlan
    from dpltm.options import Overrides


def stage_audit(cli: Overrides, config: Path | None, ticket: Path | None, data_dir: Path | None, device: str,
                plan: AuditPlan, progress: bool, noise_seed: int | None = None,
                public_data: str | None = None) -> TrainingReport:
    """`dpltm train`'s stage with canaries: the same settings, ticket, data and checks; the model
    (trained on canaries) goes to a temporary file and is not kept."""
    with tempfile.TemporaryDirectory(prefix="dpltm-audit-") as scratch:
        report = stage_train(cli, config, ticket, False, False, data_dir, device, Path(scratch) / "audited.pt",
                             progress, public_data=public_data, noise_seed=noise_seed, audit=plan)
    return replace(report, audit={**report.audit, "unaccounted": unaccounted_note(report.dataset)})


def unaccounted_note(dataset: str) -> str:
    """What an audit publishes that no ledger counts: it trains on the private records with DP, and its lower
    bound and test accuracy are outputs of that run (post-processing of it, so bounded by its ε), but the
    model is not kept and no checkpoint records the spend: a second audit, or a `train`, spends again."""
    return (f"not in any ledger: this audit trained with DP on the training records of {dataset}; its lower bound "
            "and test accuracy are outputs of that run (covered by its claimed ε), which no checkpoint records: "
            "count it in your own budget, or audit on public data")


@dataclass(frozen=True)
class AuditRequest(TrainingRequest):
    """`dpltm audit`: `dpltm train`'s run with canaries, and the lower bound on ε they give."""

    ticket: Path | None = option(help='Winning ticket from `dpltm select` (as for `dpltm train`).')
    dense: bool = option("--dense", default=False, help='Audit DP-SGD on the full network (no ticket).')
    dataset: str | None = opt.PRIVATE_DATASET()
    split: str | None = opt.SPLIT()
    eps: float | None = option("--eps", "--eps2", config="train.eps2",
        help='Training budget ε; σ is calibrated to it (the claim the audit tests).')
    sigma: float | None = opt.SIGMA()
    delta: float | None = opt.DELTA()
    epochs: int | None = opt.EPOCHS()
    batch_size: int | None = opt.BATCH_SIZE()
    clip: float | None = opt.CLIP()
    lr: float | None = opt.LEARNING_RATE()
    recipe: str = option(choices=Recipe, default='paper', help='Training recipe, as for `dpltm train`.')
    optimizer: str | None = opt.OPTIMIZER()
    momentum: float | None = opt.MOMENTUM()
    noise_filter: str | None = opt.NOISE_FILTER()
    activation: str | None = opt.ACTIVATION()
    arch: str | None = opt.ARCH()
    noise: str | None = opt.NOISE()
    accountant: str | None = opt.ACCOUNTANT()
    canaries: int = option(default=1000, help='Number m of canaries, each included with probability 1/2.')
    threat_model: str = option(choices=ThreatModel, default='white-box',
        help=('white-box: Dirac gradient canaries on surviving weights, observed through the released noisy '
              'gradients (also reported: the final model only); black-box: out-of-distribution input records '
              "with random labels, scored by the released model's loss."))
    confidence: float = option(default=0.95, help='Confidence of the lower bound.')
    canary_seed: int | None = option(min=0, max=opt.MAX_SEED,
        help='Seed the canaries and their inclusion bits (reproducible audits). Default: fresh OS randomness.')
    seed: int | None = opt.SEED()
    noise_seed: int | None = opt.NOISE_SEED()
    device: str = opt.DEVICE("auto")
    config: Path | None = opt.CONFIG_FILE()
    data_dir: Path | None = opt.DATA_DIR()
    progress: bool = opt.PROGRESS(True)
    json_out: bool = opt.JSON(False)

    def run(self) -> TrainingReport:
        """The training report with its `audit` part (dpltm.audit.run)."""
        from dpltm.audit.run import AuditPlan

        if self.dense == (self.ticket is not None):
            raise DpltmUserError("give --ticket PATH (from `dpltm select`) or --dense"
                                 + (", not both" if self.dense else ""))
        self._check_network()
        self._check_budget()
        plan = AuditPlan(self.threat_model, self.canaries, self.confidence, self.canary_seed)
        return stage_audit(self.settings(), self.config, self.ticket, self.data_dir, self.device, plan, self.progress,
                           noise_seed=self.noise_seed)
