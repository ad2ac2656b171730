"""The dpltm checkpoint format: its version, the kinds of file, the one place older files are brought to
today's layout, and the checks every typed artefact's `from_dict` makes (a header of the right kind and
a readable format; each field present with its type; tensors that fit the architecture), refused in one
line that names the file and the field. Below both the artefacts and the file layer (dpltm.checkpoint),
so neither imports the other.

Networks are built on PyTorch's `meta` device to check shapes: no memory, no initialisation.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dpltm.errors import DpltmUserError

FORMAT_VERSION = 4
"""2: config hashes cover every setting (format 1's hashes left out settings added at their defaults
and hashed renamed ones under their old names); a format-1 file is refused in one line.
3: a model file is a `dpltm.artefacts.TrainedModel` whose privacy facts are stored once (format 2 kept
a report that copied them beside the ledger); a format-2 model file is refused in one line. The other
kinds did not change: their format-2 files are still read (`OLDEST_READABLE`).
4: the generate settings gained `rewind_step` (late rewinding), so every ticket set's config hash changed, and
ticket sets and winners may hold a `rewind_point`. Older files of every kind are still read; an older ticket set
is not resumed under today's settings (its hash differs: `generate --overwrite`)."""
KINDS = ("tickets", "ticket", "model", "run")
"""tickets: a generated ticket set; ticket: one selected winner; model: a trained network; run: a library
run of `make_private` (`PrivateTraining.save`), resumable, with the segments it spent."""
OLDEST_READABLE = {"tickets": 2, "ticket": 2, "run": 2, "model": 3}
"""The oldest format each kind is read in: the last format that changed that kind's layout."""

MODEL_FORMAT_2 = 2
"""Model files of checkpoint format 2 stored the privacy facts twice (ledger and report)."""


def header(kind: str) -> dict[str, Any]:
    """What begins every checkpoint's body: the format's name, the file's kind and the format's version."""
    return {"format": "dpltm", "kind": kind, "format_version": FORMAT_VERSION}


def refusal(path: Path | str, kind: Any, version: Any) -> str:
    """The one line that refuses a file of a checkpoint format this dpltm does not read."""
    if kind == "model" and version == MODEL_FORMAT_2:
        return (f"{path} is a model of checkpoint format 2 (its privacy facts stored twice), this dpltm reads "
                f"format {FORMAT_VERSION}: train it again with this dpltm")
    return f"{path} has checkpoint format {version}, this dpltm reads format {FORMAT_VERSION}"


def is_readable(kind: Any, version: Any) -> bool:
    """Whether this dpltm reads a file of `kind` written in format `version` (an unknown kind: today's only)."""
    oldest = OLDEST_READABLE.get(kind, FORMAT_VERSION) if isinstance(kind, str) else FORMAT_VERSION
    return isinstance(version, int) and not isinstance(version, bool) and oldest <= version <= FORMAT_VERSION


# ---- older files, read in today's layout ----------------------------------------------------

_OLD_PARAMETER_NAME = re.compile(r"^layers\.(?:(conv|hidden)_(\d+)|(project|output))\.(weight|bias)$")


def current_parameter_names(state: dict[str, Any], where: str = "the file") -> dict[str, Any]:
    """A built-in network's weights under today's parameter names. Until the networks became plain modules
    (`dpltm.networks.lenet.LeNet`), their parameters lived in one `layers` dict: `layers.hidden_0.weight` is now
    `hidden.0.weight`, `layers.output.bias` is `output.bias`. Files written before keep loading: their
    θ0 and state_dict keys are renamed as they are read (values untouched; other keys kept as they are).
    A file holding one parameter under both names is refused in one line (which one would be trained?)."""
    renamed = {}
    for key, value in state.items():
        match = _OLD_PARAMETER_NAME.match(key) if isinstance(key, str) else None
        if match is None:
            renamed[key] = value
            continue
        family, index, single, leaf = match.groups()
        new = f"{family}.{index}.{leaf}" if family else f"{single}.{leaf}"
        if new in state:
            raise DpltmUserError(f"{where} holds {key} and {new}, one parameter under its old and its new name")
        renamed[new] = value
    return renamed


def migrate(body: dict[str, Any], path: Path | str) -> dict[str, Any]:
    """An old file's body in today's layout, as it is read: θ0 and state_dict keys of the old `layers` dict
    renamed (`current_parameter_names`). A file in today's layout is returned as it is, untouched."""
    for key in ("theta0", "state_dict"):
        state = body.get(key)
        if body.get("kind") != "run" and isinstance(state, dict) and any(
                isinstance(name, str) and _OLD_PARAMETER_NAME.match(name) for name in state):
            body[key] = current_parameter_names(state, f"{path}'s {key}")
    return body


# ---- fields ---------------------------------------------------------------------------------

HEADER_KEYS = ("format", "kind", "format_version", "environment")
"""What `checkpoint.save_atomic` adds to every body: the header, and the library versions that wrote it."""


def damaged(path: Path | str, kind: str, what: str) -> DpltmUserError:
    return DpltmUserError(f"{path} is a damaged '{kind}' checkpoint: {what}")


def typed(record: Mapping[str, Any], key: str, types: tuple[type, ...], where: str, path: Path | str, kind: str,
          optional: bool = False) -> Any:
    """record[key], refused in one line when it is absent (and not `optional`) or of another type.
    An int passes where a float is asked for; a bool passes only where a bool is."""
    if key not in record:
        if optional:
            return None
        raise damaged(path, kind, f"it lacks '{where}{key}'")
    value = record[key]
    if value is None and optional:
        return None
    if float in types:
        types = (*types, int)
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        raise damaged(path, kind, f"'{where}{key}' has the wrong type ({type(value).__name__})")
    return value


def check_header(body: Any, kind: str, path: Path | str) -> Mapping[str, Any]:
    """The body, once its header says it is a dpltm file of `kind` in a format this dpltm reads."""
    if not isinstance(body, Mapping) or body.get("format") != "dpltm":
        raise DpltmUserError(f"{path} is not a dpltm checkpoint")
    if body.get("kind") != kind:
        raise DpltmUserError(f"{path} holds a '{body.get('kind')}' checkpoint, expected {kind}")
    version = body.get("format_version")
    if not is_readable(kind, version):
        raise DpltmUserError(refusal(path, kind, version))
    return body


def check_unknown(record: Mapping[str, Any], known: tuple[str, ...] | set[str], where: str, path: Path | str,
                  kind: str) -> None:
    """Refuse keys no writer puts there: a stored copy of a computed fact, or a foreign field."""
    extra = sorted(set(record) - set(known))
    if extra:
        raise damaged(path, kind, f"{where or 'it'} holds unknown {extra[:3]}")


def number_list(record: Mapping[str, Any], key: str, where: str, path: Path | str, kind: str,
                optional: bool = False) -> list[float] | None:
    """A list of numbers (a loss curve, scores), refused in one line if any entry is not one."""
    values = typed(record, key, (list,), where, path, kind, optional=optional)
    if values is None:
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise damaged(path, kind, f"'{where}{key}' must be a list of numbers")
    return values


def mapping_of(record: Mapping[str, Any], key: str, value_types: tuple[type, ...], where: str, path: Path | str,
               kind: str, optional: bool = False) -> dict[str, Any] | None:
    """A dict from names to values of `value_types` (per-layer densities, prune rates)."""
    values = typed(record, key, (dict,), where, path, kind, optional=optional)
    if values is None:
        return None
    if float in value_types:
        value_types = (*value_types, int)
    if not all(isinstance(k, str) and isinstance(v, value_types) and not isinstance(v, bool)
               for k, v in values.items()):
        raise damaged(path, kind, f"'{where}{key}' must map names to {value_types[0].__name__}s")
    return values


# ---- tensors --------------------------------------------------------------------------------

def architecture_of(body: dict[str, Any], kind: str, path: Path) -> Any:
    """The checkpoint's `Architecture`, or a one-line error saying why its record builds none."""
    from dpltm.networks.lenet import Architecture

    try:
        return Architecture.from_dict(body["architecture"])
    except DpltmUserError as exc:
        raise damaged(path, kind, f"its 'architecture' is invalid ({exc})") from None
    except (KeyError, ValueError, TypeError, AttributeError, OverflowError) as exc:
        raise damaged(path, kind, f"its 'architecture' is invalid ({type(exc).__name__}: {exc})") from None


def check_tensors(found: Any, expected: dict[str, Any], where: str, kind: str, path: Path,
                  check_dtype: bool) -> None:
    """`found` must hold exactly `expected`'s tensors, with their shapes (and, with `check_dtype`,
    boolean where the reference is: the masks), and finite values (weights no training leaves non-finite)."""
    import torch

    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    if missing or extra:
        raise damaged(path, kind, f"'{where}' does not fit its architecture "
                       f"(missing {missing[:3]}, unexpected {extra[:3]})")
    for name, reference in expected.items():
        tensor = found[name]
        if not isinstance(tensor, torch.Tensor):
            raise damaged(path, kind, f"'{where}.{name}' is not a tensor")
        if tuple(tensor.shape) != tuple(reference.shape):
            raise damaged(path, kind, f"'{where}.{name}' has shape {tuple(tensor.shape)}, "
                           f"its architecture needs {tuple(reference.shape)}")
        if check_dtype and (tensor.dtype == torch.bool) != (reference.dtype == torch.bool):
            raise damaged(path, kind, f"'{where}.{name}' has dtype {tensor.dtype}")
        if tensor.dtype != torch.bool and not tensor.is_floating_point():
            raise damaged(path, kind, f"'{where}.{name}' has dtype {tensor.dtype}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise damaged(path, kind, f"'{where}.{name}' holds NaN or infinite values "
                           "(a diverged run, or a damaged file)")



def reference_state(arch: Any) -> dict[str, Any]:
    """A model file's state (`dpltm.masks.stored_state`): weights, biases and, beside them, the boolean
    masks."""

    from dpltm.masks import stored_mask_key

    masks = {stored_mask_key(name): mask for name, mask in reference_masks(arch).items()}
    return {**reference_theta0(arch), **masks}


def reference_theta0(arch: Any) -> dict[str, Any]:
    """θ0 as ticket files keep it: the network's parameters (the model holds no masks)."""
    import torch

    from dpltm.networks.lenet import build_network

    with torch.device("meta"):
        return build_network(arch).state_dict()


def reference_masks(arch: Any) -> dict[str, Any]:
    """A ticket's masks: one boolean tensor per prunable weight, keyed `<layer>.weight`."""
    import torch

    return {f"{name}.weight": torch.empty(shape, dtype=torch.bool, device="meta")
            for name, shape in arch.layer_shapes().items()}
