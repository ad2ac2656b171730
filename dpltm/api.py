"""dpltm as a library: tickets, selection, DP training and accounting for your own model and data.

The CLI's mechanism, for any model built from `nn.Linear` and `nn.Conv2d` layers (plus
parameter-free modules): Poisson sampling (dpltm.dp.sampling), per-sample clipping over the
surviving weights (dpltm.dp.per_sample), Gaussian noise on the surviving coordinates only
(dpltm.dp.noise), σ calibrated by dp-accounting and every ε stated by the ledger
(dpltm.privacy.ledger). Pruned weights are zero at the start and stay exactly zero: their clipped
sum and noise are zero, and the mask is applied again after every optimiser step.

    import dpltm
    tickets = dpltm.generate_tickets(model, public_train, val=public_val, rounds=5)
    ticket = dpltm.select_ticket(tickets)                 # public tickets: no ε spent
    private = dpltm.make_private(model, optimizer, (x, y), target_epsilon=1.0, epochs=10,
                                 batch_size=256, masks=ticket.masks, masks_from="public data")
    private.fit()
    print(private.epsilon, private.evaluate((x_test, y_test)))
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpltm.config import TrainSettings
from dpltm.dp.distributed import rank_sampling_seed
from dpltm.dp.noise import GaussianNoise
from dpltm.dp.per_sample import Loss, clipped_gradient_sum_of, per_sample_cross_entropy, trainable_layers
from dpltm.dp.sampling import PoissonBatches
from dpltm.errors import DpltmUserError
from dpltm.privacy.accounting import epsilon as accountant_epsilon
from dpltm.privacy.events import dpsgd_event
from dpltm.privacy.exponential import sample_exponential, score_sensitivity, ticket_scores
from dpltm.privacy.ledger import PrivacyLedger, training_record
from dpltm.private_training import TrainPlan, plan_training
from dpltm.pruning import prune_layerwise

Data = tuple[Tensor, Tensor] | torch.utils.data.Dataset  # type: ignore[type-arg]
Masks = dict[str, Tensor]


def as_tensors(data: Data, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """(features, labels) on `device`: tensors as given, or a map-style Dataset read once into tensors
    (every item stacked: later batches are index_select on the device, never per-sample decoding)."""
    if isinstance(data, tuple):
        if len(data) != 2:
            raise DpltmUserError("data must be (features, labels) or a torch Dataset")
        features, labels = (torch.as_tensor(t) for t in data)
    else:
        try:
            items = [data[i] for i in range(len(data))]  # type: ignore[arg-type]
        except TypeError:
            raise DpltmUserError("data must be (features, labels) or a map-style torch Dataset with len()") from None
        if not items:
            raise DpltmUserError("the dataset is empty")
        features = torch.stack([torch.as_tensor(item[0]) for item in items])
        labels = torch.stack([torch.as_tensor(item[1]) for item in items])
    if features.shape[0] != labels.shape[0]:
        raise DpltmUserError(f"{features.shape[0]} feature rows but {labels.shape[0]} labels")
    if not features.is_floating_point():
        features = features.float()
    target = torch.device(device) if device is not None else features.device
    if not labels.is_floating_point():  # class indices; float targets (regression, soft labels) stay as they are
        labels = labels.long()
    return features.to(target), labels.to(target)


def prunable_weights(model: nn.Module) -> dict[str, Tensor]:
    """The weights a ticket masks: those of every trainable nn.Linear and nn.Conv2d (biases never)."""
    return {(f"{name}." if name else "") + "weight": module.weight  # type: ignore[misc]
            for name, module in trainable_layers(model) if module.weight.requires_grad}


def check_user_masks(model: nn.Module, masks: Mapping[str, Tensor]) -> Masks:
    """Masks keyed by weight names, 0/1, of the weights' shapes, on their devices."""
    weights = prunable_weights(model)
    unknown = sorted(set(masks) - set(weights))
    if unknown:
        raise DpltmUserError(f"masks name weights the model has not (or cannot mask): {unknown}; "
                             f"maskable: {sorted(weights)}")
    out: Masks = {}
    for name, mask in masks.items():
        mask = torch.as_tensor(mask)
        if tuple(mask.shape) != tuple(weights[name].shape):
            raise DpltmUserError(f"mask {name} has shape {tuple(mask.shape)}, the weight {tuple(weights[name].shape)}")
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise DpltmUserError(f"mask {name} must hold only 0 and 1")
        out[name] = mask.to(device=weights[name].device, dtype=torch.bool)
    return out


def surviving_coordinates(model: nn.Module, masks: Mapping[str, Tensor]) -> dict[str, Tensor | None]:
    """Per parameter, the flat indices the noise goes on (None: every coordinate survives)."""
    surviving: dict[str, Tensor | None] = {name: None for name, _ in model.named_parameters()}
    for name, mask in masks.items():
        surviving[name] = None if bool(mask.all()) else mask.flatten().nonzero().squeeze(1)
    return surviving


def user_run_ledger(plan: TrainPlan, steps: int, clip: float, dataset_size: int, delta: float, accountant: str,
                    masks: Mapping[str, Tensor], masks_from: str | None, masks_private: bool,
                    selection_eps1: float | None, dataset_name: str) -> PrivacyLedger:
    """What a `make_private` / `DPCallback` run spent: its DP-SGD steps, any ε1 of the selection, and the
    masks' provenance (none; public; or these private records: then not DP end to end)."""
    phase1 = "none" if not masks else "same-data" if masks_private else "public"
    return PrivacyLedger(
        phase1=phase1, phase1_dataset=masks_from if masks else None, private_dataset=dataset_name,
        selection_eps1=selection_eps1,
        training=training_record(plan.sample_rate, plan.noise_multiplier, steps, clip, plan.expected_batch_size,
                                 dataset_size),
        delta=delta, accountant=accountant)


@torch.no_grad()
def apply_masks(model: nn.Module, masks: Mapping[str, Tensor]) -> None:
    """Zero the pruned weights in place."""
    parameters = dict(model.named_parameters())
    for name, mask in masks.items():
        parameters[name].mul_(mask.to(parameters[name].dtype))


def density_of(model: nn.Module, masks: Mapping[str, Tensor]) -> float:
    """Fraction of the maskable weights a ticket keeps."""
    weights = prunable_weights(model)
    kept = sum(int(masks[n].sum()) if n in masks else w.numel() for n, w in weights.items())
    return kept / sum(w.numel() for w in weights.values())


@torch.no_grad()
def evaluate(model: nn.Module, data: Data, batch_size: int = 4096) -> float:
    """Top-1 accuracy (no privacy: for held-out or public data)."""
    device = next(model.parameters()).device
    features, labels = as_tensors(data, device)
    was_training = model.training
    model.eval()
    correct = sum(int((model(features[i : i + batch_size]).argmax(1) == labels[i : i + batch_size]).sum())
                  for i in range(0, len(labels), batch_size))
    model.train(was_training)
    return correct / max(len(labels), 1)


@dataclass
class Ticket:
    """One round of iterative magnitude pruning: the mask, θ0 it rewinds to, C and A."""

    round: int
    masks: Masks
    density: float
    accuracy: float | None
    theta0: dict[str, Tensor] = field(repr=False)


def generate_tickets(model: nn.Module, train: Data, *, val: Data | None = None, rounds: int = 5,
                     iterations: int = 1000, batch_size: int = 128, lr: float = 0.1,
                     prune_rate: float = 0.3, output_prune_rate: float = 0.2, seed: int = 0,
                     loss: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy) -> list[Ticket]:
    """Iterative magnitude pruning of a user's model (Frankle & Carbin 2019; DPLTM Alg. 1), NOT private:
    train `iterations` SGD steps, prune the smallest surviving weights of each layer (`prune_rate`,
    `output_prune_rate` for the last), rewind to θ0, repeat. Make tickets on public data; the model
    is left at θ0 with no mask."""
    device = next(model.parameters()).device
    features, labels = as_tensors(train, device)
    names = list(prunable_weights(model))
    theta0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    masks: Masks = {n: torch.ones_like(w, dtype=torch.bool) for n, w in prunable_weights(model).items()}
    rates = {n: (output_prune_rate if i == len(names) - 1 else prune_rate) for i, n in enumerate(names)}
    generator = torch.Generator(device="cpu").manual_seed(seed)
    tickets = []
    for k in range(rounds + 1):
        model.load_state_dict(theta0)
        apply_masks(model, masks)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        for _ in range(iterations):
            index = torch.randint(0, len(labels), (min(batch_size, len(labels)),), generator=generator).to(device)
            optimizer.zero_grad(set_to_none=True)
            loss(model(features[index]), labels[index]).backward()
            optimizer.step()
            apply_masks(model, masks)
        accuracy = evaluate(model, val) if val is not None else None
        tickets.append(Ticket(k, {n: m.clone() for n, m in masks.items()}, density_of(model, masks), accuracy,
                              {n: v.clone() for n, v in theta0.items()}))
        if k < rounds:
            masks = prune_layerwise(prunable_weights(model), masks, rates)
    model.load_state_dict(theta0)
    return tickets


def select_ticket(tickets: list[Ticket], *, eps1: float | None = None, nu: float = 50.0,
                  accuracy_sensitivity: float = 1.0, seed: int | None = None) -> Ticket:
    """The ticket with the best score S = A·(1 − ν·C) (`eps1=None`: tickets made on public data, no ε
    spent), or one drawn by the exponential mechanism with ε1 (McSherry & Talwar 2007; sensitivity
    `score_sensitivity`, PRIVACY.md §2) when the accuracies come from private data."""
    if any(t.accuracy is None for t in tickets):
        raise DpltmUserError("every ticket needs an accuracy: generate them with val=…")
    scores = ticket_scores([t.accuracy for t in tickets], [t.density for t in tickets], nu)  # type: ignore[misc]
    if eps1 is None:
        return tickets[int(scores.argmax())]
    sensitivity = score_sensitivity([t.density for t in tickets], nu, accuracy_sensitivity)
    import numpy as np

    rng = None if seed is None else np.random.default_rng(seed)
    return tickets[sample_exponential(scores, eps1, sensitivity, rng)]


def account(*, sample_rate: float, noise_multiplier: float, steps: int, delta: float = 1e-5,
            accountant: str = "pld") -> float:
    """ε of `steps` Poisson-subsampled Gaussian steps (dp-accounting's PLD or RDP accountant)."""
    return accountant_epsilon(dpsgd_event(sample_rate, noise_multiplier, steps), delta, accountant)


class PrivateTraining:
    """A user's model under dpltm's masked DP-SGD. Build it with `make_private`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, features: Tensor, labels: Tensor,
                 plan: TrainPlan, settings: TrainSettings, masks: Masks, masks_from: str | None, loss: Loss,
                 seed: int, dataset_name: str, masks_private: bool = False,
                 selection_eps1: float | None = None) -> None:
        self.model, self.optimizer, self.features, self.labels = model, optimizer, features, labels
        self.plan, self.settings, self.masks, self.masks_from, self.loss = plan, settings, masks, masks_from, loss
        self.dataset_name, self.masks_private, self.selection_eps1 = dataset_name, masks_private, selection_eps1
        self.noise = GaussianNoise(plan.noise_multiplier)
        self.surviving = surviving_coordinates(model, masks)  # noise only where a weight survives
        self.generator = torch.Generator(device=features.device).manual_seed(seed)
        # one sampling stream for the whole run: every epoch, however it is driven, draws fresh batches
        self.sampler = PoissonBatches(len(labels), plan.sample_rate, plan.steps_per_epoch,
                                      rank_sampling_seed(seed, 0), features.device)
        self.steps_done = 0
        self.epochs_done = 0
        self.history: list[dict[str, Any]] = []

    def batches(self) -> Iterator[tuple[Tensor, Tensor]]:
        """One epoch of fresh Poisson batches (each record in each batch with probability q = L/N): feed
        each to `step`. Every call continues the run's one sampling stream."""
        for index in self.sampler:
            yield self.features.index_select(0, index), self.labels.index_select(0, index)

    def step(self, x: Tensor, y: Tensor) -> None:
        """One DP-SGD step on a batch from `batches` (the accountant assumes exactly those Poisson
        batches): masked clipped sum + noise on the surviving coordinates, divided by the expected
        batch size L, then the optimiser."""
        if self.steps_done >= self.plan.steps:
            raise DpltmUserError(f"the planned {self.plan.steps} steps are done: the privacy budget is spent")
        batch = clipped_gradient_sum_of(self.model, x, y, self.settings.clip, self.masks, self.loss)
        noisy = self.noise.perturb(batch.grad_sums, self.surviving, self.settings.clip, self.generator)
        parameters = dict(self.model.named_parameters())
        for name, total in noisy.items():
            parameters[name].grad = total.mul_(1.0 / self.plan.expected_batch_size)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        apply_masks(self.model, self.masks)  # pruned weights stay exactly zero whatever the optimiser does
        self.steps_done += 1

    def fit(self, epochs: int | None = None, val: Data | None = None,
            on_epoch: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
        """Run the planned epochs (or `epochs` of them); returns one record per epoch with ε so far."""
        todo = self.plan.epochs - self.epochs_done if epochs is None else epochs
        for _ in range(todo):
            for x, y in self.batches():
                self.step(x, y)
            self.epochs_done += 1
            record = {"epoch": self.epochs_done, "steps": self.steps_done, "epsilon": self.epsilon}
            if val is not None:
                record["val_accuracy"] = evaluate(self.model, val)
            self.history.append(record)
            if on_epoch is not None:
                on_epoch(record)
        return self.history

    def evaluate(self, data: Data) -> float:
        return evaluate(self.model, data)

    def ledger(self) -> PrivacyLedger:
        """What ran on the private data so far (q, σ, steps, δ) and the mask's provenance."""
        return user_run_ledger(self.plan, self.steps_done, self.settings.clip, len(self.labels), self.settings.delta,
                               self.settings.accountant, self.masks if self.masks_from else {}, self.masks_from,
                               self.masks_private, self.selection_eps1, self.dataset_name)

    @property
    def epsilon(self) -> float:
        """The run's ε so far (0 before the first step), by the accountant the plan was calibrated with;
        ∞ when the masks came from these private records (`masks_private`): not DP end to end."""
        return 0.0 if self.steps_done == 0 else self.ledger().overall_epsilon

    @property
    def epsilon_dp_part(self) -> float:
        """ε of the DP phases alone (selection and training), even when the run is not DP end to end."""
        return 0.0 if self.steps_done == 0 else self.ledger().best_bound().epsilon

    def report(self) -> dict[str, Any]:
        """The ledger's JSON report (ε, δ, accountant, what ran) and its plain-English statement."""
        ledger = self.ledger()
        return {**ledger.report(), "statement": ledger.statement()}


def make_private(model: nn.Module, optimizer: torch.optim.Optimizer, train: Data, *,
                 target_epsilon: float | None = None, noise_multiplier: float | None = None,
                 delta: float = 1e-5, epochs: int = 1, batch_size: int = 256, max_grad_norm: float = 1.0,
                 masks: Mapping[str, Tensor] | None = None, masks_from: str | None = None,
                 loss: Loss = per_sample_cross_entropy, accountant: str = "pld", noise_seed: int | None = None,
                 dataset_name: str = "user data", masks_private: bool = False,
                 selection_eps1: float | None = None) -> PrivateTraining:
    """Masked DP-SGD for a user's model, in the spirit of Opacus's `make_private_with_epsilon`.

    σ is calibrated so that `epochs` epochs of Poisson batches of expected size `batch_size` meet
    (`target_epsilon`, `delta`), or `noise_multiplier` is used and ε reported. `masks` (weight name
    → 0/1, e.g. `select_ticket(...).masks`) restrict clipping norms, sums and noise to the surviving
    weights; `masks_from` must then say where they came from. Masks made on other (public) data are
    covered; masks made on these private records are not DP (say so by not using them here).
    `loss(outputs, targets)` must return one loss per sample. The noise seed comes from the OS
    CSPRNG unless `noise_seed` is given (then DP holds only while it stays secret).
    """
    if masks and not masks_from:
        raise DpltmUserError("say where the masks come from (masks_from='public data …'): tickets made on the "
                             "private records are not differentially private")
    if (target_epsilon is None) == (noise_multiplier is None):
        raise DpltmUserError("give target_epsilon (σ is calibrated) or noise_multiplier (ε is reported)")
    if not max_grad_norm > 0:
        raise DpltmUserError(f"max_grad_norm must be > 0, got {max_grad_norm}")
    parameters = list(model.parameters())
    if not parameters:
        raise DpltmUserError("the model has no parameters")
    device = parameters[0].device
    features, labels = as_tensors(train, device)
    trainable_layers(model)  # unsupported layers fail here, before any step
    checked = check_user_masks(model, masks or {})
    apply_masks(model, checked)
    settings = TrainSettings(epochs=epochs, batch_size=batch_size, clip=max_grad_norm, eps2=target_epsilon,
                             sigma=noise_multiplier, delta=delta, accountant=accountant)
    plan = plan_training(settings, len(labels))
    if not math.isfinite(plan.noise_multiplier):
        raise DpltmUserError("no finite noise multiplier meets this budget")
    seed = secrets.randbits(63) if noise_seed is None else int(noise_seed)
    return PrivateTraining(model, optimizer, features, labels, plan, settings, checked,
                           masks_from if checked else None, loss, seed, dataset_name,
                           masks_private=masks_private and bool(checked), selection_eps1=selection_eps1)


def load_model(path: str | Path) -> nn.Module:
    """The released model of a `dpltm train` checkpoint (masks included), ready for inference."""
    from dpltm.checkpoint import load_checkpoint
    from dpltm.model import Architecture, MaskedMLP

    body = load_checkpoint(Path(path), "model")
    model = MaskedMLP(Architecture.from_dict(body["architecture"]))
    model.load_state_dict(body["state_dict"])
    return model.eval()
