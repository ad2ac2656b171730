"""`dpltm export`: a trained model as one safetensors file that needs no dpltm to read.

Tensors: the released weights and biases (pruned weights exactly 0) and each layer's boolean
mask (`mask_<layer>`), named as in the model's `state_dict`. Metadata (safetensors keeps only
str → str, so structured values are JSON): the architecture, the input normalisation (how a raw
record becomes the network's input, `data.loaders.INPUT_NORMALISATION`), the data settings and counts (so
`dpltm predict` rebuilds the same test set; a data fingerprint only when every raw file is the
official published one, dpltm.data.release), the privacy statement and ledger, and the versions
that made it. Safetensors rather than a pickle: loading it runs no code, and other frameworks
read it.

`digest` is a SHA-256 of every other metadata value and every tensor as written (`content_digest`):
a file edited or damaged after export (an activation changed by hand, a flipped weight) is refused
where its other checks would not notice. It guards against edits and damage, not forgery (anyone can
recompute it); files without one (older exports) are read as before.

The privacy metadata is the model's `TrainedModel` privacy record, computed from its one ledger and
caveats the way the training run's report was: the statement the training run printed is the one
the file carries, including "NOT end-to-end DP" where that applies.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpltm.errors import DpltmUserError, one_line

if TYPE_CHECKING:
    import torch

    from dpltm.artefacts import TrainedModel
    from dpltm.artefacts.trained_model import ReleasedPrivacy

FORMAT = "dpltm-export-v1"
SUFFIX = ".safetensors"
DIGEST_KEY = "digest"


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for inference, and what is known about how it was made."""

    model: Any  # the network (dpltm.networks.lenet.build_network), in eval mode, on the CPU; its `arch` built
    data: dict[str, Any]
    """dataset, split, val_fraction, seed and counts of the data the model was trained on, and its
    fingerprint only for official files (dpltm.data.release)."""
    privacy: ReleasedPrivacy
    source: str  # "checkpoint" or "safetensors"


def _data_summary(trained: TrainedModel) -> dict[str, Any]:
    """The data settings and counts, and a fingerprint only of official files (dpltm.data.release):
    a model written by an older dpltm may carry one of the user's data, which is dropped here."""
    from dpltm.data.release import scrub

    settings = trained.config.get("data", {})
    recorded = {key: trained.data.get(key) for key in ("official_files", "fingerprint", "n_train", "n_val", "n_test")}
    return scrub({"dataset": trained.dataset, "split": settings.get("split"),
                  "val_fraction": settings.get("val_fraction"), "seed": trained.config.get("seed"), **recorded})


def _ticket_summary(trained: TrainedModel) -> dict[str, Any] | None:
    """The model's ticket record, without fingerprints of tickets made on the private data."""
    from dpltm.data.release import scrub_ticket

    return scrub_ticket(trained.ticket, ticket_data_public=trained.privacy.ledger.phase1 == "public")


def private_fingerprints(trained: TrainedModel) -> list[str]:
    """Where a model file carries a fingerprint of user data (files written before the rule in
    dpltm.data.release): `export` drops them, `inspect` warns."""
    from dpltm.data.release import carries_private_fingerprint

    found = ["data"] if carries_private_fingerprint(trained.data) else []
    ticket = trained.ticket
    if ticket is not None and trained.privacy.ledger.phase1 != "public":
        selection = ticket.get("selection")
        choice = selection.get("noise_aware") if isinstance(selection, dict) else None
        choice = choice if isinstance(choice, dict) else {}
        found += [where for where, record in (("ticket.source", ticket.get("source")),
                                              ("ticket.selection", choice.get("public_data")))
                  if carries_private_fingerprint(record)]
    return found


def export_model(model_path: Path, out: Path, warn: Callable[[str], None] | None = None) -> dict[str, str]:
    """Write `model_path` (a `dpltm train` checkpoint) to `out` as safetensors; returns the metadata.
    `warn` hears about fingerprints of user data an older model file carried (not exported)."""
    from safetensors.torch import save

    from dpltm.checkpoint import load_artefact
    from dpltm.data.loaders import INPUT_NORMALISATION
    from dpltm.data.release import PRIVATE_FINGERPRINT_WARNING
    from dpltm.outputs import write_bytes_atomic

    trained = load_artefact(model_path, ("model", "run"))
    if isinstance(trained, dict):  # a library run: its checked body, not an artefact
        metadata, tensors = _run_export(trained, model_path)
        metadata[DIGEST_KEY] = content_digest(metadata, tensors)
        write_bytes_atomic(save(tensors, metadata=metadata), out)
        return metadata
    dropped = private_fingerprints(trained)
    if dropped and warn is not None:
        warn(f"warning: {model_path} {PRIVATE_FINGERPRINT_WARNING} ({', '.join(dropped)}); not copied to the export")
    data = _data_summary(trained)
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in trained.state_dict.items()}
    metadata = {
        "format": FORMAT,
        "architecture": json.dumps(trained.architecture),
        "input_normalisation": json.dumps(INPUT_NORMALISATION.get(str(data["dataset"]), {})),
        "data": json.dumps(data),
        "privacy": json.dumps(trained.released_privacy.to_dict()),
        "privacy_statement": trained.privacy.statement,
        "ledger": json.dumps(trained.privacy.ledger.to_json()),
        "test_accuracy": json.dumps(trained.test_accuracy),
        "ticket": json.dumps(_ticket_summary(trained)),
        "environment": json.dumps(trained.environment or {}),
        "exported_by": json.dumps(_environment()),
        "source_checkpoint": str(model_path),
    }
    metadata[DIGEST_KEY] = content_digest(metadata, tensors)
    write_bytes_atomic(save(tensors, metadata=metadata), out)
    return metadata


def content_digest(metadata: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the metadata (all but the digest) and the tensors' names, dtypes, shapes and bytes."""
    import torch

    digest = hashlib.sha256()
    for key in sorted(k for k in metadata if k != DIGEST_KEY):
        digest.update(json.dumps([key, metadata[key]]).encode())
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return f"sha256:{digest.hexdigest()}"


def check_digest(path: Path, tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Refuse an export whose contents differ from the digest `dpltm export` wrote (none: nothing to check).
    Called after the file's other checks, whose messages say more where they apply. `tensors`: the file's
    tensors as already read (else read here); the metadata is read as stored, not as `read_metadata`
    returns it (its statements rebuilt from the ledger)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
        if DIGEST_KEY not in metadata:
            return
        if tensors is None:
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    if content_digest(metadata, tensors) != metadata[DIGEST_KEY]:
        raise DpltmUserError(f"{path} is a damaged dpltm export: its contents differ from the digest written at "
                             "export (the file was edited or damaged after `dpltm export`)")


USER_MODEL = "user-model"
"""The architecture of an exported library run: the user's own nn.Module, which the file cannot rebuild."""


def _run_export(body: dict[str, Any], path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """A library run (`PrivateTraining.save`) as safetensors: the model's state_dict (pruned weights 0)
    and masks, the ledger and the statement computed from it, and nothing about the data but its name
    and N (public under add/remove). The network is the user's own: load the state_dict into it."""
    from dpltm.artefacts.trained_model import ReleasedPrivacy
    from dpltm.privacy.ledger import PrivacyLedger

    if body.get("ledger") is None:
        raise DpltmUserError(f"{path} holds a run that has taken no DP step: nothing to release")
    ledger = PrivacyLedger.from_json(body["ledger"])
    tensors = {name: torch_tensor(value) for name, value in body["model"].items()}
    for name, mask in body["masks"].items():
        tensors[f"mask_{name}"] = torch_tensor(mask).bool()
    report = ledger.report()
    privacy = ReleasedPrivacy(float(report["overall_epsilon"]), float(report["epsilon"]), ledger.delta,
                              ledger.end_to_end_dp, True, ledger.accountant, ledger.neighboring, None,
                              ledger.statement())
    metadata = {
        "format": FORMAT,
        "architecture": json.dumps({"kind": USER_MODEL, "note": "a dpltm.make_private run of your own nn.Module: "
                                    "load these tensors (without the mask_ entries) with model.load_state_dict"}),
        "input_normalisation": json.dumps({}),
        "data": json.dumps({"dataset": body["dataset_name"], "n_train": body["dataset_size"]}),
        "privacy": json.dumps(privacy.to_dict()),
        "privacy_statement": ledger.statement(),
        "ledger": json.dumps(body["ledger"]),
        "test_accuracy": json.dumps(None),
        "ticket": json.dumps(None),
        "environment": json.dumps(body.get("environment", {})),
        "exported_by": json.dumps(_environment()),
        "source_checkpoint": str(path),
    }
    return metadata, tensors


def torch_tensor(value: Any) -> torch.Tensor:
    import torch

    return torch.as_tensor(value).detach().cpu().contiguous()


def _environment() -> dict[str, str]:
    from dpltm.provenance import environment

    return environment()


def read_metadata(path: Path) -> dict[str, str]:
    """The metadata of a dpltm safetensors export, or a one-line error saying why it is not one."""
    from safetensors import SafetensorError, safe_open

    from dpltm.paths import check_input_file

    check_input_file(path, "model file")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except (SafetensorError, OSError, ValueError) as exc:
        raise DpltmUserError(f"{path} is not a readable safetensors file ({str(exc).splitlines()[0][:120]})") from None
    if metadata.get("format") != FORMAT:
        raise DpltmUserError(f"{path} is a safetensors file but not a dpltm export (no format {FORMAT})")
    check_export_metadata(metadata, path)
    return privacy_from_ledger(metadata, path)


EXPORT_TEXT_KEYS = ("format", "privacy_statement", "source_checkpoint", "digest")
"""Metadata of a safetensors export kept as plain text; every other value is JSON."""
EXPORT_OBJECT_KEYS = ("architecture", "data", "privacy", "input_normalisation")


def check_export_metadata(metadata: dict[str, str], path: Path) -> None:
    """Refuse an export whose metadata is not what `dpltm export` writes: JSON that does not
    parse, a record that is not an object, no privacy statement."""
    def damaged(what: str) -> DpltmUserError:
        return DpltmUserError(f"{path} is a damaged dpltm export: {what}")

    for key, text in metadata.items():
        if key in EXPORT_TEXT_KEYS:
            continue
        try:
            json.loads(text)
        except (ValueError, RecursionError):
            raise damaged(f"its metadata '{key}' is not JSON") from None
    for key in EXPORT_OBJECT_KEYS:
        if key not in metadata:
            raise damaged(f"its metadata lacks '{key}'")
        if not isinstance(json.loads(metadata[key]), dict):
            raise damaged(f"its metadata '{key}' is not a JSON object")
    if not metadata.get("privacy_statement", "").strip():
        raise damaged("it has no privacy statement")


def privacy_from_ledger(metadata: dict[str, str], path: Path) -> dict[str, str]:
    """The metadata with its privacy copies checked against, and its statements rebuilt from, the
    ledger. The ε, δ and scope must be what the ledger gives now (recomputed by the accountant), else
    the file is damaged: a hand-edited `privacy.epsilon` was once shown by `inspect` and `predict`
    below what the run spent. The statements shown are the ledger's own (after the file's CAVEAT
    lines), never the stored text, whose wording may be an older release's or someone's edit."""
    import math

    from dpltm.privacy.ledger import PrivacyLedger

    def damaged(what: str) -> DpltmUserError:
        return DpltmUserError(f"{path} is a damaged dpltm export: {what}")

    try:
        ledger = PrivacyLedger.from_json(json.loads(metadata["ledger"]))
    except KeyError:
        raise damaged("its metadata lacks 'ledger'") from None
    except DpltmUserError as exc:
        raise damaged(str(exc)) from None
    report = ledger.report()
    stated = json.loads(metadata["privacy"])
    expected = {"epsilon": report["overall_epsilon"], "epsilon_dp_part": report["epsilon"], "delta": ledger.delta,
                "end_to_end_dp": ledger.end_to_end_dp, "accountant": ledger.accountant,
                "neighboring": ledger.neighboring}
    for key, value in expected.items():
        shown = stated.get(key)
        if isinstance(value, float):
            agrees = (isinstance(shown, (int, float)) and not isinstance(shown, bool)
                      and (shown == value or math.isclose(shown, value, rel_tol=1e-3)))
        else:
            agrees = shown == value
        if not agrees:
            raise damaged(f"its privacy record says {key} = {str(shown)[:40]}, its ledger gives {value}")
    caveats = [line for line in metadata.get("privacy_statement", "").split("\n") if line.startswith("CAVEAT: ")]
    statement = "\n".join([*caveats, ledger.statement()])
    return {**metadata, "privacy_statement": statement,
            "privacy": json.dumps({**stated, **({"statement": statement} if "statement" in stated else {})})}


def load_exported(path: Path, metadata: dict[str, str] | None = None) -> LoadedModel:
    """The model of a dpltm export; `metadata`: what `read_metadata(path)` already returned."""
    from safetensors.torch import load_file

    from dpltm.artefacts.format import current_parameter_names
    from dpltm.artefacts.trained_model import ReleasedPrivacy
    from dpltm.masks import pruned_but_not_zero, split_stored_state
    from dpltm.networks.lenet import Architecture, build_network

    metadata = read_metadata(path) if metadata is None else metadata
    if json.loads(metadata["architecture"]).get("kind") == USER_MODEL:
        raise DpltmUserError(f"{path} holds your own model's weights (a dpltm.make_private run): load them into "
                             "your nn.Module with safetensors.torch.load_file; dpltm cannot rebuild that network")
    try:
        architecture = json.loads(metadata["architecture"])
        try:
            arch = Architecture.from_dict(architecture)
        except DpltmUserError as exc:  # its own words name a flag; here a stored value is at fault
            stored = re.sub(r"--([a-z][a-z-]*)", r"\1", str(exc))  # the stored field, not a flag the user gave
            raise DpltmUserError(f"{path} is a damaged dpltm export: its architecture record does not build a "
                                 f"network ({one_line(stored, 160)})") from None
        model = build_network(arch)
        stored = load_file(str(path))
        weights, masks = split_stored_state(arch, current_parameter_names(dict(stored), str(path)))
        acting = pruned_but_not_zero(weights, masks)
        if acting is not None:
            raise DpltmUserError(f"{path} is a damaged dpltm export: {acting} is non-zero where its mask prunes it")
        non_finite = next((name for name, value in weights.items()
                           if value.is_floating_point() and not bool(value.isfinite().all())), None)
        if non_finite is not None:
            raise DpltmUserError(f"{path} is a damaged dpltm export: {non_finite} holds NaN or infinite values")
        try:
            model.load_state_dict(weights)
        except RuntimeError as exc:  # torch's first line names only the class: give the detail that says what
            detail = next((line.strip() for line in str(exc).splitlines()[1:] if line.strip()), "")
            raise DpltmUserError(f"{path} is a damaged dpltm export: its weights do not fit its architecture record "
                                 f"({one_line(detail, 200)})") from None
        check_digest(path, stored)
        return LoadedModel(model.eval(), json.loads(metadata["data"]),
                           ReleasedPrivacy.from_dict(json.loads(metadata["privacy"])), "safetensors")
    except (KeyError, ValueError, RuntimeError, TypeError, AttributeError) as exc:
        raise DpltmUserError(f"{path} is a damaged dpltm export ({str(exc).splitlines()[0][:120]})") from None


def load_any_model(path: Path) -> LoadedModel:
    """A model from a `dpltm train` checkpoint or from its safetensors export."""
    if path.suffix == SUFFIX:
        return load_exported(path)
    from dpltm.checkpoint import load_trained_model

    trained = load_trained_model(path)
    return LoadedModel(trained.network(), _data_summary(trained), trained.released_privacy, "checkpoint")
