"""The stages as library calls: select a winner, train it (privately or not), report.

The CLI is a thin layer over these functions; `dpltm run` chains them.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dpltm import __version__
from dpltm.artefacts import Outcome, PrivacyRecord, TrainedModel, Winner
from dpltm.artefacts.trained_model import EpochRow, TrainingReport
from dpltm.checkpoint import save_atomic
from dpltm.config import to_dict
from dpltm.data.release import mismatch, scrub_ticket
from dpltm.data.splits import record_hashes
from dpltm.data.types import DatasetSplits, LabeledTensors
from dpltm.dp.distributed import Distribution, is_main_process
from dpltm.dp.mechanism import NoiseContext
from dpltm.dp.noise import NOISE_PLUGINS, check_noise_for_network, noise_plugin
from dpltm.errors import DpltmUserError
from dpltm.feature_cache import network_inputs
from dpltm.masks import Masks, density, freeze_layers_, full_masks, stored_state
from dpltm.networks.lenet import build_architecture, build_network
from dpltm.outputs import check_writable, output_lock
from dpltm.privacy.accounting import require_support
from dpltm.privacy.display import format_epsilon, round_up
from dpltm.privacy.events import DpEvent
from dpltm.privacy.ledger import PrivacyLedger, dpsgd_events, training_record
from dpltm.selection.rules import SELECTION_RULES
from dpltm.settings import TrainConfig, TrainSettings, describe_start
from dpltm.training.plan import EpochRecord, TrainPlan, plan_training
from dpltm.training.private import TrainOutcome, epochs_within_budget, mechanism_seed, run_non_private, run_private
from dpltm.training.transfer import TransferRecord, model_from_ticket

if TYPE_CHECKING:
    from dpltm.audit.run import AuditPlan
    from dpltm.run_log import RunLog


@dataclass(frozen=True)
class TicketOrigin:
    """How the ticket relates to the private data: decides end-to-end DP (docs/privacy.md §1)."""

    phase1: str  # "public" | "same-data" | "private" | "none"
    phase1_dataset: str | None
    selection_eps1: float | None
    explanation: str
    data_independent_selection: bool = False
    caveat: str | None = None
    selection_draws: int = 1
    phase1_training: tuple[dict[str, float | int], ...] | None = None
    """A private ticket's DP warm-up rounds on this very data (ledger records)."""

    def spent_events(self) -> list[DpEvent]:
        """The DP events that already ran on the private data before training (private tickets)."""
        return dpsgd_events(self.phase1_training or ())


def shared_records(seen_by_tickets: list[LabeledTensors], private: LabeledTensors) -> int:
    """How many private training records the ticket generation also saw, by the per-record content
    hash the splits use (equal records, equal hashes; a 64-bit collision can only refuse more)."""
    private_keys = record_hashes(private.features, private.labels, seed=0)
    return sum(int(np.isin(record_hashes(part.features, part.labels, seed=0), private_keys).sum())
               for part in seen_by_tickets)


def ticket_origin(ticket: Winner | None, private: DatasetSplits, assert_public: bool,
                  ticket_data: DatasetSplits | None = None, unchecked: str | None = None) -> TicketOrigin:
    """Same dataset name, or the private data's fingerprint ⇒ same data (conservative), unless the user
    asserts the tickets are public.

    Whatever the names, tickets are checked record by record whenever their own data could be reloaded
    (`ticket_data`: the train and validation parts generation saw): tickets asserted public, or made on
    another dataset, that saw a private training record are refused. `unchecked` says why the data of
    tickets from another dataset could not be reloaded; the guarantee then carries that caveat. A private
    ticket's DP warm-up is composed into the ledger whatever data it names, since its records may be
    the private ones.
    """
    if ticket is None:
        return TicketOrigin("none", None, None, "dense network: no ticket")
    source = ticket.source_data
    generated_on = f"{source['dataset']} ({source['split']} split)"
    if ticket.is_private_ticket:
        return _private_ticket_origin(ticket, private, generated_on)
    selection = ticket.selection
    private_dataset = private.name
    # The name decides, and the data's fingerprint backs it: tickets that name another dataset but hold
    # the private data's fingerprint (a renamed file, or one set of files under two names) are same-data.
    same_name = source["dataset"] == private_dataset or (
        source.get("fingerprint") is not None and source.get("fingerprint") == private.fingerprint)
    if same_name and assert_public:
        refused = f"--public-tickets refused: the tickets come from {generated_on}, which"
        if source.get("fingerprint") == private.fingerprint:
            raise DpltmUserError(f"{refused} is the private data itself (same data fingerprint)")
        if ticket_data is None:
            raise DpltmUserError(f"{refused} cannot be checked against the private data (reload it)")
        _refuse_shared_records(refused, ticket_data, private)
    if same_name and not assert_public:
        # What the pick spent, from its rule's declared capabilities (dpltm.selection.rules); a method no
        # rule knows is taken as a non-private look at the data.
        rule = SELECTION_RULES.get(selection["method"])
        spent = rule is not None and rule.spends_eps1
        eps1 = selection.get("eps1_total", selection["eps1"]) if spent else None
        return TicketOrigin("same-data", generated_on, eps1,
                            f"tickets generated without privacy on {generated_on}, the private dataset",
                            data_independent_selection=rule is not None and not rule.touches_ticket_data,
                            selection_draws=int(selection.get("draws", 1)) if eps1 is not None else 1)
    if same_name:
        return TicketOrigin("public", generated_on, None,
                            f"tickets from {generated_on}: asserted public by --public-tickets",
                            caveat=f"the tickets' data ({generated_on}) was asserted public by the user "
                                   "(--public-tickets; no private training record found among them); the "
                                   "end-to-end guarantee rests on that assertion")
    explanation = f"tickets from {generated_on}: another dataset than the private one"
    if ticket_data is None:
        return TicketOrigin("public", generated_on, None, explanation,
                            caveat=f"the tickets' data ({generated_on}) could not be checked record by record for "
                                   f"private training records of {private_dataset} ({unchecked or 'not reloaded'}); "
                                   "the end-to-end guarantee assumes it holds none")
    _refuse_shared_records(f"the tickets come from {generated_on}, which", ticket_data, private)
    return TicketOrigin("public", generated_on, None, f"{explanation} (no private training record among them)")


def _refuse_shared_records(refused: str, ticket_data: DatasetSplits, private: DatasetSplits) -> None:
    overlap = shared_records([ticket_data.train, ticket_data.val], private.train)
    if overlap:
        raise DpltmUserError(f"{refused} includes {overlap} of the private training records of "
                             f"{private.name} ({private.source_split} split): tickets trained without privacy on "
                             "private records are not public; make them on data that shares no record with it")


def _private_ticket_origin(ticket: Winner, private: DatasetSplits, generated_on: str) -> TicketOrigin:
    """A ticket made with privacy (`generate --private`): its warm-up is composed into this run's ledger, on
    the data it was made on and on any other (whose records may be the same people's)."""
    warmup = None if ticket.private_ticket is None else ticket.private_ticket.warmup
    if not warmup:
        raise DpltmUserError("the private ticket lacks the record of its DP warm-up (a damaged or foreign file)")
    source = ticket.source_data
    if source["dataset"] != private.name:
        return TicketOrigin("private", generated_on, None,
                            f"ticket made with privacy on {generated_on}, another dataset whose records may be among "
                            f"{private.name}'s: its DP warm-up is composed below", phase1_training=tuple(warmup))
    differs = mismatch(source, private)  # settings and counts: the file holds no fingerprint of user data
    if differs is not None:
        raise DpltmUserError(
            f"this private ticket was made on {generated_on} with other data settings ({differs}): "
            "train it on the same dataset, split, seed and --val-fraction it was made with")
    return TicketOrigin("private", generated_on, None,
                        f"ticket made on {generated_on} itself, with privacy (DP warm-up, composed below)",
                        phase1_training=tuple(warmup))


def check_start(start: str, output_layer: str, ticket: Winner | None, origin: TicketOrigin) -> None:
    """`--rewind public` (and `--rewind K`, iterate K of public training) starts from weights trained without
    privacy on the tickets' data. Trained on other, public data they are public knowledge and add nothing to the
    ledger; trained on the private data itself (same-data tickets) they would make the run not DP at all, beyond
    the mask's own leak, so they are refused, as for a private ticket (made on the private data; its own start is
    `generate --private --rewind`). One line each, before any work."""
    if start == "init":
        if output_layer == "keep":
            raise DpltmUserError("--output-layer keep applies with --rewind public or K (from θ0 every layer is "
                                 "θ0's)")
        return
    what = describe_start(start)
    if ticket is None:
        raise DpltmUserError(f"--rewind {start} starts a ticket from {what}: the dense network has none (give "
                             f"--ticket, or drop --rewind {start})")
    if origin.phase1 == "private":
        raise DpltmUserError(f"--rewind {start} is refused for a private ticket: it was made on the private data, "
                             "not public data (its start is chosen when it is made: generate --private --rewind)")
    if origin.phase1 == "same-data":
        raise DpltmUserError(f"--rewind {start} is refused: the tickets were trained without privacy on "
                             f"{origin.phase1_dataset}, the private dataset, so starting from their weights is not "
                             "DP; use tickets from other (public) data, or --rewind init")


def build_model(ticket: Winner | None, data: DatasetSplits, hidden: tuple[int, ...],
                seed: int, activation: str = "relu",
                arch: str = "mlp", start: str = "init",
                output_layer: str = "reinit") -> tuple[torch.nn.Module, Masks, TransferRecord]:
    """The network to train and its masks: the dense one (`hidden`, `arch`; every weight kept), or the
    ticket's, from θ0 or its public-trained weights (`start`, `output_layer`: transfer.start_weights). Both
    get `activation`, so a ticket and the dense baseline of one config train the same network family."""
    if ticket is None:
        architecture = build_architecture(data.num_features, data.num_classes, hidden, None, activation, arch)
        record = TransferRecord("dense", activation=activation, arch=arch if arch != "mlp" else None)
        model = build_network(architecture, torch.Generator().manual_seed(seed))
        return model, full_masks(model), record
    return model_from_ticket(ticket, data.num_features, data.num_classes, seed, activation, start, output_layer)


def train(cfg: TrainConfig, data: DatasetSplits, out: Path, *, ticket: Winner | None,
          ticket_path: Path | None, private: bool, assert_public: bool = False,
          progress: bool = True,
          public_data: LabeledTensors | None = None, public_dataset: str | None = None,
          noise_seed: int | None = None, ticket_data: DatasetSplits | None = None,
          ticket_data_unchecked: str | None = None, on_start: Callable[[], None] | None = None,
          distribution: Distribution | None = None, step_mode: str = "eager",
          logger: str | None = None, log_dir: Path | None = None,
          audit: AuditPlan | None = None) -> TrainingReport:
    """Train and write the model checkpoint; returns the final report.

    `public_data` (records of `public_dataset`, never the private one) is handed to the noise
    plug-in, e.g. for the sensitivity-shaped noise (docs/privacy.md §6). `noise_seed` seeds the noise
    and Poisson sampling (default: a fresh OS-CSPRNG seed; never stored). `ticket_data` is the
    tickets' own data, reloaded to check record by record that it holds no private training record
    (`ticket_data_unchecked`: why it could not be reloaded).
    `on_start` is called once every check has passed, just before training (the output is
    locked from then on). With a multi-process `distribution` (DP training only) every rank runs
    this function; only rank 0 locks and writes the output. `step_mode` (private_training.STEP_MODES)
    says how a DP step runs, never what it computes. `audit` (dpltm.audit.run.AuditPlan) adds
    canaries to this very run and puts the empirical lower bound on ε in `report.audit`. With `logger`
    (csv, tensorboard, mlflow or none), rank 0 logs the run under `log_dir` (dpltm.run_log).
    """
    distribution = distribution or Distribution()
    if distribution.multi_process and not private:
        raise DpltmUserError("--devices/--num-nodes > 1 is for DP training; "
                             "the non-private baseline runs on one device")
    main = is_main_process()
    check_writable(out)  # read-only, on every rank: under torchrun they all fail together
    s = cfg.train
    origin = ticket_origin(ticket, data, assert_public, ticket_data, ticket_data_unchecked)
    check_start(s.rewind, s.output_layer, ticket, origin)
    model, masks, transfer, data = _prepared_model(cfg, data, ticket, step_mode, audit, private, distribution,
                                                   progress and main, warn=main)
    n = len(data.train) + (audit.extra_records if audit is not None else 0)
    plan = plan_training(s, n, origin.spent_events()) if private else None
    if plan is not None and plan.lr != s.lr:  # lr_sigma: the run's lr follows its σ (and is stored)
        s = replace(s, lr=plan.lr)
        cfg = replace(cfg, train=s)
    accounting = RunAccounting(origin, plan, s, n, data.name)
    plan, budget_note = accounting.within_max_eps()
    if plan is not None:  # refuse an accountant that cannot state this run before any step
        ledger = accounting.ledger_for(plan.steps)
        require_support(ledger.training_event(), s.accountant, s.neighboring)
        ledger.best_bound()
        if audit is not None:  # the claim the audit tests, stated before any step
            audit.state_claim(ledger, s)
    planned = accounting.ledger_for(plan.steps if plan is not None else 0)
    on_epoch = EpochLog(planned.end_to_end_dp and s.patience is None,
                        planned.best_bound().epsilon if plan is not None and s.patience is not None else None,
                        show=progress and main)
    if logger is not None and main:
        from dpltm.run_log import check_log_root

        check_log_root(log_dir, "train", data.name)
    if on_start is not None and main:
        on_start()
    run_log = None
    with output_lock(out) if main else contextlib.nullcontext():
        if logger is not None and main:  # claimed once the output is ours: a refused run leaves no folder
            run_log = on_epoch.open_log(logger, log_dir, data.name, {**to_dict(cfg), "ticket": str(ticket_path)},
                                        private=plan is not None, epsilon_scope=planned.epsilon_scope)
        with run_log.closed_on_error() if run_log is not None else contextlib.nullcontext():
            seed, randomness = mechanism_seed(noise_seed)  # under DDP, rank 0's is broadcast
            if plan is not None:
                context = NoiseContext(model=model, masks=masks, clip=s.clip, private_dataset=data.name,
                                       public_data=public_data, public_dataset=public_dataset)
                outcome = run_private(model, data, plan, s, seed=seed, progress=progress and main,
                                      epsilon_after=accounting.epsilon_after if main else None,
                                      noise_context=context, on_epoch=on_epoch,
                                      distribution=distribution, step_mode=step_mode,
                                      canaries=None if audit is None else audit.canaries_in_training)
            else:
                outcome = run_non_private(model, data, s, seed=cfg.seed, progress=progress, on_epoch=on_epoch,
                                          masks=masks)
            if budget_note is not None and outcome.stop_reason.startswith("finished"):
                outcome = replace(outcome, stop_reason=budget_note)
            adaptive_stop = s.patience is not None and outcome.steps < (plan.steps if plan else 0)
            # An adaptively chosen stopping time is covered by the budget of the planned run
            # (post-processing of all T iterates), not by the ε at the stopping point.
            guarantee_steps = plan.steps if (plan is not None and adaptive_stop) else outcome.steps
            ledger = accounting.ledger_for(guarantee_steps)
            released = outcome.released if outcome.released is not None else model  # the EMA when on
            audited = None if audit is None or plan is None else audit.conclude(released, plan, ledger, s)
            trained = trained_model(released, masks, ledger, outcome, cfg, ticket, ticket_path, transfer, data,
                                    origin, plan, out, adaptive_stop, network_density=density(masks),
                                    randomness=randomness if plan is not None else None,
                                    processes=distribution.world_size,
                                    log_dir=None if run_log is None else str(run_log.folder), audit=audited)
            report = trained.report()
            if not main:  # another rank of a multi-device run: rank 0 writes
                return report
            save_atomic(trained.to_dict(), out, "model")
    if run_log is not None:  # finished only once the model it describes is kept
        run_log.finish(output=str(out), history=on_epoch.logged, report=report.to_json())
    return report


@dataclass
class EpochLog:
    """Each epoch's record on screen and in the run's log, ε named as the run may claim it: a bare "epsilon"
    only for a run that is DP end to end and stops at a data-independent time; otherwise "epsilon_dp_part",
    and with --patience the planned run's bound (an adaptive stop is covered by the planned run's budget, not
    by the ε at the stopping point)."""

    end_to_end: bool
    planned_epsilon: float | None
    show: bool
    run_log: RunLog | None = None
    logged: list[EpochRecord] = field(default_factory=list)

    def open_log(self, logger: str, log_dir: Path | None, dataset: str, config: dict[str, object], *, private: bool,
                 epsilon_scope: str) -> RunLog:
        """The run's log (dpltm.run_log), which every epoch's record joins from now on."""
        from dpltm.run_log import RunLog

        self.run_log = RunLog("train", dataset, logger, log_dir, config, mode="dp-sgd" if private else "non-private")
        self.run_log.update(end_to_end_dp=self.end_to_end, epsilon_scope=epsilon_scope)
        return self.run_log

    def loggable(self, record: EpochRecord) -> EpochRecord:
        if self.end_to_end:
            return record
        shown = {("epsilon_dp_part" if k == "epsilon" else k): v for k, v in record.items()}
        if self.planned_epsilon is not None:
            shown["epsilon_dp_part"] = self.planned_epsilon
        return shown

    def __call__(self, record: EpochRecord) -> None:
        if self.show:
            _print_epoch(record, self.end_to_end)
        if self.run_log is not None:
            self.logged.append(self.loggable(record))
            self.run_log.log_metrics(self.logged[-1], step=record["steps"])
            self.run_log.update(history=self.logged)  # readable (and plottable) while the run goes on


def _prepared_model(cfg: TrainConfig, data: DatasetSplits, ticket: Winner | None, step_mode: str,
                    audit: AuditPlan | None, private: bool, distribution: Distribution, progress: bool,
                    warn: bool) -> tuple[Any, Masks, TransferRecord, DatasetSplits]:
    """The network to train (from the ticket or dense, frozen layers held), on its device, and the data it
    trains on: a fixed front end's features, and an audit's canaries."""
    s = cfg.train
    model, masks, transfer = build_model(ticket, data, cfg.model.hidden, cfg.seed, cfg.model.activation, cfg.model.arch,
                                         s.rewind, s.output_layer)
    override = transfer.activation_override
    if override and s.rewind != "init" and warn:  # recorded in the checkpoint too (transfer)
        from dpltm.console import err_console

        err_console.print(f"warning: the ticket's public weights were trained with {override['ticket']}; training "
                          f"them with {override['used']} starts where public training never went (drop --activation, "
                          f"or make the tickets in {override['used']})", markup=False, highlight=False)
    if s.freeze:  # held at the start's weights (public-trained or θ0): trained, clipped and noised is the rest
        if not freezing_can_run(step_mode, audited=audit is not None, noise=s.noise):
            raise DpltmUserError("--freeze trains in the eager DP step with --noise gaussian, without an audit "
                                 "(drop --cuda-graphs, the audit or the noise plug-in, or --freeze)")
        frozen = freeze_layers_(model, s.freeze)
        transfer = replace(transfer, frozen_layers=list(dict.fromkeys(s.freeze)),
                           trained_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
                           frozen_parameters=sum(p.numel() for n, p in model.named_parameters() if n in frozen))
    check_noise_for_network(s.noise, model.arch.is_mlp)
    model.to(data.train.labels.device)
    # a fixed front end's cached features; with --augmult K each training record's K views
    data = network_inputs(model, data, progress=progress, views=s.augmult)
    if audit is not None and s.augmult > 1:
        raise DpltmUserError("an audit's canaries are single records: audit without --augmult")
    if audit is not None:  # canaries join the training set (input canaries) or its index space (gradient ones)
        if not private or distribution.multi_process or step_mode != "eager":
            raise DpltmUserError("an audit runs DP training on one device, in the eager step")
        if not noise_plugin(s.noise).plain_norm:  # e.g. shaped: its clipping geometry ‖g/s‖ ≤ C
            plain = " or ".join(n for n, p in NOISE_PLUGINS.items() if p.plain_norm)
            raise DpltmUserError(f"the audit's canaries assume the plain clipping norm: audit --noise {plain}")
        data = audit.prepare(model, data, s.clip, masks)
    return model, masks, transfer, data


@dataclass(frozen=True)
class RunAccounting:
    """The run's privacy ledger after any number of steps: what every ε the run states is computed from."""

    origin: TicketOrigin
    plan: TrainPlan | None
    settings: TrainSettings
    records: int
    dataset: str

    def ledger_for(self, steps: int) -> PrivacyLedger:
        s, plan, origin = self.settings, self.plan, self.origin
        training = (training_record(plan.sample_rate, plan.noise_multiplier, steps, s.clip,
                                    plan.expected_batch_size, self.records) if plan is not None else None)
        return PrivacyLedger(phase1=origin.phase1, phase1_dataset=origin.phase1_dataset,
                             private_dataset=self.dataset, selection_eps1=origin.selection_eps1,
                             training=training, delta=s.delta, neighboring=s.neighboring,
                             accountant=s.accountant, noise=s.noise,
                             data_independent_selection=origin.data_independent_selection,
                             selection_draws=origin.selection_draws, phase1_training=origin.phase1_training)

    def epsilon_after(self, steps: int) -> float:
        return self.ledger_for(steps).best_bound().epsilon

    def within_max_eps(self) -> tuple[TrainPlan | None, str | None]:
        """The plan cut to the epochs --max-eps allows (a data-independent stop), and the note saying so."""
        plan, cap = self.plan, self.settings.max_eps
        if plan is None or cap is None:
            return plan, None
        allowed = epochs_within_budget(plan, cap, self.epsilon_after)
        if allowed >= plan.epochs:
            return plan, None
        one_more = self.epsilon_after((allowed + 1) * plan.steps_per_epoch)
        note = (f"--max-eps {cap:g}: stopped after {allowed} of {plan.epochs} epochs; "
                f"one more would spend ε = {format_epsilon(one_more)}")
        return replace(plan, epochs=allowed), note


def trained_model(released: torch.nn.Module, masks: Masks, ledger: PrivacyLedger, outcome: TrainOutcome,
                  cfg: TrainConfig, ticket: Winner | None, ticket_path: Path | None, transfer: TransferRecord,
                  data: DatasetSplits, origin: TicketOrigin, plan: TrainPlan | None, out: Path, adaptive_stop: bool,
                  *, network_density: float, randomness: str | None, processes: int, log_dir: str | None,
                  audit: dict[str, Any] | None) -> TrainedModel:
    """The model checkpoint as a `TrainedModel`: the released weights and masks, one privacy record (the ledger
    and the caveats it cannot know), what the run did, and provenance. Its `report()` is the run's."""
    caveats = [origin.caveat] if origin.caveat else []
    if adaptive_stop:
        caveats.append(
            f"early stopping (--patience) chose the stopping epoch from validation accuracy on "
            f"{len(data.val)} held-out private records without privacy: those records are not "
            f"protected; the guarantee for the training records is the planned run's budget")
    return TrainedModel(
        architecture=released.arch.to_dict(),
        state_dict=stored_state(released, masks),
        privacy=PrivacyRecord(ledger, tuple(caveats), adaptive_stop),
        history=tuple(map(EpochRow.from_dict, outcome.history)),
        config=to_dict(cfg),
        data=data.summary(),
        outcome=Outcome(
            steps=outcome.steps, stop_reason=outcome.stop_reason, tickets=origin.explanation,
            density=network_density,
            # what the accuracies and the state_dict are: the last iterate, or an EMA of the iterates
            # (post-processing, docs/privacy.md §7)
            released_weights=outcome.released_weights,
            noise_parameter=plan.noise_parameter if plan is not None else None,
            sigma_calibrated=plan.calibrated if plan is not None else None,
            output=str(out), processes=processes, randomness=randomness, log_dir=log_dir, audit=audit),
        transfer=transfer,
        # a released file: no fingerprint of the private data, nor of tickets made on it (data.release)
        ticket=None if ticket is None else scrub_ticket({
            "path": str(ticket_path), "round": ticket.round, "density": ticket.density,
            "source": ticket.source_data, "selection": ticket.selection,
        }, ticket_data_public=ledger.phase1 == "public"),
        dpltm_version=__version__,
    )


def _print_epoch(record: EpochRecord, end_to_end: bool) -> None:
    """One progress line per epoch; "(DP part)" only where the run is not DP end to end."""
    eps = record["epsilon"]
    scope = "" if end_to_end else " (DP part)"
    spent = "non-private: no guarantee" if math.isinf(eps) else f"ε spent ≤ {round_up(eps, 4)}{scope}"
    print(f"epoch {record['epoch']}: val acc {record['val_accuracy']:.4f}, test acc {record['test_accuracy']:.4f}, "
          f"{spent}", file=sys.stderr, flush=True)


def freezing_can_run(step_mode: str, *, audited: bool, noise: str) -> bool:
    """Frozen layers train in the eager DP step (the engine's rules), with Gaussian noise and no audit: the
    graph steps, the audit's canaries and the noise geometries assume every layer is trained."""
    return step_mode == "eager" and not audited and noise == "gaussian"
