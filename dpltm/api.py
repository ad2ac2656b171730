"""dpltm as a library: tickets, selection, DP training and accounting for your own model and data.

The CLI's mechanism, for any model built from `nn.Linear` and `nn.Conv2d` layers (plus
parameter-free modules): Poisson sampling (dpltm.dp.sampling), per-sample clipping over the
surviving weights (dpltm.dp.engine), Gaussian noise on the surviving coordinates only
(dpltm.dp.noise), σ calibrated by dp-accounting and every ε stated by the ledger
(dpltm.privacy.ledger). Pruned weights are zero at the start and stay exactly zero: their clipped
sum and noise are zero, and the mask is applied again after every optimiser step.

    import dpltm
    tickets = dpltm.generate_tickets(model, public_train, val=public_val, rounds=5)
    ticket = dpltm.select_ticket(tickets, rule="best")    # public tickets: no ε spent
    private = dpltm.make_private(model, optimizer, (x, y), target_epsilon=1.0, epochs=10,
                                 batch_size=256, masks=ticket.masks, masks_from="public data")
    private.fit()
    print(private.epsilon, private.evaluate((x_test, y_test)))
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpltm.api_checks import (
    PrivacyOptions,
    check_batch_size,
    check_count,
    check_data_fits_model,
    check_epochs,
    check_finite,
    check_flag,
    check_model_and_optimizer,
    check_positive,
    check_seed,
    check_steps,
    check_token_ids,
    delta_or_target_delta,
    expected_batch_size,
    first_parameter,
    layer_clip_bounds,
    user_path,
    warn_if_delta_above_one_over_n,
)
from dpltm.dp.engine import (
    Loss,
    per_sample_cross_entropy,
    trainable_layers,
)
from dpltm.dp.independence import (
    check_gradients_reach_their_layers,
    check_loss_per_sample,
    check_loss_shape,
    check_samples_independent,
    probe_rows,
)
from dpltm.errors import DpltmUserError
from dpltm.opacus_names import resolve_inputs
from dpltm.privacy.accounting import check_accountant
from dpltm.privacy.accounting import epsilon as accountant_epsilon
from dpltm.privacy.events import dpsgd_event
from dpltm.private_records import DatasetRecords, Records, TensorRecords, training_records
from dpltm.private_training import _OWNERS, PrivateTraining
from dpltm.pruning import paper_prune_rates, prune_layerwise, pruned_count
from dpltm.run_resume import ResumedRun, RunProvenance, resume_run
from dpltm.settings import MAX_LR, MAX_ROUNDS, TrainSettings, check_noise_filter
from dpltm.training.plan import plan_training
from dpltm.user_inputs import (
    Data,
    Masks,
    apply_masks,
    as_tensors,
    check_user_masks,
    density_of,
    evaluate,
    model_tensors,
    prunable_weights,
    record_keys,
    takes_ids,
)
from dpltm.weight_guard import check_not_trained_elsewhere, note_private_step, privately_stepped

__all__ = ["Data", "PrivateTraining", "Ticket", "account", "evaluate", "generate_tickets", "get_epsilon", "load_model",
           "make_private", "make_private_with_epsilon", "prunable_weights", "public_provenance"]


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
    seen = [record_keys(features, labels)]
    if val is not None:
        seen.append(record_keys(*as_tensors(val, "cpu")))
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


def account(*, sample_rate: float, noise_multiplier: float, steps: int, delta: float = 1e-5,
            accountant: str = "pld") -> float:
    """ε of `steps` Poisson-subsampled Gaussian steps (dp-accounting's PLD or RDP accountant)."""
    sample_rate = check_positive(sample_rate, "sample_rate")
    noise_multiplier = check_positive(noise_multiplier, "noise_multiplier")
    steps = check_count(steps, "steps", minimum=0)
    delta = delta_or_target_delta(delta)
    return accountant_epsilon(dpsgd_event(sample_rate, noise_multiplier, steps), delta, check_accountant(accountant))



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
        public = np.unique(record_keys(pub_x, pub_y))
        what = "the public data given as masks_from"
    if len(public) == 0:
        raise DpltmUserError("masks_from holds no public records to check against")
    shared = sum(int(np.isin(record_keys(x, y), public).sum()) for x, y in records.chunks())
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


def _checked_records(model: nn.Module, train: Data, *, in_memory: bool, delta: float, loss: Loss,
                     batch_size: int | None,
                     epochs: int, resuming: bool) -> tuple[Records, int]:
    """The training records as the run reads them, with every check made before any step: finite values, the
    model's layers and classes, records independent under the model, a per-sample loss, and the batch size."""
    parameter = next(model.parameters())
    dtype = parameter.dtype if parameter.is_floating_point() else None
    records = training_records(train, parameter.device, in_memory,
                               lambda data, device: model_tensors(model, data, device), dtype, takes_ids(model))
    batch_size = expected_batch_size(train, batch_size)  # the loader's own, where it has one
    n = len(records)
    if isinstance(records, TensorRecords):
        check_finite(records.features, "the training features")
        check_finite(records.labels, "the training labels")
        check_token_ids(model, records.features, "the training data")
    warn_if_delta_above_one_over_n(delta, n, stacklevel=3)
    trainable_layers(model)  # unsupported layers fail here, before any step
    if not resuming:
        check_not_trained_elsewhere(model)
    first_x, first_y = records.batch(torch.zeros(1, dtype=torch.long, device=records.device))
    labels = records.labels if isinstance(records, TensorRecords) else first_y
    check_data_fits_model(model, first_x, labels, classification=loss is per_sample_cross_entropy)
    batch_size = check_batch_size(batch_size, n)
    rows = probe_rows(batch_size)
    check_samples_independent(model, first_x, rows=rows)  # parameter-free mixing layers and buffers updated in forward
    check_loss_shape(model, first_x, first_y, loss)  # a batch-mean loss, named as such
    check_gradients_reach_their_layers(model, first_x, first_y, loss)  # weights used outside their layer
    if loss is not per_sample_cross_entropy:
        check_loss_per_sample(model, first_x, first_y, loss, rows)  # a loss reading other rows (batch means)
    check_steps(epochs, batch_size, n)
    return records, batch_size


def make_private(model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 train: Data | None = None, *,
                 target_epsilon: float | None = None, noise_multiplier: float | None = None,
                 delta: float | None = None, epochs: int | None = None, batch_size: int | None = None,
                 max_grad_norm: float | Mapping[str, float] = 1.0, clipping: str = "flat",
                 masks: Mapping[str, Tensor] | None = None, masks_from: Any = None,
                 loss: Loss = per_sample_cross_entropy, accountant: str = "pld", noise_seed: int | None = None,
                 dataset_name: str = "user data", masks_private: bool = False,
                 selection_eps1: float | None = None, neighboring: str = "add_remove",
                 target_delta: float | None = None, resume_from: str | Path | None = None,
                 in_memory: bool = True, max_physical_batch_size: int | None = None,
                 noise_filter: str = "none", **opacus_names: Any) -> PrivateTraining:
    """Masked DP-SGD for a user's model, in the spirit of Opacus's `make_private_with_epsilon`.

    σ is calibrated so that `epochs` epochs (required) of Poisson batches of expected size `batch_size` meet
    (`target_epsilon`, `delta`) (Opacus's name `target_delta` works too; default 1e-5), or
    `noise_multiplier` is used and ε reported (`epochs` then only bounds the run's steps; default 1).
    The expected batch size is `batch_size`, else a DataLoader's own batch size, else 256; a DataLoader whose
    batch size differs from `batch_size` is refused (its batching is replaced by Poisson sampling, so
    one of the two would be ignored). Opacus's keyword names (`module`, `data_loader`) and its arguments
    work where dpltm does the same and are refused in one line otherwise (dpltm.opacus_names).
    `masks` (weight name → 0/1, e.g. `select_ticket(...).masks`) restrict clipping norms, sums and noise
    to the surviving weights;
    `masks_from` must then say where they came from: a string (taken on your word), or the public
    data itself / the tickets of `generate_tickets`, and then no private record may be among the
    public ones (checked). `neighboring` is "add_remove" (N treated as public; the default, as in
    Opacus) or "replace_one". `clipping="per_layer"` clips each layer's part of a record's gradient to its
    own bound (`max_grad_norm` a dict by layer name, or one float split evenly), the noise scaled to
    √(Σ C_l²). `loss(outputs, targets)` must return one loss per sample. The noise seed comes from the OS
    CSPRNG unless `noise_seed` is given (then DP holds only while it stays secret; it is never stored).

    `resume_from` (a file `PrivateTraining.save` wrote) continues that run: model, optimiser and what
    was spent are restored, and the resumed run takes the steps left of `epochs` (steps saved mid-epoch
    count); with `target_epsilon` (the whole run's budget), σ is calibrated for those steps given the
    segments spent (composed as they ran); noise and sampling draw fresh OS randomness. With `selection_eps1`
    the budget covers the ticket's selection too.

    `train` is (features, labels), a map-style Dataset (read once into tensors; `in_memory=False`
    reads it per batch: larger-than-memory data, augmentation in `__getitem__`), or a DataLoader
    (its dataset read per batch with its collate_fn; its own batching is replaced by the run's
    Poisson sampler). dpltm.private_records says why an IterableDataset is refused.

    `max_physical_batch_size` bounds the rows whose per-sample gradients are computed at once (memory): a larger
    Poisson batch runs in chunks whose clipped sums are added before the one noise draw, the same mechanism and ε.

    `noise_filter="doppler"`: the optimiser reads a low-pass filtered sequence of the noisy gradients (Zhang et al.
    2024, dpltm.dp.noise_filter) instead of each step's own; post-processing, so ε is the same. Its history is saved
    with the run, and a resume must name the same filter.
    """
    noise_filter = check_noise_filter(noise_filter, "noise_filter")
    model, optimizer, train = resolve_inputs(model, optimizer, train, opacus_names)
    check_model_and_optimizer(model, optimizer)
    owner = _OWNERS.get(optimizer)
    if resume_from is None and owner is not None and owner() is not None:  # a resume takes the optimizer over
        raise DpltmUserError("this optimizer already belongs to another private run: build a new optimizer for a new "
                             "run (two runs stepping one optimizer would each count only their own steps)")
    options = PrivacyOptions.checked(
        target_epsilon=target_epsilon, noise_multiplier=noise_multiplier, delta=delta, target_delta=target_delta,
        accountant=accountant, neighboring=neighboring, masks=masks, masks_from=masks_from,
        masks_private=masks_private, selection_eps1=selection_eps1, noise_seed=noise_seed,
        max_physical_batch_size=max_physical_batch_size,
        where_from="masks_from='public data …', or the public data or tickets themselves")
    clip, layer_clips = layer_clip_bounds(model, max_grad_norm, clipping)
    epochs = check_epochs(epochs, options.target_epsilon)
    if not isinstance(dataset_name, str) or not dataset_name:
        raise DpltmUserError("dataset_name must be a non-empty string")
    if not callable(loss):
        raise DpltmUserError("loss must be callable: loss(outputs, targets) -> one loss per sample")
    check_flag(in_memory, "in_memory")
    if not list(model.parameters()):
        raise DpltmUserError("the model has no parameters")
    records, batch_size = _checked_records(model, train, in_memory=in_memory, delta=options.delta, loss=loss,
                                           batch_size=batch_size, epochs=epochs, resuming=resume_from is not None)
    checked = check_user_masks(model, options.masks)
    provenance = _mask_provenance(masks_from, records, checked, options.masks_private)
    masks_private = options.masks_private and bool(checked)
    settings = options.train_settings(epochs=epochs, batch_size=batch_size, clip=clip, noise_filter=noise_filter)
    resumed = _resumed(resume_from, model, optimizer, checked, options, settings, len(records), masks_private)
    apply_masks(model, checked)
    plan = plan_training(settings, len(records), spent=resumed.segments.events(), steps_before=resumed.steps_before,
                         selection_eps1=options.selection_eps1)
    if not math.isfinite(plan.noise_multiplier):
        raise DpltmUserError("no finite noise multiplier meets this budget")
    seed = secrets.randbits(63) if options.noise_seed is None else int(options.noise_seed)
    run = PrivateTraining(model, optimizer, records, plan, settings, checked, provenance, loss, seed, dataset_name,
                          masks_private=masks_private, selection_eps1=options.selection_eps1, resumed=resumed,
                          layer_clips=layer_clips,
                          max_physical_batch_size=options.max_physical_batch_size)
    if run.steps_done:  # resumed: the weights loaded are the saved run's, with its steps
        note_private_step(model, run)
    return run


def _resumed(resume_from: str | Path | None, model: nn.Module, optimizer: torch.optim.Optimizer, masks: Masks,
             options: PrivacyOptions, settings: TrainSettings, n: int, masks_private: bool) -> ResumedRun:
    """The saved run `resume_from` continues (its model and optimiser loaded), checked against this call's
    settings; a fresh run's is empty."""
    if resume_from is None:
        return ResumedRun()
    provenance = RunProvenance(masks_private, options.selection_eps1, options.neighboring, settings.noise_filter)
    return resume_run(resume_from, model, optimizer, masks, noise_seed=options.noise_seed, dataset_size=n,
                      batch_size=settings.batch_size, epochs=settings.epochs, provenance=provenance,
                      target_epsilon=options.target_epsilon, delta=options.delta, accountant=options.accountant)


def _mask_provenance(masks_from: Any, records: Records, masks: Masks, masks_private: bool) -> str | None:
    """Where the masks came from, as the ledger states it (None: no masks), checked where it can be
    (`public_provenance`) unless they are declared to come from the private records."""
    if not masks:
        return None
    provenance = masks_from if masks_private else public_provenance(masks_from, records, masks)
    if provenance is None or isinstance(provenance, str):
        return provenance
    return "the private training records themselves"


def make_private_with_epsilon(model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                              train: Data | None = None, *, target_epsilon: float | None = None,
                              epochs: int | None = None, **arguments: Any) -> PrivateTraining:
    """Opacus's name: `make_private` with σ calibrated to `target_epsilon` over `epochs` (both required)."""
    if target_epsilon is None or "noise_multiplier" in arguments:
        raise DpltmUserError("make_private_with_epsilon calibrates σ: give target_epsilon and epochs, not "
                             "noise_multiplier (for a given σ, call make_private)")
    return make_private(model, optimizer, train, target_epsilon=target_epsilon, epochs=epochs, **arguments)


def get_epsilon(path: str | Path, delta: float | None = None) -> float:
    """ε of a saved run (`PrivateTraining.save`) or a `dpltm train` model at `delta` (None: the run's own δ), read
    from the privacy record stored in the file: the events that ran, composed by the run's accountant. ∞ for a
    run that is not DP end to end."""
    from dpltm.artefacts.trained_model import TrainedModel
    from dpltm.checkpoint import load_artefact
    from dpltm.privacy.accounting import check_delta
    from dpltm.privacy.ledger import PrivacyLedger, before_any_step

    target = user_path(path, "path")
    if delta is not None:
        delta = check_delta(delta)
    artefact = load_artefact(target, ("run", "model"))
    if isinstance(artefact, TrainedModel):
        return artefact.privacy.get_epsilon(delta)
    stored = artefact.get("ledger")
    if stored is None:  # no step taken: what chose the masks on the model
        return before_any_step(bool(artefact.get("masks_from") and artefact.get("masks")),
                               bool(artefact.get("masks_private")), artefact.get("selection_eps1"))[0]
    return PrivacyLedger.from_json(stored).get_epsilon(delta)


def load_model(path: str | Path) -> nn.Module:
    """The released model of a `dpltm train` checkpoint (masks included), ready for inference."""
    from dpltm.checkpoint import load_trained_model

    return load_trained_model(user_path(path, "path")).network()
