"""The library's ticket choice, by default the one `dpltm run` makes: the noise-aware choice.

The paper's score S = A·(1 − ν·C) ranks tickets by their accuracy *without* noise; at a small ε the sparsest
ticket it favours often trains worst under the noise (docs/experiments/noise-aware-choice.md). The noise-aware
choice trains every candidate (the dense network, round 0, included) under the planned run's noise on the public
data the tickets were made on, and takes the dense network unless a ticket beats it on the public validation
records by more than 2 standard errors (dpltm.selection.noise_aware.winning_index). It reads public data only, so
it spends no ε. `rule="best"` keeps the paper's score; `eps1=...` draws by the exponential mechanism over it, for
accuracies measured on private data.
"""

from __future__ import annotations

import copy
import math
import secrets
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from dpltm.api import Data, Ticket, make_private
from dpltm.api_checks import (
    check_budget,
    check_clip,
    check_count,
    check_data_fits_model,
    check_finite,
    check_positive,
    check_seed,
    delta_or_target_delta,
)
from dpltm.dp.engine import Loss, per_sample_cross_entropy
from dpltm.errors import DpltmUserError
from dpltm.privacy.exponential import sample_exponential, score_sensitivity, ticket_scores
from dpltm.selection.noise_aware import paired_gains, winning_index
from dpltm.user_inputs import model_tensors

RULES = ("noise-aware", "best", "exponential")


@dataclass(frozen=True)
class PlannedPrivateRun:
    """The DP training the chosen ticket will get, as `make_private` will run it: N private records, `epochs`
    of Poisson batches of expected size `batch_size`, σ given or calibrated to (`target_epsilon`, `delta`), the
    clipping bound, and the optimiser (`optimizer(parameters)`; default SGD at `lr`)."""

    private_size: int
    epochs: int
    batch_size: int
    target_epsilon: float | None = None
    noise_multiplier: float | None = None
    delta: float = 1e-5
    max_grad_norm: float = 1.0
    lr: float = 0.1
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None

    def __post_init__(self) -> None:
        check_count(self.private_size, "private_size", minimum=2)
        check_count(self.epochs, "epochs")
        check_count(self.batch_size, "batch_size")
        if self.batch_size >= self.private_size:
            raise DpltmUserError(f"batch_size ({self.batch_size}) must be smaller than private_size "
                                 f"({self.private_size})")
        check_budget(self.target_epsilon, self.noise_multiplier)
        object.__setattr__(self, "delta", delta_or_target_delta(self.delta))  # None: the default, as make_private
        check_clip(self.max_grad_norm)
        check_positive(self.lr, "lr")
        if self.optimizer is not None and not callable(self.optimizer):
            raise DpltmUserError("optimizer must be callable: optimizer(parameters) -> a torch.optim.Optimizer")

    @property
    def sigma(self) -> float:
        """σ of the planned run: given, or calibrated as make_private will calibrate it."""
        if self.noise_multiplier is not None:
            return float(self.noise_multiplier)
        from dpltm.settings import TrainSettings
        from dpltm.training.plan import plan_training

        settings = TrainSettings(epochs=self.epochs, batch_size=self.batch_size, clip=self.max_grad_norm,
                                 eps2=self.target_epsilon, delta=self.delta)
        return plan_training(settings, self.private_size).noise_multiplier

    def make_optimizer(self, parameters: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return self.optimizer(parameters) if self.optimizer is not None else torch.optim.SGD(parameters, lr=self.lr)


def select_ticket(tickets: list[Ticket], *, rule: str | None = None, model: nn.Module | None = None,
                  public: Data | None = None, val: Data | None = None, planned: PlannedPrivateRun | None = None,
                  loss: Loss = per_sample_cross_entropy, eps1: float | None = None, nu: float = 50.0,
                  accuracy_sensitivity: float = 1.0, seed: int | None = None) -> Ticket:
    """The ticket to train privately, among the tickets of one `generate_tickets` call.

    `rule` (default: "exponential" with `eps1`, else "noise-aware"):
    * "noise-aware": each ticket (round 0, the dense network, included) trained from its rewind weights on
      `public` as `make_private` will train it (the planned expected batch L, σ, clipping bound and number of
      steps: the same noise per step σC/L over as many steps), then scored on `val`; `model` is the network the
      tickets were made from. Public data only: no ε.
    * "best": the best paper score S = A·(1 − ν·C) (tickets made on public data: no ε).
    * "exponential": drawn by the exponential mechanism over S with ε1 = `eps1` (McSherry & Talwar 2007;
      sensitivity `score_sensitivity`, docs/privacy.md §2), when the accuracies come from private data.
    """
    _check_tickets(tickets)
    rule = ("exponential" if eps1 is not None else "noise-aware") if rule is None else rule
    if rule not in RULES:
        raise DpltmUserError(f"rule must be one of {', '.join(RULES)}, got {rule!r}")
    if (rule == "exponential") != (eps1 is not None):
        raise DpltmUserError("eps1 is the exponential mechanism's budget: give it with rule='exponential' only")
    seed = None if seed is None else check_seed(seed, "seed")
    if rule == "noise-aware":
        return tickets[_noise_aware_index(tickets, model, public, val, planned, loss, seed)]
    nu = check_positive(nu, "nu", inclusive=True)
    accuracy_sensitivity = check_positive(accuracy_sensitivity, "accuracy_sensitivity")
    if any(t.accuracy is None for t in tickets):
        raise DpltmUserError("every ticket needs an accuracy: generate them with val=…")
    scores = ticket_scores([t.accuracy for t in tickets], [t.density for t in tickets], nu)  # type: ignore[misc]
    if rule == "best":
        return tickets[int(scores.argmax())]
    eps1 = check_positive(eps1, "eps1")
    sensitivity = score_sensitivity([t.density for t in tickets], nu, accuracy_sensitivity)
    rng = None if seed is None else np.random.default_rng(seed)
    return tickets[sample_exponential(scores, eps1, sensitivity, rng)]


def _check_tickets(tickets: object) -> None:
    if not isinstance(tickets, (list, tuple)) or not tickets or not all(isinstance(t, Ticket) for t in tickets):
        raise DpltmUserError("tickets must be a non-empty list of the Tickets generate_tickets returns")
    shapes = [{n: tuple(m.shape) for n, m in t.masks.items()} for t in tickets]
    if any(s != shapes[0] for s in shapes):
        odd = next(i for i, s in enumerate(shapes) if s != shapes[0])
        raise DpltmUserError(f"tickets[{odd}] masks other weights than tickets[0] (names or shapes differ), so the "
                             "tickets come from different models: select among the tickets of one model")


def _noise_aware_index(tickets: list[Ticket], model: nn.Module | None, public: Data | None, val: Data | None,
                       planned: PlannedPrivateRun | None, loss: Loss, seed: int | None) -> int:
    """The index `winning_index` picks from each candidate's per-record correctness on `val`."""
    missing = [name for name, value in (("model", model), ("public", public), ("val", val), ("planned", planned))
               if value is None]
    if missing:
        raise DpltmUserError(f"the noise-aware choice (select_ticket's default, as `dpltm run`'s) trains each ticket "
                             f"under the planned noise: give {', '.join(f'{m}=' for m in missing)} (planned="
                             "dpltm.PlannedPrivateRun(...)); or rule='best' for the paper's score A·(1 − ν·C)")
    if not isinstance(planned, PlannedPrivateRun):
        raise DpltmUserError(f"planned must be a dpltm.PlannedPrivateRun, got {type(planned).__name__}")
    if not isinstance(model, nn.Module):
        raise DpltmUserError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if tickets[0].density != 1.0:
        raise DpltmUserError("the noise-aware choice measures each ticket against the dense network: pass every "
                             "ticket generate_tickets returned, round 0 (the dense network) first")
    device = next(model.parameters()).device
    features, labels = model_tensors(model, public, device)  # type: ignore[arg-type]
    val_features, val_labels = model_tensors(model, val, device)  # type: ignore[arg-type]
    if val_features.is_floating_point():  # as evaluate() reads them: in the model's precision
        val_features = val_features.to(next(model.parameters()).dtype)
    check_finite(val_features, "the validation features")  # checked as evaluate() checks them, before any training
    check_data_fits_model(model, val_features, val_labels, classification=True, what="the validation data")
    own = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    if {name: tuple(value.shape) for name, value in tickets[0].rewind_weights.items()} != own:
        raise DpltmUserError("the tickets' weights are not model's (names or shapes differ): pass the model "
                             "generate_tickets made them from")
    if planned.batch_size >= len(labels):
        raise DpltmUserError(f"the public data ({len(labels)} records) must hold more records than the planned batch "
                             f"({planned.batch_size}) to simulate its steps: give more public records, or choose "
                             "with rule='best'")
    base_seed = secrets.randbits(62) if seed is None else seed
    correct = torch.stack([_trained_correctness(model, ticket, (features, labels), (val_features, val_labels),
                                                planned, loss, base_seed + k)
                           for k, ticket in enumerate(tickets)])
    gains, se = paired_gains(correct)
    return winning_index(correct.double().mean(dim=1), gains, se)


def _trained_correctness(model: nn.Module, ticket: Ticket, public: tuple[Tensor, Tensor], val: tuple[Tensor, Tensor],
                         planned: PlannedPrivateRun, loss: Loss, seed: int) -> Tensor:
    """Per validation record, whether a copy of `model` at the ticket's rewind weights and mask, trained on the
    public records as the planned run will train (the same expected batch L, σ and clipping bound, so the same
    noise per step σC/L, over the same number of steps), classifies it right."""
    candidate = copy.deepcopy(model)
    candidate.load_state_dict(ticket.rewind_weights)
    dense = all(bool(m.all()) for m in ticket.masks.values())
    steps = planned.epochs * math.ceil(planned.private_size / planned.batch_size)
    per_public_epoch = math.ceil(len(public[1]) / planned.batch_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a simulation on public data: the run's notes are about no private data
        run = make_private(candidate, planned.make_optimizer(candidate.parameters()), public,
                           noise_multiplier=planned.sigma, batch_size=planned.batch_size,
                           epochs=math.ceil(steps / per_public_epoch), max_grad_norm=planned.max_grad_norm,
                           masks=None if dense else ticket.masks,
                           masks_from=None if dense else "public data (the noise-aware choice's simulation)",
                           noise_seed=seed, loss=loss, dataset_name="public data (a simulation)")
        for _ in range(steps):
            run.step()
    with torch.no_grad():
        candidate.eval()
        predicted = torch.cat([candidate(val[0][i:i + 4096]).argmax(dim=1) for i in range(0, len(val[1]), 4096)])
    return (predicted == val[1]).cpu()
