"""The settings of each stage as frozen dataclasses, each checking its own values in one line per mistake.

A resolved configuration (dpltm.config) is built from these; a library caller can build them directly and
gets the same checks.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from dpltm.choices import NoiseFilterName, Optimizer, OutputLayer, PrivatePrune, Rewind
from dpltm.data.views import MAX_AUGMULT
from dpltm.errors import DpltmUserError
from dpltm.networks.lenet import ACTIVATIONS, ARCHS
from dpltm.privacy.accountants import accountant_entry
from dpltm.privacy.accounting import check_neighboring, check_target_epsilon
from dpltm.privacy.events import MAX_NOISE_MULTIPLIER, MIN_NOISE_MULTIPLIER
from dpltm.privacy.exponential import check_eps1

#: The largest learning rate accepted: far beyond any that trains (the paper uses 0.1); larger
#: ones only turn the weights into inf/NaN.
MAX_LR = 1e3

#: The most SGD iterations per ticket `generate` runs (paper: 5000); a loss curve is kept per ticket.
MAX_ITERATIONS = 1_000_000

MAX_ROUNDS = 100

MAX_CLIP = 1e6
"""Per-sample gradient norms of the networks dpltm trains are O(1)–O(100); C above this only scales the noise."""

MIN_CLIP = 1e-6
"""The smallest clipping norm C: float32 resolves about 7 digits (and 1e-38 is its smallest normal number), so
clipped gradients of norm C and the noise σ·C at this size would lose all precision beside the O(0.01–1) weights
they update, and far below it they round to 0 or to denormals (C = 1e-300 is 0 in float32): no training at all.
Compared with a relative slack of 1e-6 (`check_clip_range`), so 1e-6 read back from float32 is still 1e-6."""


def check_clip_range(clip: float, name: str) -> None:
    """C within [MIN_CLIP, MAX_CLIP] (`name`: the flag or argument that gave it), the one check of the CLI's
    settings and the API's `max_grad_norm`."""
    if clip > MAX_CLIP:  # the noise σC swamps float32 weights: a run that can only diverge
        raise DpltmUserError(f"{name} must be at most {MAX_CLIP:g} (the noise is σ·C per coordinate), got {clip:g}")
    if clip < MIN_CLIP * (1 - 1e-6):  # the clipped sums and the noise σC vanish in float32: a run that cannot move
        raise DpltmUserError(f"{name} must be at least {MIN_CLIP:g} (below it the clipped gradients and the noise "
                             f"σ·C lose all precision in float32), got {clip:g}")


#: Seeds are non-negative and fit in 63 bits (what torch and numpy generators accept).
MAX_SEED = 2**63 - 1


def _require_positive(option: str, value: float | None) -> None:
    """One-line user error unless `value` (when given) is > 0 (NaN fails too)."""
    if value is not None and not value > 0:
        raise DpltmUserError(f"{option} must be positive, got {value}")


def _require_count(option: str, value: object) -> None:
    """One-line user error unless `value` (when given) is a whole number ≥ 1 (a bool is no count)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise DpltmUserError(f"{option} must be an integer, got {value!r}")
    if value < 1:
        raise DpltmUserError(f"{option} must be at least 1, got {value}")


#: Settings whose CLI option is not their field name with dashes.
OPTION_OF_FIELD = {"eps2": "--eps"}


def _require_finite(settings: Any) -> None:
    """One-line user error for any inf/NaN float field (or element of a float tuple)."""
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, float) and not math.isfinite(v):
                option = OPTION_OF_FIELD.get(f.name, f"--{f.name.replace('_', '-')}")
                raise DpltmUserError(f"{option} must be a finite number, got {v}")


def _require_lr(lr: float) -> None:
    if not 0.0 < lr <= MAX_LR:
        raise DpltmUserError(f"--lr must lie in (0, {MAX_LR:g}], got {lr:g}")


def _require_seed(seed: int) -> None:
    if not 0 <= seed <= MAX_SEED:
        raise DpltmUserError(f"--seed must lie in [0, 2**63 - 1], got {seed}")


@dataclass(frozen=True)
class DataSettings:
    dataset: str = "kmnist"
    split: str = "train"
    val_fraction: float = 0.1

    def __post_init__(self) -> None:
        _require_finite(self)
        from dpltm.data.loaders import MAX_VAL_FRACTION  # the loader's own bound, stated once

        if not 0.0 <= self.val_fraction < MAX_VAL_FRACTION:
            raise DpltmUserError(f"--val-fraction must lie in [0, {MAX_VAL_FRACTION:g}), got {self.val_fraction}")


@dataclass(frozen=True)
class ModelSettings:
    """Hidden widths (and an optional input projection); the size limit needs the dataset's input
    width, so `resolve_generate_config` checks it (and `model.Architecture` checks it again).

    `activation` is the hidden layers' (relu, the paper's; or tanh, bounded: Papernot et al. 2021).
    Training uses it for the network it trains, a ticket's included (dpltm.training.transfer)."""

    hidden: tuple[int, ...] = (300, 100)
    project_to: int | None = None
    activation: str = "relu"
    arch: str = "mlp"
    """mlp (the paper's), or lenet5: LeNet-5's two 5×5 convolutions (6 and 16 maps, each followed by the
    activation and 2×2 average pooling) in front of the `hidden` layers (28×28 images only)."""

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise DpltmUserError(f"--arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        if self.arch != "mlp" and self.project_to is not None:
            raise DpltmUserError("--project-to applies to --arch mlp")
        if any(h < 1 for h in self.hidden):
            raise DpltmUserError(f"--hidden takes positive integers, got {list(self.hidden)}")
        _require_positive("--project-to", self.project_to)
        if self.activation not in ACTIVATIONS:
            raise DpltmUserError(f"--activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")


MAX_NU = 1e6
"""The score's density weight ν: beyond this S = A·(1 − ν·C) is −ν·C to every digit a float keeps, so
the accuracy no longer counts; ν up to 1e6 leaves room for any sane sweep."""


@dataclass(frozen=True)
class GenerateSettings:
    """Phase 1 (paper §4.2): 5000 iterations per ticket, batch 400, SGD at lr 0.1."""

    rounds: int = 10
    iterations: int = 5000
    batch_size: int = 400
    lr: float = 0.1
    prune_rates: tuple[float, ...] | None = None  # None: 0.3 per layer, 0.2 for the output
    min_density: float = 0.01
    controls: bool = False
    log_every: int = 100
    rewind_step: int = 0
    """K: every round after the first rewinds to the dense network's weights after K steps of round 0 (and trains
    the remaining iterations − K), not to θ0: IMP with late rewinding (Frankle et al. 2020, "Linear mode
    connectivity and the lottery ticket hypothesis"). 0: θ0 (Frankle & Carbin 2019, the paper's). The ticket
    set keeps that iterate, where `train --rewind K` starts."""

    def __post_init__(self) -> None:
        _require_finite(self)
        if not 0 <= self.rounds <= MAX_ROUNDS:
            raise DpltmUserError(f"--rounds must lie in [0, {MAX_ROUNDS}] (at 20–30 % pruned a round, 100 rounds leave "
                                 f"under 1e-9 of the weights), got {self.rounds}")
        _require_positive("--iterations", self.iterations)
        if self.iterations > MAX_ITERATIONS:
            raise DpltmUserError(f"--iterations must be at most {MAX_ITERATIONS} per ticket (the paper uses 5000), "
                                 f"got {self.iterations}")
        if not 0 <= self.rewind_step < self.iterations:
            raise DpltmUserError(f"--rewind-step must lie in [0, --iterations) = [0, {self.iterations}) (the iterate "
                                 f"of round 0 every later round rewinds to), got {self.rewind_step}")
        _require_positive("--batch-size", self.batch_size)
        _require_lr(self.lr)
        if not 0.0 <= self.min_density < 1.0:
            raise DpltmUserError(f"--min-density must lie in [0, 1), got {self.min_density}")
        _require_positive("log_every", self.log_every)
        for rate in self.prune_rates or ():
            if not 0.0 < rate < 1.0:
                raise DpltmUserError(f"prune rates must lie in (0, 1), got {rate}")


@dataclass(frozen=True)
class GenerateConfig:
    data: DataSettings = field(default_factory=DataSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    generate: GenerateSettings = field(default_factory=GenerateSettings)
    seed: int = 0

    def __post_init__(self) -> None:
        _require_seed(self.seed)


MAX_HALVING = 10
"""More rungs than this would score candidates after under T/1000 steps."""


@dataclass(frozen=True)
class SelectSettings:
    """Phase 2 (paper §4.2): ε1 = 10 % of the budget, ν = 50."""

    eps1: float = 0.1
    nu: float = 50.0
    halving: int = 0
    """Rungs of successive halving in the noise-aware choice (dpltm.selection.noise_aware.rung_steps); 0: every
    candidate trains the whole planned run."""
    search: tuple[str, ...] = ()
    """What the noise-aware choice searches besides the ticket (SEARCHABLE); the winner's variant is what
    `train` then runs, below the --config file and flags."""

    def __post_init__(self) -> None:
        _require_finite(self)
        check_eps1(self.eps1, "--eps1")
        object.__setattr__(self, "search", check_search(self.search))
        if not 0 <= self.halving <= MAX_HALVING:
            raise DpltmUserError(f"--halving must lie in [0, {MAX_HALVING}] (rungs after T/2, T/4, …), got "
                                 f"{self.halving}")
        if not 0 <= self.nu <= MAX_NU:
            raise DpltmUserError(f"--nu must lie in [0, {MAX_NU:g}] (S = A·(1 − ν·C) with C ≤ 1: the paper uses "
                                 f"0.1 to 1), got {self.nu}")


SEARCHABLE = ("start", "release", "freeze")
"""What the noise-aware choice may change besides the ticket (`select.search`, `--search`):
where the run starts (θ0 or the ticket's public-trained weights), what it releases (the final iterate or an
EMA with warm-up), and whether the first layer is held at its public weights
(dpltm.selection.noise_aware.searched_trainings, searched_releases)."""


def check_search(search: Any) -> tuple[str, ...]:
    """`search` as a tuple of known dimensions, in SEARCHABLE's order; a one-line refusal of anything else."""
    if isinstance(search, str) or not isinstance(search, (list, tuple)) or not all(isinstance(d, str) for d in search):
        raise DpltmUserError(f"--search takes a list of {', '.join(SEARCHABLE)}, got {search!r}")
    if tuple(d.strip().lower() for d in search) == ("none",):  # `search: none` in a config file, as on the CLI
        return ()
    unknown = [d for d in search if d not in SEARCHABLE]
    if unknown:
        raise DpltmUserError(f"--search: unknown {', '.join(map(repr, unknown))}; choose among "
                             f"{', '.join(SEARCHABLE)}")
    return tuple(d for d in SEARCHABLE if d in set(search))


OPTIMIZERS = tuple(choice.value for choice in Optimizer)

NOISE_FILTERS = tuple(choice.value for choice in NoiseFilterName)
"""`train.noise_filter`: none, or a low-pass filter over the noisy gradients (dpltm.dp.noise_filter)."""


def check_noise_filter(name: Any, what: str = "--noise-filter") -> str:
    """A filter's name (`train.noise_filter`, `make_private`/`DPCallback`'s noise_filter), or one line refusing it."""
    if not isinstance(name, str) or name not in NOISE_FILTERS:
        raise DpltmUserError(f"{what} must be one of {', '.join(NOISE_FILTERS)}, got {name!r}")
    return name

TICKET_STARTS = ("init", "public")
"""`train.rewind`: a ticket's training starts from θ0 or from the weights its public IMP round ended with
(dpltm.training.transfer.start_weights), or from iterate K of public training (a step number, `late_rewind_step`)."""


def late_rewind_step(start: str | int) -> int | None:
    """K of a start that names a step of public training (`--rewind K`, late rewinding: Frankle et al. 2020),
    None for `init` and `public`; anything else is refused in one line."""
    if isinstance(start, str) and start in TICKET_STARTS:
        return None
    text = str(start) if isinstance(start, (str, int)) and not isinstance(start, bool) else ""
    if re.fullmatch(r"[0-9]{1,7}", text) and int(text) >= 1:
        return int(text)
    raise DpltmUserError(f"--rewind must be init, public or a step K ≥ 1 of public training (late rewinding; the "
                         f"tickets made with generate --rewind-step K), got {start!r}")


def canonical_start(start: str | int) -> str:
    """A start as stored and compared: `init`, `public`, or K's digits without leading zeros."""
    step = late_rewind_step(start)
    return str(start) if step is None else str(step)


def describe_start(start: str) -> str:
    """Where a start (`train --rewind`) takes a ticket's weights from, in words: every message and report says it so."""
    if start == "public":
        return "its public-trained weights"
    return "θ0" if start == "init" else f"its iterate {start} of public training (late rewinding)"


OUTPUT_LAYERS = tuple(choice.value for choice in OutputLayer)
"""`train.output_layer`: a public start's output layer, θ0's or the public-trained one."""


@dataclass(frozen=True)
class TrainSettings:
    """Phase 3 (paper §4.2): 50 epochs, expected batch 400, clip 1, lr 0.1, δ = 1e-5."""

    epochs: int = 50
    batch_size: int = 400
    clip: float = 1.0
    lr: float = 0.1
    optimizer: str = "sgd"
    noise: str = "gaussian"
    eps2: float | None = 0.9
    sigma: float | None = None
    delta: float = 1e-5
    accountant: str = "pld"
    neighboring: str = "add_remove"
    max_eps: float | None = None
    patience: int | None = None
    momentum: float = 0.0
    """SGD momentum on the privatized gradients (post-processing); 0: plain SGD (sgd only)."""
    ema: float | None = None
    """Decay of an exponential moving average of the iterates, evaluated and released instead of
    the final iterate (post-processing of the released iterates, docs/privacy.md §7); None: off."""
    ema_warmup: bool = False
    """Warm the EMA up (decay_t = min(ema, (1 + t)/(10 + t)), TensorFlow's rule): without it the first
    iterates keep a large weight (decay^T), which drags a public-trained start back (dpltm.dp.averaging)."""
    noise_filter: str = "none"
    """A low-pass filter over the released noisy gradients, read by the optimiser instead of them (doppler: Zhang et
    al. 2024, dpltm.dp.noise_filter); post-processing of DP outputs, so no ε. none: the optimiser reads ĝ itself.
    DP runs only: the non-private baseline keeps the plain recipe."""
    lr_sigma: float | None = None
    """When set, a DP run's learning rate is lr_sigma / σ (σ the effective noise multiplier, a
    function of public q, T, ε and δ only), so the noise an update carries, lr·σC/L, stays the same
    across budgets; chosen on public data (configs/recipes/tuned.yaml). Non-private runs use `lr`."""
    rewind: str | int = "init"
    """Where a ticket's training starts: θ0 (init, the paper's), the weights its public IMP round ended
    with (public: the public training is kept; public data adds nothing to the privacy ledger), or K, the
    iterate K steps into public training that late-rewound tickets keep (`generate --rewind-step K`). Public
    starts are refused for tickets made on the private data itself (dpltm.training.pipeline.check_start).
    Stored as a string ("init", "public", "500")."""
    output_layer: str = "reinit"
    """With rewind public: θ0's output layer (reinit; the public one was trained for other classes) or the
    public-trained one (keep, only for as many classes)."""
    freeze: tuple[str, ...] = ()
    """Layers (e.g. hidden.0) held at their start weights — public-trained with rewind public, else θ0 —
    and not trained: no clipped gradient, no noise, no update (dpltm.masks.freeze_layers_). Public
    knowledge: nothing is added to the privacy ledger."""
    physical_batch: int | None = None
    """The most rows whose per-sample gradients are computed at once (memory); a larger Poisson batch runs in
    chunks whose clipped sums are added before the one noise draw: the same mechanism and ε. None: no limit."""
    augmult: int = 1
    """K, augmentation multiplicity (De et al. 2022, §3): each record's gradient is the mean of its loss's gradients
    over K fixed shifted views (dpltm.data.views), taken *before* clipping, so it is still one record's and its
    clipped norm ≤ C: the sensitivity, the Poisson sampling over records and ε are unchanged. 1: the record alone."""

    def __post_init__(self) -> None:
        _require_finite(self)
        _require_count("--physical-batch", self.physical_batch)
        _require_count("--augmult", self.augmult)
        if self.augmult > MAX_AUGMULT:
            raise DpltmUserError(f"--augmult must lie in [1, {MAX_AUGMULT}] (the fixed shifted views of a record, "
                                 f"dpltm.data.views), got {self.augmult}")
        _require_positive("--epochs", self.epochs)
        _require_positive("--batch-size", self.batch_size)
        _require_positive("--clip", self.clip)
        check_clip_range(self.clip, "--clip")
        _require_lr(self.lr)
        if self.optimizer not in OPTIMIZERS:
            raise DpltmUserError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer}")
        if self.eps2 is not None:
            check_target_epsilon(self.eps2, "--eps")
        if self.sigma is not None and not self.sigma >= MIN_NOISE_MULTIPLIER:
            raise DpltmUserError(f"--sigma must be at least {MIN_NOISE_MULTIPLIER:g} (less gives no meaningful "
                                 f"privacy), got {self.sigma:g}")
        if self.sigma is not None and self.sigma > MAX_NOISE_MULTIPLIER:
            raise DpltmUserError(f"--sigma must be at most {MAX_NOISE_MULTIPLIER:g} (more noise drowns every "
                                 f"gradient, and the accountants cannot state its tiny ε), got {self.sigma:g}")
        if not 0 < self.delta < 1:
            raise DpltmUserError(f"--delta must lie in (0, 1), got {self.delta}")
        if self.max_eps is not None:
            check_target_epsilon(self.max_eps, "--max-eps")
            if self.sigma is None and self.eps2 is not None and self.max_eps >= self.eps2:
                raise DpltmUserError(f"--max-eps {self.max_eps:g} cannot stop a run whose σ is calibrated to spend "
                                     f"--eps {self.eps2:g} in all: drop --max-eps, or give --sigma and cap its ε")
        _require_positive("--patience", self.patience)
        accountant_entry(self.accountant, "--accountant").check_delta(self.delta)
        # the CLI's and the API's spellings (replace-one) too, stored in the accountant's (replace_one)
        object.__setattr__(self, "neighboring", check_neighboring(self.neighboring))
        if not 0.0 <= self.momentum < 1.0:
            raise DpltmUserError(f"--momentum must lie in [0, 1), got {self.momentum:g}")
        if self.momentum and self.optimizer != "sgd":
            raise DpltmUserError(f"--momentum is for --optimizer sgd ({self.optimizer} keeps its own moments)")
        check_noise_filter(self.noise_filter)
        if self.lr_sigma is not None and not 0.0 < self.lr_sigma <= MAX_LR:
            raise DpltmUserError(f"--lr-sigma must lie in (0, {MAX_LR:g}], got {self.lr_sigma:g}")
        if self.ema is not None and not 0.0 < self.ema < 1.0:
            raise DpltmUserError(f"--ema must lie in (0, 1), got {self.ema:g}")
        if self.ema_warmup and self.ema is None:  # checked once the layers merge (the decay may come from
            # another), and for settings built directly (the API, the grid): never a silent no-op
            raise DpltmUserError("--ema-warmup (train.ema_warmup) warms up the moving average of the iterates: give "
                                 "its decay too, --ema DECAY (train.ema)")
        object.__setattr__(self, "rewind", canonical_start(self.rewind))
        if self.output_layer not in OUTPUT_LAYERS:
            raise DpltmUserError(f"--output-layer must be one of {', '.join(OUTPUT_LAYERS)}, got {self.output_layer}")


REWIND_POINTS = tuple(choice.value for choice in Rewind)
PRIVATE_PRUNES = tuple(choice.value for choice in PrivatePrune)


@dataclass(frozen=True)
class PrivateTicketSettings:
    """A ticket made on the private data with privacy (`dpltm generate --private`, docs/privacy.md §7):
    `rounds` DP-SGD warm-up rounds of `warmup_epochs` epochs each (the `train:` recipe, one σ for
    every phase), masks by magnitude of the DP weights down to `density`, then training from the
    masked warm-up weights (`rewind: warmup`) or from the initialisation θ0 (`rewind: init`)."""

    warmup_epochs: int = 10
    rounds: int = 1
    density: float = 0.25
    rewind: str = "warmup"
    prune: str = "weights"
    """weights: the smallest-magnitude DP weights of every layer, down to `density` of all weights; inputs: DP
    feature selection, whole input features of the first (linear) layer by the L2 norm of their DP weights, down to
    `density` of the features, every other weight kept (dpltm.pruning.magnitude.prune_input_features)."""

    def __post_init__(self) -> None:
        _require_finite(self)
        _require_positive("--warmup-epochs", self.warmup_epochs)
        _require_positive("--rounds", self.rounds)
        if self.rounds > 20:
            raise DpltmUserError(f"--rounds {self.rounds} with --private: at most 20 DP warm-up rounds")
        if not 0.0 < self.density < 1.0:
            raise DpltmUserError(f"--density must lie in (0, 1), got {self.density:g}")
        if self.rewind not in REWIND_POINTS:
            raise DpltmUserError(f"--rewind must be one of {', '.join(REWIND_POINTS)}, got {self.rewind}")
        if self.prune not in PRIVATE_PRUNES:
            raise DpltmUserError(f"--prune must be one of {', '.join(PRIVATE_PRUNES)}, got {self.prune!r}")


@dataclass(frozen=True)
class TrainConfig:
    data: DataSettings = field(default_factory=lambda: DataSettings(dataset="mnist"))
    train: TrainSettings = field(default_factory=TrainSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    """The dense network's shape (--dense and --non-private baselines); a ticket brings its own."""
    private_ticket: PrivateTicketSettings = field(default_factory=PrivateTicketSettings)
    """How `generate --private` makes a ticket on the private data (unused by `train`)."""
    seed: int = 0

    def __post_init__(self) -> None:
        _require_seed(self.seed)
        if self.train.augmult > 1 and self.model.arch not in VIEW_ARCHS:  # before any data is read (a ticket's
            # own network is checked when its views are made: dpltm.data.views.check_takes_views)
            raise DpltmUserError(f"--augmult {self.train.augmult} averages a record's views through fully connected "
                                 f"layers (--arch {', '.join(VIEW_ARCHS)}); --arch {self.model.arch} takes one image "
                                 "per record: drop --augmult")


VIEW_ARCHS = ("mlp", "scatter-linear", "scatter-mlp")
"""The networks augmentation multiplicity runs on: chains of linear layers, which apply alike to each of a
record's views (B, K, width)."""
