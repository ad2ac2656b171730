"""The checks every typed artefact's `from_dict` makes: a header of the right kind and a readable
format, and each field present with its type, refused in one line that names the file and the field."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dpltm.checkpoint_format import FORMAT_VERSION, OLDEST_READABLE, refusal
from dpltm.errors import DpltmUserError

HEADER_KEYS = ("format", "kind", "format_version", "environment")
"""What `checkpoint.save_atomic` adds to every body: the header, and the library versions that wrote it."""


def json_number(value: float) -> float | str:
    """A float as a strict-JSON report writes it: ±∞ as "inf"/"-inf" (as `PrivacyLedger.report`)."""
    if math.isfinite(value):
        return float(value)
    return "inf" if value > 0 else "-inf"


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
    readable = isinstance(version, int) and not isinstance(version, bool)
    if not (readable and OLDEST_READABLE[kind] <= version <= FORMAT_VERSION):
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
