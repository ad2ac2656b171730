"""Each command's options as one typed request, and the checks between options.

The CLI parses flags into these (plain values: enums are unwrapped by `from_options`) and hands
them over; a request checks how its options combine (one line per mistake, before any work),
builds the settings tree its stage resolves against the YAML config (dpltm.config), and runs the
stage. A library caller can build the same request in Python and get the same checks.
`dpltm run`'s request is `dpltm.stages.run.RunRequest`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from dpltm.architectures import model_cli
from dpltm.errors import DpltmUserError

if TYPE_CHECKING:
    from dpltm.artefacts import Winner

R = TypeVar("R", bound="CommandRequest")


def floats_option(text: str | None, option: str) -> tuple[float, ...] | None:
    """A comma- or space-separated list of numbers (`--prune-rates 0.2,0.1`)."""
    if text is None:
        return None
    if not text.strip():  # '' is no list, not an empty one (`--hidden ''` would build a network with no hidden layer)
        raise DpltmUserError(f"{option} takes comma-separated numbers, got an empty value")
    if not text.replace(",", " ").split():  # "," alone: separators and no number
        raise DpltmUserError(f"{option} takes comma-separated numbers, got '{text}'")
    fields = text.split(",")
    if len(fields) > 1 and any(not field.strip() for field in fields):  # "300,,100": a number left out?
        raise DpltmUserError(f"{option} has an empty item in '{text}': give comma-separated numbers")
    try:
        return tuple(float(v) for v in text.replace(",", " ").split())
    except ValueError:
        raise DpltmUserError(f"{option} takes comma-separated numbers, got '{text}'") from None


MAX_WIDTH = 1_000_000
"""The widest layer an integer-list option takes: a width past it is a typo (it would not fit in memory)."""


def ints_option(text: str | None, option: str) -> tuple[int, ...] | None:
    """A list of positive integers (`--hidden 300,100`), written in ASCII digits: `1e2`, `300.0`, other scripts'
    digits and absurd widths are refused rather than read through float."""
    values = floats_option(text, option)  # the list's shape and its messages
    if values is None:
        return None
    fields = text.replace(",", " ").split()  # type: ignore[union-attr]
    if any(not (f.isascii() and f.isdigit()) or not 0 < int(f) <= MAX_WIDTH for f in fields):
        raise DpltmUserError(f"{option} takes positive integers up to {MAX_WIDTH} (digits only), got '{text}'")
    return tuple(int(f) for f in fields)


def _plain(option: Any) -> Any:
    """An option's plain value: a neighbouring relation in the accountant's spelling, an enum's value."""
    relation = getattr(option, "relation", None)
    if isinstance(option, Enum) and relation is not None:
        return relation
    return option.value if isinstance(option, Enum) else option


def _given(options: Mapping[str, Any]) -> list[str]:
    return [name for name, value in options.items() if value is not None]


@dataclass(frozen=True)
class CommandRequest:
    """A command's options; `from_options` takes the CLI's keyword arguments (enums unwrapped)."""

    @classmethod
    def from_options(cls: type[R], options: Mapping[str, Any]) -> R:
        names = {f.name for f in fields(cls)}
        return cls(**{name: _plain(v) for name, v in options.items() if name in names})


@dataclass(frozen=True)
class GenerateRequest(CommandRequest):
    """`dpltm generate`: IMP tickets on public data, or with `private` one ticket made by DP warm-up."""

    dataset: str | None = None
    split: str | None = None
    rounds: int | None = None
    iterations: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    prune_rates: str | None = None
    min_density: float | None = None
    hidden: str | None = None
    arch: str | None = None
    project_to: int | None = None
    activation: str | None = None
    controls: bool | None = None
    rewind_step: int | None = None
    val_fraction: float | None = None
    seed: int | None = None
    private: bool = False
    eps: float | None = None
    delta: float | None = None
    warmup_epochs: int | None = None
    density: float | None = None
    rewind: str | None = None
    epochs: int | None = None
    noise_seed: int | None = None
    device: str = "auto"
    cuda_graphs: bool = False
    config: Path | None = None
    data_dir: Path | None = None
    download: bool = False
    out: Path | None = None
    overwrite: bool = False
    progress: bool = True
    logger: str = "csv"
    log_dir: Path | None = None

    def _model(self) -> dict[str, Any]:
        return model_cli(self.arch, ints_option(self.hidden, "--hidden"), project_to=self.project_to,
                         activation=self.activation)

    def _private_settings(self) -> dict[str, Any]:
        imp_only = {"--iterations": self.iterations, "--prune-rates": self.prune_rates,
                    "--min-density": self.min_density, "--controls": self.controls,
                    "--rewind-step": self.rewind_step, "--cuda-graphs": self.cuda_graphs or None}
        if _given(imp_only):
            given = _given(imp_only)
            raise DpltmUserError(f"{', '.join(given)} {'belongs' if len(given) == 1 else 'belong'} to non-private IMP: "
                                 f"drop {'it' if len(given) == 1 else 'them'} with --private")
        return {
            "data": {"dataset": self.dataset, "split": self.split, "val_fraction": self.val_fraction},
            "model": self._model(),
            "train": {"eps2": self.eps, "delta": self.delta, "epochs": self.epochs, "batch_size": self.batch_size,
                      "lr": self.lr},
            "private_ticket": {"warmup_epochs": self.warmup_epochs, "rounds": self.rounds, "density": self.density,
                               "rewind": self.rewind},
            "seed": self.seed,
        }

    def _imp_settings(self) -> dict[str, Any]:
        private_only = {"--eps": self.eps, "--delta": self.delta, "--warmup-epochs": self.warmup_epochs,
                        "--density": self.density, "--rewind": self.rewind, "--epochs": self.epochs,
                        "--noise-seed": self.noise_seed}
        if _given(private_only):
            given = _given(private_only)
            raise DpltmUserError(f"{', '.join(given)} only {'applies' if len(given) == 1 else 'apply'} with --private")
        return {
            "data": {"dataset": self.dataset, "split": self.split, "val_fraction": self.val_fraction},
            "model": self._model(),
            "generate": {
                "rounds": self.rounds, "iterations": self.iterations, "batch_size": self.batch_size, "lr": self.lr,
                "prune_rates": floats_option(self.prune_rates, "--prune-rates"), "min_density": self.min_density,
                "controls": self.controls, "rewind_step": self.rewind_step,
            },
            "seed": self.seed,
        }

    def run(self) -> tuple[dict[str, Any], Path]:
        """The ticket set (or with `private` the one private ticket) and the file it was written to."""
        from dpltm.run_log import check_logger
        from dpltm.stages.generate import stage_generate, stage_generate_private

        check_logger(self.logger)
        common = {"logger": self.logger, "log_dir": self.log_dir, "download": self.download}
        if self.private:
            return stage_generate_private(self._private_settings(), self.config, self.data_dir, self.device,
                                          self.out, self.overwrite, self.progress, self.noise_seed, **common)
        return stage_generate(self._imp_settings(), self.config, self.data_dir, self.device, self.out,
                              self.overwrite, self.progress, self.cuda_graphs, **common)


def search_option(value: str | None) -> str | list[str] | None:
    """`--search`'s value for the settings tree: None (not given), [] for `none`, else the comma list."""
    if value is None:
        return None
    return [] if value.strip().lower() == "none" else value


@dataclass(frozen=True)
class SelectRequest(CommandRequest):
    """`dpltm select`: the exponential mechanism (ε1), the best pick, or the noise-aware choice."""

    tickets: Path | None = None
    eps1: float | None = None
    nu: float | None = None
    rule: str | None = None
    best: bool = False
    noise_aware: bool = False
    halving: int | None = None
    search: str | None = None
    private_size: int | None = None
    eps2: float | None = None
    sigma: float | None = None
    epochs: int | None = None
    batch_size: int | None = None
    device: str | None = None  # None: not given (the noise-aware choice then trains on "auto")
    data_dir: Path | None = None
    reselect: bool = False
    seed: int | None = None
    config: Path | None = None
    out: Path | None = None
    overwrite: bool = False
    progress: bool = True

    def rule_name(self) -> str:
        """The rule `--rule` names, or the one the flags --best/--noise-aware name (else exponential)."""
        from dpltm.stages.select import rule_for_flags

        if self.rule is not None:
            if self.best or self.noise_aware:
                raise DpltmUserError(f"--rule {self.rule} is the choice: drop --best/--noise-aware")
            return self.rule
        return rule_for_flags(self.best, self.noise_aware)

    def check(self) -> None:
        """The options' combinations, one line each."""
        from dpltm.selection.rules import selection_rule

        if self.best and self.eps1 is not None:
            raise DpltmUserError("--best picks without privacy and spends no ε1: drop --eps1, or drop --best for "
                                 "the exponential mechanism")
        if self.noise_aware and (self.best or self.eps1 is not None):
            raise DpltmUserError("--noise-aware is its own choice: drop "
                                 + " and ".join(flag for flag, given in (("--best", self.best),
                                                                         ("--eps1", self.eps1 is not None)) if given))
        name = self.rule_name()
        rule = selection_rule(name)
        if self.eps1 is not None and not rule.spends_eps1:
            raise DpltmUserError(f"the {name} selection spends no ε1: drop --eps1")
        flag = "--noise-aware" if self.noise_aware else f"--rule {name}"
        if self.nu is not None and rule.needs_planned_run:
            raise DpltmUserError(f"--nu weighs density in the score A·(1 − ν·C); {flag} chooses by public accuracy "
                                 "under the planned noise: drop --nu")
        if self.nu is not None and not rule.touches_ticket_data:
            raise DpltmUserError(f"--nu weighs density in the score A·(1 − ν·C); {flag} looks at no score: drop --nu")
        if self.seed is not None and name == "best":
            raise DpltmUserError("--seed makes a random choice reproducible; --best has none (the highest score): "
                                 "drop --seed")
        if self.reselect and not rule.spends_eps1:
            raise DpltmUserError(f"--reselect allows another exponential-mechanism draw; the {name} selection draws "
                                 "nothing: drop --reselect")
        planned = (self.eps2, self.sigma, self.epochs, self.batch_size, self.private_size)
        if not rule.needs_planned_run and any(v is not None for v in planned):
            raise DpltmUserError("--private-size, --eps, --sigma, --epochs and --batch-size describe the planned "
                                 "run of --noise-aware: add --noise-aware or drop them")
        data_options = [flag for flag, value in (("--device", self.device), ("--data-dir", self.data_dir))
                        if value is not None]
        if not rule.needs_planned_run and data_options:  # silently ignored, they would suggest data was read
            chooser = "--best" if self.best else f"the {name} selection"
            raise DpltmUserError(f"{' and '.join(data_options)} {'is' if len(data_options) == 1 else 'are'} for "
                                 f"--noise-aware, which trains on data; {chooser} reads only the ticket file: drop "
                                 f"{'it' if len(data_options) == 1 else 'them'}")
        if rule.needs_planned_run and self.private_size is None:
            raise DpltmUserError(f"{flag} needs --private-size N, the private training set's size")
        if self.private_size is not None and self.private_size < 2:
            raise DpltmUserError(f"--private-size must be at least 2 records, got {self.private_size}")
        if self.eps2 is not None and self.sigma is not None:
            raise DpltmUserError("give --eps (σ is calibrated to it) or --sigma, not both")

    def run(self) -> tuple[Winner, Path]:
        """The winner (`dpltm.artefacts.Winner`) and the file it was written to."""
        from dpltm.selection.rules import selection_rule
        from dpltm.stages.select import NoiseAwareRequest, stage_select

        self.check()
        name = self.rule_name()
        planned = None if not selection_rule(name).needs_planned_run else NoiseAwareRequest(
            int(self.private_size),  # type: ignore[arg-type]
            {"train": {"eps2": self.eps2, "sigma": self.sigma, "epochs": self.epochs,
                       "batch_size": self.batch_size}}, self.data_dir, self.device or "auto", self.progress)
        select = {"eps1": self.eps1, "nu": self.nu, "halving": self.halving, "search": search_option(self.search)}
        return stage_select({"select": select}, self.config, self.tickets, self.best, self.seed, self.out,
                            overwrite=self.overwrite, reselect=self.reselect, noise_aware=planned, rule=name)


@dataclass(frozen=True)
class _TrainingOptions(CommandRequest):
    """What `dpltm train` and `dpltm audit` share: the ticket or dense network and the DP recipe."""

    ticket: Path | None = None
    dense: bool = False
    dataset: str | None = None
    split: str | None = None
    eps2: float | None = None
    delta: float | None = None
    sigma: float | None = None
    epochs: int | None = None
    batch_size: int | None = None
    clip: float | None = None
    lr: float | None = None
    recipe: str = "paper"
    optimizer: str | None = None
    momentum: float | None = None
    activation: str | None = None
    arch: str | None = None
    noise: str | None = None
    accountant: str | None = None
    seed: int | None = None
    noise_seed: int | None = None
    device: str = "auto"
    config: Path | None = None
    data_dir: Path | None = None
    progress: bool = True

    def _check_network(self) -> None:
        if self.arch is not None and self.ticket is not None:
            raise DpltmUserError("--arch is for --dense: a ticket brings its own network")

    def _check_budget(self) -> None:
        if self.sigma is not None and self.eps2 is not None:
            raise DpltmUserError("give --eps (σ is calibrated to it) or --sigma (ε is reported), not both")

    def _train_settings(self) -> dict[str, Any]:
        return {"eps2": self.eps2, "delta": self.delta, "sigma": self.sigma, "epochs": self.epochs,
                "batch_size": self.batch_size, "clip": self.clip, "lr": self.lr, "optimizer": self.optimizer,
                "noise": self.noise, "accountant": self.accountant, "momentum": self.momentum}


@dataclass(frozen=True)
class TrainRequest(_TrainingOptions):
    """`dpltm train`: DP-SGD on a ticket, or the dense and non-private baselines."""

    lr_sigma: float | None = None
    ema: float | None = None
    ema_warmup: bool | None = None
    rewind: str | None = None
    output_layer: str | None = None
    freeze: str | None = None
    neighbouring: str | None = None
    max_eps: float | None = None
    patience: int | None = None
    non_private: bool = False
    public_tickets: bool = False
    val_fraction: float | None = None
    public_dataset: str | None = None
    public_split: str | None = None  # None: "train"
    devices: int = 1
    num_nodes: int = 1
    strategy: str = "auto"
    cuda_graphs: bool = False
    download: bool = False
    out: Path | None = None
    overwrite: bool = False
    logger: str = "csv"
    log_dir: Path | None = None

    def check(self) -> None:
        """The options' combinations, one line each."""
        if self.dense and self.ticket is not None:
            raise DpltmUserError("--dense trains the full network: drop --ticket")
        if self.public_split is not None and self.public_dataset is None:
            raise DpltmUserError("--public-split chooses a split of --public-dataset: give --public-dataset too, or "
                                 "drop --public-split")
        if self.dense and self.public_tickets:
            raise DpltmUserError("--public-tickets is about a ticket's data: drop it with --dense")
        self._check_budget()
        if self.non_private and (self.eps2 is not None or self.sigma is not None):
            raise DpltmUserError("--non-private trains without noise: drop --eps/--sigma")
        if self.non_private:  # options of the DP mechanism: silently ignored, they would suggest it ran
            given = [flag for flag, value in (("--noise", self.noise), ("--clip", self.clip),
                                              ("--noise-seed", self.noise_seed), ("--accountant", self.accountant),
                                              ("--max-eps", self.max_eps), ("--neighbouring", self.neighbouring),
                                              ("--delta", self.delta))
                     if value is not None]
            if given:
                raise DpltmUserError(f"--non-private trains without clipping, noise or accounting: drop "
                                     f"{', '.join(given)}")
        if self.lr is not None and self.lr_sigma is not None:
            raise DpltmUserError("give --lr (a fixed step size) or --lr-sigma (lr = lr_sigma / σ), not both: one "
                                 "would be ignored")
        if not self.dense and self.ticket is None:
            raise DpltmUserError("give --ticket PATH (from `dpltm select`), or --dense for the DP-SGD baseline")
        if self.rewind is not None:
            from dpltm.config import late_rewind_step

            late_rewind_step(self.rewind)  # a start train takes, before what it combines with
        if self.dense and ((self.rewind is not None and self.rewind != "init") or self.output_layer is not None):
            raise DpltmUserError(f"--rewind {self.rewind or 'public'} and --output-layer choose a ticket's start: drop "
                                 "them with --dense")
        self._check_network()

    def settings(self) -> dict[str, Any]:
        """The settings tree the stage resolves against the config (dpltm.config.resolve_train_config)."""
        return {
            "data": {"dataset": self.dataset, "split": self.split, "val_fraction": self.val_fraction},
            "train": {**self._train_settings(), "lr_sigma": self.lr_sigma, "neighboring": self.neighbouring,
                      "max_eps": self.max_eps, "patience": self.patience, "ema": self.ema,
                      "ema_warmup": self.ema_warmup,
                      "rewind": self.rewind, "output_layer": self.output_layer, "freeze": self.freeze},
            "model": model_cli(self.arch, None, activation=self.activation),
            "seed": self.seed,
            "recipe": self.recipe,
        }

    def run(self) -> dict[str, Any]:
        """The training report (dpltm.training.pipeline.final_report)."""
        from dpltm.dp.distributed import Distribution
        from dpltm.run_log import check_logger
        from dpltm.stages.train import stage_train

        check_logger(self.logger)
        self.check()
        public = None if self.public_dataset is None else f"{self.public_dataset}:{self.public_split or 'train'}"
        return stage_train(self.settings(), self.config, self.ticket, self.non_private, self.public_tickets,
                           self.data_dir, self.device, self.out, self.progress, public_data=public,
                           noise_seed=self.noise_seed, overwrite=self.overwrite,
                           distribution=Distribution(self.devices, self.num_nodes, self.strategy),
                           cuda_graphs=self.cuda_graphs, logger=self.logger, log_dir=self.log_dir,
                           download=self.download)


@dataclass(frozen=True)
class AuditRequest(_TrainingOptions):
    """`dpltm audit`: `dpltm train`'s run with canaries, and the lower bound on ε they give."""

    canaries: int = 1000
    threat_model: str = "white-box"
    confidence: float = 0.95
    canary_seed: int | None = None

    def run(self) -> dict[str, Any]:
        """The training report with its `audit` part (dpltm.audit.run)."""
        from dpltm.audit.run import AuditPlan
        from dpltm.stages.audit import stage_audit

        if self.dense == (self.ticket is not None):
            raise DpltmUserError("give --ticket PATH (from `dpltm select`) or --dense"
                                 + (", not both" if self.dense else ""))
        self._check_network()
        self._check_budget()
        plan = AuditPlan(self.threat_model, self.canaries, self.confidence, self.canary_seed)
        settings = {
            "data": {"dataset": self.dataset, "split": self.split},
            "train": self._train_settings(),
            "model": model_cli(self.arch, None, activation=self.activation),
            "seed": self.seed,
            "recipe": self.recipe,
        }
        return stage_audit(settings, self.config, self.ticket, self.data_dir, self.device, plan, self.progress,
                           noise_seed=self.noise_seed)
