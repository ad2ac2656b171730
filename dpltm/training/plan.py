"""The DP training a run will do, fixed before any private record is read: q, steps and σ.

Kept apart from the Lightning training (dpltm.training.private) so that the checks and the noise-aware
choice that plan a run import neither Lightning nor what it imports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dpltm.dp.noise import noise_plugin
from dpltm.errors import DpltmUserError
from dpltm.privacy.calibration import calibrate_noise_multiplier
from dpltm.privacy.display import format_sigma
from dpltm.privacy.events import MAX_STEPS, DpEvent
from dpltm.settings import MAX_LR, TrainSettings

EpochRecord = dict[str, float]
"""One row of a run's history (JSON as it is), an epoch's or a private ticket's warm-up round's: the epoch (round)
and steps (whole numbers), the released model's accuracies and the ε spent so far, and a noise plug-in's own
figures; nothing measured on the private batches."""


@dataclass(frozen=True)
class TrainPlan:
    """The mechanism that will run, fixed before any private data is touched."""

    dataset_size: int
    expected_batch_size: int
    sample_rate: float
    steps_per_epoch: int
    epochs: int
    noise_multiplier: float
    """Effective Gaussian multiplier under add/remove (what the accountant sees)."""
    noise_parameter: float
    """The plug-in's own parameter (equal to the above for `gaussian`)."""
    calibrated: bool
    lr: float = 0.1
    """The learning rate the run uses: `settings.lr`, or `settings.lr_sigma / noise_multiplier`."""
    steps_before: int = 0
    """Steps of the run's `epochs` already taken in earlier segments (a library run resumed mid-epoch): this
    plan's noise covers only the rest, so a resume never trains more than the run's epochs."""

    @property
    def steps(self) -> int:
        """The steps this plan runs: what is left of `epochs` epochs of `steps_per_epoch`."""
        return self.steps_per_epoch * self.epochs - self.steps_before


def plan_training(settings: TrainSettings, dataset_size: int, spent: list[DpEvent] | None = None,
                  steps_before: int = 0, selection_eps1: float | None = None) -> TrainPlan:
    """q = L/N, ⌈N/L⌉ steps per epoch, and σ: given, or the smallest σ meeting eps2 at δ.

    Without `spent` or `selection_eps1`, σ is calibrated on the training mechanism alone (ε_train ≤ eps2; the
    CLI's ε2, which its report composes with the selection). With `spent` (the DP warm-up of a private ticket,
    on this same data) eps2 is the whole run's target: σ is calibrated so that `spent` composed with training meets
    it. Calibration never overshoots the target (dpltm.privacy.calibration). `steps_before`: steps of
    the run's epochs already taken (a resumed library run, whose earlier segments are in `spent`); the
    plan covers the rest. `selection_eps1` (a library run's ticket, chosen by the exponential mechanism on the
    private data) makes eps2 the whole run's target too: σ is calibrated so that the selection composed with
    `spent` and training meets it, by the bounds the ledger takes the best of (`calibrate_noise_multiplier`).
    """
    L_ = settings.batch_size
    if L_ >= dataset_size:
        raise DpltmUserError(f"--batch-size {L_} must be smaller than the training set ({dataset_size} records)")
    q = L_ / dataset_size
    steps_per_epoch = math.ceil(dataset_size / L_)
    steps = steps_per_epoch * settings.epochs - steps_before
    if not 0 <= steps_before < steps_per_epoch * settings.epochs:
        raise DpltmUserError(f"{steps_before} of the run's {steps_per_epoch * settings.epochs} steps are done: "
                             "nothing is left to plan")
    if steps > MAX_STEPS:
        raise DpltmUserError(f"--epochs {settings.epochs} at {steps_per_epoch} steps an epoch (batch {L_} of "
                             f"{dataset_size} records) is {steps} DP steps; dpltm accounts for at most "
                             f"{MAX_STEPS:.0e}: use fewer epochs or a larger --batch-size")
    mechanism = noise_plugin(settings.noise)
    if settings.sigma is not None:
        parameter, calibrated = settings.sigma, False
        effective = mechanism.effective_for(parameter)
    elif settings.eps2 is not None:
        effective = calibrate_noise_multiplier(q, steps, settings.eps2, settings.delta, settings.accountant,
                                               settings.neighboring, selection_eps1=selection_eps1, spent=spent or ())
        parameter, calibrated = mechanism.parameter_for(effective), True
    else:
        raise DpltmUserError("give --eps (σ is calibrated to it) or --sigma")
    return TrainPlan(dataset_size, L_, q, steps_per_epoch, settings.epochs, effective, parameter, calibrated,
                     learning_rate(settings, effective), steps_before)


def learning_rate(settings: TrainSettings, noise_multiplier: float | None) -> float:
    """`settings.lr`, or lr_sigma / σ for a DP run when `settings.lr_sigma` is set (σ depends on public
    parameters only, so this choice is too)."""
    if settings.lr_sigma is None or noise_multiplier is None:
        return settings.lr
    lr = settings.lr_sigma / noise_multiplier
    if not 0.0 < lr <= MAX_LR:
        raise DpltmUserError(f"--lr-sigma {settings.lr_sigma:g} / σ {format_sigma(noise_multiplier)} gives "
                             f"learning rate "
                             f"{lr:.4g}, outside (0, {MAX_LR:g}]")
    return lr
