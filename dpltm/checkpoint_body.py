"""Deep checks of a checkpoint's body and of an export's metadata, past their top-level keys.

A file can carry every key a reader asks for and still be broken inside: an `architecture` that
builds no network, a `state_dict` whose tensors do not fit it, an export without its privacy
statement. Every reader (predict, export, inspect, `dpltm.load_model`) would then fail late with a
traceback, or, worse, export an empty privacy statement. `architecture_of` and `check_tensors` (used
by the typed artefacts' `from_dict`: `TrainedModel`, `TicketSet`, `Winner`) and `check_export_metadata`
refuse such a file in one line when it is loaded.

The network is built on PyTorch's `meta` device: shapes only, no memory, no initialisation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpltm.errors import DpltmUserError


def _damaged(path: Path, kind: str, what: str) -> DpltmUserError:
    return DpltmUserError(f"{path} is a damaged '{kind}' checkpoint: {what}")


def architecture_of(body: dict[str, Any], kind: str, path: Path) -> Any:
    """The checkpoint's `Architecture`, or a one-line error saying why its record builds none."""
    from dpltm.networks.lenet import Architecture

    try:
        return Architecture.from_dict(body["architecture"])
    except DpltmUserError as exc:
        raise _damaged(path, kind, f"its 'architecture' is invalid ({exc})") from None
    except (KeyError, ValueError, TypeError, AttributeError, OverflowError) as exc:
        raise _damaged(path, kind, f"its 'architecture' is invalid ({type(exc).__name__}: {exc})") from None


def check_tensors(found: Any, expected: dict[str, Any], where: str, kind: str, path: Path,
                  check_dtype: bool) -> None:
    """`found` must hold exactly `expected`'s tensors, with their shapes (and, with `check_dtype`,
    boolean where the reference is: the masks), and finite values (weights no training leaves non-finite)."""
    import torch

    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    if missing or extra:
        raise _damaged(path, kind, f"'{where}' does not fit its architecture "
                       f"(missing {missing[:3]}, unexpected {extra[:3]})")
    for name, reference in expected.items():
        tensor = found[name]
        if not isinstance(tensor, torch.Tensor):
            raise _damaged(path, kind, f"'{where}.{name}' is not a tensor")
        if tuple(tensor.shape) != tuple(reference.shape):
            raise _damaged(path, kind, f"'{where}.{name}' has shape {tuple(tensor.shape)}, "
                           f"its architecture needs {tuple(reference.shape)}")
        if check_dtype and (tensor.dtype == torch.bool) != (reference.dtype == torch.bool):
            raise _damaged(path, kind, f"'{where}.{name}' has dtype {tensor.dtype}")
        if tensor.dtype != torch.bool and not tensor.is_floating_point():
            raise _damaged(path, kind, f"'{where}.{name}' has dtype {tensor.dtype}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise _damaged(path, kind, f"'{where}.{name}' holds NaN or infinite values "
                           "(a diverged run, or a damaged file)")


EXPORT_TEXT_KEYS = ("format", "privacy_statement", "source_checkpoint", "digest")
"""Metadata of a safetensors export kept as plain text; every other value is JSON."""
EXPORT_OBJECT_KEYS = ("architecture", "data", "privacy", "input_normalisation")


def check_export_metadata(metadata: dict[str, str], path: Path) -> None:
    """Refuse an export whose metadata is not what `dpltm export` writes: JSON that does not
    parse, a record that is not an object, no privacy statement."""
    import json

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
