"""The dpltm checkpoint format: its version, the kinds of file, the one place older files are brought to
today's layout, and the checks every typed artefact's `from_dict` makes (a header of the right kind and
a readable format; each field present with its type; tensors that fit the architecture), refused in one
line that names the file and the field. Below both the artefacts and the file layer (dpltm.checkpoint),
so neither imports the other.

Networks are built on PyTorch's `meta` device to check shapes: no memory, no initialisation.
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self

from dpltm.errors import DpltmUserError

if TYPE_CHECKING:
    from dpltm.networks.lenet import Architecture
    from dpltm.privacy.events import DpEvent

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


def check_header(body: Any, kinds: tuple[str, ...], path: Path | str) -> Any:
    """The body, once its header says it is a dpltm file of one of `kinds` in a format this dpltm reads."""
    if not isinstance(body, Mapping) or body.get("format") != "dpltm":
        raise DpltmUserError(f"{path} is not a dpltm checkpoint")
    version, found = body.get("format_version"), body.get("kind")
    if not is_readable(found, version):
        raise DpltmUserError(refusal(path, found, version))
    if found not in kinds:
        raise DpltmUserError(f"{path} holds a '{found}' checkpoint, expected {' or '.join(kinds)}")
    return body


def is_readable(kind: Any, version: Any) -> bool:
    """Whether this dpltm reads a file of `kind` written in format `version` (an unknown kind: today's only)."""
    oldest = OLDEST_READABLE.get(kind, FORMAT_VERSION) if isinstance(kind, str) else FORMAT_VERSION
    return isinstance(version, int) and not isinstance(version, bool) and oldest <= version <= FORMAT_VERSION


# ---- older files, read in today's layout ----------------------------------------------------

PARAMETER_NAMES_SINCE = 4
"""The format from which every file names a built-in network's parameters as the network does (`hidden.0.weight`)."""
_OLD_PARAMETER_NAME = re.compile(r"^layers\.(?:(conv|hidden)_(\d+)|(project|output))\.(weight|bias)$")


def current_parameter_names(state: dict[str, Any], where: str = "the file") -> dict[str, Any]:
    """A built-in network's weights under today's parameter names: a file that stores them under the names of
    one `layers` dict (`layers.hidden_0.weight`, `layers.output.bias`) reads as `hidden.0.weight`, `output.bias`
    (values untouched; other keys kept as they are). A file holding one parameter under both names is refused
    in one line (which one would be trained?)."""
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
    """A body of an older format in today's layout, as it is read; a body of today's format is returned untouched.
    Files before format 4 may name a built-in network's parameters as the old `layers` dict did: their θ0 and
    state_dict keys are renamed (`current_parameter_names`). A library run holds the user's own network."""
    if body["format_version"] >= PARAMETER_NAMES_SINCE or body["kind"] == "run":
        return body
    for key in ("theta0", "state_dict"):
        if isinstance(body.get(key), dict):
            body[key] = current_parameter_names(body[key], f"{path}'s {key}")
    return body


# ---- fields ---------------------------------------------------------------------------------

HEADER_KEYS = ("format", "kind", "format_version", "environment")
"""What `checkpoint.save_atomic` adds to every body: the header, and the library versions that wrote it."""


@dataclass(frozen=True)
class Reader:
    """The checks one file's body goes through, each refusing a damaged field in one line that names the file
    (`path`), its kind and the field (`where` is the dotted prefix of the record the key is read from)."""

    path: Path | str
    kind: str

    def damaged(self, what: str) -> DpltmUserError:
        return DpltmUserError(f"{self.path} is a damaged '{self.kind}' checkpoint: {what}")

    def field(self, record: Mapping[str, Any], key: str, types: tuple[type, ...], where: str = "",
              optional: bool = False) -> Any:
        """record[key], refused when it is absent (and not `optional`) or of another type. An int passes
        where a float is asked for; a bool passes only where a bool is."""
        if key not in record:
            if optional:
                return None
            raise self.damaged(f"it lacks '{where}{key}'")
        value = record[key]
        if value is None and optional:
            return None
        if float in types:
            types = (*types, int)
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            raise self.damaged(f"'{where}{key}' has the wrong type ({type(value).__name__})")
        return value

    def header(self, body: Any) -> Mapping[str, Any]:
        return check_header(body, (self.kind,), self.path)

    def unknown(self, record: Mapping[str, Any], known: Iterable[str], where: str = "") -> None:
        """Refuse keys no writer puts there: a stored copy of a computed fact, or a foreign field."""
        extra = sorted(set(record) - set(known))
        if extra:
            raise self.damaged(f"{where or 'it'} holds unknown {extra[:3]}")

    def numbers(self, record: Mapping[str, Any], key: str, where: str = "",
                optional: bool = False) -> list[float] | None:
        """A list of numbers (a loss curve, scores), refused if any entry is not one."""
        values = self.field(record, key, (list,), where, optional=optional)
        if values is not None and not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise self.damaged(f"'{where}{key}' must be a list of numbers")
        return values

    def floats_by_name(self, record: Mapping[str, Any], key: str, where: str = "",
                       optional: bool = False) -> dict[str, float] | None:
        """A dict from names to numbers (per-layer densities, prune rates)."""
        values = self.field(record, key, (dict,), where, optional=optional)
        if values is not None and not all(isinstance(k, str) and isinstance(v, (float, int)) and not isinstance(v, bool)
                                          for k, v in values.items()):
            raise self.damaged(f"'{where}{key}' must map names to floats")
        return values

    def event(self, record: Any, where: str) -> DpEvent:
        """A stored DpEvent (`privacy.events.event_to_json`)."""
        from dpltm.privacy.events import event_from_json

        try:
            return event_from_json(record)
        except DpltmUserError as exc:
            raise self.damaged(f"'{where}' is not a DpEvent ({exc})") from None
        except (KeyError, ValueError, TypeError, AttributeError, OverflowError) as exc:
            raise self.damaged(f"'{where}' is not a DpEvent ({type(exc).__name__})") from None

    def architecture(self, record: Any) -> Architecture:
        """The `Architecture` a stored record builds."""
        from dpltm.networks.lenet import Architecture

        try:
            return Architecture.from_dict(record)
        except DpltmUserError as exc:
            raise self.damaged(f"its 'architecture' is invalid ({exc})") from None
        except (KeyError, ValueError, TypeError, AttributeError, OverflowError) as exc:
            raise self.damaged(f"its 'architecture' is invalid ({type(exc).__name__}: {exc})") from None

    def tensors(self, found: Any, expected: Mapping[str, Any], where: str, check_dtype: bool) -> None:
        """`found` must hold exactly `expected`'s tensors, with their shapes (and, with `check_dtype`,
        boolean where the reference is: the masks), and finite values (weights no training leaves non-finite)."""
        import torch

        missing = sorted(set(expected) - set(found))
        extra = sorted(set(found) - set(expected))
        if missing or extra:
            raise self.damaged(f"'{where}' does not fit its architecture "
                               f"(missing {missing[:3]}, unexpected {extra[:3]})")
        for name, reference in expected.items():
            tensor = found[name]
            if not isinstance(tensor, torch.Tensor):
                raise self.damaged(f"'{where}.{name}' is not a tensor")
            if tuple(tensor.shape) != tuple(reference.shape):
                raise self.damaged(f"'{where}.{name}' has shape {tuple(tensor.shape)}, "
                                   f"its architecture needs {tuple(reference.shape)}")
            if check_dtype and (tensor.dtype == torch.bool) != (reference.dtype == torch.bool):
                raise self.damaged(f"'{where}.{name}' has dtype {tensor.dtype}")
            if tensor.dtype != torch.bool and not tensor.is_floating_point():
                raise self.damaged(f"'{where}.{name}' has dtype {tensor.dtype}")
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise self.damaged(f"'{where}.{name}' holds NaN or infinite values (a diverged run, or a damaged file)")

    def trained(self, weights: Mapping[str, Any], masks: Mapping[str, Any], arch: Architecture, where: str) -> None:
        """Public-trained weights checked as θ0 is (its keys, shapes, floating dtypes), and zero where the mask
        prunes: a ticket's weights that act where its mask prunes would not be that ticket."""
        from dpltm.masks import pruned_but_not_zero

        self.tensors(weights, reference_theta0(arch), where, check_dtype=True)
        acting = pruned_but_not_zero(dict(weights), dict(masks))
        if acting is not None:
            raise self.damaged(f"'{where}.{acting}' is non-zero where the mask prunes it")


def body_of(record: Any, keys: Iterable[str], omitted_when_none: Container[str] = ()) -> dict[str, Any]:
    """A typed record as the plain dict its file stores, the one place records become file bodies: its fields
    in `keys` order, nested records by their own `to_dict`, tuples as lists; a field of `omitted_when_none`
    is left out while it is None (a reader takes it as absent)."""
    body = {}
    for key in keys:
        value = getattr(record, key)
        if value is None and key in omitted_when_none:
            continue
        body[key] = _plain(value)
    return body


def _plain(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return [_plain(v) for v in value] if isinstance(value, tuple) else value


@dataclass(frozen=True, kw_only=True)
class Artefact:
    """What every artefact's body holds beside its own fields: the network's record and the versions that
    wrote it. `to_dict()` is the body; `from_dict(body, path)` checks it."""

    KIND: ClassVar[str]
    WHAT: ClassVar[str]
    """What the artefact is called in a writer's refusal ("the ticket set being written")."""
    BODY: ClassVar[tuple[str, ...]]
    """The body's keys after the header, in the order the writers write them."""
    OMITTED_WHEN_NONE: ClassVar[tuple[str, ...]] = ("environment",)
    architecture: dict[str, Any]
    dpltm_version: str | None = None
    environment: dict[str, Any] | None = None
    """The library versions that wrote the file (set by `checkpoint.save_atomic`)."""

    @property
    def arch(self) -> Architecture:
        from dpltm.networks.lenet import Architecture

        return Architecture.from_dict(self.architecture)

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint body: the header, then the fields (`BODY`)."""
        return {**header(self.KIND), **body_of(self, self.BODY, self.OMITTED_WHEN_NONE)}

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> Self:
        """The artefact from the dict a writer builds (with or without a header), checked as a file would be:
        a writer cannot save what a reader would refuse."""
        return cls.from_dict({**payload, **header(cls.KIND)}, f"the {cls.WHAT} being written")

    @classmethod
    def from_dict(cls, body: Any, path: Path | str) -> Self:
        raise NotImplementedError


# ---- tensors --------------------------------------------------------------------------------

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
