"""`dpltm run`: every stage in a sound (end-to-end DP) mode, orchestrated in one place.

Public tickets: IMP on the public dataset → the noise-aware choice (or the best score) on public data
→ DP training of the winner on the private dataset with all of ε. Private tickets: a ticket made on
the private data by DP warm-up → its DP training, one σ composed over both to ε.

Every check runs before the first line of work (settings, outputs, both datasets, the recipe against
the data: L < N, σ calibrable, lr in range). σ is calibrated by pure, cached functions
(dpltm.privacy.calibration), so the plan check, the noise-aware choice and the training share one
calibration per distinct plan. The CLI only parses the options into a `RunRequest` and prints the
report.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpltm import options as opt
from dpltm.architectures import model_cli
from dpltm.choices import Activation, Dataset, OutputLayer, RunRecipe, Split
from dpltm.console import err_console, kept_by_earlier_stage, on_interrupt_kept
from dpltm.errors import DpltmUserError
from dpltm.options import Overrides, option
from dpltm.privacy.display import format_delta, format_epsilon
from dpltm.stages.generate import stage_generate, stage_generate_private
from dpltm.stages.requests import CommandRequest
from dpltm.stages.select import (
    NoiseAwareRequest,
    TicketChoice,
    TicketSource,
    check_halving,
    check_search,
    stage_select,
)
from dpltm.stages.train import check_lr_given, check_planned_training, stage_train

if TYPE_CHECKING:
    from dpltm.artefacts.trained_model import TrainingReport
    from dpltm.settings import GenerateConfig, TrainConfig

TUNED_RECIPE_MIN_RECORDS = 20000
"""`run --recipe auto` takes the tuned recipe from this many private training records up: it was
chosen for N = 54000 (MNIST, Fashion-MNIST); its batch of 1600 does not suit small sets."""


def chosen_recipe(recipe: str, n_train: int, scatter: bool = False, arch: str | None = None) -> str:
    """The recipe `--recipe auto|paper|tuned|scatter|cnn` gives for a private training set of `n_train` records:
    auto is the ScatterNet one (the best sound configuration measured, docs/results.md) where its front end
    applies (`scatter`: square images of a side it takes, public tickets of the same shape, no other --arch),
    else, from TUNED_RECIPE_MIN_RECORDS records up (the size all three were chosen for), LeNet-5's own for
    `--arch lenet5` and tuned for the rest; under that size, paper."""
    if recipe == "auto":
        if n_train < TUNED_RECIPE_MIN_RECORDS:
            return "paper"
        return "scatter" if scatter else "cnn" if arch == "lenet5" else "tuned"
    return recipe


def auto_recipe_note(recipe: str, n_train: int) -> str:
    """`--recipe auto` reads N (the released mechanism differs on either side of the threshold): said where it
    is chosen, as the privacy statement says N is treated as public."""
    if recipe != "auto":
        return ""
    side = "≥" if n_train >= TUNED_RECIPE_MIN_RECORDS else "<"
    return f" (auto: N = {n_train} {side} {TUNED_RECIPE_MIN_RECORDS} training records; N is treated as public)"


def scatter_applies(arch: str | None, private_features: int, public_features: int) -> bool:
    """Whether `run --recipe auto` may take the ScatterNet front end: no --arch or a scatter-* one, the same
    input size on both sides (its tickets do not transfer across sizes), square images whose side is a
    multiple of 4 (the scattering's J = 2)."""
    import math

    side = math.isqrt(private_features)
    return ((arch is None or arch.startswith("scatter-")) and private_features == public_features
            and side * side == private_features and side % 4 == 0 and side >= 8)


@dataclass(frozen=True)
class RunRequest(CommandRequest):
    """`dpltm run`'s options, as plain values (None: the recipe's or the config's)."""

    dataset: str = option(choices=Dataset, default='mnist', config="data.dataset", shown=True,
        help='Private dataset to train on.')
    public_dataset: str = option(choices=Dataset, default='kmnist', help='Public dataset the tickets come from.')
    public_split: str = option(choices=Split, default='test', help='Split of the public dataset (KMNIST here: test).')
    eps: float = option("--eps", "--eps2", default=1.0, config="train.eps2", shown=True,
        help='Privacy budget ε for the private data (all of it goes to training: public tickets cost nothing).')
    delta: float = option(default=1e-5, config="train.delta", shown=True, help='δ.')
    epochs: int | None = option(config="train.epochs", shown=True, help='DP training epochs (paper: 50).')
    batch_size: int | None = option(config="train.batch_size", shown=True,
        help='Expected DP batch size L (paper: 400).')
    clip: float | None = opt.CLIP()
    lr: float | None = opt.LEARNING_RATE()
    neighboring: str | None = opt.NEIGHBORING()
    rounds: int | None = option(help='Pruning rounds (paper-style default: 10).')
    iterations: int | None = option(help='SGD iterations per ticket (paper: 5000).')
    project_to: int | None = option("--project-to",
        help=("Input projection width of the tickets (default: added automatically when the two datasets' input"
              ' sizes differ).'))
    activation: str | None = option(shown="the recipe's", choices=Activation,
        help=('Hidden activation of the tickets and the trained network: relu (paper) or tanh (bounded; helps '
              'under DP, Papernot et al. 2021).'))
    arch: str | None = opt.ARCH()
    momentum: float | None = option(config="train.momentum", shown="the recipe's",
        help='SGD momentum on the privatized gradients, in [0, 1).')
    augmult: int | None = opt.AUGMULT()
    noise_filter: str | None = opt.NOISE_FILTER()
    ema: float | None = opt.EMA()
    ema_warmup: bool | None = opt.EMA_WARMUP()
    rewind: str | None = option("--rewind", metavar="init|public|K", config="train.rewind",
        help=("Where the winner's weights start for DP training: θ0 (init), the weights its public IMP round "
              'ended with (public), or K: the tickets are made with late rewinding to step K of public training'
              ' and training starts there. Adds nothing to ε. Public tickets only.'))
    output_layer: str | None = option("--output-layer", config="train.output_layer", choices=OutputLayer,
        help="With --rewind public or K: θ0's output layer (reinit) or the public-trained one (keep).")
    freeze: str | None = option("--freeze", metavar="LAYER[,LAYER…]", config="train.freeze",
        help=('Layers of the winner held at their start weights and not trained (e.g. hidden.0); the '
              'noise-aware choice simulates the same. Public tickets only.'))
    recipe: str = option(choices=RunRecipe, default='auto',
        help=('Training recipe (under --config and flags): auto (the default: from 20000 training records, the '
              'size the recipes were chosen for, scatter where its front end applies — square images, public '
              'tickets of the same shape, no other --arch — else cnn for --arch lenet5 and tuned for the rest; '
              'paper below), scatter (the ScatterNet front end with tickets over a linear head, chosen on '
              'public data: L = 4096, momentum 0.9, lr = 1/σ, 5 IMP rounds of 1000 steps), tuned (chosen on '
              "public data: tanh, L = 1600, lr = 6/σ, EMA 0.999), cnn (LeNet-5's, chosen on public data: the "
              "tuned recipe's rate, the final iterate) or paper."))
    ticket_source: TicketSource = option("--ticket-source", default=TicketSource.public,
        help=('Where the ticket comes from: public (generated without privacy on --public-dataset) or private '
              '(made on --dataset itself by DP warm-up, no public data needed; warm-up and training composed to'
              ' --eps).'))
    warmup_epochs: int | None = option(config="private_ticket.warmup_epochs",
        help='With --ticket-source private: DP warm-up epochs, taken out of --epochs.')
    density: float | None = option(config="private_ticket.density",
        help='With --ticket-source private: fraction of weights the ticket keeps.')
    prune: str | None = opt.PRIVATE_PRUNE()
    choice: TicketChoice = option(default=TicketChoice.noise_aware,
        help=('How to pick the public ticket: noise-aware (train every ticket, the dense network included, '
              "under the planned DP noise on the public data; spends no ε) or best (the paper's score, which at"
              ' ν = 50 always takes the sparsest ticket).'))
    halving: int | None = opt.HALVING()
    search: str | None = option("--search", metavar="DIM[,DIM…]", shown="start,release with --choice noise-aware",
        help=('What the noise-aware choice also tries for each ticket (start, release, freeze; none: nothing): '
              'see `dpltm select --help`. A setting you give (--rewind, --ema, --freeze) fixes its dimension.'))
    seed: int | None = option(config="seed", shown=True, help='Seed.')
    noise_seed: int | None = opt.NOISE_SEED()
    device: str = opt.DEVICE("auto")
    cuda_graphs: bool = opt.CUDA_GRAPHS(False)
    physical_batch: int | None = opt.PHYSICAL_BATCH()
    config: Path | None = opt.CONFIG_FILE()
    data_dir: Path | None = opt.DATA_DIR()
    download: bool = opt.DOWNLOAD(False)
    out: Path | None = option(
        help=('Model checkpoint (default checkpoints/<dataset>-dpltm.pt); the tickets and winner go beside it '
              'as <stem>-tickets.pt and <stem>-winner.pt.'))
    overwrite: bool = option(default=False,
        help='Replace existing outputs (finished tickets made with the same settings are reused).')
    progress: bool = opt.PROGRESS(True)
    logger: str = opt.LOGGER('csv')
    log_dir: Path | None = opt.LOG_DIR()
    json_out: bool = opt.JSON(False)


def stage_run(request: RunRequest) -> TrainingReport:
    """Run every stage; returns the DP training's report. Each dataset is read once for all of them."""
    from dpltm.data.loaders import each_dataset_loaded_once

    with each_dataset_loaded_once():
        return _stage_run(request)


def _stage_run(request: RunRequest) -> TrainingReport:
    from dpltm.run_log import check_logger

    r = request
    check_logger(r.logger)
    if r.download:
        from dpltm.data.download import fetch_for_run

        fetch_for_run([r.dataset] + ([r.public_dataset] if r.ticket_source == TicketSource.public else []),
                      r.data_dir)
    if r.ticket_source == TicketSource.private:
        if r.cuda_graphs:
            raise DpltmUserError("--cuda-graphs: a private ticket's DP warm-up and training run in the eager step; "
                                 "drop --cuda-graphs with --ticket-source private")
        public_only = {"--rounds": r.rounds, "--iterations": r.iterations, "--project-to": r.project_to,
                       "--rewind": r.rewind, "--output-layer": r.output_layer, "--freeze": r.freeze,
                       "--halving": r.halving, "--search": r.search}
        given = ([name for name, value in public_only.items() if value is not None]
                 + [flag for name, flag in (("public_dataset", "--public-dataset"),
                                            ("public_split", "--public-split")) if name in r.given])
        if r.choice != TicketChoice.noise_aware:
            given.append("--choice")
        if given:
            one = len(given) == 1
            rounds = (" (a private ticket's warm-up rounds are the config setting private_ticket.rounds)"
                      if "--rounds" in given else "")
            raise DpltmUserError(f"{', '.join(given)} {'applies' if one else 'apply'} to public tickets only: with "
                                 f"--ticket-source private, drop {'it' if one else 'them'}{rounds}")
        return _run_private_tickets(r)
    if r.warmup_epochs is not None or r.density is not None or r.prune is not None:
        raise DpltmUserError("--warmup-epochs, --density and --prune apply with --ticket-source private")
    return _run_public_tickets(r)


def _run_public_tickets(r: RunRequest) -> TrainingReport:
    from dpltm.config import resolve_select_config, resolve_train_config
    from dpltm.data import load_dataset
    from dpltm.data.loaders import SPECS
    from dpltm.devices import require_cuda_for_graphs, resolve_device
    from dpltm.outputs import prepare_output
    from dpltm.paths import default_checkpoint_dir
    from dpltm.settings import late_rewind_step

    private_spec, public_spec = SPECS[r.dataset], SPECS[r.public_dataset]
    project_to = transfer_width(r)
    # every check before the (long) ticket generation: settings, outputs, both datasets
    model_out = r.out or default_checkpoint_dir() / f"{r.dataset}-dpltm.pt"
    tickets_path = model_out.with_name(f"{model_out.stem}-tickets.pt")
    winner_path = model_out.with_name(f"{model_out.stem}-winner.pt")
    train_cli = r.overrides("data", "train", "seed").updated({"model.activation": r.activation})
    train_cfg = resolve_train_config(train_cli, r.config)
    # the given generation options checked before any data is read (the recipe's own come once it is chosen)
    given_recipe = "paper" if r.recipe == "auto" else r.recipe
    given_generation = generation_settings(r, given_recipe, project_to, late_rewind_step(train_cfg.train.rewind))
    check_recipe_carries(r, given_recipe, given_generation, project_to)
    generation_config(given_generation, r.config)
    select_cli = Overrides({"select.halving": r.halving, "select.search": run_search(r)})
    select_settings = resolve_select_config(select_cli, r.config)
    check_halving(select_settings.halving, noise_aware=r.choice == TicketChoice.noise_aware,
                  name=TicketChoice(r.choice).value)
    check_search(select_settings.search, noise_aware=r.choice == TicketChoice.noise_aware,
                 name=TicketChoice(r.choice).value)
    if r.cuda_graphs and "freeze" in select_settings.search:
        raise DpltmUserError("--search freeze: a frozen layer trains in the eager step, and --cuda-graphs trains in "
                             "graphs: drop freeze from --search, or --cuda-graphs")
    for path in (model_out, winner_path):
        prepare_output(path, overwrite=r.overwrite, inputs=[r.config], checkpoint=True)
    torch_device = resolve_device(r.device)
    if r.cuda_graphs:
        require_cuda_for_graphs(torch_device)
    private = load_dataset(r.dataset, split=train_cfg.data.split, data_dir=r.data_dir,
                           val_fraction=train_cfg.data.val_fraction, seed=train_cfg.seed, device=torch_device)
    scatter = scatter_applies(r.arch, private_spec.num_features, public_spec.num_features)
    recipe = chosen_recipe(r.recipe, len(private.train), scatter, r.arch)
    train_cli = replace(train_cli, recipe=recipe)
    planned = resolve_train_config(train_cli, r.config)  # the recipe's settings under the given ones
    gen_cli = generation_settings(r, recipe, project_to, late_rewind_step(planned.train.rewind))
    check_recipe_carries(r, recipe, gen_cli, project_to)
    check_graphs_take(r.cuda_graphs, gen_cli.get("model.arch"))
    gen_cfg = generation_config(gen_cli, r.config)
    noise_aware = r.choice == TicketChoice.noise_aware
    public = load_dataset(r.public_dataset, split=gen_cfg.data.split, data_dir=r.data_dir,
                          val_fraction=gen_cfg.data.val_fraction, seed=gen_cfg.seed, device=torch_device)
    # the recipe's settings against both datasets (L < N, σ, lr), before any ticket
    check_lr_given(r.lr, planned, recipe)
    check_planned_start(planned, private_spec.num_classes, public_spec.num_classes, project_to)
    check_planned_freeze(planned, gen_cfg, public_spec)
    check_planned_training(planned, private, recipe, public.train if noise_aware else None)
    err_console.print(f"[bold]1/3[/bold] tickets from public data: {r.public_dataset} ({r.public_split} split)"
                      + (f", input projection to {project_to}" if project_to is not None else "")
                      + f"; training recipe: {recipe}" + auto_recipe_note(r.recipe, len(private.train)))
    from dpltm.tickets.cache import keep_tickets, restore_tickets

    cached = restore_tickets(gen_cfg, public.fingerprint, tickets_path) if (
        r.overwrite or not tickets_path.exists()) else None
    if cached is not None:  # public tickets are public artefacts: made once per settings and public data
        err_console.print(f"tickets: {tickets_path}, from the cache of public tickets ({cached}: made before with "
                          "these settings on this public data)")
    else:
        tickets, _ = stage_generate(gen_cli, r.config, r.data_dir, r.device, tickets_path, r.overwrite, r.progress,
                                    r.cuda_graphs, logger=r.logger, log_dir=r.log_dir)
        if tickets.complete:
            keep_tickets(gen_cfg, public.fingerprint, tickets_path)
    kept_by_earlier_stage(f"the public tickets are kept in {tickets_path}")
    on_interrupt_kept("no model was written")
    err_console.print(f"[bold]2/3[/bold] selection on public tickets ({TicketChoice(r.choice).value}; spends nothing "
                      "on private data)")
    request = (NoiseAwareRequest(len(private.train), train_cli, r.data_dir, r.device, r.progress) if noise_aware
               else None)
    stage_select(select_cli, r.config, tickets_path, not noise_aware, r.seed, winner_path,
                 overwrite=r.overwrite, noise_aware=request)
    kept_by_earlier_stage(f"the winner in {winner_path}")
    err_console.print(f"[bold]3/3[/bold] DP training on {r.dataset} at ε = {format_epsilon(r.eps)}, "
                      f"δ = {format_delta(r.delta)}")
    return stage_train(train_cli, r.config, winner_path, False, False, r.data_dir, r.device, model_out, r.progress,
                       noise_seed=r.noise_seed, overwrite=r.overwrite, cuda_graphs=r.cuda_graphs, logger=r.logger,
                       log_dir=r.log_dir)


def transfer_width(r: RunRequest) -> int | None:
    """The tickets' input projection width: none where both datasets have the private data's input size, else
    the private data's (the paper's §4.5.2 transfer; --arch mlp only). Checked before any data is read."""
    from dpltm.data.loaders import DATASETS, SPECS

    if r.public_dataset == r.dataset:
        raise DpltmUserError("`dpltm run` uses public tickets: --public-dataset must differ from --dataset "
                             "(for the paper's same-data mode run generate, select and train yourself)")
    for name in (r.dataset, r.public_dataset):
        if name not in SPECS:
            raise DpltmUserError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")
    check_graphs_take(r.cuda_graphs, r.arch)
    private_spec, public_spec = SPECS[r.dataset], SPECS[r.public_dataset]
    project_to = r.project_to
    mlp = r.arch in (None, "mlp")
    if not mlp and private_spec.num_features != public_spec.num_features:
        raise DpltmUserError(f"--arch {r.arch} tickets made on {r.public_dataset} ({public_spec.num_features} "
                             f"features) train only on data of that shape; {r.dataset} has "
                             f"{private_spec.num_features}: use --arch mlp, whose input projection carries tickets "
                             "across input sizes")
    if project_to is None and private_spec.num_features != public_spec.num_features:
        project_to = private_spec.num_features  # the paper's §4.5.2 transfer between input sizes
    if project_to is not None and project_to < 1:
        raise DpltmUserError(f"--project-to must be a positive width, got {project_to}")
    first_layer_inputs = project_to if project_to is not None else public_spec.num_features
    if first_layer_inputs != private_spec.num_features:
        raise DpltmUserError(f"--project-to {project_to} cannot transfer: {r.dataset} has "
                             f"{private_spec.num_features} features, so the tickets' projection width must be "
                             f"{private_spec.num_features}")
    return project_to


RUN_SEARCH = "start,release"
"""`run`'s default --search with the noise-aware choice: the other start and the other release of each ticket
For the default ScatterNet linear head both cost no extra training: its public start is
θ0 (its only layer is the re-initialised output layer) and a release is scored on the same run."""


def run_search(r: RunRequest) -> str | list[str] | None:
    """The search `run` hands the choice: --search as given, else RUN_SEARCH with the noise-aware choice and
    no config file that sets `select.search`, else the config's."""
    from dpltm.config import config_file_keys
    from dpltm.stages.requests import search_option

    if r.search is not None:
        return search_option(r.search)
    configured = "search" in config_file_keys(r.config, "select")
    return RUN_SEARCH if r.choice == TicketChoice.noise_aware and not configured else None


def check_graphs_take(cuda_graphs: bool, arch: str | None) -> None:
    """`--cuda-graphs` trains networks of the fused DP step only (`ArchitectureEntry.fused_step`): refused
    before any ticket is made for another."""
    from dpltm.architectures import ARCHITECTURES

    entry = ARCHITECTURES.get(arch or "mlp")
    if cuda_graphs and entry is not None and not entry.fused_step:
        able = ", ".join(name for name, e in ARCHITECTURES.items() if e.fused_step)
        raise DpltmUserError(f"--cuda-graphs trains {able}; --arch {arch} trains in the eager step: drop --cuda-graphs")


def check_recipe_carries(r: RunRequest, recipe: str, gen_cli: Overrides, project_to: int | None) -> None:
    """A recipe whose network is not the MLP (scatter: a ScatterNet head) makes tickets of the public images'
    shape; only the MLP's input projection carries tickets to data of another width."""
    from dpltm.config import recipe_settings
    from dpltm.data.loaders import SPECS

    own = recipe_settings(recipe).get("model.arch")  # the network a recipe was chosen for, if it names one
    if r.arch is not None and own is not None and r.arch.split("-")[0] != own.split("-")[0]:
        raise DpltmUserError(f"--recipe {recipe} was chosen for --arch {own}" + (
            " (or another ScatterNet head)" if own.startswith("scatter-") else "") +
            f"; --arch {r.arch} trains with " + (
                "--recipe cnn, tuned or paper" if r.arch == "lenet5" else "--recipe scatter" if r.arch.startswith(
                    "scatter-") else "--recipe tuned or paper"))
    recipe_arch = gen_cli.get("model.arch")
    if r.arch is None and recipe_arch not in (None, "mlp") and project_to is not None:
        raise DpltmUserError(f"--recipe {recipe} trains {recipe_arch} tickets, made on {r.public_dataset}'s "
                             f"{SPECS[r.public_dataset].num_features} values, which cannot carry to {r.dataset}'s "
                             f"{SPECS[r.dataset].num_features}: use --recipe paper (MLP tickets with an input "
                             "projection)")


def generation_settings(r: RunRequest, recipe: str, project_to: int | None,
                        rewind_step: int | None = None) -> Overrides:
    """The public tickets' settings tree: the given options, else the recipe's network (`model.arch`,
    `model.activation`; its built-in widths follow) and IMP length (`generate.rounds`, `generate.iterations`;
    configs/recipes/; a --config file's `generate:` lies above the recipe's), else the config's. `rewind_step` (the
    planned start `--rewind K`) makes them with late rewinding to step K, so the winner holds the iterate training
    starts from."""
    from dpltm.config import config_file_keys, recipe_settings

    own = recipe_settings(recipe)
    in_file = {f"generate.{key}" for key in config_file_keys(r.config, "generate")}
    given = {"model.arch": r.arch, "model.activation": r.activation, "generate.rounds": r.rounds,
             "generate.iterations": r.iterations}
    chosen = Overrides({key: value if value is not None else None if key in in_file else own.get(key)
                        for key, value in given.items()})
    network = model_cli(chosen.get("model.arch"), None, project_to=project_to,
                        activation=chosen.get("model.activation"))
    return chosen.updated(network, "model").updated({"data.dataset": r.public_dataset, "data.split": r.public_split,
                                                     "generate.rewind_step": rewind_step, "seed": r.seed})


def generation_config(gen_cli: Overrides, config: Path | None) -> GenerateConfig:
    """The public tickets' GenerateConfig; a late-rewinding step past the round, which `--rewind K` set, is refused
    naming the flag the user gave."""
    from dpltm.config import resolve_generate_config

    step = gen_cli.get("generate.rewind_step")
    if step is not None:  # the round's length comes from flags, the recipe or the config: resolved without K first
        iterations = resolve_generate_config(gen_cli.updated({"generate.rewind_step": None}),
                                             config).generate.iterations
        if step >= iterations:
            raise DpltmUserError(f"--rewind {step} makes the public tickets with late rewinding to step {step}, which "
                                 f"must come before the end of a round: --rewind-step must lie in [0, --iterations) "
                                 f"= [0, {iterations})")
    return resolve_generate_config(gen_cli, config)


def check_planned_freeze(planned: TrainConfig, gen_cfg: GenerateConfig, public_spec: Any) -> None:
    """--freeze's layer names checked against the tickets' network before they are made (a wrong name would
    otherwise surface only at training, after generation and the choice)."""
    if not planned.train.freeze:
        return
    from dpltm.masks import frozen_parameter_names
    from dpltm.networks.lenet import build_architecture, build_network

    arch = build_architecture(public_spec.num_features, public_spec.num_classes, gen_cfg.model.hidden,
                              gen_cfg.model.project_to, gen_cfg.model.activation, gen_cfg.model.arch)
    frozen_parameter_names(build_network(arch), planned.train.freeze)


def check_planned_start(planned: TrainConfig, private_classes: int, public_classes: int,
                        project_to: int | None) -> None:
    """The winner's start (`--rewind`, `--output-layer`) checked before the tickets are made: a kept output
    layer needs a public start, as many classes, and no input projection (which builds a new output layer)."""
    if planned.train.output_layer != "keep":
        return
    if planned.train.rewind == "init":
        raise DpltmUserError("--output-layer keep applies with --rewind public or K (from θ0 every layer is θ0's)")
    if private_classes != public_classes or project_to is not None:
        projection = ", an input projection" if project_to is not None else ""
        raise DpltmUserError(f"--output-layer keep: the public tickets' output layer cannot carry over "
                             f"({public_classes} classes{projection}; the private data has {private_classes} "
                             "classes); use --output-layer reinit")


def _run_private_tickets(r: RunRequest) -> TrainingReport:
    """A private ticket on the private data, then its DP training; the warm-up is taken out of the
    recipe's epochs, and one σ makes the whole run meet --eps."""
    from dpltm.config import resolve_train_config
    from dpltm.data import load_dataset
    from dpltm.outputs import prepare_output
    from dpltm.paths import default_checkpoint_dir
    from dpltm.tickets.private import check_private_prune, plan_private_ticket, ticket_architecture

    base = resolve_train_config(Overrides({"data.dataset": r.dataset, "seed": r.seed}), r.config)
    pool = load_dataset(r.dataset, split=base.data.split, data_dir=r.data_dir, val_fraction=base.data.val_fraction,
                        seed=base.seed)
    chosen = chosen_recipe(r.recipe, len(pool.train), arch=r.arch)
    settings = resolve_train_config(Overrides({"data.dataset": r.dataset, "train.epochs": r.epochs}, chosen),
                                    r.config)
    check_lr_given(r.lr, settings, chosen)
    warmup = r.warmup_epochs if r.warmup_epochs is not None else settings.private_ticket.warmup_epochs
    rounds = settings.private_ticket.rounds
    if warmup * rounds >= settings.train.epochs:
        raise DpltmUserError(f"{rounds} warm-up round(s) of {warmup} epochs leave none of the "
                             f"{settings.train.epochs} epochs for training")
    model_out = r.out or default_checkpoint_dir() / f"{r.dataset}-dpltm-private.pt"
    ticket_path = model_out.with_name(f"{model_out.stem}-ticket.pt")
    for path in (model_out, ticket_path):
        prepare_output(path, overwrite=r.overwrite, inputs=[r.config], checkpoint=True)
    train_cli = replace(r.overrides("data", "train", "seed").updated({  # the public-only ones were refused: None
        "train.epochs": settings.train.epochs - warmup * rounds, "private_ticket.warmup_epochs": warmup,
        "private_ticket.density": r.density, "private_ticket.prune": r.prune}).updated(
        model_cli(r.arch, None, activation=r.activation), "model"),
        recipe=chosen)
    # the whole plan checked against the data before the first line of work (σ, L < N, the density)
    planned = resolve_train_config(train_cli, r.config)
    if planned.train.rewind != "init":  # e.g. from a --config file
        raise DpltmUserError(f"train.rewind {planned.train.rewind} starts from weights of public training: a private "
                             "ticket has none (its start is private_ticket.rewind)")
    plan_private_ticket(planned, len(pool.train))
    check_private_prune(ticket_architecture(planned, pool), planned.private_ticket)
    err_console.print(f"[bold]1/2[/bold] private ticket on {r.dataset}: {rounds} × {warmup} DP warm-up epochs, "
                      f"then {settings.train.epochs - warmup * rounds} epochs of DP training, "
                      f"ε = {format_epsilon(r.eps)} in all; "
                      f"recipe {chosen}{auto_recipe_note(r.recipe, len(pool.train))}")
    logging = {"logger": r.logger, "log_dir": r.log_dir}
    stage_generate_private(train_cli, r.config, r.data_dir, r.device, ticket_path, r.overwrite, r.progress,
                           noise_seed=r.noise_seed, **logging)  # its warm-up rounds draw from their own streams
    kept_by_earlier_stage(f"the private ticket is kept in {ticket_path}")
    on_interrupt_kept("no model was written")
    err_console.print(f"[bold]2/2[/bold] DP training of the private ticket on {r.dataset}")
    return stage_train(train_cli, r.config, ticket_path, False, False, r.data_dir, r.device, model_out, r.progress,
                       noise_seed=r.noise_seed, overwrite=r.overwrite, **logging)
