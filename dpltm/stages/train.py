"""Phase 3 as a command: resolve the settings, check the ticket and the output, load the data, train."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpltm import options as opt
from dpltm.architectures import model_cli
from dpltm.choices import Activation, Dataset, OutputLayer, Recipe, Split, Strategy
from dpltm.console import err_console, on_interrupt_kept, warn_large_delta
from dpltm.dp.noise import NOISE_PLUGINS, noise_plugin
from dpltm.errors import DpltmUserError
from dpltm.options import Overrides, option
from dpltm.privacy.display import format_rate, format_sigma
from dpltm.stages.requests import CommandRequest

if TYPE_CHECKING:
    from rich.console import Console

    from dpltm.artefacts import Winner
    from dpltm.artefacts.trained_model import TrainingReport
    from dpltm.audit.run import AuditPlan
    from dpltm.data.types import DatasetSplits, LabeledTensors
    from dpltm.dp.distributed import Distribution
    from dpltm.settings import TrainConfig


def stage_train(cli: Overrides, config: Path | None, ticket: Path | None, non_private: bool,
                public_tickets: bool, data_dir: Path | None, device: str, out: Path | None,
                progress: bool, public_data: str | None = None, noise_seed: int | None = None,
                overwrite: bool = False, distribution: Distribution | None = None,
                cuda_graphs: bool = False, logger: str | None = None,
                log_dir: Path | None = None, download: bool = False, audit: AuditPlan | None = None) -> TrainingReport:
    from dpltm.checkpoint import load_winner
    from dpltm.data import load_dataset
    from dpltm.devices import resolve_device
    from dpltm.dp.distributed import Distribution, check_launch, is_main_process, local_device
    from dpltm.outputs import prepare_output
    from dpltm.paths import check_not_input, default_checkpoint_dir
    from dpltm.tickets.data import data_to_check
    from dpltm.training import pipeline

    winner = load_winner(ticket) if ticket is not None else None
    cfg, chose = resolve_training(cli, config, winner, non_private, cuda_graphs=cuda_graphs, audited=audit is not None)
    mode = ("dpltm" if ticket is not None else "dense") + ("-nonprivate" if non_private else "")
    target = out or default_checkpoint_dir() / f"{cfg.data.dataset}-{mode}.pt"
    distribution = distribution or Distribution()
    check_launch(distribution)
    main = is_main_process()  # under DDP, every rank runs this; rank 0 alone writes and prints
    # read-only: every rank fails alike
    prepare_output(target, overwrite=overwrite, inputs=[ticket, config], checkpoint=True)
    torch_device = local_device(resolve_device(device), distribution)
    if cuda_graphs and (torch_device.type != "cuda" or distribution.multi_process or non_private):
        raise DpltmUserError("--cuda-graphs needs DP training on one CUDA device (--device cuda, one process)")
    public_name, public_split = public_data_for_noise(public_data, cfg, non_private)
    if download:
        if distribution.multi_process:  # every rank would write into the data root at once
            raise DpltmUserError("--download with several processes: run `dpltm download "
                                 f"{cfg.data.dataset}` first, then train without --download")
        from dpltm.data.download import fetch_for_run

        fetch_for_run([n for n in (cfg.data.dataset, public_name) if n is not None], data_dir)
    data = load_dataset(cfg.data.dataset, split=cfg.data.split, data_dir=data_dir,
                        val_fraction=cfg.data.val_fraction, seed=cfg.seed, device=torch_device)
    public = None if public_name is None else load_dataset(
        public_name, split=public_split, data_dir=data_dir, device=torch_device).train
    check_not_input(target)  # a data file just read
    ticket_data, unchecked = data_to_check(winner, data.name, public_tickets, data_dir)
    if main:
        on_interrupt_kept("no model was written" + (f" (the model already at {target} is unchanged)"
                                                    if target.exists() else ""))

    def announce() -> None:
        where = f"{distribution.world_size} processes (DDP)" if distribution.multi_process else str(torch_device)
        err_console.print(f"training on {data.name} ({len(data.train)} records) on {where}: "
                          f"{'NON-PRIVATE baseline' if non_private else 'DP-SGD'}"
                          f"{' on the dense network' if ticket is None else f' on ticket {ticket}'}")
        if chose:
            announce_variant(chose, cfg)
        if not non_private:
            warn_large_delta(cfg.train.delta, len(data.train))  # as make_private warns

    report = pipeline.train(cfg, data, target, ticket=winner, ticket_path=ticket, private=not non_private,
                            assert_public=public_tickets, progress=progress, public_data=public,
                            public_dataset=public_name, noise_seed=noise_seed, ticket_data=ticket_data,
                            ticket_data_unchecked=unchecked,
                            on_start=announce, distribution=distribution,
                            step_mode="graphs" if cuda_graphs else "eager", logger=logger, log_dir=log_dir,
                            audit=audit)
    if main:  # said if printing the report fails now (a full or closed stdout) or the run is stopped
        on_interrupt_kept(f"the model is written to {target}")
    return report


def resolve_training(cli: Overrides, config: Path | None, winner: Winner | None, non_private: bool, *,
                     cuda_graphs: bool, audited: bool) -> tuple[TrainConfig, Mapping[str, Any] | None]:
    """The training settings, and the `train:` variant a noise-aware choice chose for the winner (None: none).

    A private ticket was made with a training plan (recipe, epochs, data settings, and the whole run's ε): that
    plan is the default, under the --config file and flags. So is the start, frozen layers and release a
    noise-aware choice chose for its winner (`select --search`)."""
    from dpltm.config import SEARCH_FIXED_BY, fixed_dimensions, resolve_train_config
    from dpltm.selection.winner import chosen_training
    from dpltm.tickets.private import private_ticket_plan
    from dpltm.training.pipeline import freezing_can_run

    private_ticket = winner is not None and winner.is_private_ticket
    check_recipe_suits_ticket(cli.recipe, winner)
    chose = None if winner is None or private_ticket or non_private else chosen_training(winner.selection)
    chosen = chose
    if chose is not None:  # a setting the user gives fixes its whole dimension (as it did for the choice)
        fixed = fixed_dimensions(cli, config)
        dropped = {f"train.{key}" for dimension in fixed for key in SEARCH_FIXED_BY[dimension]}
        chosen = Overrides({k: v for k, v in chose.values.items() if k not in dropped})
    base = private_ticket_plan(winner) if winner is not None and private_ticket else chosen
    if winner is not None and private_ticket and not cli.get("data.dataset"):  # the data it was made on
        cli = cli.updated({"data.dataset": winner.dataset})
    cfg = resolve_train_config(cli, config, base=base)
    if chosen is not None and chosen.get("train.freeze") and cfg.train.freeze and not freezing_can_run(
            "graphs" if cuda_graphs else "eager", audited=audited, noise=cfg.train.noise):
        raise DpltmUserError(f"the winner's noise-aware choice holds {', '.join(cfg.train.freeze)} at its public "
                             "weights, and freezing trains in the eager step with --noise gaussian and no audit: "
                             "train it unfrozen with `train: {freeze: []}` in a --config file, or select again "
                             "without freeze in --search")
    if non_private and cli.get("train.lr_sigma") is not None:
        raise DpltmUserError("--lr-sigma sets a DP run's learning rate from its σ; a --non-private run has no σ: "
                             "give --lr")
    if not non_private and cli.get("train.lr") is not None and cli.get("train.lr_sigma") is None:
        check_lr_given(cli.get("train.lr"), cfg, cli.recipe or "the config's")  # --lr would be ignored
    return cfg, None if chose is None else chose.section("train")


def announce_variant(chose: Mapping[str, Any], cfg: TrainConfig) -> None:
    """The variant the noise-aware choice chose, and what the --config file or flags changed of it."""
    from dpltm.selection.winner import describe_variant

    ran = {"rewind": cfg.train.rewind, "output_layer": cfg.train.output_layer,
           "freeze": list(cfg.train.freeze), "ema": cfg.train.ema, "ema_warmup": cfg.train.ema_warmup}
    ran = {k: v for k, v in ran.items() if k in chose}
    err_console.print(f"the noise-aware choice chose: {describe_variant(chose)}" + (
        "" if ran == chose else f"; the --config file or flags override it: {describe_variant(ran)}"),
        markup=False, highlight=False)


def public_data_for_noise(public_data: str | None, cfg: TrainConfig,
                          non_private: bool) -> tuple[str | None, str | None]:
    """`--public-dataset NAME[:SPLIT]` for a noise plug-in that needs public data: given exactly when the plug-in
    reads it, and never the private dataset."""
    public_name, public_split = (public_data.split(":", 1) + ["train"])[:2] if public_data else (None, None)
    if public_name is not None and not noise_plugin(cfg.train.noise).needs_public_data:
        needing = ", ".join(n for n, p in NOISE_PLUGINS.items() if p.needs_public_data)
        raise DpltmUserError(f"--public-dataset is only used by --noise {needing} (this run uses {cfg.train.noise})")
    if public_name is None and not non_private and noise_plugin(cfg.train.noise).needs_public_data:
        raise DpltmUserError(f"--noise {cfg.train.noise} needs public data: pass --public-dataset NAME "
                             "(and --public-split)")
    if public_name is not None and public_name == cfg.data.dataset:
        raise DpltmUserError(f"--public-dataset must be public: it names the private dataset {cfg.data.dataset}")
    return public_name, public_split


RECIPE_ARCHITECTURES = {"scatter": ("scatter-linear", "scatter-mlp", "scatter-cnn"), "cnn": ("lenet5",)}
"""The networks a network-specific recipe was chosen for (as `--dense --arch` checks them in resolve_train_config)."""


def check_recipe_suits_ticket(recipe: Any, ticket: Winner | None) -> None:
    """A ticket brings its own network: a recipe chosen for another kind would train it with that kind's rates."""
    if ticket is None or recipe not in RECIPE_ARCHITECTURES:
        return
    record = ticket.architecture
    arch = str(record.get("name") or ("lenet5" if record.get("conv") else "mlp"))  # the LeNet family has no name
    if arch not in RECIPE_ARCHITECTURES[recipe]:
        raise DpltmUserError(f"--recipe {recipe} is for {', '.join(RECIPE_ARCHITECTURES[recipe])}; this ticket's "
                             f"network is {arch}: train it with --recipe tuned or paper")


def check_lr_given(lr: float | None, cfg: TrainConfig, recipe: str) -> None:
    """`--lr` under a recipe whose DP learning rate is lr_sigma / σ would be ignored: say so."""
    if lr is not None and cfg.train.lr_sigma is not None:
        raise DpltmUserError(f"--lr {lr:g} would be ignored: recipe {recipe} sets a DP run's learning rate to "
                             f"lr_sigma / σ ({cfg.train.lr_sigma:g} / σ); drop --lr, or use --recipe paper with --lr")


def check_planned_training(cfg: TrainConfig, private: DatasetSplits, recipe: str,
                           noise_aware_on: LabeledTensors | None = None) -> None:
    """`dpltm run`'s DP training checked against the data before any ticket is made: the
    batch below the private training set, σ calibrable to the budget, lr_sigma's learning rate in
    range, a noise `run` can give; with the noise-aware choice (`noise_aware_on`: its public
    training records) Gaussian-type noise and a batch below that set too."""
    from dpltm.training.plan import plan_training

    s, n = cfg.train, len(private.train)
    remedy = "pass a smaller --batch-size" + (" or --recipe paper" if recipe != "paper" else "")
    if s.batch_size >= n:
        raise DpltmUserError(f"batch size {s.batch_size} (recipe {recipe}) must be smaller than {private.name}'s "
                             f"training set ({n} records): {remedy}")
    if noise_aware_on is not None and s.batch_size >= len(noise_aware_on):
        raise DpltmUserError(f"batch size {s.batch_size} (recipe {recipe}) must be smaller than the public "
                             f"training set the noise-aware choice trains on ({len(noise_aware_on)} records): "
                             f"{remedy}, or --choice best")
    if noise_plugin(s.noise).needs_public_data:
        others = " or ".join(n for n, p in NOISE_PLUGINS.items() if not p.needs_public_data)
        raise DpltmUserError(f"noise {s.noise} needs public data for its shape: use `dpltm train --public-dataset`; "
                             f"`dpltm run` trains with {others} noise")
    plan_training(s, n)  # σ for the budget and the learning rate it gives


def print_training_report(report: TrainingReport, console: Console = err_console) -> None:
    """The human summary: the result on stdout as a CLI's output, or on stderr beside a `--json`
    report (the CLI's, alone on stdout)."""
    r = report
    validation = ("no validation set" if r.val_accuracy is None or math.isnan(r.val_accuracy)
                  else f"validation {r.val_accuracy:.4f}")
    console.print(f"test accuracy {r.test_accuracy:.4f} ({validation}) "
                  f"after {r.epochs_run} epochs, {r.steps} steps: {r.stop_reason}")
    if r.noise_multiplier is not None:
        how = "calibrated" if r.sigma_calibrated else "given"
        if r.noise_parameter != r.noise_multiplier:
            how = f"effective; plug-in parameter {format_sigma(r.noise_parameter)}, {how}"
        console.print(f"noise multiplier σ = {format_sigma(r.noise_multiplier)} ({how}), "
                      f"q = {format_rate(r.sample_rate)}")
    console.print(r.statement, markup=False, highlight=False)
    console.print(f"model: {r.output}" + (f"; log: {r.log_dir}" if r.log_dir else ""))


class TrainingRequest(CommandRequest):
    """What `dpltm train` and `dpltm audit` share: the checks of the ticket or dense network and of the budget, and
    the settings they train with."""

    ticket: Path | None
    arch: str | None
    activation: str | None
    recipe: str
    sigma: float | None
    eps: float | None

    def _check_network(self) -> None:
        if self.arch is not None and self.ticket is not None:
            raise DpltmUserError("--arch is for --dense: a ticket brings its own network")

    def _check_budget(self) -> None:
        if self.sigma is not None and self.eps is not None:
            raise DpltmUserError("give --eps (σ is calibrated to it) or --sigma (ε is reported), not both")

    def settings(self) -> Overrides:
        """The settings the stage resolves against the config (dpltm.config.resolve_train_config)."""
        network = model_cli(self.arch, None, activation=self.activation)
        return replace(self.overrides("data", "train", "seed").updated(network, "model"), recipe=self.recipe)


@dataclass(frozen=True)
class TrainRequest(TrainingRequest):
    """`dpltm train`: DP-SGD on a ticket, or the dense and non-private baselines."""

    ticket: Path | None = option(help='Winning ticket from `dpltm select`.')
    dataset: str | None = opt.PRIVATE_DATASET()
    split: str | None = opt.SPLIT()
    eps: float | None = option("--eps", "--eps2", config="train.eps2",
        help=("Training budget ε (the paper's ε2); σ is calibrated to it. With a private ticket (generate "
              "--private): the whole run's ε, warm-up included (default: the ε the ticket was planned for)."))
    delta: float | None = opt.DELTA()
    sigma: float | None = opt.SIGMA()
    epochs: int | None = opt.EPOCHS()
    batch_size: int | None = opt.BATCH_SIZE()
    clip: float | None = opt.CLIP()
    lr: float | None = opt.LEARNING_RATE()
    recipe: str = option(choices=Recipe, default='paper',
        help=('Training recipe under --config and flags: paper (defaults.yaml; the default), tuned (chosen on '
              'public data for MNIST-sized sets: tanh, L = 1600, lr = 6/σ, EMA 0.999; '
              'configs/recipes/tuned.yaml), scatter (chosen on public data: the ScatterNet front end and a '
              'linear head, --arch scatter-linear, L = 4096, momentum 0.9, lr = 1/σ, 40 epochs; '
              "configs/recipes/scatter.yaml) or cnn (LeNet-5's, chosen on public data: --arch lenet5, tanh, L ="
              ' 1600, lr = 6/σ, the final iterate; configs/recipes/cnn.yaml).'))
    lr_sigma: float | None = option("--lr-sigma", config="train.lr_sigma", shown=True,
        help=("Set a DP run's learning rate to this / σ, so an update's noise stays the same across budgets "
              "(the tuned recipe's rule; overrides --lr for DP runs)."))
    optimizer: str | None = opt.OPTIMIZER()
    momentum: float | None = opt.MOMENTUM()
    augmult: int | None = opt.AUGMULT()
    noise_filter: str | None = opt.NOISE_FILTER()
    ema: float | None = opt.EMA()
    ema_warmup: bool | None = opt.EMA_WARMUP()
    rewind: str | None = option("--rewind", metavar="init|public|K", config="train.rewind",
        help=("Where the ticket's weights start: θ0 (init, the paper's), the weights its public IMP round ended"
              ' with (public), or K, the iterate K steps into public training its tickets rewound to (generate '
              '--rewind-step K, late rewinding). Public data adds nothing to ε; public starts are refused for '
              'tickets made on the private data.'))
    output_layer: str | None = option("--output-layer", config="train.output_layer", choices=OutputLayer,
        help=("With --rewind public or K: θ0's output layer (reinit; the public one learned other classes) or "
              'the public-trained one (keep; same class count only).'))
    freeze: str | None = option("--freeze", metavar="LAYER[,LAYER…]", config="train.freeze",
        help=('Layers held at their start weights and not trained (e.g. hidden.0, or conv.0,conv.1): no clipped'
              ' gradient, no noise, no update. With --rewind public they keep what public data taught them '
              '(public knowledge: nothing added to ε).'))
    activation: str | None = option(config="model.activation", choices=Activation,
        help=("Activation of the network trained (a ticket's included): relu (paper) or tanh (bounded; helps "
              'under DP, Papernot et al. 2021).'))
    arch: str | None = opt.ARCH()
    noise: str | None = opt.NOISE()
    accountant: str | None = opt.ACCOUNTANT()
    neighboring: str | None = opt.NEIGHBORING()
    max_eps: float | None = option("--max-eps", config="train.max_eps", shown=True,
        help='A cap: stop before the ε spent would exceed this (σ stays calibrated to --eps).')
    patience: int | None = option(config="train.patience", shown=True,
        help='Early-stop after this many epochs without validation gain.')
    dense: bool = option("--dense", default=False, help='DP-SGD baseline on the full network (no ticket).')
    non_private: bool = option("--non-private", default=False, help='Train without privacy (baseline).')
    public_tickets: bool = option("--public-tickets", default=False,
        help=("Assert the ticket's generation data is public even though it has the private dataset's name "
              '(checked record by record).'))
    val_fraction: float | None = opt.VAL_FRACTION()
    public_dataset: str | None = option(choices=Dataset,
        help='Public dataset for noise plug-ins that need one (shaped); never the private dataset.')
    public_split: str | None = option(choices=Split,
        help='Split of --public-dataset whose training part is used [default: train].')
    seed: int | None = opt.SEED()
    noise_seed: int | None = opt.NOISE_SEED()
    device: str = opt.DEVICE("auto")
    devices: int = option(default=1,
        help=('DP training on this many devices per node (Lightning DDP: one process each; on CPU, gloo '
              'processes). Each rank Poisson-samples its shard of the records, the clipped sums are all-reduced'
              ' and the noise is added once: the same mechanism and ε as on one device.'))
    num_nodes: int = option("--num-nodes", default=1,
        help=('Nodes of a multi-device run (launch one command per node with NODE_RANK, MASTER_ADDR and '
              'MASTER_PORT set, as Lightning documents).'))
    strategy: str = option(choices=Strategy, default='auto',
        help='auto, or ddp (what auto picks for more than one process).')
    cuda_graphs: bool = opt.CUDA_GRAPHS(False)
    physical_batch: int | None = opt.PHYSICAL_BATCH()
    config: Path | None = opt.CONFIG_FILE()
    data_dir: Path | None = opt.DATA_DIR()
    download: bool = opt.DOWNLOAD(False)
    out: Path | None = option(help='Model checkpoint (default checkpoints/<dataset>-<mode>.pt).')
    overwrite: bool = option(default=False, help='Replace an existing model file.')
    progress: bool = opt.PROGRESS(True)
    logger: str = opt.LOGGER('csv')
    log_dir: Path | None = opt.LOG_DIR()
    json_out: bool = opt.JSON(False)

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
        if self.non_private and (self.eps is not None or self.sigma is not None):
            raise DpltmUserError("--non-private trains without noise: drop --eps/--sigma")
        if self.non_private:  # options of the DP mechanism: silently ignored, they would suggest it ran
            given = [flag for flag, value in (("--noise", self.noise), ("--clip", self.clip),
                                              ("--noise-seed", self.noise_seed), ("--accountant", self.accountant),
                                              ("--max-eps", self.max_eps), ("--neighbouring", self.neighboring),
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
            from dpltm.settings import late_rewind_step

            late_rewind_step(self.rewind)  # a start train takes, before what it combines with
        if self.dense and ((self.rewind is not None and self.rewind != "init") or self.output_layer is not None):
            raise DpltmUserError(f"--rewind {self.rewind or 'public'} and --output-layer choose a ticket's start: drop "
                                 "them with --dense")
        self._check_network()

    def run(self) -> TrainingReport:
        from dpltm.dp.distributed import Distribution
        from dpltm.run_log import check_logger

        check_logger(self.logger)
        self.check()
        public = None if self.public_dataset is None else f"{self.public_dataset}:{self.public_split or 'train'}"
        return stage_train(self.settings(), self.config, self.ticket, self.non_private, self.public_tickets,
                           self.data_dir, self.device, self.out, self.progress, public_data=public,
                           noise_seed=self.noise_seed, overwrite=self.overwrite,
                           distribution=Distribution(self.devices, self.num_nodes, self.strategy),
                           cuda_graphs=self.cuda_graphs, logger=self.logger, log_dir=self.log_dir,
                           download=self.download)
