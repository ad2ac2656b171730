"""`dpltm audit`'s plan: the canaries a DP training run adds, and the lower bound read afterwards.

The run (dpltm.stages.audit) goes through `dpltm.training.pipeline.train` (the same ticket or dense
network, noise plug-in,
Poisson sampling, clipping and accountant as `dpltm train`); the plan only adds the canaries and
reads the attack's scores at the end. The claimed ε is the accountant's ε for the training
mechanism that ran (its q counts the included canaries as records). A lower bound above it means
the code is not the mechanism the accountant analysed (or the claim is wrong); below it says
nothing more than "not refuted by this attack".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from dpltm.audit.bounds import bound_from_scores
from dpltm.audit.canaries import THREAT_MODELS, GradientCanaries, InputCanaries, describe
from dpltm.data.types import DatasetSplits, LabeledTensors
from dpltm.errors import DpltmUserError

MAX_CANARIES = 100_000
"""The most canaries an audit draws: each is a training record (an input canary holds a record's
features), so 1e12 would ask for terabytes; audits use hundreds to a few thousand."""

CLAIM_SCOPE = ("the training mechanism alone: the canaries take part in DP training only, so a DP warm-up "
               "(private tickets) or a selection composed into the run's ε is not what the audit tests")
"""What `epsilon_claimed` covers (the run's own ε, over its scope, is reported beside it)."""


@dataclass
class AuditPlan:
    """What to add to a training run, and how to judge it afterwards."""

    threat_model: str
    canaries: int
    confidence: float = 0.95
    seed: int | None = None
    """seeds the canaries and their inclusion bits (reproducible audits); default: fresh OS randomness"""
    gradient: GradientCanaries | None = None
    inputs: InputCanaries | None = None
    claimed: float | None = None

    def __post_init__(self) -> None:
        if self.threat_model not in THREAT_MODELS:
            raise DpltmUserError(f"--threat-model must be one of {', '.join(THREAT_MODELS)}, got {self.threat_model!r}")
        if not 2 <= self.canaries <= MAX_CANARIES:
            raise DpltmUserError(f"--canaries must lie in [2, {MAX_CANARIES}] (each canary is a record trained "
                                 f"on; Steinke et al. use up to a few thousand), got {self.canaries}")
        if not 0.5 <= self.confidence < 1:  # below 1/2 a "lower bound" is likelier wrong than right
            raise DpltmUserError(f"--confidence must lie in [0.5, 1), got {self.confidence}")

    @property
    def extra_records(self) -> int:
        """Records the sampler sees beyond data.train: all m gradient canaries' slots."""
        return 0 if self.gradient is None else self.gradient.extra_records

    @property
    def canaries_in_training(self) -> GradientCanaries | InputCanaries | None:
        return self.gradient if self.gradient is not None else self.inputs

    def state_claim(self, ledger: Any, settings: Any) -> None:
        """The accountant's ε for the training run about to start, under add/remove-one adjacency (what a
        canary's presence or absence is), computed before any step."""
        from dpltm.privacy.accounting import epsilon

        self.claimed = epsilon(ledger.training_event(), settings.delta, settings.accountant, "add_remove")

    def prepare(self, model: torch.nn.Module, data: DatasetSplits, clip: float,
                masks: dict[str, torch.Tensor] | None = None) -> DatasetSplits:
        """Draw the canaries; input canaries become the training set's last m rows (an excluded one's
        row is dropped whenever it is sampled: the universe is N + m records whatever the bits)."""
        if self.threat_model == "white-box":
            from dpltm.dp.step import step_layout
            from dpltm.masks import full_masks

            ticket = masks if masks is not None else full_masks(model)
            surviving = step_layout(model, ticket, data.train.features.dtype).surviving
            self.gradient = GradientCanaries.draw(model, surviving, self.canaries, clip, self.seed,
                                                  features=data.train.features)
            return data
        self.inputs = InputCanaries.draw(data.train.features, data.num_classes, self.canaries, self.seed)
        train = LabeledTensors(torch.cat([data.train.features, self.inputs.features]),
                               torch.cat([data.train.labels, self.inputs.labels]))
        return dataclasses.replace(data, train=train, fingerprint=f"{data.fingerprint}+audit-canaries",
                                   official_files=False)

    def conclude(self, released: torch.nn.Module, plan: Any, ledger: Any, settings: Any) -> dict[str, Any]:
        """The lower bound beside the claim; one bound per observation the threat model allows."""
        claimed = self.claimed
        assert claimed is not None, "state_claim runs before training"
        if self.gradient is not None:
            scores = self.gradient.scores(dict(released.named_parameters()), plan.sample_rate, plan.noise_multiplier)
            included = self.gradient.included
        else:
            assert self.inputs is not None
            scores = {"final_model": self.inputs.scores(released)}
            included = self.inputs.included
        bounds = {name: bound_from_scores(values, included, settings.delta, self.confidence)
                  for name, values in scores.items()}
        primary = "iterates" if "iterates" in bounds else "final_model"
        return {
            "epsilon_lower_bound": bounds[primary].epsilon_lower_bound,
            "epsilon_claimed": claimed,
            "canaries": self.canaries,
            "canaries_included": int(included.sum()),
            "confidence": self.confidence,
            "threat_model": self.threat_model,
            "observed": primary,
            "by_observation": {name: dataclasses.asdict(b) for name, b in bounds.items()},
            "refuted": bounds[primary].epsilon_lower_bound > claimed,
            "claim_scope": CLAIM_SCOPE,
            **describe(self.threat_model),
        }
