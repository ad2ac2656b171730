"""Checkpoint files: saved with the format's header, read with `weights_only=True`, checked field by field.

A file is a dict of tensors and plain values (no pickled classes), so `torch.load` can read it without
executing code. Saving goes through `dpltm.outputs.write_atomic`. Reading refuses a foreign, damaged or
unreadable file in one line, brings an old file to today's layout (`dpltm.artefacts.format.migrate`), and
checks it as its typed artefact (dpltm.artefacts) or, for a library run, against `SCHEMA`.
"""

from __future__ import annotations

import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from dpltm.artefacts.format import KINDS, check_header, header, migrate
from dpltm.errors import DpltmUserError
from dpltm.outputs import write_atomic

SCHEMA: dict[str, dict[str, type]] = {
    "run": {"model": dict, "optimizer": dict, "masks": dict, "dataset_name": str, "dataset_size": int,
            "settings": dict, "segments": list, "epochs_done": int, "history": list},
}
"""Keys a library run must hold and their types: a file that claims to be a dpltm checkpoint but lacks its
body is refused in one line, not a KeyError. The other kinds are typed artefacts, checked by their own
`from_dict` (`ARTEFACTS`)."""
ARTEFACTS = {"tickets": "TicketSet", "ticket": "Winner", "model": "TrainedModel"}
"""The kinds read as typed artefacts (dpltm.artefacts), each checked field by field when loaded."""


def _check_schema(body: dict[str, Any], kind: str, path: Path) -> None:
    for key, expected in SCHEMA[kind].items():
        if key not in body:
            raise DpltmUserError(f"{path} is a damaged '{kind}' checkpoint: it lacks '{key}'")
        value = body[key]
        if isinstance(value, bool) and expected is not bool or not isinstance(value, expected):
            raise DpltmUserError(f"{path} is a damaged '{kind}' checkpoint: '{key}' has the wrong type")


def save_atomic(payload: dict[str, Any], path: Path, kind: str) -> None:
    """Write `payload` (plus format header and the library versions that made it) to `path` atomically."""
    if kind not in KINDS:
        raise ValueError(f"unknown checkpoint kind {kind}")
    from dpltm.provenance import environment

    # the versions of *this* write: a resumed ticket file says what finished it
    body = {**header(kind), **payload, "environment": environment()}
    write_atomic(path, lambda handle: torch.save(body, handle))


def holds_checkpoint_of_kind(path: Path, kind: str) -> bool:
    """Whether `path` is a dpltm checkpoint of `kind`, from its header alone (tensors memory-mapped, not read):
    the cheap look a save takes before replacing a file, unlike `load_checkpoint`'s full check."""
    if not path.is_file():
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            body = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # not a torch file, or a damaged one: either way not one to replace silently
        return False
    return isinstance(body, dict) and body.get("format") == "dpltm" and body.get("kind") == kind


def load_checkpoint(path: Path, kind: str | tuple[str, ...]) -> dict[str, Any]:
    """Read a dpltm checkpoint of the expected kind(s), or explain in one line why not. Every kind is
    checked field by field (a typed artefact by its `from_dict`, a library run by `SCHEMA`)."""
    body = _read(path, kind)
    _checked(body, path)
    return body


def load_artefact(path: Path, kinds: tuple[str, ...]) -> Any:
    """A checkpoint of one of `kinds`, as its typed artefact (`dpltm.artefacts`), or as the checked body
    of a library run (kind "run", not an artefact)."""
    return _checked(_read(path, kinds), path)


def _checked(body: dict[str, Any], path: Path) -> Any:
    """A read body as its typed artefact, or (a library run) the body once `SCHEMA` passes it."""
    if body["kind"] in ARTEFACTS:
        import dpltm.artefacts

        return getattr(dpltm.artefacts, ARTEFACTS[body["kind"]]).from_dict(body, path)
    _check_schema(body, body["kind"], path)
    return body


def _is_safetensors(path: Path) -> bool:
    """A safetensors file: an 8-byte little-endian header length, then a JSON object of that length."""
    try:
        with path.open("rb") as handle:
            head = handle.read(9)
        return len(head) == 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") < path.stat().st_size
    except OSError:
        return False


def _why_unreadable(path: Path, exc: Exception) -> str:
    """torch.load's failure in the user's terms (its own text speaks of `weights_only` and pickle opcodes)."""
    import pickle

    try:
        with path.open("rb") as handle:
            head = handle.read(2)
    except OSError as err:
        return err.strerror or type(err).__name__
    if head != b"PK":  # torch.save's zip format
        return "not a PyTorch save file"
    if isinstance(exc, pickle.UnpicklingError):
        return "it holds Python objects beyond tensors and plain data, which dpltm never unpickles"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if len(first) > 100:  # cut at a word, and say so
        first = first[:100].rsplit(" ", 1)[0] + " …"
    return f"a damaged PyTorch save file: {first}"


def _damaged_entry(path: Path) -> str | None:
    """The first entry of a zip-format checkpoint (torch.save's format) whose bytes fail their CRC-32, or None.
    torch.load reads the tensors without checking it: one flipped byte would load as other weights."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip()
    except Exception:  # not a zip, unreadable, or a foreign one (encrypted, unknown compression): torch.load says
        return None


def _read(path: Path, kind: str | tuple[str, ...]) -> dict[str, Any]:
    """The body of a dpltm checkpoint of a readable format and of the expected kind(s), unchecked."""
    kinds = (kind,) if isinstance(kind, str) else kind
    from dpltm.paths import check_input_file

    check_input_file(path, "checkpoint")
    if _is_safetensors(path):
        raise DpltmUserError(f"{path} is a safetensors file (a `dpltm export`), not a dpltm checkpoint: give the "
                             ".pt file it was made from")
    damaged = _damaged_entry(path)
    if damaged is not None:
        raise DpltmUserError(f"{path} is damaged: its entry {damaged} fails its CRC-32 check (a changed or corrupted "
                             "file); use an intact copy")
    try:
        with warnings.catch_warnings():  # torch's warnings about a foreign file's pickle protocol: the error says it
            warnings.simplefilter("ignore")
            body = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for foreign or damaged files
        raise DpltmUserError(f"{path} is not a readable dpltm checkpoint ({_why_unreadable(path, exc)})") from None
    return migrate(check_header(body, kinds, path), path)


def load_ticket_set(path: Path) -> Any:
    """A `dpltm generate` checkpoint as a checked `dpltm.artefacts.TicketSet`; a winner (which needs no
    selection) is refused in one line that says how to train it."""
    from dpltm.artefacts import Winner

    artefact = load_artefact(path, ("tickets", "ticket"))
    if isinstance(artefact, Winner):
        what = "a private ticket (generate --private)" if artefact.is_private_ticket else "a winner"
        raise DpltmUserError(f"{path} is {what}, not a ticket set: it needs no selection; train it with "
                             f"`dpltm train --ticket {path}`")
    return artefact


def load_winner(path: Path) -> Any:
    """A `dpltm select` (or `generate --private`) checkpoint as a checked `dpltm.artefacts.Winner`; a
    ticket set is refused in one line that says to select from it first."""
    from dpltm.artefacts import TicketSet

    artefact = load_artefact(path, ("ticket", "tickets"))
    if isinstance(artefact, TicketSet):
        raise DpltmUserError(f"{path} is a ticket set: pick a winner with `dpltm select --tickets {path}` first")
    return artefact


def load_trained_model(path: Path) -> Any:
    """A `dpltm train` checkpoint as a checked `dpltm.artefacts.TrainedModel`."""
    return load_artefact(path, ("model",))
