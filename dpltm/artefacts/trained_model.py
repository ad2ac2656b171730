"""`TrainedModel`: what a "model" checkpoint holds, the network `dpltm train` writes, with one privacy record.

The privacy record is stored once (`PrivacyRecord`: the ledger, which holds the DpEvent tree, plus the
facts the ledger cannot know: caveats and whether early stopping chose the stopping epoch); every
privacy fact a report, `inspect`, `predict` or `export` shows is computed from it, so a file cannot
state an ε its ledger does not give.

`TrainedModel.to_dict()` is the checkpoint body (format `dpltm.artefacts.format.FORMAT_VERSION`);
`TrainedModel.from_dict(body, path)` checks it and refuses a damaged file in one line naming the
file and the bad field.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpltm.artefacts.format import HEADER_KEYS, Artefact, Reader, body_of, reference_state
from dpltm.errors import DpltmUserError
from dpltm.privacy.ledger import PrivacyLedger, json_float  # ±∞ as strict JSON writes it

if TYPE_CHECKING:
    import torch
    from torch import nn

KIND = "model"
MODEL_KEYS = ("dpltm_version", "architecture", "state_dict", "privacy", "history", "config", "data", "outcome",
              "transfer", "ticket")
"""The keys of a model checkpoint's body besides the header and `environment`, in the order `dpltm train` writes
them; no ε among them."""
PRIVACY_KEYS = ("ledger", "caveats", "adaptive_stop")


@dataclass(frozen=True)
class PrivacyRecord:
    """The one privacy record of a trained model: the ledger and what the ledger cannot know.

    `caveats` are conditions the guarantee rests on (tickets asserted public; validation records
    that early stopping looked at without privacy); `adaptive_stop` says early stopping chose the
    stopping epoch, so the ledger holds the planned run (which covers it) and the run is not
    called DP end to end. Everything else is computed, never stored.
    """

    ledger: PrivacyLedger
    caveats: tuple[str, ...] = ()
    adaptive_stop: bool = False

    @functools.cached_property
    def ledger_report(self) -> dict[str, Any]:
        """`PrivacyLedger.report()` (every bound), computed once per record."""
        return self.ledger.report()

    @property
    def private(self) -> bool:
        return self.ledger.training is not None

    @property
    def end_to_end_dp(self) -> bool:
        """The ledger's verdict, and no adaptive stop (its ε is no guarantee at the stopping point)."""
        return bool(self.ledger_report["end_to_end_dp"]) and not self.adaptive_stop

    @property
    def epsilon_dp_part(self) -> float:
        """ε of the DP part (the ledger's best bound), whether or not the whole run is DP."""
        return self.ledger.best_bound().epsilon

    @property
    def epsilon(self) -> float:
        """ε of the whole run: ∞ unless it is DP end to end."""
        return self.epsilon_dp_part if self.end_to_end_dp else math.inf

    def get_epsilon(self, delta: float | None = None) -> float:
        """ε of the whole run at `delta` (None: its own δ); ∞ unless it is DP end to end."""
        return self.ledger.get_epsilon(delta) if not self.adaptive_stop else math.inf

    @property
    def statement(self) -> str:
        """The caveats, then the ledger's plain-English statement (what `train` prints and exports carry)."""
        return "\n".join([*(f"CAVEAT: {c}" for c in self.caveats), self.ledger.statement()])

    def to_dict(self) -> dict[str, Any]:
        return {"ledger": self.ledger.to_json(), "caveats": list(self.caveats), "adaptive_stop": self.adaptive_stop}

    @classmethod
    def from_dict(cls, record: Any, path: Path | str) -> PrivacyRecord:
        """The record `to_dict` wrote; a stored ε, statement or any other extra key is refused:
        those are computed from the ledger, and a stored copy could disagree with it."""
        read = Reader(path, KIND)
        if not isinstance(record, Mapping):
            raise read.damaged("'privacy' has the wrong type")
        extra = sorted(set(record) - set(PRIVACY_KEYS))
        if extra:
            raise read.damaged(f"'privacy' holds {extra[:3]}, which are computed from its ledger, not stored")
        caveats = read.field(record, "caveats", (list,), "privacy.")
        if not all(isinstance(c, str) for c in caveats):
            raise read.damaged("'privacy.caveats' must be a list of strings")
        adaptive_stop = read.field(record, "adaptive_stop", (bool,), "privacy.")
        read.field(record, "ledger", (dict,), "privacy.")
        try:
            ledger = PrivacyLedger.from_json(record["ledger"])
        except DpltmUserError as exc:
            raise read.damaged(f"'privacy.ledger' is invalid ({exc})") from None
        except (KeyError, ValueError, TypeError, AttributeError, OverflowError) as exc:
            raise read.damaged(f"'privacy.ledger' is invalid ({type(exc).__name__})") from None
        return cls(ledger, tuple(caveats), adaptive_stop)


@dataclass(frozen=True)
class ReleasedPrivacy:
    """What a released model says about its privacy (`predict`'s report, an export's `privacy` metadata):
    the whole run's ε ("inf" in JSON unless it is DP end to end), the DP part's, and what they are stated
    under. `private` and `statement` may be absent from older exports; a library run's export has no
    `released_weights`."""

    epsilon: float
    epsilon_dp_part: float
    delta: float
    end_to_end_dp: bool
    private: bool | None
    accountant: str
    neighboring: str
    released_weights: str | None
    statement: str | None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object an export stores, in the order it has always had."""
        body = body_of(self, [f.name for f in fields(self)], ("released_weights",))
        return {**body, "epsilon": json_float(self.epsilon), "epsilon_dp_part": json_float(self.epsilon_dp_part)}

    @classmethod
    def from_dict(cls, stated: Mapping[str, Any]) -> ReleasedPrivacy:
        """An export's `privacy` metadata, once `export.privacy_from_ledger` has checked it against its ledger."""
        return cls(float(stated["epsilon"]), float(stated["epsilon_dp_part"]), stated["delta"],
                   stated["end_to_end_dp"], stated.get("private"), stated["accountant"], stated["neighboring"],
                   stated.get("released_weights"), stated.get("statement"))


@dataclass(frozen=True)
class EpochRow:
    """One epoch of a training run's history: the released network's accuracies after it, the ε spent so far by
    its DP part (None where nothing was accounted), and the noise plug-in's own figures (`epoch_metrics`)."""

    epoch: int
    steps: int
    val_accuracy: float
    test_accuracy: float
    epsilon: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    _TYPES = {"epoch": (int,), "steps": (int,), "val_accuracy": (float,), "test_accuracy": (float,),
              "epsilon": (float,)}

    def to_dict(self) -> dict[str, float]:
        return {**body_of(self, self._TYPES, ("epsilon",)), **self.metrics}

    @classmethod
    def from_dict(cls, record: Mapping[str, float]) -> EpochRow:
        return cls(**{k: record[k] for k in cls._TYPES if k in record},  # type: ignore[arg-type]
                   metrics={k: v for k, v in record.items() if k not in cls._TYPES})

    @classmethod
    def checked(cls, record: Any, index: int, read: Reader) -> EpochRow:
        """Row `index` of a model file's history, its fields' types checked."""
        if not isinstance(record, Mapping):
            raise read.damaged("'history' must be a list of records")
        for key, types in cls._TYPES.items():
            read.field(record, key, types, f"history[{index}].", optional=key == "epsilon")
        return cls.from_dict(record)


@dataclass(frozen=True)
class TransferRecord:
    """How the trained network relates to its ticket (dpltm.training.transfer): the checkpoint's "transfer"
    (`to_dict`, in this order). `mode` is "dense" (no ticket), "direct" (θ0 and masks as they are) or
    "cross-architecture" (a new output layer); `activation_override` holds the ticket's own activation where the
    run used another; `rewind` and `output_layer` the start; the frozen fields what `--freeze` held."""

    mode: str
    kept_layers: list[str] | None = None
    dropped_layers: list[str] | None = None
    new_output_classes: int | None = None
    activation: str | None = None
    activation_override: dict[str, str] | None = None
    arch: str | None = None
    rewind: str | None = None
    output_layer: str | None = None
    frozen_layers: list[str] | None = None
    trained_parameters: int | None = None
    frozen_parameters: int | None = None

    _TYPES = {"mode": (str,), "kept_layers": (list,), "dropped_layers": (list,), "new_output_classes": (int,),
              "activation": (str,), "activation_override": (dict,), "arch": (str,), "rewind": (str,),
              "output_layer": (str,), "frozen_layers": (list,), "trained_parameters": (int,),
              "frozen_parameters": (int,)}

    def to_dict(self) -> dict[str, object]:
        return body_of(self, self._TYPES, self._TYPES)

    @classmethod
    def from_dict(cls, record: Mapping[str, Any], read: Reader) -> TransferRecord:
        read.unknown(record, cls._TYPES, "'transfer'")
        return cls(**{key: read.field(record, key, types, "transfer.", optional=key != "mode")
                      for key, types in cls._TYPES.items()})


@dataclass(frozen=True)
class Outcome:
    """What the training run did, beyond its privacy and its per-epoch history: no privacy facts."""

    steps: int
    stop_reason: str
    tickets: str
    """How the ticket relates to the private data (`TicketOrigin.explanation`)."""
    density: float
    released_weights: str
    """What the state_dict is: the final iterate, or an EMA of the iterates (post-processing)."""
    noise_parameter: float | None
    """The noise plug-in's own parameter (the ledger holds the effective multiplier σ)."""
    sigma_calibrated: bool | None
    output: str
    processes: int
    randomness: str | None = None
    log_dir: str | None = None
    audit: dict[str, Any] | None = None
    """An audit's empirical lower bound beside the claim (dpltm.audit), when the run was audited."""

    _TYPES = {"steps": (int,), "stop_reason": (str,), "tickets": (str,), "density": (float,),
              "released_weights": (str,), "noise_parameter": (float,), "sigma_calibrated": (bool,),
              "output": (str,), "processes": (int,), "randomness": (str,), "log_dir": (str,), "audit": (dict,)}
    _OPTIONAL = ("noise_parameter", "sigma_calibrated", "randomness", "log_dir", "audit")

    def to_dict(self) -> dict[str, Any]:
        return body_of(self, self._TYPES, ("audit",))

    @classmethod
    def from_dict(cls, record: Any, path: Path | str) -> Outcome:
        read = Reader(path, KIND)
        if not isinstance(record, Mapping):
            raise read.damaged("'outcome' has the wrong type")
        read.unknown(record, cls._TYPES, "'outcome'")
        values = {key: read.field(record, key, types, "outcome.", optional=key in cls._OPTIONAL)
                  for key, types in cls._TYPES.items()}
        return cls(**values)


@dataclass(frozen=True)
class TrainingReport:
    """What `train`, `audit` and `run` report: the run's result, its privacy and where it went, fields in the order
    `train --json` has always printed them (`TrainedModel.report`; run.json keeps `to_json()`). `privacy` (the
    ledger's report), `transfer` and `audit` are JSON records, passed through unread."""

    test_accuracy: float | None
    val_accuracy: float | None
    epochs_run: int
    steps: int
    stop_reason: str
    epsilon: float | str | None
    epsilon_dp_part: float | str | None
    epsilon_scope: str
    warning: str | None
    epsilon_spent_at_stop: float | None
    delta: float | None
    accountant: str | None
    composition: str | None
    neighboring: str | None
    end_to_end_dp: bool | None
    private: bool
    caveats: list[str]
    statement: str
    privacy: object
    tickets: str | None
    density: float | None
    transfer: object
    released_weights: str | None
    noise_multiplier: float | None
    noise_parameter: float | None
    sigma_calibrated: bool | None
    sample_rate: float | None
    dataset: str
    output: str
    randomness: str | None
    processes: int
    log_dir: str | None
    audit: dict[str, Any] | None = None
    """An audited run's lower bound on ε beside the claim (dpltm.audit.run); no key in the JSON otherwise."""

    def to_json(self) -> dict[str, object]:
        body = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.audit is None:
            del body["audit"]
        return body


@dataclass(frozen=True)
class TrainedModel(Artefact):
    """A trained network as `dpltm train` writes it: weights, one privacy record, how it was made.

    `state_dict` holds the weights (pruned ones exactly 0) and the masks beside them
    (`dpltm.masks.stored_state`). `report()` is the dict a run
    returns and `train --json` prints, built from the stored facts and the privacy record.
    """

    KIND = KIND
    WHAT = "model"
    BODY = (*MODEL_KEYS, "environment")
    state_dict: dict[str, torch.Tensor]
    privacy: PrivacyRecord
    history: tuple[EpochRow, ...]
    config: dict[str, Any]
    data: dict[str, Any]
    """Data settings and counts (`DatasetSplits.summary`): a fingerprint only of official files."""
    outcome: Outcome
    transfer: TransferRecord
    ticket: dict[str, Any] | None = None
    """The ticket it was trained from (scrubbed of fingerprints of private data), or None (dense)."""

    # ---- computed facts -------------------------------------------------------------------

    @property
    def dataset(self) -> str:
        return str(self.data["dataset"])

    @property
    def last_epoch(self) -> EpochRow | None:
        return self.history[-1] if self.history else None

    @property
    def test_accuracy(self) -> float | None:
        return None if self.last_epoch is None else self.last_epoch.test_accuracy

    @property
    def val_accuracy(self) -> float | None:
        return None if self.last_epoch is None else self.last_epoch.val_accuracy

    @property
    def epochs_run(self) -> int:
        return len(self.history)

    @property
    def epsilon_spent_at_stop(self) -> float | None:
        """ε of the steps actually run; None after an adaptive stop, where it is no guarantee."""
        return None if self.privacy.adaptive_stop or self.last_epoch is None else self.last_epoch.epsilon

    @property
    def noise_multiplier(self) -> float | None:
        """The effective σ the accountant saw: the ledger's."""
        training = self.privacy.ledger.training
        return None if training is None else training["sigma"]

    @property
    def sample_rate(self) -> float | None:
        """The Poisson sampling rate q: the ledger's."""
        training = self.privacy.ledger.training
        return None if training is None else training["q"]

    def report(self) -> TrainingReport:
        """The run's report, fields in the order `train --json` has always printed them."""
        p, o = self.privacy, self.outcome
        return TrainingReport(
            test_accuracy=self.test_accuracy, val_accuracy=self.val_accuracy, epochs_run=self.epochs_run,
            steps=o.steps, stop_reason=o.stop_reason, epsilon=json_float(p.epsilon),
            epsilon_dp_part=json_float(p.epsilon_dp_part), epsilon_scope=p.ledger_report["epsilon_scope"],
            warning=p.ledger.warning(), epsilon_spent_at_stop=self.epsilon_spent_at_stop, delta=p.ledger.delta,
            accountant=p.ledger.accountant, composition=p.ledger_report["composition"],
            neighboring=p.ledger.neighboring,
            end_to_end_dp=p.end_to_end_dp, private=p.private, caveats=list(p.caveats),
            statement=p.statement, privacy=p.ledger_report,
            tickets=o.tickets, density=o.density, transfer=self.transfer.to_dict(),
            released_weights=o.released_weights, noise_multiplier=self.noise_multiplier,
            noise_parameter=o.noise_parameter, sigma_calibrated=o.sigma_calibrated,
            sample_rate=self.sample_rate, dataset=self.dataset, output=o.output,
            randomness=o.randomness, processes=o.processes, log_dir=o.log_dir, audit=o.audit)

    @property
    def released_privacy(self) -> ReleasedPrivacy:
        """What `predict` and an export's metadata say about privacy (`export.LoadedModel.privacy`)."""
        p = self.privacy
        return ReleasedPrivacy(p.epsilon, p.epsilon_dp_part, p.ledger.delta, p.end_to_end_dp, p.private,
                               p.ledger.accountant, p.ledger.neighboring, self.outcome.released_weights, p.statement)

    def network(self) -> nn.Module:
        """The released network, in eval mode, on the CPU (its pruned weights are 0)."""
        from dpltm.masks import split_stored_state
        from dpltm.networks.lenet import build_network

        model = build_network(self.arch)
        model.load_state_dict(split_stored_state(self.arch, self.state_dict)[0])
        return model.eval()

    @property
    def masks(self) -> dict[str, torch.Tensor]:
        """The ticket's masks, keyed by mask name (all True for a dense network)."""
        from dpltm.masks import split_stored_state

        return split_stored_state(self.arch, self.state_dict)[1]

    # ---- storage --------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, body: Any, path: Path | str) -> TrainedModel:
        """A model checkpoint's body, checked: header and version, every field's type, an architecture
        that builds a network, weights that fit it, a ledger that parses. One-line errors name the file
        and the field."""
        read = Reader(path, KIND)
        body = read.header(body)
        extra = sorted(set(body) - {*HEADER_KEYS, *MODEL_KEYS})
        if extra:
            raise read.damaged(f"it holds unknown {extra[:3]} (privacy facts are computed from 'privacy.ledger')")
        values = {key: read.field(body, key, (dict,)) for key in ("architecture", "state_dict", "config", "data",
                                                                    "transfer")}
        transfer = TransferRecord.from_dict(values["transfer"], read)
        history = tuple(EpochRow.checked(r, i, read) for i, r in enumerate(read.field(body, "history", (list,))))
        ticket = read.field(body, "ticket", (dict,), optional=True)
        version_text = read.field(body, "dpltm_version", (str,), optional=True)
        environment = read.field(body, "environment", (dict,), optional=True)
        if not isinstance(values["data"].get("dataset"), str):
            raise read.damaged("'data.dataset' is not a dataset name")
        config = values["config"]
        for section in ("data", "train", "model"):
            if not isinstance(config.get(section, {}), dict):
                raise read.damaged(f"'config.{section}' is not a mapping")
        seed = config.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise read.damaged("'config.seed' is not an integer")
        privacy = PrivacyRecord.from_dict(read.field(body, "privacy", (dict,)), path)
        outcome = Outcome.from_dict(read.field(body, "outcome", (dict,)), path)
        arch = read.architecture(values["architecture"])
        read.tensors(values["state_dict"], reference_state(arch), "state_dict", check_dtype=True)
        from dpltm.masks import pruned_but_not_zero, split_stored_state

        acting = pruned_but_not_zero(*split_stored_state(arch, values["state_dict"]))
        if acting is not None:
            raise read.damaged(f"'state_dict.{acting}' is non-zero where its mask prunes it")
        return cls(architecture=values["architecture"], state_dict=values["state_dict"], privacy=privacy,
                   history=history, config=config, data=values["data"], outcome=outcome,
                   transfer=transfer, ticket=ticket, dpltm_version=version_text, environment=environment)
