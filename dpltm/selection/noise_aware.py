"""Noise-aware ticket choice: which ticket trains best under the noise the private run will add?

The paper's score S = A·(1 − ν·C) ignores the noise: at ν = 50 it always takes the sparsest
public ticket, although a sparser ticket has less noise to absorb but also less capacity, and
the best density moves with σ, q and the number of steps. Here every candidate —
always including the dense network (C = 1) — is trained from the planned start (θ0, or with
`--rewind public` its public-trained weights) by the *planned* DP-SGD (same
effective noise multiplier σ, expected batch L, number of steps T, clip C, learning rate and
optimiser, so the noise per step σC/L is the one the private run will see) on the tickets' own
public data. A ticket wins only if it beats the dense network on the public validation records by
more than two standard errors of the paired per-record difference (`winning_index`; then the most
accurate such ticket), else the dense network does: a sparse ticket chosen on proxy noise costs
accuracy in the private run (docs/results.md, ScatterNet rows). Candidates that are chains of linear
layers (MLPs, ScatterNet's linear and MLP heads) are stacked into one set of batched kernels
(dpltm.dp.batched); convolutional ones, and candidates with frozen layers, are stepped one by one by the
private training's own step (`EachCandidate`). With successive halving (`halving`, `--halving`) only the
dense network and the better half of the tickets train on after T/2^R, …, T/2 steps.

Privacy (docs/privacy.md §7): a function of public data and public hyperparameters (σ, L, T, C, lr,
and the private set's size N, which dpltm treats as public) only. It reads no private record
and spends no ε; the private ledger records the selection as touching no private data. The
ticket data must be the public data it is run on (checked by fingerprint).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from dpltm.data.splits import derive_seed
from dpltm.data.types import DatasetSplits
from dpltm.dp.averaging import Ema, average_into
from dpltm.dp.batched import StackedMLP, correct_predictions, noisy_step
from dpltm.dp.gaussian import GaussianNoise
from dpltm.dp.sampling import MAX_DRAWS_AT_ONCE, BatchGather, poisson_batches_at_once
from dpltm.dp.step import DpSgdStep, record_terms, step_layout, takes_fused_step
from dpltm.errors import DpltmUserError, raise_if_stopping
from dpltm.feature_cache import network_inputs
from dpltm.masks import Masks, freeze_layers_, rewind, ticket_masks
from dpltm.networks.lenet import Architecture, build_network
from dpltm.settings import check_search
from dpltm.training.transfer import start_weights

if TYPE_CHECKING:
    from dpltm.artefacts import TicketRecord, TicketSet
    from dpltm.settings import TrainSettings
    from dpltm.training.plan import TrainPlan


def tan_proxy(batch: int, sigma: float, private_size: int, public_size: int,
              whole: bool = False) -> tuple[float, float]:
    """(expected batch, noise multiplier) of a run on `public_size` records that stands for a private run of
    expected batch `batch` at σ over `private_size` records: the private sampling rate, L' = L·n/N (rounded
    to a whole batch ≥ 1 with `whole`), and σ' = σ·L'/L, so σ'/L' = σ/L — the same noise per step over the
    same steps, hence the same epochs (Sander et al. 2023, "TAN without a burn", §3)."""
    scaled = batch * public_size / private_size
    if whole:
        scaled = max(1, round(scaled))
    return scaled, sigma * scaled / batch


def among_rounds(tickets: TicketSet, rounds: Iterable[int]) -> TicketSet:
    """The ticket set with only the tickets of `rounds` as candidates; the dense round 0 always among them."""
    keep = set(rounds) | {0}
    return replace(tickets, tickets=tuple(t for t in tickets.tickets if t.round in keep))


@dataclass(frozen=True)
class PlannedRun:
    """The DP training the winner will get, as far as the noise it sees is concerned."""

    noise_multiplier: float
    """Effective Gaussian multiplier σ (what the accountant sees; `dpd`'s 2σ)."""
    expected_batch_size: int
    steps: int
    clip: float
    lr: float
    optimizer: str = "sgd"
    momentum: float = 0.0
    activation: str | None = None
    """The planned run's activation (None: the tickets' own)."""
    ema: float | None = None
    """The planned run's EMA decay: candidates are then compared by their averaged weights, as
    the private run will release them (the average starts at the first iterate, as there)."""
    start: str = "init"
    """Where the planned run's weights start (`train --rewind`): θ0, each ticket's public-trained weights, or
    (a step K) the set's iterate K of public training under each mask, so each candidate is simulated from the
    start it would get."""
    output_layer: str = "reinit"
    """With a public start (`public` or K): θ0's output layer (`reinit`) or the public one (`keep`)."""
    freeze: tuple[str, ...] = ()
    """Layers the planned run holds at their start weights (`train --freeze`): held in every candidate too."""
    private_size: int | None = None
    """N, the private training set's size (public in dpltm). Given, the public run is *epoch-matched*
    (`on_public`): as many passes over the public set as the private run makes over N, with the same
    noise per step σC/L (Sander et al. 2023: runs with equal σ/L and equal steps behave alike). None: the
    private run's L and σ as they are, which on a small public set means many more passes over it."""
    ema_warmup: bool = False
    """Whether the planned run's EMA warms up (`train --ema-warmup`); the candidates' average does too."""

    @classmethod
    def of(cls, settings: TrainSettings, plan: TrainPlan, activation: str | None,
           private_size: int | None) -> PlannedRun:
        """The run `settings` describe, as `plan_training` fixed it (σ, L, steps, lr): every field read in this one
        place, so a setting the simulation must share (a frozen layer, the EMA's warm-up) is never left out."""
        return cls(plan.noise_multiplier, plan.expected_batch_size, plan.steps, settings.clip, plan.lr,
                   settings.optimizer, settings.momentum, activation, settings.ema, settings.rewind,
                   settings.output_layer, tuple(settings.freeze), private_size, settings.ema_warmup)

    def on_public(self, public_size: int) -> tuple[int, float]:
        """(expected batch, noise multiplier) of the public proxy run: L_pub = round(L·n/N) and
        σ_pub = σ·L_pub/L, so σ_pub/L_pub = σ/L exactly and T steps are the private run's epochs over n
        records; or (L, σ) when N is not given."""
        if self.private_size is None:
            return self.expected_batch_size, self.noise_multiplier
        batch, sigma = tan_proxy(self.expected_batch_size, self.noise_multiplier, self.private_size, public_size,
                                 whole=True)
        return int(batch), sigma

    def __post_init__(self) -> None:
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise DpltmUserError(f"noise multiplier must be finite and ≥ 0, got {self.noise_multiplier}")
        if self.expected_batch_size < 1 or self.steps < 1:
            raise DpltmUserError("the planned run needs a positive batch size and number of steps")


@dataclass(frozen=True)
class Candidate:
    round: int
    density: float
    public_val_accuracy: float
    gain_over_dense: float = 0.0
    """Public validation accuracy minus the dense candidate's, on the same records."""
    gain_standard_error: float = 0.0
    """The standard error of that gain from the per-record paired differences (`paired_gains`)."""
    steps: int = 0
    """The steps it trained before it was scored: the planned T, or fewer where successive halving dropped it."""
    start: str | None = None
    """Where its run started (`train --rewind`); None in records written before the choice searched starts:
    the plan's."""
    freeze: tuple[str, ...] | list[str] | None = None
    """The layers it held at their start weights (None: the plan's, as for `start`)."""
    ema: float | None = None
    """The EMA decay of the weights it was scored by; None: the final iterate (or, with `start` None, the plan's)."""
    ema_warmup: bool = False


SEARCHED_EMA = 0.999
"""The decay a searched release tries when the plan releases the final iterate (warmed up: without a warm-up
the first iterate, a pre-trained start's, keeps 0.999^T of the weight; docs/results.md)."""


@dataclass(frozen=True)
class Variant:
    """How a candidate's private run starts (`train --rewind`, with the plan's `--output-layer`), which layers
    it holds fixed (`--freeze`) and which weights it releases (`--ema`, `--ema-warmup`; `ema` None: the final
    iterate)."""

    start: str = "init"
    freeze: tuple[str, ...] = ()
    ema: float | None = None
    ema_warmup: bool = False
    output_layer: str = "reinit"


def searched_trainings(plan: PlannedRun, search: tuple[str, ...], first_layer: str | None,
                       rewind_step: int | None = None) -> list[tuple[str, tuple[str, ...]]]:
    """The (start, frozen layers) each ticket is trained under: the plan's first, then with `start` the other
    starts (θ0, θ_K where the set was made with late rewinding to `rewind_step` K, the public-trained weights),
    with `freeze` the first layer's freezing toggled at the public start (a layer held at its public
    weights, Adamczewski & Park 2023). No frozen variant when the first layer is the only one (nothing would
    train: `first_layer` None), nor when the start is fixed at θ0 (a layer frozen at random weights)."""
    trainings = [(plan.start, tuple(plan.freeze))]
    if "start" in search:
        starts = ("init", *((str(rewind_step),) if rewind_step else ()), "public")
        trainings += [(start, tuple(plan.freeze)) for start in starts if start != plan.start]
    if "freeze" in search and first_layer is not None and ("start" in search or plan.start == "public"):
        toggled = (tuple(layer for layer in plan.freeze if layer != first_layer) if first_layer in plan.freeze
                   else (first_layer, *plan.freeze))
        trainings.append(("public", toggled))
    return list(dict.fromkeys(trainings))


def freezable_first_layer(arch: Architecture) -> str | None:
    """The layer a searched `freeze` holds: the first the private network keeps from the ticket (an input
    projection is rebuilt for the private data: dpltm.training.transfer); None for a one-layer network
    (freezing its layer would leave nothing to train)."""
    names = [name for name in arch.layer_names() if name != "project"]
    return names[0] if len(names) > 1 else None


def searched_releases(plan: PlannedRun, search: tuple[str, ...]) -> list[tuple[float | None, bool]]:
    """The released weights each trained candidate is scored by: the plan's first, then with `release` the
    other kind (the final iterate for a plan that averages, else an EMA of SEARCHED_EMA with warm-up)."""
    releases = [(plan.ema, plan.ema_warmup)]
    if "release" in search:
        releases.append((None, False) if plan.ema is not None else (SEARCHED_EMA, True))
    return releases


GAIN_Z = 2.0
"""A ticket replaces the dense network only if its public gain exceeds GAIN_Z standard errors."""


def paired_gains(correct: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each candidate's accuracy gain over candidate 0 (the dense network) and its standard error, from
    the (K, n) per-record correctness on the same n validation records: d_i = c_k,i − c_0,i, gain = mean(d),
    SE = sd(d)/√n (the paired comparison; McNemar's test in normal form)."""
    diffs = correct.double() - correct[:1].double()
    n = diffs.shape[1]
    gains = diffs.mean(dim=1)
    se = diffs.std(dim=1, correction=1) / math.sqrt(n) if n > 1 else torch.full_like(gains, math.inf)
    return gains, se


def winning_index(accuracy: torch.Tensor, gains: torch.Tensor, se: torch.Tensor, z: float = GAIN_Z) -> int:
    """The dense network (0) unless some ticket beats it on the public validation records by more than
    z standard errors; then the most accurate of those (ties: the earlier round). The candidates'
    accuracies are single noisy runs on a few hundred records; the largest of K of them overstates the
    winner (the winner's curse), and a sparse ticket picked on such noise costs accuracy privately.
    The standard error covers the sampling of the validation records only, not the proxy run's own
    noise draw (a second run of the same candidate can land a point or two away): the rule screens
    out validation luck, not every difference the proxy's noise makes."""
    clear = [k for k in range(1, len(accuracy)) if float(gains[k]) > z * float(se[k])]
    if not clear:
        return 0
    return max(clear, key=lambda k: (float(accuracy[k]), -k))


@dataclass(frozen=True)
class PublicData:
    """The public data a choice ran on: the tickets' own."""

    dataset: str
    split: str
    fingerprint: str


@dataclass(frozen=True)
class NoiseAwareChoice:
    index: int
    """Index of the winner in the ticket set's `tickets` list."""
    candidates: list[Candidate]
    plan: PlannedRun
    public_data: PublicData
    rungs: tuple[int, ...] = ()
    """The steps after which successive halving scored and halved the candidates (none: every one trained T)."""
    searched: tuple[str, ...] = ()
    """What the choice searched besides the ticket (SEARCHABLE); none: every candidate ran as planned."""
    chosen: Variant | None = None
    """The winner's start, frozen layers and release (`train` runs the winner so); None: the plan's."""

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "candidates": [asdict(c) for c in self.candidates],
                "plan": asdict(self.plan), "public_data": asdict(self.public_data), "halving_rungs": list(self.rungs),
                "searched": list(self.searched), "chosen": None if self.chosen is None else asdict(self.chosen)}

    def ticket_scores(self) -> list[float]:
        """Each ticket's best public validation accuracy over its variants (one per ticket, in the set's order)."""
        best: dict[int, float] = {}
        for c in self.candidates:
            best[c.round] = max(best.get(c.round, -math.inf), c.public_val_accuracy)
        return list(best.values())


def candidate_model(tickets: TicketSet, ticket: TicketRecord, device: torch.device, activation: str | None,
                    start: str, output_layer: str, freeze: tuple[str, ...],
                    ) -> tuple[torch.nn.Module, Masks, dict[str, torch.Tensor]]:
    """One ticket as a network at its planned start with `freeze` held, its masks, and the start weights: θ0,
    (`start="public"`) the weights its public IMP round ended with, or (a step K) the set's θ_K, as `train
    --rewind` would start it (dpltm.training.transfer.start_weights); with the planned run's activation when it
    differs from the tickets' own."""
    arch = Architecture.from_dict(tickets.architecture)
    if activation is not None:
        arch = replace(arch, activation=activation)
    weights = start_weights(tickets.theta0, ticket.trained, tickets.rewind_point, arch, start, output_layer,
                            arch.num_classes)
    model = build_network(arch).to(device)
    masks = rewind(model, weights, ticket_masks(ticket.masks))
    freeze_layers_(model, freeze)
    return model, masks, weights


def _searched_models(tickets: TicketSet, plan: PlannedRun, search: tuple[str, ...], device: torch.device,
                     ) -> tuple[list[torch.nn.Module], list[Masks], list[tuple[int, str, tuple[str, ...]]]]:
    """Every (ticket, start, frozen layers) the choice trains, the plan's own first for each ticket; a
    variant is left out where the ticket has no public weights (an older ticket set) and where it would
    train exactly as one before it (e.g. a public start whose only trained layer is re-initialised)."""
    arch = Architecture.from_dict(tickets.architecture)
    trainings = searched_trainings(plan, search, freezable_first_layer(arch), tickets.rewind_step or None)
    models, masks, rows = [], [], []
    for k, ticket in enumerate(tickets.tickets):
        seen: list[tuple[dict[str, torch.Tensor], tuple[str, ...]]] = []
        for j, (start, freeze) in enumerate(trainings):
            if j and start == "public" and ticket.trained is None:
                continue
            model, ms, weights = candidate_model(tickets, ticket, device, plan.activation, start,
                                                 plan.output_layer if start != "init" else "reinit", freeze)
            if any(frozen == freeze and weights.keys() == w.keys() and all(torch.equal(weights[n], w[n]) for n in w)
                   for w, frozen in seen):
                continue
            seen.append((weights, freeze))
            models.append(model)
            masks.append(ms)
            rows.append((k, start, freeze))
    return models, masks, rows


def _optimizer(parameters: list[torch.nn.Parameter], plan: PlannedRun) -> torch.optim.Optimizer:
    """The planned run's optimiser; element-wise, so one over every candidate's parameters is K
    independent ones."""
    if plan.optimizer == "adam":
        return torch.optim.Adam(parameters, lr=plan.lr)
    return torch.optim.SGD(parameters, lr=plan.lr, momentum=plan.momentum)


def stacks(model: torch.nn.Module) -> bool:
    """Whether candidates of this network train stacked (`StackedMLP`): a network of the fused step with no
    convolution, i.e. a chain of linear layers over its inputs (an MLP, a ScatterNet linear or MLP head)."""
    return takes_fused_step(model) and not model.conv_layers_in_order()


class EachCandidate:
    """Candidates of any architecture (convolutional ones included), each stepped in turn by the DP
    training's own step (dpltm.dp.step: masked per-sample clipping, Gaussian noise on the surviving
    coordinates, over L): the same Poisson batch for all of them, an independent noise draw each."""

    def __init__(self, models: list[torch.nn.Module], masks: list[Masks], plan: PlannedRun,
                 dtype: torch.dtype) -> None:
        self.models, self.plan = models, plan
        noise = GaussianNoise(plan.noise_multiplier)
        self.steps = [DpSgdStep(model, step_layout(model, ms, dtype), plan.clip, noise, plan.expected_batch_size,
                                torch.Generator()) for model, ms in zip(models, masks)]

    def use_records(self, records: torch.Tensor) -> None:
        """Each candidate's per-record norm tables over the records its batches are drawn from."""
        self.steps = [replace(s, terms=record_terms(s.model, s.layout, records)) for s in self.steps]

    @property
    def size(self) -> int:
        return len(self.models)

    def keep(self, positions: list[int]) -> None:
        """Only the candidates at `positions` go on (successive halving)."""
        self.models = [self.models[k] for k in positions]
        self.steps = [self.steps[k] for k in positions]

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for model in self.models for p in model.parameters()]

    def step(self, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
             generator: torch.Generator, index: torch.Tensor | None = None) -> None:
        """One DP step of every candidate on the batch (x, y): rows `index` of the records given to
        `use_records` (None: no tables), each candidate's ĝ installed, then one optimiser step for all."""
        raise_if_stopping()
        self.steps = [dp if dp.generator is generator else replace(dp, generator=generator) for dp in self.steps]
        for dp in self.steps:
            dp.apply(dp.gradients(x, y, index))  # a frozen parameter gets no ĝ and no update
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def correct(self, x: torch.Tensor, y: torch.Tensor, batch_size: int = 4096) -> torch.Tensor:
        """Whether each candidate's top-1 prediction is right, per record: shape (K, n), on the CPU."""
        rows = []
        for model in self.models:
            parts = [(model(x[start:start + batch_size]).argmax(dim=1) == y[start:start + batch_size]).cpu()
                     for start in range(0, len(y), batch_size)]
            rows.append(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool))
        return torch.stack(rows)


def rung_steps(steps: int, halving: int) -> list[int]:
    """The steps after which successive halving scores and halves the candidates: T/2^R, …, T/4, T/2 for
    R = `halving` rungs (budgets doubling from rung to rung, Jamieson & Talwalkar 2016); none for R = 0."""
    if halving < 0:
        raise DpltmUserError(f"--halving must be ≥ 0, got {halving}")
    points = sorted({steps >> r for r in range(1, halving + 1)} - {0})
    return [s for s in points if 0 < s < steps]


def halving_keep(correct: torch.Tensor) -> list[int]:
    """Which candidates (rows of the (K, n) per-record correctness) go on to the next rung: the dense
    network (row 0, which every ticket is compared with at the end) and the more accurate half of the
    tickets, ⌈(K − 1)/2⌉ of them (ties: the earlier row)."""
    accuracy = correct.double().mean(dim=1)
    tickets = sorted(range(1, correct.shape[0]), key=lambda k: (-float(accuracy[k]), k))
    return [0, *sorted(tickets[:math.ceil(len(tickets) / 2)])]


def noise_aware_choice(tickets: TicketSet, public: DatasetSplits, plan: PlannedRun, *,
                       seed: int | None = None, halving: int = 0, search: tuple[str, ...] = (),
                       on_progress: Callable[[int, int], None] | None = None) -> NoiseAwareChoice:
    """Train every ticket of `tickets` under `plan` on `public` (its own data) and pick the best.

    `search` (SEARCHABLE): the choice also tries each ticket from the other start, with the first layer
    frozen at its public weights, and scores both the final iterate and an EMA of the same run; every
    such variant is a candidate of its own, compared with the dense network run as planned (the reference,
    which a variant must beat by the same two-standard-error rule) and the winner's variant is recorded
    (`NoiseAwareChoice.chosen`) for `train` to run.

    `halving` R > 0: successive halving. After T/2^R, …, T/2 steps every network still in is scored on
    the public validation records (by the better of the weights it would release) and only the dense network
    as planned and the better half of the others train on; a dropped candidate reports
    its score at the step it stopped (`Candidate.steps`). Five candidates with R = 2 cost 3 full runs
    instead of 5. The winner is chosen among those that trained all T steps, by the same rule."""
    if public.fingerprint != tickets.fingerprint:
        raise DpltmUserError("the noise-aware choice runs on the tickets' own (public) data: the data given "
                             f"({public.name}, {public.source_split}) is not the data that made them")
    if not tickets.tickets or tickets.tickets[0].density != 1.0:
        raise DpltmUserError("the ticket set has no dense round 0: the dense network must be a candidate")
    search = check_search(search)
    rungs = rung_steps(plan.steps, halving)
    n = len(public.train)
    batch, sigma = plan.on_public(n)
    if batch >= n:
        raise DpltmUserError(f"the planned batch size {batch} is not below the public training set ({n} records): "
                             "no Poisson sampling to simulate")
    if len(public.val) == 0:
        raise DpltmUserError("the tickets' data has no validation records to compare the candidates on")
    proxy = replace(plan, expected_batch_size=batch, noise_multiplier=sigma)  # what the candidates train under
    device = public.train.labels.device
    models, masks, trainings = _searched_models(tickets, plan, search, device)
    releases = searched_releases(plan, search)
    public = network_inputs(models[0], public)  # a fixed front end's cached features (dpltm.feature_cache)
    stack: StackedMLP | EachCandidate = (
        StackedMLP(models, masks) if stacks(models[0]) and not any(freeze for _, _, freeze in trainings)
        else EachCandidate(models, masks, proxy, public.train.features.dtype))
    first_terms = None
    if isinstance(stack, EachCandidate):
        stack.use_records(public.train.features)
    else:
        first_terms = stack.first_layer_terms(public.train.features)
    optimizer = _optimizer(stack.parameters(), plan)
    base = secrets.randbits(63) if seed is None else seed
    generator = torch.Generator(device=device).manual_seed(base)  # the noise
    sampling = torch.Generator(device=device).manual_seed(derive_seed(base, "noise-aware sampling"))  # its own
    # stream: batches drawn ahead (poisson_steps) leave the noise as a run of any length draws it
    q = batch / n
    x_all, y_all = public.train.features, public.train.labels
    averaged: list[torch.Tensor] | None = None
    averaging = next(((decay, warmup) for decay, warmup in releases if decay is not None), None)
    ema = None if averaging is None else Ema.of(*averaging)
    count = torch.zeros((), dtype=torch.long, device=device)
    gather = BatchGather()  # one kept buffer for every step's rows (its docstring: why)
    alive = list(range(len(trainings)))  # which trained networks the stack's rows are
    scored: dict[tuple[int, int], Candidate] = {}
    halved: list[int] = []
    for step, index in enumerate(poisson_steps(n, q, plan.steps, sampling, device)):
        x, y = gather(x_all, index), y_all.index_select(0, index)
        if isinstance(stack, EachCandidate):
            stack.step(optimizer, x, y, generator, index)
        else:
            noisy_step(stack, optimizer, x, y, clip=plan.clip, noise_multiplier=sigma, expected_batch_size=batch,
                       generator=generator,
                       first_terms=None if first_terms is None else first_terms.index_select(0, index))
        if ema is not None:  # the private run's average, by the same rule (EMA_1 = θ_1)
            if averaged is None:
                averaged = [p.detach().clone() for p in stack.parameters()]
            average_into(averaged, [p.detach() for p in stack.parameters()], count, ema)
        if step + 1 in rungs and len(alive) > 2:
            correct = _released_correct(stack, averaged, public, releases)  # (networks, releases, n)
            keep = halving_keep(_best_release(correct))
            scored.update({key: c for key, c in _scored(tickets, trainings, releases, alive, correct, step + 1).items()
                           if alive.index(key[0]) not in keep})
            alive = [alive[k] for k in keep]
            halved.append(step + 1)
            optimizer, averaged, first_terms = _keep_rows(stack, keep, optimizer, plan, averaged, first_terms)
        if on_progress is not None:
            on_progress(step + 1, plan.steps)
    correct = _released_correct(stack, averaged, public, releases)
    finished = _scored(tickets, trainings, releases, alive, correct, plan.steps)
    scored.update(finished)
    keys = list(finished)  # the reference (network 0 as planned, the plan's release) first
    accuracy, gains, se = (torch.tensor([[c.public_val_accuracy, c.gain_over_dense, c.gain_standard_error]
                                         for c in finished.values()], dtype=torch.float64).T)
    network, release = keys[winning_index(accuracy, gains, se)]
    ticket, start, freeze = trainings[network]
    chosen = Variant(start, freeze, *releases[release], plan.output_layer) if search else None
    return NoiseAwareChoice(ticket, [scored[key] for key in sorted(scored)], plan,
                            PublicData(public.name, public.source_split, public.fingerprint),
                            tuple(halved), search, chosen)


def poisson_steps(n: int, sample_rate: float, steps: int, generator: torch.Generator,
                  device: torch.device) -> Iterator[torch.Tensor]:
    """The candidates' Poisson batches, step by step, drawn a block of steps at a time
    (`poisson_batches_at_once`, at most `MAX_DRAWS_AT_ONCE` draws held): a batch drawn at its own step
    costs a host synchronisation (its size) every step, which on a GPU stalls the queue of launches."""
    block = max(1, MAX_DRAWS_AT_ONCE // max(n, 1))
    for start in range(0, steps, block):
        yield from poisson_batches_at_once(n, sample_rate, min(block, steps - start), generator, device)


def _scored(tickets: TicketSet, trainings: list[tuple[int, str, tuple[str, ...]]],
            releases: list[tuple[float | None, bool]], alive: list[int], correct: torch.Tensor,
            steps: int) -> dict[tuple[int, int], Candidate]:
    """The candidates of the networks `alive` (rows of `correct`, (networks, releases, n), the reference
    network first) under each release, keyed by (network, release), with their public scores: gains are
    paired against network 0's first release (the dense network as planned)."""
    flat = correct.reshape(-1, correct.shape[-1])
    scores = flat.double().mean(dim=1)
    gains, se = paired_gains(flat)
    out = {}
    for row, (s, g, e) in enumerate(zip(scores.tolist(), gains.tolist(), se.tolist())):
        network, release = alive[row // len(releases)], row % len(releases)
        ticket, start, freeze = trainings[network]
        t = tickets.tickets[ticket]
        decay, warmup = releases[release]
        out[(network, release)] = Candidate(t.round, float(t.density), float(s), float(g), float(e), steps,
                                            start, freeze, decay, warmup)
    return out


def _best_release(correct: torch.Tensor) -> torch.Tensor:
    """(networks, n): each network's per-record correctness under the release it scores best with."""
    best = correct.double().mean(dim=2).argmax(dim=1)
    return correct[torch.arange(correct.shape[0]), best]


@torch.no_grad()
def _released_correct(stack: StackedMLP | EachCandidate, averaged: list[torch.Tensor] | None,
                      public: DatasetSplits, releases: list[tuple[float | None, bool]]) -> torch.Tensor:
    """Per-record correctness on the public validation records of what each network's run would release,
    shape (networks, releases, n): the current iterate for a release without EMA, else the average (swapped
    in for the evaluation, then back)."""
    def evaluate() -> torch.Tensor:
        return (stack.correct(public.val.features, public.val.labels) if isinstance(stack, EachCandidate)
                else correct_predictions(stack, public.val.features, public.val.labels))

    final = evaluate() if any(decay is None for decay, _ in releases) else None
    mean = None
    if averaged is not None:
        parameters = stack.parameters()
        current = [p.detach().clone() for p in parameters]
        for p, a in zip(parameters, averaged):
            p.copy_(a)
        mean = evaluate()
        for p, saved in zip(parameters, current):
            p.copy_(saved)
    return torch.stack([final if decay is None else mean for decay, _ in releases], dim=1)


def _keep_rows(stack: StackedMLP | EachCandidate, keep: list[int], optimizer: torch.optim.Optimizer,
               plan: PlannedRun, averaged: list[torch.Tensor] | None, first_terms: torch.Tensor | None,
               ) -> tuple[torch.optim.Optimizer, list[torch.Tensor] | None, torch.Tensor | None]:
    """Only the candidates `keep` go on: the stack, its optimiser (with each kept candidate's state, e.g.
    momentum), its average and its first-layer table lose the others' rows."""
    before = stack.parameters()
    if isinstance(stack, EachCandidate):  # the kept networks are the same modules: the optimiser goes on as it
        per_candidate = len(before) // stack.size  # is (a dropped network gets no gradient again: it skips it)
        if averaged is not None:
            averaged = [averaged[k * per_candidate + j] for k in keep for j in range(per_candidate)]
        stack.keep(keep)
        return optimizer, averaged, first_terms
    rows = torch.tensor(keep, device=before[0].device)
    if first_terms is not None:  # (n, K·out) → the kept candidates' columns
        n, out = first_terms.shape[0], stack.masks[0].shape[1]
        first_terms = first_terms.reshape(n, stack.size, out).index_select(1, rows).reshape(n, -1)
    if averaged is not None:
        averaged = [a.index_select(0, rows) for a in averaged]
    stack.keep(keep)  # new leaf tensors: a new optimiser, with the kept rows of each state tensor
    fresh = _optimizer(stack.parameters(), plan)
    for old, new in zip(before, stack.parameters()):
        fresh.state[new] = {name: value.index_select(0, rows) if torch.is_tensor(value) and value.dim() > 0
                            else value for name, value in optimizer.state.get(old, {}).items()}
    return fresh, averaged, first_terms
