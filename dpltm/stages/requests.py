"""Each command's options as one typed request, and the checks between options.

The CLI parses flags into these (plain values: enums are unwrapped by `from_options`) and hands
them over; a request checks how its options combine (one line per mistake, before any work),
builds the settings tree its stage resolves against the YAML config (dpltm.config), and runs the
stage. A library caller can build the same request in Python and get the same checks.
`dpltm run`'s request is `dpltm.stages.run.RunRequest`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from dpltm import options as opt
from dpltm.architectures import model_cli
from dpltm.choices import Dataset, Rewind, SelectionRuleName
from dpltm.errors import DpltmUserError
from dpltm.options import Overrides, flag_of, option

if TYPE_CHECKING:
    from dpltm.artefacts import TicketSet, Winner

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
    if isinstance(option, list):
        return tuple(_plain(item) for item in option)
    relation = getattr(option, "relation", None)
    if isinstance(option, Enum) and relation is not None:
        return relation
    return option.value if isinstance(option, Enum) else option


def _given(options: Mapping[str, Any]) -> list[str]:
    return [name for name, value in options.items() if value is not None]


@dataclass(frozen=True)
class CommandRequest:
    """A command's options, each field declared once with its `dpltm.options.Flag` (the CLI derives the command's
    options from them); `from_options` takes the parsed values (enums unwrapped)."""

    given: frozenset[str] = field(default=frozenset(), kw_only=True, compare=False)
    """The options given on the command line, not defaulted (a default cannot be told from a choice otherwise)."""

    @classmethod
    def from_options(cls: type[R], options: Mapping[str, Any], given: frozenset[str] = frozenset()) -> R:
        names = {f.name for f in fields(cls)}
        return cls(**{name: _plain(v) for name, v in options.items() if name in names}, given=given)

    def overrides(self, *sections: str) -> Overrides:
        """The options whose config key lies in `sections`, under that key (None: not given, the config's)."""
        return Overrides({flag.config: getattr(self, f.name) for f in fields(self)
                          if (flag := flag_of(f)) is not None and flag.config is not None
                          and flag.config.split(".")[0] in sections})


@dataclass(frozen=True)
class GenerateRequest(CommandRequest):
    """`dpltm generate`: IMP tickets on public data, or with `private` one ticket made by DP warm-up."""

    dataset: str | None = option(config="data.dataset", choices=Dataset, help='Dataset the tickets are made on.')
    split: str | None = opt.SPLIT()
    rounds: int | None = option(config="generate.rounds", help='Pruning rounds T (ticket 0 is the dense network).')
    iterations: int | None = option(config="generate.iterations", help='SGD iterations per ticket (paper: 5000).')
    batch_size: int | None = option(config="generate.batch_size", help='Mini-batch size (paper: 400).')
    lr: float | None = option(config="generate.lr", help='SGD learning rate (paper: 0.1).')
    prune_rates: str | None = option(config="generate.prune_rates",
        shown='0.3 per layer, 0.2 for the output layer from config',
        help='Fraction of survivors pruned per round: one value, or one per layer (paper: 0.3,0.3,0.2).')
    min_density: float | None = option(config="generate.min_density",
        help='Stop before a ticket would keep less than this fraction of weights.')
    hidden: str | None = option(config="model.hidden", help='Hidden layer widths (paper: 300,100).')
    arch: str | None = opt.ARCH()
    project_to: int | None = option("--project-to",
        help='Add an input projection layer to this width (paper §4.5.2 transfer).')
    activation: str | None = opt.ACTIVATION()
    controls: bool | None = option("--controls/--no-controls", config="generate.controls",
        help='Also train the random-reinit and random-mask control tickets.')
    rewind_step: int | None = option("--rewind-step", metavar="K", config="generate.rewind_step",
        help=("Late rewinding (Frankle et al. 2020): rounds after the first rewind to the dense network's "
              'weights after K steps of round 0, not θ0, and train the remaining iterations; the tickets keep '
              "that iterate (train --rewind K starts there). 0: θ0 (the paper's)."))
    val_fraction: float | None = opt.VAL_FRACTION()
    seed: int | None = option(config="seed", help='Seed for θ0, data split and batch order.')
    private: bool = option("--private", default=False,
        help=('Make ONE ticket on the private data itself, with privacy: DP-SGD warm-up (the train: recipe), '
              'masks by magnitude of the DP weights, one σ calibrated so warm-up + the planned training meet '
              '--eps. Writes a ticket for `dpltm train --ticket` (no select).'))
    eps: float | None = option("--eps", "--eps2", config="train.eps2",
        help='With --private: ε of the whole run (warm-up and training, composed by PLD).')
    delta: float | None = option(config="train.delta", help='With --private: δ.')
    warmup_epochs: int | None = option(config="private_ticket.warmup_epochs",
        help='With --private: DP-SGD epochs per warm-up round.')
    density: float | None = option(config="private_ticket.density",
        help='With --private: fraction of weights the ticket keeps.')
    rewind: str | None = option(config="private_ticket.rewind", choices=Rewind,
        help='With --private: train from the masked warm-up weights (warmup) or from θ0 (init).')
    prune: str | None = opt.PRIVATE_PRUNE()
    epochs: int | None = option(config="train.epochs",
        help="With --private: epochs of the ticket's DP training, planned now (σ covers them).")
    noise_seed: int | None = option("--noise-seed", min=0, max=opt.MAX_SEED,
        help=('With --private: seed the noise and Poisson sampling (reproducible; DP only while the seed stays '
              'secret). Default: a fresh OS-CSPRNG seed, never stored.'))
    device: str = opt.DEVICE("auto")
    cuda_graphs: bool = opt.CUDA_GRAPHS(False)
    config: Path | None = opt.CONFIG_FILE()
    data_dir: Path | None = opt.DATA_DIR()
    download: bool = opt.DOWNLOAD(False)
    out: Path | None = option(
        help=('Ticket file (default checkpoints/<dataset>-tickets.pt; with --private '
              '<dataset>-private-ticket.pt).'))
    overwrite: bool = option(default=False, help='Replace an existing ticket file made with other settings.')
    progress: bool = opt.PROGRESS(True)
    logger: str = opt.LOGGER('csv')
    log_dir: Path | None = opt.LOG_DIR()
    json_out: bool = opt.JSON(False)

    def _model(self) -> dict[str, object]:
        return model_cli(self.arch, ints_option(self.hidden, "--hidden"), project_to=self.project_to,
                         activation=self.activation)

    def _private_settings(self) -> Overrides:
        """A training config's settings: the warm-up trains as the ticket will (`train:`), `private_ticket:` the
        rest; --rounds, --batch-size and --lr name the warm-up's."""
        imp_only = {"--iterations": self.iterations, "--prune-rates": self.prune_rates,
                    "--min-density": self.min_density, "--controls": self.controls,
                    "--rewind-step": self.rewind_step, "--cuda-graphs": self.cuda_graphs or None}
        if given := _given(imp_only):
            raise DpltmUserError(f"{', '.join(given)} {'belongs' if len(given) == 1 else 'belong'} to non-private IMP: "
                                 f"drop {'it' if len(given) == 1 else 'them'} with --private")
        warmup = {"train.batch_size": self.batch_size, "train.lr": self.lr, "private_ticket.rounds": self.rounds}
        return self.overrides("data", "train", "private_ticket", "seed").updated(warmup).updated(self._model(), "model")

    def _imp_settings(self) -> Overrides:
        private_only = {"--eps": self.eps, "--delta": self.delta, "--warmup-epochs": self.warmup_epochs,
                        "--density": self.density, "--rewind": self.rewind, "--prune": self.prune,
                        "--epochs": self.epochs, "--noise-seed": self.noise_seed}
        if given := _given(private_only):
            raise DpltmUserError(f"{', '.join(given)} only {'applies' if len(given) == 1 else 'apply'} with --private")
        rates = floats_option(self.prune_rates, "--prune-rates")
        return self.overrides("data", "generate", "seed").updated({"generate.prune_rates": rates}).updated(
            self._model(), "model")

    def run(self) -> tuple[TicketSet | Winner, Path]:
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

    tickets: Path | None = option(help='Ticket set (default: the newest in checkpoints/, named on screen).')
    eps1: float | None = option(config="select.eps1", help='Selection budget ε1 (paper: 0.1).')
    nu: float | None = option(config="select.nu", help='Score weight ν in S = A·(1 − ν·C) (paper: 50).')
    rule: str | None = option("--rule", choices=SelectionRuleName,
        help=('Choose by a rule of dpltm/selection/rules.py by name (exponential: ε1-DP; best; noise-aware: '
              'needs --private-size; random: looks at no data). Default: exponential, or what '
              '--best/--noise-aware name.'))
    best: bool = option("--best", default=False,
        help=('Pick the best paper score S = A·(1 − ν·C) without privacy (for tickets from public data). '
              'Beware: at ν = 50 the factor is negative for every C > 0.02, so it always takes the sparsest '
              'ticket, whatever the noise; prefer --noise-aware.'))
    noise_aware: bool = option("--noise-aware", default=False,
        help=("Train every ticket (the dense network included) under the planned DP noise on the tickets' own "
              'public data and pick the best; spends no ε. Needs --private-size; the planned run is '
              "--eps/--sigma, --epochs, --batch-size and the config's train section."))
    halving: int | None = opt.HALVING()
    search: str | None = option("--search", metavar="DIM[,DIM…]", config="select.search",
        shown="the config's select.search (none)",
        help=('What the noise-aware choice also tries for each ticket, each as a candidate of its own: start '
              "(θ0 and the ticket's public-trained weights), release (the final iterate and an EMA 0.999 with "
              'warm-up, scored on the same run), freeze (the first layer held at its public weights). A variant'
              ' wins only if it beats the dense network as planned by two standard errors; `train` then runs '
              'the winner as chosen. A train: setting in the --config file (rewind/output_layer, '
              'ema/ema_warmup, freeze) fixes its dimension. none: search nothing.'))
    private_size: int | None = option("--private-size",
        help="N, the private training set's size (public), for --noise-aware's planned run.")
    eps: float | None = option("--eps", "--eps2", config="train.eps2",
        help='--noise-aware: the planned training budget ε2 (σ calibrated to it).')
    sigma: float | None = option(config="train.sigma", shown=True,
        help='--noise-aware: the planned noise multiplier instead of --eps.')
    epochs: int | None = option(config="train.epochs", help='--noise-aware: the planned epochs.')
    batch_size: int | None = option(config="train.batch_size", help='--noise-aware: the planned expected batch size L.')
    device: str | None = option("--device", shown=False,
        help='--noise-aware: where the candidates train (auto, cpu, cuda or cuda:N; default auto).')
    data_dir: Path | None = option("--data-dir",
        help=("--noise-aware: data root of the tickets' public data (else $DPLTM_DATA_DIR, else "
              '../shared/data).'))
    reselect: bool = option("--reselect", default=False,
        help=("Allow another exponential-mechanism draw from a ticket set already drawn from; the winner's "
              'ledger composes every draw.'))
    seed: int | None = option(min=0, max=opt.MAX_SEED,
        help='Seed the draw (reproducible, not secret); default: OS CSPRNG.')
    config: Path | None = opt.CONFIG_FILE()
    out: Path | None = option(help='Winner file (default checkpoints/<dataset>-winner.pt).')
    overwrite: bool = option(default=False, help='Replace an existing winner file.')
    progress: bool = opt.PROGRESS(True)
    json_out: bool = opt.JSON(False)

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
        planned = (self.eps, self.sigma, self.epochs, self.batch_size, self.private_size)
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
        if self.eps is not None and self.sigma is not None:
            raise DpltmUserError("give --eps (σ is calibrated to it) or --sigma, not both")

    def run(self) -> tuple[Winner, Path]:
        """The winner (`dpltm.artefacts.Winner`) and the file it was written to."""
        from dpltm.selection.rules import selection_rule
        from dpltm.stages.select import NoiseAwareRequest, stage_select

        self.check()
        name = self.rule_name()
        planned = None if not selection_rule(name).needs_planned_run else NoiseAwareRequest(
            int(self.private_size),  # type: ignore[arg-type]
            self.overrides("train"), self.data_dir, self.device or "auto", self.progress)
        select = self.overrides("select").updated({"select.search": search_option(self.search)})
        return stage_select(select, self.config, self.tickets, self.best, self.seed, self.out,
                            overwrite=self.overwrite, reselect=self.reselect, noise_aware=planned, rule=name)
