"""Phase 3 as a command: resolve the settings, check the ticket and the output, load the data, train."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpltm.console import err_console, on_interrupt_kept
from dpltm.dp.plugins import NOISE_PLUGINS, noise_plugin
from dpltm.errors import DpltmUserError
from dpltm.privacy.display import format_rate, format_sigma

if TYPE_CHECKING:
    from rich.console import Console

    from dpltm.audit.run import AuditPlan
    from dpltm.config import TrainConfig
    from dpltm.data.types import DatasetSplits, LabeledTensors
    from dpltm.dp.distributed import Distribution


def stage_train(cli: dict[str, Any], config: Path | None, ticket: Path | None, non_private: bool,
                public_tickets: bool, data_dir: Path | None, device: str, out: Path | None,
                progress: bool, public_data: str | None = None, noise_seed: int | None = None,
                overwrite: bool = False, distribution: Distribution | None = None,
                cuda_graphs: bool = False, logger: str | None = None,
                log_dir: Path | None = None, download: bool = False, audit: AuditPlan | None = None) -> dict[str, Any]:
    from dpltm.checkpoint import prepare_output
    from dpltm.config import SEARCH_FIXED_BY, fixed_dimensions, resolve_train_config
    from dpltm.data import load_dataset
    from dpltm.devices import resolve_device
    from dpltm.dp.distributed import Distribution, check_launch, is_main_process, local_device
    from dpltm.paths import check_not_input, default_checkpoint_dir
    from dpltm.selection.winner import chosen_training, describe_variant
    from dpltm.tickets.data import data_to_check
    from dpltm.tickets.private import is_private_ticket, private_ticket_plan
    from dpltm.training import pipeline

    ticket_body = pipeline.load_ticket(ticket) if ticket is not None else None
    # A private ticket was made with a training plan (recipe, epochs, data settings, and the whole
    # run's ε): that plan is the default, under the --config file and flags. So is the start, frozen
    # layers and release a noise-aware choice chose for its winner (`select --search`).
    private_ticket = is_private_ticket(ticket_body)
    check_recipe_suits_ticket(cli.get("recipe"), ticket_body)
    chose = None if private_ticket or non_private else chosen_training(ticket_body)
    chosen = chose
    if chose is not None:  # a setting the user gives fixes its whole dimension (as it did for the choice)
        dropped = {key for dimension in fixed_dimensions(cli, config) for key in SEARCH_FIXED_BY[dimension]}
        chosen = {"train": {k: v for k, v in chose["train"].items() if k not in dropped}}
    base = private_ticket_plan(ticket_body) if private_ticket else chosen
    if private_ticket and not cli.get("data", {}).get("dataset"):  # the data it was made on
        cli = {**cli, "data": {**cli.get("data", {}), "dataset": ticket_body["source"]["data"]["dataset"]}}  # type: ignore[index]
    cfg = resolve_train_config(cli, config, base=base)
    if chosen is not None and chosen["train"].get("freeze") and cfg.train.freeze and not pipeline.freezing_can_run(
            "graphs" if cuda_graphs else "eager", audited=audit is not None, noise=cfg.train.noise):
        raise DpltmUserError(f"the winner's noise-aware choice holds {', '.join(cfg.train.freeze)} at its public "
                             "weights, and freezing trains in the eager step with --noise gaussian and no audit: "
                             "train it unfrozen with `train: {freeze: []}` in a --config file, or select again "
                             "without freeze in --search")
    given = cli.get("train", {})
    if non_private and given.get("lr_sigma") is not None:
        raise DpltmUserError("--lr-sigma sets a DP run's learning rate from its σ; a --non-private run has no σ: "
                             "give --lr")
    if not non_private and given.get("lr") is not None and given.get("lr_sigma") is None:
        check_lr_given(given["lr"], cfg, str(cli.get("recipe", "the config's")))  # --lr would be ignored
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
    public_name, public_split = (public_data.split(":", 1) + ["train"])[:2] if public_data else (None, None)
    if public_name is not None and not noise_plugin(cfg.train.noise).needs_public_data:
        needing = ", ".join(n for n, p in NOISE_PLUGINS.items() if p.needs_public_data)
        raise DpltmUserError(f"--public-dataset is only used by --noise {needing} (this run uses {cfg.train.noise})")
    if public_name is None and not non_private and noise_plugin(cfg.train.noise).needs_public_data:
        raise DpltmUserError(f"--noise {cfg.train.noise} needs public data: pass --public-dataset NAME "
                             "(and --public-split)")
    if public_name is not None and public_name == cfg.data.dataset:
        raise DpltmUserError(f"--public-dataset must be public: it names the private dataset {cfg.data.dataset}")
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
    ticket_data, unchecked = data_to_check(ticket_body, data.name, public_tickets, data_dir)
    if main:
        on_interrupt_kept("no model was written" + (f" (the model already at {target} is unchanged)"
                                                    if target.exists() else ""))

    def announce() -> None:
        where = f"{distribution.world_size} processes (DDP)" if distribution.multi_process else str(torch_device)
        err_console.print(f"training on {data.name} ({len(data.train)} records) on {where}: "
                          f"{'NON-PRIVATE baseline' if non_private else 'DP-SGD'}"
                          f"{' on the dense network' if ticket is None else f' on ticket {ticket}'}")
        if chose is not None and chose["train"]:
            ran = {"rewind": cfg.train.rewind, "output_layer": cfg.train.output_layer,
                   "freeze": list(cfg.train.freeze), "ema": cfg.train.ema, "ema_warmup": cfg.train.ema_warmup}
            ran = {k: v for k, v in ran.items() if k in chose["train"]}
            err_console.print(f"the noise-aware choice chose: {describe_variant(chose['train'])}" + (
                "" if ran == chose["train"] else f"; the --config file or flags override it: {describe_variant(ran)}"),
                markup=False, highlight=False)
        if not non_private and cfg.train.delta > 1.0 / len(data.train):  # as make_private warns
            err_console.print(f"warning: δ = {cfg.train.delta:g} is above 1/N = {1.0 / len(data.train):.3g}: an (ε, δ) "
                              "guarantee with δ > 1/N allows releasing a record outright; the usual choice is δ ≪ 1/N")

    report = pipeline.train(cfg, data, target, ticket=ticket_body, ticket_path=ticket, private=not non_private,
                            assert_public=public_tickets, progress=progress, public_data=public,
                            public_dataset=public_name, noise_seed=noise_seed, ticket_data=ticket_data,
                            ticket_data_unchecked=unchecked,
                            on_start=announce, distribution=distribution,
                            step_mode="graphs" if cuda_graphs else "eager", logger=logger, log_dir=log_dir,
                            audit=audit)
    if main:  # said if printing the report fails now (a full or closed stdout) or the run is stopped
        on_interrupt_kept(f"the model is written to {target}")
    return report


RECIPE_ARCHITECTURES = {"scatter": ("scatter-linear", "scatter-mlp", "scatter-cnn"), "cnn": ("lenet5",)}
"""The networks a network-specific recipe was chosen for (as `--dense --arch` checks them in resolve_train_config)."""


def check_recipe_suits_ticket(recipe: Any, ticket_body: dict[str, Any] | None) -> None:
    """A ticket brings its own network: a recipe chosen for another kind would train it with that kind's rates."""
    if ticket_body is None or recipe not in RECIPE_ARCHITECTURES:
        return
    record = ticket_body.get("architecture", {})
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
    """`dpltm run`'s DP training checked against the data before any ticket is made (issue 19): the
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


def print_training_report(report: dict[str, Any], console: Console = err_console) -> None:
    """The human summary: the result on stdout as a CLI's output, or on stderr beside a `--json`
    report (the CLI's, alone on stdout)."""
    val_accuracy = report["val_accuracy"]
    validation = ("no validation set" if val_accuracy is None or math.isnan(val_accuracy)
                  else f"validation {val_accuracy:.4f}")
    console.print(f"test accuracy {report['test_accuracy']:.4f} ({validation}) "
                  f"after {report['epochs_run']} epochs, {report['steps']} steps: {report['stop_reason']}")
    if report["noise_multiplier"] is not None:
        how = "calibrated" if report["sigma_calibrated"] else "given"
        if report["noise_parameter"] != report["noise_multiplier"]:
            how = f"effective; plug-in parameter {format_sigma(report['noise_parameter'])}, {how}"
        console.print(f"noise multiplier σ = {format_sigma(report['noise_multiplier'])} ({how}), "
                      f"q = {format_rate(report['sample_rate'])}")
    console.print(report["statement"], markup=False, highlight=False)
    console.print(f"model: {report['output']}" + (f"; log: {report['log_dir']}" if report.get("log_dir") else ""))
