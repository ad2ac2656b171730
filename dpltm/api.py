"""dpltm as a library: tickets, selection, DP training and accounting for your own model and data.

The CLI's mechanism, for any model built from `nn.Linear` and `nn.Conv2d` layers (plus
parameter-free modules): Poisson sampling (dpltm.dp.sampling), per-sample clipping over the
surviving weights (dpltm.dp.engine), Gaussian noise on the surviving coordinates only
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

import copy
import hashlib
import itertools
import math
import secrets
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpltm.api_checks import (
    check_batch_size,
    check_budget,
    check_budget_left,
    check_callable,
    check_clip,
    check_count,
    check_data_fits_model,
    check_finite,
    check_flag,
    check_mask_values,
    check_model_and_optimizer,
    check_positive,
    check_seed,
    check_steps,
    check_token_ids,
    delta_or_target_delta,
    evaluation_mode,
    first_parameter,
    user_path,
)
from dpltm.data.splits import record_hashes
from dpltm.dp.distributed import rank_sampling_seed
from dpltm.dp.engine import (
    Loss,
    RecordTable,
    clipped_gradient_sum_of,
    per_sample_cross_entropy,
    prunable_weight_names,
    record_norm_tables,
    table_rows,
    trainable_layers,
)
from dpltm.dp.gaussian import GaussianNoise
from dpltm.dp.independence import (
    check_gradients_reach_their_layers,
    check_loss_per_sample,
    check_samples_independent,
    module_modes,
    probe_rows,
)
from dpltm.dp.sampling import poisson_sample
from dpltm.dp.step import noisy_mean
from dpltm.errors import DpltmUserError
from dpltm.privacy.accounting import check_accountant, check_neighboring
from dpltm.privacy.accounting import epsilon as accountant_epsilon
from dpltm.privacy.events import dpsgd_event
from dpltm.privacy.exponential import sample_exponential, score_sensitivity, ticket_scores
from dpltm.privacy.ledger import PrivacyLedger
from dpltm.privacy.segments import SpentSegments
from dpltm.private_records import DatasetRecords, Records, TensorRecords, training_records
from dpltm.pruning import paper_prune_rates, prune_layerwise, pruned_count
from dpltm.settings import MAX_LR, MAX_ROUNDS, TrainSettings
from dpltm.training.plan import TrainPlan, plan_training

Data = tuple[Tensor, Tensor] | torch.utils.data.Dataset  # type: ignore[type-arg]
Masks = dict[str, Tensor]


def as_tensors(data: Data, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """(features, labels) on `device`: tensors as given, or a map-style Dataset read once into tensors
    (every item stacked: later batches are index_select on the device, never per-sample decoding)."""
    if isinstance(data, list) and len(data) == 2 and all(isinstance(t, Tensor) for t in data):
        data = tuple(data)
    if isinstance(data, (str, bytes, Mapping)) or data is None:
        raise DpltmUserError(f"data must be (features, labels) or a map-style torch Dataset, got {type(data).__name__}")
    try:
        if isinstance(data, tuple):
            if len(data) != 2:
                raise DpltmUserError("data must be (features, labels) or a torch Dataset")
            features, labels = (torch.as_tensor(t) for t in data)
        else:
            items = [data[i] for i in range(len(data))]  # type: ignore[arg-type]
            if not items:
                raise DpltmUserError("the dataset is empty")
            odd = next((i for i, item in enumerate(items) if not isinstance(item, (tuple, list)) or len(item) != 2),
                       None)
            if odd is not None:  # a third field (a weight, an index) dropped, or a tensor's first two rows taken
                item = items[odd]
                got = f"{len(item)} field(s)" if isinstance(item, (tuple, list)) else f"a {type(item).__name__}"
                raise DpltmUserError(f"each record must be a (features, label) pair, but item {odd} is {got}")
            features = torch.stack([torch.as_tensor(item[0]) for item in items])
            labels = torch.stack([torch.as_tensor(item[1]) for item in items])
    except DpltmUserError:
        raise
    except (TypeError, KeyError, IndexError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
        raise DpltmUserError(f"data must be (features, labels) tensors or a map-style Dataset of (features, label) "
                             f"items ({first})") from None
    for name, values in (("features", features), ("labels", labels)):
        if values.layout != torch.strided:
            layout = str(values.layout).removeprefix("torch.")
            raise DpltmUserError(f"{name} must be a dense tensor, got layout {layout} (call .to_dense())")
        if values.is_meta:
            raise DpltmUserError(f"{name} are on the meta device (shapes without values): load the data itself")
    if features.dim() == 0 or labels.dim() == 0:
        raise DpltmUserError("features and labels need a first (record) dimension")
    if features.shape[0] != labels.shape[0]:
        raise DpltmUserError(f"{features.shape[0]} feature rows but {labels.shape[0]} labels")
    if features.dtype in (torch.uint8, torch.int8, torch.bool):  # pixels and flags; other integers: model_tensors
        features = features.float()
    target = torch.device(device) if device is not None else features.device
    if not labels.is_floating_point():  # class indices; float targets (regression, soft labels) stay as they are
        labels = labels.long()
    return features.to(target), labels.to(target)


def takes_ids(model: nn.Module) -> bool:
    """Whether integer features may be token ids for the model (it embeds): otherwise they are numbers."""
    return any(isinstance(module, (nn.Embedding, nn.EmbeddingBag)) for module in model.modules())


def model_tensors(model: nn.Module, data: Data, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """`as_tensors`, with integer features as floats unless the model embeds ids (int64 from NumPy or pandas is
    usually a measurement; a model with an nn.Embedding takes ids)."""
    features, labels = as_tensors(data, device)
    if features.is_complex():  # .float() would drop the imaginary part with only a warning
        raise DpltmUserError(f"features must be real numbers, got {str(features.dtype).removeprefix('torch.')}")
    if not features.is_floating_point() and not takes_ids(model):
        features = features.float()
    return features, labels


def prunable_weights(model: nn.Module) -> dict[str, Tensor]:
    """The weights a ticket masks: every trainable weight matrix or kernel (dpltm.dp.engine.prunable_weight_names;
    biases and normalisation scales never)."""
    parameters = dict(model.named_parameters())
    return {name: parameters[name] for name in prunable_weight_names(model)}


def check_user_masks(model: nn.Module, masks: Mapping[str, Tensor]) -> Masks:
    """Masks keyed by weight names, 0/1, of the weights' shapes, on their devices."""
    weights = prunable_weights(model)
    unknown = sorted(set(masks) - set(weights))
    if unknown:
        raise DpltmUserError(f"masks name weights the model has not (or cannot mask): {unknown}; "
                             f"maskable: {sorted(weights)}")
    out: Masks = {}
    for name, mask in masks.items():
        try:
            mask = torch.as_tensor(mask)
        except (TypeError, RuntimeError, ValueError):
            raise DpltmUserError(f"mask {name} must be a 0/1 tensor, got {type(mask).__name__}") from None
        if tuple(mask.shape) != tuple(weights[name].shape):
            raise DpltmUserError(f"mask {name} has shape {tuple(mask.shape)}, the weight {tuple(weights[name].shape)}")
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise DpltmUserError(f"mask {name} must hold only 0 and 1")
        if mask.numel() and not bool(mask.any()):  # as generate_tickets refuses a round that would do it
            raise DpltmUserError(f"mask {name} prunes every weight of the layer: the network could not compute through "
                                 "it (use a ticket of an earlier round, or no mask for this layer)")
        # a copy: the run's noise positions are fixed from these masks, so a later edit of the caller's tensor
        # must not change which coordinates are clipped and re-masked
        out[name] = mask.to(device=weights[name].device, dtype=torch.bool, copy=True)
    return out


def surviving_coordinates(model: nn.Module, masks: Mapping[str, Tensor]) -> dict[str, Tensor | None]:
    """Per parameter, the flat indices the noise goes on (None: every coordinate survives)."""
    surviving: dict[str, Tensor | None] = {name: None for name, _ in model.named_parameters()}
    for name, mask in masks.items():
        surviving[name] = None if bool(mask.all()) else mask.flatten().nonzero().squeeze(1)
    return surviving


def user_run_ledger(segments: SpentSegments, delta: float, accountant: str, neighboring: str,
                    masks: Mapping[str, Tensor], masks_from: str | None, masks_private: bool,
                    selection_eps1: float | None, dataset_name: str,
                    non_private_updates: int = 0) -> PrivacyLedger | None:
    """What a `make_private` / `DPCallback` run spent: every DP-SGD segment as it ran (composed, never
    re-planned: docs/privacy.md §8), any ε1 of the selection, the masks' provenance (none; public; or
    these private records: then not DP end to end), and any optimiser step on an un-noised gradient (then not
    DP at all). None before the first step, unless an update outside the mechanism already ran: the ledger then
    says so, with the open segment counted as one step (a count that over-states, never under-states)."""
    records = segments.records()
    if not records and non_private_updates and segments.latest_mechanism is not None:
        records = [{**segments.latest_mechanism, "steps": 1}]
    if not records:
        return None
    phase1 = "none" if not masks else "same-data" if masks_private else "public"
    return PrivacyLedger(
        phase1=phase1, phase1_dataset=masks_from if masks else None, private_dataset=dataset_name,
        selection_eps1=selection_eps1, training=records[-1],
        earlier_training=tuple(records[:-1]) or None, delta=delta, neighboring=neighboring, accountant=accountant,
        held_out_records=False, non_private_updates=non_private_updates)


@torch.no_grad()
def apply_masks(model: nn.Module, masks: Mapping[str, Tensor]) -> None:
    """Zero the pruned weights in place (called every step: nothing to do without masks)."""
    if not masks:
        return
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
    """Top-1 accuracy (no privacy: for held-out or public data). Empty data, non-finite features (whose scores'
    argmax is arbitrary) and labels the model has no class for are refused rather than scored."""
    batch_size = check_count(batch_size, "batch_size")
    parameter = first_parameter(model)
    features, labels = model_tensors(model, data, parameter.device)
    if labels.dim() != 1 or labels.is_floating_point():
        kind = str(labels.dtype).removeprefix("torch.")  # (N, 1) against (N,) would broadcast to N × N
        raise DpltmUserError(f"class labels must be integers of shape (N,), got {kind} of shape {tuple(labels.shape)}")
    if len(labels) == 0:
        raise DpltmUserError("there are no records to evaluate on")
    if features.is_floating_point():
        features = features.to(parameter.dtype)
        if not bool(torch.isfinite(features).all()):
            raise DpltmUserError("the features hold NaN or infinite values: their accuracy would be arbitrary")
    try:
        with evaluation_mode(model):
            return _accuracy(model, features, labels, batch_size)
    except (RuntimeError, ValueError, IndexError) as exc:
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise DpltmUserError(f"the model cannot be evaluated on this data: {first}") from None


@torch.no_grad()
def _accuracy(model: nn.Module, features: Tensor, labels: Tensor, batch_size: int) -> float:
    """Top-1 accuracy in batches (the caller sets the modes)."""
    correct = 0
    for i in range(0, len(labels), batch_size):
        outputs, targets = model(features[i : i + batch_size]), labels[i : i + batch_size]
        if not isinstance(outputs, Tensor) or outputs.dim() != 2 or outputs.shape[0] != len(targets):
            got = tuple(outputs.shape) if isinstance(outputs, Tensor) else type(outputs).__name__
            raise DpltmUserError(f"the model must return class scores of shape (batch, classes), got {got}")
        if i == 0:  # every label must name one of the model's classes (else it is never right: a silent 0)
            low, high = int(labels.min()), int(labels.max())
            if low < 0 or high >= outputs.shape[1]:
                raise DpltmUserError(f"class labels must lie in [0, {outputs.shape[1] - 1}] (the model's "
                                     f"{outputs.shape[1]} classes), got labels from {low} to {high}")
        correct += int((outputs.argmax(1) == targets).sum())
    return correct / max(len(labels), 1)


@dataclass
class Ticket:
    """One round of iterative magnitude pruning: the mask, the weights it rewinds to (`rewind_weights`), C and A."""

    round: int
    masks: Masks
    density: float
    accuracy: float | None
    theta0: dict[str, Tensor] = field(repr=False)
    """θ0: the model's weights when `generate_tickets` was called, before any training (no record has touched
    them), whatever `rewind_step`. One call's tickets share these tensors (copy before editing them in place)."""
    public_records: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64), repr=False)
    """Content hashes of the public records the ticket was made on (training and validation): passed as
    `make_private(..., masks_from=tickets)`, they let the overlap with the private records be checked."""
    rewind_step: int = 0
    """K of late rewinding (`theta_k` holds θ_K); 0: the ticket rewinds to `theta0`."""
    theta_k: dict[str, Tensor] | None = field(default=None, repr=False)
    """With late rewinding (`rewind_step` K ≥ 1) θ_K, the model's weights after K steps of the first round's
    training: non-private training on the data `generate_tickets` was given, so public knowledge only where
    that data is public (`make_private(..., masks_from=tickets)` checks the overlap). None without."""

    @property
    def rewind_weights(self) -> dict[str, Tensor]:
        """The weights the ticket's rounds rewound to and its DP training starts from: θ_K with late rewinding
        (trained on `generate_tickets`' data), else θ0."""
        return self.theta0 if self.theta_k is None else self.theta_k


def generate_tickets(model: nn.Module, train: Data, *, val: Data | None = None, rounds: int = 5,
                     iterations: int = 1000, batch_size: int = 128, lr: float = 0.1,
                     prune_rate: float = 0.3, output_prune_rate: float = 0.2, seed: int = 0,
                     loss: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy,
                     rewind_step: int = 0) -> list[Ticket]:
    """Iterative magnitude pruning of a user's model (Frankle & Carbin 2019; DPLTM Alg. 1), NOT private:
    train `iterations` SGD steps, prune the smallest surviving weights of each layer (`prune_rate`,
    `output_prune_rate` for the last), rewind to θ0, repeat. With `rewind_step` K (late rewinding, Frankle et al.
    2020) the rounds after the first rewind to θ_K, the weights after K steps of the first, and train the
    remaining iterations − K steps; every ticket's `theta_k` (and `rewind_weights`) is then θ_K, its `theta0`
    still θ0. Make tickets on public data; the model is left at θ0 with no mask."""
    parameter = first_parameter(model)
    rounds = check_count(rounds, "rounds", minimum=0, maximum=MAX_ROUNDS)
    iterations = check_count(iterations, "iterations")
    rewind_step = check_count(rewind_step, "rewind_step", minimum=0)
    if rewind_step >= iterations:
        raise DpltmUserError(f"rewind_step must lie in [0, iterations) = [0, {iterations}), got {rewind_step}")
    batch_size = check_count(batch_size, "batch_size")
    lr = check_positive(lr, "lr")
    if lr > MAX_LR:
        raise DpltmUserError(f"lr must lie in (0, {MAX_LR:g}] (as the CLI's --lr), got {lr:g}")
    seed = check_seed(seed, "seed")
    for rate, name in ((prune_rate, "prune_rate"), (output_prune_rate, "output_prune_rate")):
        if not 0 < check_positive(rate, name, inclusive=True) < 1:  # prune_layerwise's range: 0 would prune nothing
            raise DpltmUserError(f"{name} must lie in (0, 1), got {rate:g}")
    if not callable(loss):
        raise DpltmUserError("loss must be callable: loss(outputs, targets) -> the batch loss")
    if not prunable_weights(model):
        raise DpltmUserError("the model has no weight a ticket can prune (trainable weight matrices or kernels of "
                             "nn.Linear, nn.Conv*, …; biases and normalisation scales are never pruned)")
    rates = paper_prune_rates(list(prunable_weights(model)), prune_rate, output_prune_rate)
    check_rounds_leave_weights(prunable_weights(model), rounds, rates)
    stepped = privately_stepped(model)
    if stepped:
        raise DpltmUserError(f"generate_tickets takes the model's current weights as θ0, and these took {stepped} DP "
                             "steps in a private run: its tickets would carry them; start from fresh (or public) "
                             "weights")
    device = parameter.device
    features, labels = model_tensors(model, train, device)
    if features.is_floating_point():
        features = features.to(parameter.dtype)
    check_data_fits_model(model, features, labels, classification=loss is F.cross_entropy)
    # a model make_private would refuse (an LSTM's tuple output, a tied weight) fails now, not after the rounds
    check_gradients_reach_their_layers(model, features[:1], labels[:1],
                                       per_sample_cross_entropy if loss is F.cross_entropy else _row_by_row(loss))
    if val is not None:
        val_features, val_labels = model_tensors(model, val, device)
        if val_features.is_floating_point():
            val_features = val_features.to(parameter.dtype)  # as the training features: evaluate reads the same
        check_finite(val_features, "the validation features")
        check_data_fits_model(model, val_features, val_labels, classification=True, what="the validation data")
        val = (val_features, val_labels)
    seen = [_record_keys(features, labels)]
    if val is not None:
        seen.append(_record_keys(*as_tensors(val, "cpu")))
    public_records = np.unique(np.concatenate(seen))
    theta0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    masks: Masks = {n: torch.ones_like(w, dtype=torch.bool) for n, w in prunable_weights(model).items()}
    generator = torch.Generator(device="cpu").manual_seed(seed)
    rounds_made = []
    start = theta0  # θ_K from the first round's step K on, with late rewinding
    try:
        for k in range(rounds + 1):
            model.load_state_dict(start)
            apply_masks(model, masks)
            optimizer = torch.optim.SGD(model.parameters(), lr=lr)
            for step in range(iterations if k == 0 else iterations - rewind_step):
                if k == 0 and rewind_step and step == rewind_step:
                    start = {n: v.detach().clone() for n, v in model.state_dict().items()}
                index = torch.randint(0, len(labels), (min(batch_size, len(labels)),), generator=generator).to(device)
                optimizer.zero_grad(set_to_none=True)
                batch_loss = _batch_loss(loss(model(features[index]), labels[index]))
                if not bool(torch.isfinite(batch_loss)):
                    raise DpltmUserError(f"ticket generation diverged in round {k} (a loss of "
                                         f"{float(batch_loss.detach()):g}): lower lr")
                batch_loss.backward()
                optimizer.step()
                apply_masks(model, masks)
            accuracy = evaluate(model, val) if val is not None else None
            rounds_made.append((k, {n: m.clone() for n, m in masks.items()}, density_of(model, masks), accuracy))
            if k < rounds:
                masks = prune_layerwise(prunable_weights(model), masks, rates)
    finally:  # refused, diverged or interrupted too: the model is left as it came, at θ0, never at trained weights
        model.load_state_dict(theta0)
        model.zero_grad(set_to_none=True)
    # one θ0 (and θ_K) for all the tickets, not a copy each: rounds + 1 copies of a large model's weights add up
    theta_k = start if rewind_step else None
    return [Ticket(k, m, density, accuracy, theta0, public_records, rewind_step, theta_k)
            for k, m, density, accuracy in rounds_made]


def _batch_loss(value: Any) -> Tensor:
    """generate_tickets' loss value as the one number it must be."""
    if not isinstance(value, Tensor) or value.numel() != 1:
        raise DpltmUserError("generate_tickets' loss must return the batch loss (one number, e.g. F.cross_entropy "
                             "with its default reduction='mean'), got "
                             + (f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__))
    return value.reshape(())


def _row_by_row(loss: Callable[[Tensor, Tensor], Tensor]) -> Loss:
    """A batch loss as one loss per row (each row's batch of one), for the engine's per-sample checks."""
    def per_row(outputs: Tensor, targets: Tensor) -> Tensor:
        return torch.stack([_batch_loss(loss(outputs[i:i + 1], targets[i:i + 1])) for i in range(outputs.shape[0])])

    return per_row


def check_rounds_leave_weights(weights: Mapping[str, Tensor], rounds: int, rates: Mapping[str, float]) -> None:
    """Refused before any training: `rounds` that would prune every weight of a layer (counted as prune_layerwise
    prunes), which leaves a network that cannot compute and a ticket `select_ticket` refuses."""
    for name, rate in rates.items():
        survivors = weights[name].numel()
        for k in range(1, rounds + 1):
            survivors -= pruned_count(survivors, rate)
            if survivors == 0:
                raise DpltmUserError(f"rounds={rounds}: round {k} would prune every weight of {name} (at a rate of "
                                     f"{rate:g} a round): use at most {k - 1} rounds, or a lower rate")


def select_ticket(tickets: list[Ticket], *, eps1: float | None = None, nu: float = 50.0,
                  accuracy_sensitivity: float = 1.0, seed: int | None = None) -> Ticket:
    """The ticket with the best score S = A·(1 − ν·C) (`eps1=None`: tickets made on public data, no ε
    spent), or one drawn by the exponential mechanism with ε1 (McSherry & Talwar 2007; sensitivity
    `score_sensitivity`, docs/privacy.md §2) when the accuracies come from private data."""
    if not isinstance(tickets, (list, tuple)) or not tickets or not all(isinstance(t, Ticket) for t in tickets):
        raise DpltmUserError("tickets must be a non-empty list of the Tickets generate_tickets returns")
    if eps1 is not None:
        eps1 = check_positive(eps1, "eps1")
    if seed is not None:
        seed = check_seed(seed, "seed")
    if any(t.accuracy is None for t in tickets):
        raise DpltmUserError("every ticket needs an accuracy: generate them with val=…")
    shapes = [{n: tuple(m.shape) for n, m in t.masks.items()} for t in tickets]
    if any(s != shapes[0] for s in shapes):
        odd = next(i for i, s in enumerate(shapes) if s != shapes[0])
        raise DpltmUserError(f"tickets[{odd}] masks other weights than tickets[0] (names or shapes differ), so the "
                             "tickets come from different models: select among the tickets of one model")
    nu = check_positive(nu, "nu", inclusive=True)
    accuracy_sensitivity = check_positive(accuracy_sensitivity, "accuracy_sensitivity")
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
    sample_rate = check_positive(sample_rate, "sample_rate")
    noise_multiplier = check_positive(noise_multiplier, "noise_multiplier")
    steps = check_count(steps, "steps", minimum=0)
    delta = delta_or_target_delta(delta)
    return accountant_epsilon(dpsgd_event(sample_rate, noise_multiplier, steps), delta, check_accountant(accountant))


RECORDS_COPY_MAX_BYTES = 4 << 30
"""Tensor records up to this size get per-record norm tables (`PrivateTraining._batch_tables`, which
keeps its own copy of them); larger ones compute every norm per batch."""


class PrivateTraining:
    """A user's model under dpltm's masked DP-SGD. Build it with `make_private` (or resume one with
    `make_private(..., resume_from=path)`).

    Every step draws its own batch from the run's Poisson sampler (each record in with probability
    q = L/N, from a generator seeded by the OS CSPRNG): `step()` takes no data, so no batch chosen
    any other way can be booked as a Poisson step (docs/privacy.md §8)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, records: Records, plan: TrainPlan,
                 settings: TrainSettings, masks: Masks, masks_from: str | None, loss: Loss,
                 seed: int, dataset_name: str, masks_private: bool = False,
                 selection_eps1: float | None = None, segments: SpentSegments | None = None,
                 epochs_done: int = 0, history: list[dict[str, Any]] | None = None) -> None:
        self.model, self.optimizer, self.records = model, optimizer, records
        self._plan, self._settings = plan, settings  # read-only: the ledger's segment is what steps run at
        self.masks, self.masks_from, self.loss = masks, masks_from, loss
        self._training_keys: np.ndarray | None = None  # content hashes of the training records, made when first needed
        self.dataset_name = dataset_name
        self._masks_private, self._selection_eps1 = masks_private, selection_eps1
        self._noise = GaussianNoise(plan.noise_multiplier)
        self.surviving = surviving_coordinates(model, masks)  # noise only where a weight survives
        # the masks that prune something: a weight kept whole takes the plain ghost norm, not the masked one
        self._pruning = {n: m for n, m in masks.items() if self.surviving.get(n) is not None}
        self._noise_generator = torch.Generator(device=records.device).manual_seed(seed)
        # one sampling stream for the whole run, apart from the noise's: every step draws a fresh batch
        self._sampling_generator = torch.Generator(device=records.device).manual_seed(rank_sampling_seed(seed, 0))
        self.segments = segments if segments is not None else SpentSegments()
        self.segments.begin(plan.sample_rate, plan.noise_multiplier, settings.clip, plan.expected_batch_size,
                            plan.dataset_size)
        self.epochs_done = epochs_done  # the epochs fit() finished and recorded (the length of `history`)
        self.history: list[dict[str, Any]] = list(history or [])
        self._in_step = False
        self._tables: dict[str, RecordTable] | None = None  # made at the first step (`_batch_tables`)
        self._tables_version = -1
        self._probed_modes = {module_modes(model)}  # make_private probed the model as it is now
        _guard_optimizer(optimizer, self)

    @property
    def plan(self) -> TrainPlan:
        """The open segment's plan (q, σ, steps): read-only, since every step must run at what the ledger
        records."""
        return self._plan

    @property
    def settings(self) -> TrainSettings:
        return self._settings

    @property
    def masks_private(self) -> bool:
        """The masks came from these private records: the run is not DP end to end (read-only)."""
        return self._masks_private

    @property
    def selection_eps1(self) -> float | None:
        """ε1 spent choosing the ticket, composed into every ε (read-only)."""
        return self._selection_eps1

    @property
    def steps_done(self) -> int:
        """Every DP step this run has taken, earlier segments (before a resume) included."""
        return self.segments.steps

    def batches(self, *args: Any, **kwargs: Any) -> None:
        raise DpltmUserError("PrivateTraining.batches() is gone: step() draws its own Poisson batch (a batch "
                             "chosen any other way is not the mechanism the accountant assumes); call "
                             "private.step() plan.steps_per_epoch times, or fit()")

    def step(self, *args: Any, **kwargs: Any) -> None:
        """One DP-SGD step: draw a Poisson batch from the run's own sampler, masked clipped sum + noise on
        the surviving coordinates, divided by the expected batch size L, then the optimiser."""
        if args or kwargs:
            raise DpltmUserError("step() takes no batch: it draws its own Poisson batch (each record with "
                                 "probability q), the only batches the accountant covers")
        plan = self._plan
        if self.segments.open_steps >= plan.steps:
            raise DpltmUserError(f"the planned {plan.steps} steps are done: the privacy budget is spent")
        owner = _OWNERS.get(self.optimizer)
        if owner is None or owner() is not self:  # a resume took the optimizer (and the run) over
            raise DpltmUserError("this run's optimizer now belongs to a newer private run (a resume of it): continue "
                                 "with that one")
        check_not_trained_elsewhere(self.model, self)  # another run stepped these weights since this one did
        self._check_modes()
        index = poisson_sample(len(self.records), plan.sample_rate, self._sampling_generator, self.records.device)
        x, y = self.records.batch(index)
        if isinstance(self.records, DatasetRecords):  # records held in memory were checked whole by make_private
            check_token_ids(self.model, x, "a batch of the training dataset (the step was not taken)")
        batch = clipped_gradient_sum_of(self.model, x, y, self._settings.clip, self._pruning, self.loss,
                                        input_terms=self._batch_tables(index))
        grads = noisy_mean(batch.grad_sums, noise=self._noise, surviving=self.surviving, clip=self._settings.clip,
                           expected_batch_size=plan.expected_batch_size, generator=self._noise_generator)
        parameters = dict(self.model.named_parameters())
        for name, grad in grads.items():
            parameters[name].grad = grad
        # counted before the update: an interruption inside optimizer.step() (Ctrl-C, a hook that raises) may
        # leave the update in the weights, so the ledger must already hold it (an unused count only over-states)
        self.segments.count_step()
        self._in_step = True
        try:
            self.optimizer.step()
        finally:  # interrupted too: the weights may have moved, and they are this run's
            self._in_step = False
            self.optimizer.zero_grad(set_to_none=True)
            apply_masks(self.model, self.masks)  # pruned weights stay exactly zero whatever the optimiser does
            note_private_step(self.model, self)

    def _check_modes(self) -> None:
        """The independence probe again whenever the modules are in modes not probed yet (`model.train()` after
        make_private saw it in eval mode): a layer may mix records only in training mode."""
        modes = module_modes(self.model)
        if modes in self._probed_modes:
            return
        first_x, _ = self.records.batch(torch.zeros(1, dtype=torch.long, device=self.records.device))
        check_samples_independent(self.model, first_x, rows=probe_rows(self._plan.expected_batch_size))
        self._probed_modes.add(modes)

    def _batch_tables(self, index: Tensor) -> dict[str, RecordTable] | None:
        """The batch's rows of the per-record norm tables (dpltm.dp.engine.record_norm_tables) of records
        held as one tensor. The tables must describe exactly the rows sampled: they are made from a
        private copy of the records, which then replaces them (the caller's tensor, or a NumPy array
        under it, could be written to without this object knowing); remade if its version counter moves."""
        features = getattr(self.records, "features", None)
        if not isinstance(features, Tensor) or features.numel() * features.element_size() > RECORDS_COPY_MAX_BYTES:
            return None
        if self._tables is None or self._tables_version != features._version:
            copy = features.clone()
            self._tables = record_norm_tables(self.model, self._pruning, copy)
            if self._tables:  # kept only where a table reads it
                self.records.features = features = copy  # type: ignore[union-attr]
            self._tables_version = features._version
        return table_rows(self._tables, index) if self._tables else None

    def fit(self, epochs: int | None = None, val: Data | None = None,
            on_epoch: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
        """Run the planned epochs (or `epochs` of them); returns one record per epoch with ε so far."""
        check_callable(on_epoch, "on_epoch")
        per_epoch = self.plan.steps_per_epoch
        position = self._schedule_position()
        left = self.plan.epochs - position // per_epoch  # an epoch begun (steps taken by hand) counts as one
        todo = left if epochs is None else check_count(epochs, "epochs", minimum=0)
        if todo > left:  # before any step: the budget was planned for the run's epochs
            raise DpltmUserError(f"fit(epochs={todo}): only {left} of the run's planned epochs are left (σ was "
                                 "calibrated for them); start a new run, or resume this one with a larger epochs")
        if val is not None:  # a wrong validation set fails now, not after an epoch of private steps
            val_x, val_y = model_tensors(self.model, val, next(self.model.parameters()).device)
            check_finite(val_x, "the validation features")
            check_data_fits_model(self.model, val_x, val_y, classification=True, what="the validation data")
            self._warn_if_training_records(val)
        for _ in range(todo):
            for _ in range(per_epoch - self._schedule_position() % per_epoch):  # to the end of the current epoch
                self.step()
            self.epochs_done += 1
            record = {"epoch": self._schedule_position() // per_epoch, "steps": self.steps_done,
                      "epsilon": self.epsilon}
            if val is not None:
                record["val_accuracy"] = evaluate(self.model, val)
            self.history.append(record)
            if on_epoch is not None:
                on_epoch(record)
        return self.history

    def _schedule_position(self) -> int:
        """Steps into the run's `epochs` epochs: those of earlier segments (`plan.steps_before`) and this one's."""
        return self.plan.steps_before + self.segments.open_steps

    def evaluate(self, data: Data) -> float:
        """Top-1 accuracy on `data`: not private (warned when it holds private training records)."""
        self._warn_if_training_records(data)
        return evaluate(self.model, data)

    def _warn_if_training_records(self, data: Data) -> None:
        """Accuracy measured on private training records is a statistic of them released without noise."""
        if not isinstance(self.records, TensorRecords):
            return
        if self._training_keys is None:
            self._training_keys = _record_keys(self.records.features, self.records.labels)
        try:
            keys = _record_keys(*as_tensors(data, "cpu"))
        except (DpltmUserError, RuntimeError, TypeError, ValueError):
            return  # evaluate gives the one-line error
        shared = int(np.isin(keys, self._training_keys).sum())
        if shared:
            warnings.warn(f"{shared} of the {len(keys)} evaluation records are private training records: their "
                          "accuracy is not differentially private (evaluate on held-out or public data)",
                          stacklevel=3)

    def ledger(self) -> PrivacyLedger | None:
        """What ran on the private data so far (every (q, σ, steps) segment, δ) and the mask's provenance;
        None before the first step."""
        return user_run_ledger(self.segments, self.settings.delta, self.settings.accountant,
                               self.settings.neighboring, self.masks if self.masks_from else {}, self.masks_from,
                               self.masks_private, self.selection_eps1, self.dataset_name)

    @property
    def epsilon(self) -> float:
        """The run's ε so far (0 before the first step), by the accountant the plan was calibrated with;
        ∞ when the masks came from these private records (`masks_private`): not DP end to end."""
        ledger = self.ledger()
        return 0.0 if ledger is None else ledger.overall_epsilon

    @property
    def epsilon_dp_part(self) -> float:
        """ε of the DP phases alone (selection and training), even when the run is not DP end to end."""
        ledger = self.ledger()
        return 0.0 if ledger is None else ledger.best_bound().epsilon

    def report(self) -> dict[str, Any]:
        """The ledger's JSON report (ε, δ, accountant, what ran) and its plain-English statement."""
        ledger = self.ledger()
        if ledger is None:
            return {"epsilon": 0.0, "steps": 0, "statement": "No DP step has run yet: nothing spent."}
        return {**ledger.report(), "statement": ledger.statement()}

    # ---- saving and resuming: what was spent travels, never a seed or a generator state -------
    def state_dict(self) -> dict[str, Any]:
        """Model, optimiser, masks, the spent segments and the settings: everything to resume and to
        account, and nothing that would let anyone subtract the noise (no seed, no generator state)."""
        ledger = self.ledger()
        s = self.settings
        return {
            "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "masks": {k: v.cpu() for k, v in self.masks.items()},
            "masks_from": self.masks_from, "masks_private": self.masks_private,
            "selection_eps1": self.selection_eps1, "dataset_name": self.dataset_name,
            "dataset_size": len(self.records),
            "settings": {"epochs": s.epochs, "batch_size": s.batch_size, "clip": s.clip, "eps2": s.eps2,
                         "sigma": s.sigma, "delta": s.delta, "accountant": s.accountant,
                         "neighboring": s.neighboring},
            "segments": self.segments.state(), "epochs_done": self.epochs_done, "history": list(self.history),
            "optimizer_class": type(self.optimizer).__name__,
            "ledger": None if ledger is None else ledger.to_json(),
        }

    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        """Write the run to `path` atomically (a dpltm 'run' checkpoint: `dpltm inspect` reads it); resume
        with `make_private(..., resume_from=path)`. An existing run file is replaced (saving each epoch to one
        path); any other existing file only with `overwrite=True`."""
        from dpltm.checkpoint import holds_checkpoint_of_kind, save_atomic
        from dpltm.outputs import check_checkpoint_name

        target = user_path(path, "path")
        check_checkpoint_name(target, "path")
        check_flag(overwrite, "overwrite")
        if not overwrite and (target.exists() or target.is_symlink()) and not holds_checkpoint_of_kind(target, "run"):
            raise DpltmUserError(f"{target} exists and is not a dpltm run file: not overwritten (save elsewhere, or "
                                 "pass overwrite=True)")
        save_atomic(self.state_dict(), target, "run")
        return target


def _record_keys(features: Tensor, labels: Tensor) -> np.ndarray:
    """Per-record content hashes (float32 features, int64 labels), as the CLI's overlap check uses."""
    x = features.detach().to("cpu", torch.float32)
    y = labels.detach().to("cpu")
    if y.dim() > 1:  # several targets a record (one-hot, multi-label): hashed as part of the record's row
        x = torch.cat([x.reshape(x.shape[0], -1), y.reshape(y.shape[0], -1).to(torch.float32)], dim=1)
        y = torch.zeros(y.shape[0], dtype=torch.long)
    return record_hashes(x, y.long() if not y.is_floating_point() else y.round().long(), seed=0)


def public_provenance(masks_from: Any, records: Records, masks: Mapping[str, Tensor]) -> str | None:
    """`masks_from` as a provenance line, checked where it can be: given the public data itself (a
    (features, labels) pair or a Dataset) or the tickets of `generate_tickets` (which carry their
    records' hashes), no private training record may be among the public ones (docs/privacy.md §8: public
    knowledge is free only when no private record is in it). A string is taken on the user's word."""
    if masks_from is None or isinstance(masks_from, str):
        return masks_from
    if isinstance(masks_from, Ticket):
        tickets: list[Ticket] | None = [masks_from]
    elif isinstance(masks_from, list) and masks_from and all(isinstance(t, Ticket) for t in masks_from):
        tickets = masks_from
    else:
        tickets = None
    if isinstance(records, DatasetRecords):
        raise DpltmUserError("masks_from=<data or tickets> checks record overlap on the records as stored: pass "
                             "in_memory=True (records read per batch may be augmented), or describe the source in "
                             "a string")
    if tickets is not None:
        if not any(_same_masks(masks, t.masks) for t in tickets):
            raise DpltmUserError("masks_from names tickets, but the masks are none of theirs: pass the masks of one "
                                 "of those tickets")
        public = np.unique(np.concatenate([t.public_records for t in tickets]))
        what = "the tickets' public data"
    else:
        try:
            pub_x, pub_y = as_tensors(masks_from, "cpu")
        except (DpltmUserError, TypeError, ValueError, RuntimeError):
            raise DpltmUserError("masks_from must be a string, the public data (features, labels) or a Dataset, or "
                                 f"the tickets of generate_tickets; got {type(masks_from).__name__}") from None
        public = np.unique(_record_keys(pub_x, pub_y))
        what = "the public data given as masks_from"
    if len(public) == 0:
        raise DpltmUserError("masks_from holds no public records to check against")
    shared = sum(int(np.isin(_record_keys(x, y), public).sum()) for x, y in records.chunks())
    if shared:
        raise DpltmUserError(f"{shared} of the private training records are among {what}: masks made on them are "
                             "a function of private records (not DP); remove them from one side, or pass "
                             "masks_private=True to train without an end-to-end guarantee")
    return (f"public data ({len(public)} distinct records; checked: no exact copy of a private training record "
            "among them)")


def _same_masks(given: Mapping[str, Tensor], ticket: Mapping[str, Tensor]) -> bool:
    names = {n for n, m in ticket.items() if not bool(torch.as_tensor(m).all())}
    given_pruned = {n for n, m in given.items() if not bool(torch.as_tensor(m).all())}
    return names == given_pruned and all(
        torch.equal(torch.as_tensor(given[n]).bool().cpu(), torch.as_tensor(ticket[n]).bool().cpu()) for n in names)


def make_private(model: nn.Module, optimizer: torch.optim.Optimizer, train: Data, *,
                 target_epsilon: float | None = None, noise_multiplier: float | None = None,
                 delta: float | None = None, epochs: int = 1, batch_size: int = 256, max_grad_norm: float = 1.0,
                 masks: Mapping[str, Tensor] | None = None, masks_from: Any = None,
                 loss: Loss = per_sample_cross_entropy, accountant: str = "pld", noise_seed: int | None = None,
                 dataset_name: str = "user data", masks_private: bool = False,
                 selection_eps1: float | None = None, neighboring: str = "add_remove",
                 target_delta: float | None = None, resume_from: str | Path | None = None,
                 in_memory: bool = True) -> PrivateTraining:
    """Masked DP-SGD for a user's model, in the spirit of Opacus's `make_private_with_epsilon`.

    σ is calibrated so that `epochs` epochs of Poisson batches of expected size `batch_size` meet
    (`target_epsilon`, `delta`) (Opacus's name `target_delta` works too; default 1e-5), or
    `noise_multiplier` is used and ε reported. `masks` (weight name → 0/1, e.g.
    `select_ticket(...).masks`) restrict clipping norms, sums and noise to the surviving weights;
    `masks_from` must then say where they came from: a string (taken on your word), or the public
    data itself / the tickets of `generate_tickets`, and then no private record may be among the
    public ones (checked). `neighboring` is "add_remove" (N treated as public; the default, as in
    Opacus) or "replace_one". `loss(outputs, targets)` must return one loss per sample. The noise
    seed comes from the OS CSPRNG unless `noise_seed` is given (then DP holds only while it stays
    secret; it is never stored).

    `resume_from` (a file `PrivateTraining.save` wrote) continues that run: model, optimiser and what
    was spent are restored, and the resumed run takes the steps left of `epochs` (steps saved mid-epoch
    count); with `target_epsilon` (the whole run's budget), σ is calibrated for those steps given the
    segments spent (composed as they ran); noise and sampling draw fresh OS randomness.

    `train` is (features, labels), a map-style Dataset (read once into tensors; `in_memory=False`
    reads it per batch: larger-than-memory data, augmentation in `__getitem__`), or a DataLoader
    (its dataset read per batch with its collate_fn; its own batching is replaced by the run's
    Poisson sampler at `batch_size`). dpltm.private_records says why an IterableDataset is refused.
    """
    check_model_and_optimizer(model, optimizer)
    owner = _OWNERS.get(optimizer)
    if resume_from is None and owner is not None and owner() is not None:  # a resume takes the optimizer over
        raise DpltmUserError("this optimizer already belongs to another private run: build a new optimizer for a new "
                             "run (two runs stepping one optimizer would each count only their own steps)")
    target_epsilon, noise_multiplier = check_budget(target_epsilon, noise_multiplier)
    d = delta_or_target_delta(delta, target_delta)
    clip = check_clip(max_grad_norm)
    epochs = check_count(epochs, "epochs")
    accountant = check_accountant(accountant)
    neighboring = check_neighboring(neighboring)
    masks = check_mask_values(masks)
    if not isinstance(dataset_name, str) or not dataset_name:
        raise DpltmUserError("dataset_name must be a non-empty string")
    if not callable(loss):
        raise DpltmUserError("loss must be callable: loss(outputs, targets) -> one loss per sample")
    if noise_seed is not None:
        noise_seed = check_seed(noise_seed, "noise_seed")
    check_flag(masks_private, "masks_private")
    check_flag(in_memory, "in_memory")
    if selection_eps1 is not None and not masks:
        raise DpltmUserError("selection_eps1 is the ε1 of choosing a ticket: pass the ticket's masks too")
    if selection_eps1 is not None:
        check_positive(selection_eps1, "selection_eps1")
    if masks and (masks_from is None or (isinstance(masks_from, str) and not masks_from.strip())):
        raise DpltmUserError("say where the masks come from (masks_from='public data …', or the public data or "
                             "tickets themselves): tickets made on the private records are not differentially private")
    if not list(model.parameters()):
        raise DpltmUserError("the model has no parameters")
    parameter = next(model.parameters())
    dtype = parameter.dtype if parameter.is_floating_point() else None
    records = training_records(train, parameter.device, in_memory,
                               lambda data, device: model_tensors(model, data, device), dtype, takes_ids(model))
    n = len(records)
    if isinstance(records, TensorRecords):
        check_finite(records.features, "the training features")
        check_finite(records.labels, "the training labels")
        check_token_ids(model, records.features, "the training data")
    if d > 1.0 / n:
        warnings.warn(f"delta={d:g} is above 1/N = {1.0 / n:.3g}: a (ε, δ) guarantee with δ > 1/N allows releasing "
                      "a record outright; the usual choice is δ ≪ 1/N", stacklevel=2)
    trainable_layers(model)  # unsupported layers fail here, before any step
    if resume_from is None:
        check_not_trained_elsewhere(model)
    first_x, first_y = records.batch(torch.zeros(1, dtype=torch.long, device=records.device))
    labels = records.labels if isinstance(records, TensorRecords) else first_y
    check_data_fits_model(model, first_x, labels, classification=loss is per_sample_cross_entropy)
    batch_size = check_batch_size(batch_size, n)
    rows = probe_rows(batch_size)
    check_samples_independent(model, first_x, rows=rows)  # parameter-free mixing layers and buffers updated in forward
    check_gradients_reach_their_layers(model, first_x, first_y, loss)  # weights used outside their layer
    if loss is not per_sample_cross_entropy:
        check_loss_per_sample(model, first_x, first_y, loss, rows)  # a loss reading other rows (batch means)
    check_steps(epochs, batch_size, n)
    checked = check_user_masks(model, masks)
    provenance = public_provenance(masks_from, records, checked) if checked and not masks_private else masks_from
    if provenance is not None and not isinstance(provenance, str):
        provenance = "the private training records themselves"
    segments, epochs_done, history, steps_before = None, 0, None, 0
    if resume_from is not None:
        if noise_seed is not None:
            raise DpltmUserError("noise_seed cannot be combined with resume_from: a resumed run draws fresh OS "
                                 "randomness (re-seeding would reuse the first segment's noise)")
        resume_from = user_path(resume_from, "resume_from")
        before = ({k: v.detach().clone() for k, v in model.state_dict().items()}, copy.deepcopy(optimizer.state_dict()))
        guarded = _held_entries(model)
        try:
            segments, epochs_done, history = _resume(Path(resume_from), model, optimizer, checked, n,
                                                     {"masks_private": masks_private and bool(checked),
                                                      "selection_eps1": selection_eps1, "neighboring": neighboring})
            check_budget_left(segments.events(), target_epsilon, d, accountant, neighboring)
            steps_before = _schedule_steps_done(segments, n, batch_size)
            if steps_before >= epochs * math.ceil(n / batch_size):
                run_so_far = _epochs_run(segments)
                short = (f", and a step at batch_size={batch_size} is more than the rest" if run_so_far < epochs
                         else "")
                raise DpltmUserError(f"the run in {resume_from} has done {run_so_far:.4g} of epochs={epochs}{short}: "
                                     "pass a larger epochs to train on")
        except DpltmUserError:  # a refused resume leaves the model and optimiser as they were
            model.load_state_dict(before[0])
            optimizer.load_state_dict(before[1])
            _renote(model, guarded)  # the same weights again: still another run's (restoring moved the counters)
            raise
    apply_masks(model, checked)
    settings = TrainSettings(epochs=epochs, batch_size=batch_size, clip=clip, eps2=target_epsilon,
                             sigma=noise_multiplier, delta=d, accountant=accountant, neighboring=neighboring)
    plan = plan_training(settings, n, spent=segments.events() if segments is not None else None,
                         steps_before=steps_before)
    if not math.isfinite(plan.noise_multiplier):
        raise DpltmUserError("no finite noise multiplier meets this budget")
    seed = secrets.randbits(63) if noise_seed is None else int(noise_seed)
    run = PrivateTraining(model, optimizer, records, plan, settings, checked,
                          provenance if checked else None, loss, seed, dataset_name,
                          masks_private=masks_private and bool(checked), selection_eps1=selection_eps1,
                          segments=segments, epochs_done=epochs_done, history=history)
    if run.steps_done:  # resumed: the weights loaded are the saved run's, with its steps
        note_private_step(model, run)
    return run


@dataclass(frozen=True)
class _Stepped:
    """One trainable parameter as a private run left it: the run (by id, so the entry keeps neither the run nor
    its records alive), its steps by then, and the tensor's storage and version counter just after that step."""

    parameter: weakref.ref[Tensor]
    run: int  # `_run_token`, unique in the process (an id could be reused by a later run)
    steps: int
    storage: int
    version: int
    digest: bytes | None = None
    """The values' digest (`weights_digest`), where the run noted them at its end (DPCallback's fit): a move to
    another device or dtype (Lightning moves a GPU module back to the CPU after a fit) keeps the values."""

    def holds(self, parameter: Tensor) -> bool:
        """The entry still describes `parameter`: the same tensor, not written since (`load_state_dict`, an
        optimiser step and `copy_` all move the version counter; `.data = …` moves the storage), or, where the
        digest was noted, moved with its values intact."""
        if self.parameter() is not parameter:
            return False
        if self.storage == parameter.data_ptr() and self.version == parameter._version:
            return True
        return self.digest is not None and self.digest == weights_digest(parameter)


def weights_digest(parameter: Tensor) -> bytes:
    """A digest of the values as float32 on the CPU: the same wherever the tensor lives, in float32 or float64."""
    values = parameter.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return hashlib.blake2b(values, digest_size=16).digest()


_STEPPED: dict[int, _Stepped] = {}
"""By id of the parameter tensor: which private run (make_private's PrivateTraining, or a DPCallback) last stepped
it in this process. Keyed on the tensors, not the module: a wrapper around the same weights (`nn.Sequential(net)`,
a LightningModule holding `net`) is the same weights."""


def _forget(key: int) -> Callable[[Any], None]:
    return lambda _: _STEPPED.pop(key, None)


_RUN_TOKENS = itertools.count(1)


def _run_token(run: Any) -> int:
    """A number for `run` that no other run in this process gets (ids are reused once an object dies)."""
    token = run.__dict__.get("_dpltm_run_token")
    if token is None:
        token = run.__dict__["_dpltm_run_token"] = next(_RUN_TOKENS)
    return int(token)


def note_fit_end(model: nn.Module, run: Any) -> None:
    """At the end of a fit, the digests of the weights `run` last stepped (one copy to the CPU), so the guard
    still knows them after the module moves device or dtype (`_Stepped.digest`)."""
    for parameter in model.parameters():
        entry = _STEPPED.get(id(parameter))
        if entry is not None and entry.run == _run_token(run) and entry.holds(parameter):
            _STEPPED[id(parameter)] = replace(entry, digest=weights_digest(parameter))


def note_private_step(model: nn.Module, run: Any) -> None:
    """Note that `run` stepped these weights: its DP steps, and any update it saw outside them (DPCallback's raw
    steps), so that a new run on them is refused even when only the latter happened."""
    steps = int(run.steps_done) + int(getattr(run, "_raw_steps", 0))
    token = _run_token(run)
    for parameter in model.parameters():
        if parameter.requires_grad:  # a frozen parameter carries nothing of the records
            key = id(parameter)
            entry = _STEPPED.get(key)
            ref = entry.parameter if entry is not None and entry.parameter() is parameter else \
                weakref.ref(parameter, _forget(key))  # one weakref per tensor, not one per step
            _STEPPED[key] = _Stepped(ref, token, steps, parameter.data_ptr(), parameter._version)


def _held_entries(model: nn.Module) -> dict[int, _Stepped]:
    entries = {}
    for parameter in model.parameters():
        entry = _STEPPED.get(id(parameter))
        if entry is not None and entry.holds(parameter):
            entries[id(parameter)] = entry
    return entries


def _renote(model: nn.Module, entries: Mapping[int, _Stepped]) -> None:
    """Put back entries after the weights were restored in place (which moved their version counters)."""
    for parameter in model.parameters():
        entry = entries.get(id(parameter))
        if entry is not None:
            _STEPPED[id(parameter)] = replace(entry, storage=parameter.data_ptr(), version=parameter._version)


def privately_stepped(model: nn.Module, run: Any = None) -> int:
    """The DP steps another private run took on these very weights (0: none, or they were replaced since). A guard
    against accidents, not a taint tracker: weights copied or edited in place after the run are not followed."""
    token = None if run is None else _run_token(run)
    others = [entry.steps for entry in _held_entries(model).values() if entry.run != token]
    return max(others, default=0)


def check_not_trained_elsewhere(model: nn.Module, run: Any = None) -> None:
    """Refuse a new private run on weights another run in this process has stepped and nothing has replaced
    since: the new run's ε would count only its own steps, not the earlier ones the weights carry (continue
    or resume that run, or load other weights, e.g. θ0, first)."""
    steps = privately_stepped(model, run)
    if steps:
        raise DpltmUserError(f"this model already took {steps} steps in another private run: continue that run, "
                             "or save it and resume from the file; a new run would report only its own steps")


_OWNERS: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref[PrivateTraining]] = weakref.WeakKeyDictionary()
"""Each guarded optimiser's run, by weak reference: the run holds the optimiser, so a strong value would keep both
(and the run's copy of the records) alive for the life of the process (a sweep of make_private calls grew to 22 GB)."""


def _guard_optimizer(optimizer: torch.optim.Optimizer, run: PrivateTraining) -> None:
    """Make `optimizer.step()` refuse to run outside `run.step()`: a step on a gradient that was not
    clipped and noised (a user's own loop, a stray call) would update the model outside the ledger."""
    first = optimizer not in _OWNERS
    _OWNERS[optimizer] = weakref.ref(run)
    if first:
        def guard(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            ref = _OWNERS.get(opt)
            owner = ref() if ref is not None else None
            if owner is not None and not owner._in_step:
                raise DpltmUserError("this optimizer belongs to a dpltm private run: its steps must go through "
                                     "PrivateTraining.step() (a step on an unprivatised gradient is not DP)")

        optimizer.register_step_pre_hook(guard)


def _epochs_run(segments: SpentSegments) -> float:
    """The epochs the spent segments ran: each ran steps / ⌈N/L_i⌉ at its own L_i (a resume may change L). Steps
    taken outside fit() (saved mid-epoch) count too."""
    return sum(r["steps"] / math.ceil(r["dataset_size"] / r["expected_batch_size"]) for r in segments.records())


def _schedule_steps_done(segments: SpentSegments, dataset_size: int, batch_size: int) -> int:
    """`_epochs_run` in steps of an epoch of ⌈N/L⌉ at this `batch_size`, rounded up: the resumed plan covers what is
    left of the run's epochs and never goes past them (it may stop short of them by under a step)."""
    return math.ceil(_epochs_run(segments) * math.ceil(dataset_size / batch_size) - 1e-9)


def _resume(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, masks: Masks,
            dataset_size: int, provenance: dict[str, Any]) -> tuple[SpentSegments, int, list[dict[str, Any]]]:
    """Model, optimiser and the spent segments of a saved run; the data, masks, optimiser class and the
    run's privacy provenance (masks_private, selection_eps1, neighboring) must be the run's: a resume
    that dropped `masks_private=True` or an ε1 would state a smaller ε than was spent."""
    from dpltm.checkpoint import load_checkpoint

    body = load_checkpoint(path, "run")
    saved_settings = body["settings"] if isinstance(body["settings"], dict) else {}
    stored = {"masks_private": body.get("masks_private"), "selection_eps1": body.get("selection_eps1"),
              "neighboring": saved_settings.get("neighboring")}
    differ = [f"{k}={stored[k]!r} (given {provenance[k]!r})" for k in stored if stored[k] != provenance[k]]
    if differ:
        raise DpltmUserError(f"the run in {path} was made with {', '.join(differ)}: resume with the same values")
    if body.get("optimizer_class") not in (None, type(optimizer).__name__):
        raise DpltmUserError(f"the run in {path} used {body['optimizer_class']}, not {type(optimizer).__name__}: "
                             "resume with the same optimizer class")
    if body["dataset_size"] != dataset_size:
        raise DpltmUserError(f"{path} trained on {body['dataset_size']} records, this data has {dataset_size}: "
                             "resume on the same private data")
    saved = {k: torch.as_tensor(v) for k, v in body["masks"].items()}
    if set(saved) != set(masks) or any(not torch.equal(saved[k].bool().cpu(), masks[k].cpu()) for k in masks):
        raise DpltmUserError(f"the masks differ from those of the run in {path}: pass the same masks")
    segments, epochs_done, history = _spent_record(path, body, saved, saved_settings)
    try:
        model.load_state_dict(body["model"])
        optimizer.load_state_dict(body["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise DpltmUserError(f"{path} does not fit this model or optimizer: {first}") from None
    return segments, epochs_done, history


def _spent_record(path: Path, body: dict[str, Any], masks: Mapping[str, Tensor],
                  settings: dict[str, Any]) -> tuple[SpentSegments, int, list[dict[str, Any]]]:
    """The saved run's spent segments, epoch count and history, each checked against the others and against the
    privacy record saved beside them: a resume composes its budget with these segments, so a file whose segments
    were emptied or shortened while its ledger still records the steps would state a smaller ε than was spent.
    A file edited consistently in all four places is not caught (that would need a keyed MAC: docs/privacy.md §8)."""
    segments = SpentSegments(body["segments"])
    epochs_done, history = body["epochs_done"], body["history"]
    if (isinstance(epochs_done, bool) or not isinstance(epochs_done, int) or epochs_done < 0
            or not isinstance(history, list) or len(history) != epochs_done
            or not all(isinstance(r, dict) and isinstance(r.get("steps"), int) for r in history)
            or (history and not history[-1]["steps"] <= segments.steps)):
        raise DpltmUserError(f"{path}: its epochs_done, history and spent segments disagree (an altered file): "
                             "refusing to resume from it")
    try:
        rebuilt = user_run_ledger(segments, settings.get("delta"), settings.get("accountant"),  # type: ignore[arg-type]
                                  settings.get("neighboring"), masks, body.get("masks_from"),  # type: ignore[arg-type]
                                  bool(body.get("masks_private")), body.get("selection_eps1"),
                                  body.get("dataset_name"))  # type: ignore[arg-type]
        stored = body.get("ledger")
        fields = None if rebuilt is None else {k: v for k, v in rebuilt.to_json().items() if k != "format_version"}
        agrees = fields == (None if stored is None else {k: v for k, v in stored.items() if k != "format_version"})
    except (DpltmUserError, TypeError, ValueError):
        agrees = False
    if not agrees:
        raise DpltmUserError(f"{path}: its spent segments disagree with the privacy record saved beside them (an "
                             "altered file): refusing to resume from it")
    return segments, epochs_done, list(history)


def load_model(path: str | Path) -> nn.Module:
    """The released model of a `dpltm train` checkpoint (masks included), ready for inference."""
    from dpltm.checkpoint import load_trained_model

    return load_trained_model(user_path(path, "path")).network()
