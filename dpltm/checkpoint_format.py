"""The checkpoint format's version and kinds: the facts both the file layer (dpltm.checkpoint) and
the typed artefacts (dpltm.artefacts) read, kept apart so neither imports the other's module."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

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
OLDEST_READABLE = {"tickets": 2, "ticket": 2, "run": 2, "model": 3}
"""The oldest format each kind is read in: the last format that changed that kind's layout."""
"""tickets: a generated ticket set; ticket: one selected winner; model: a trained network; run: a library
run of `make_private` (`PrivateTraining.save`), resumable, with the segments it spent."""


MODEL_FORMAT_2 = 2
"""Model files of checkpoint format 2 stored the privacy facts twice (ledger and report)."""


def refusal(path: Path | str, kind: Any, version: Any) -> str:
    """The one line that refuses a file of a checkpoint format this dpltm does not read."""
    if kind == "model" and version == MODEL_FORMAT_2:
        return (f"{path} is a model of checkpoint format 2 (its privacy facts stored twice), this dpltm reads "
                f"format {FORMAT_VERSION}: train it again with this dpltm")
    return f"{path} has checkpoint format {version}, this dpltm reads format {FORMAT_VERSION}"


_OLD_PARAMETER_NAME = re.compile(r"^layers\.(?:(conv|hidden)_(\d+)|(project|output))\.(weight|bias)$")


def current_parameter_names(state: dict[str, Any], where: str = "the file") -> dict[str, Any]:
    """A built-in network's weights under today's parameter names. Until the networks became plain modules
    (`dpltm.networks.lenet.LeNet`), their parameters lived in one `layers` dict: `layers.hidden_0.weight` is now
    `hidden.0.weight`, `layers.output.bias` is `output.bias`. Files written before keep loading: their
    θ0 and state_dict keys are renamed as they are read (values untouched; other keys kept as they are).
    A file holding one parameter under both names is refused in one line (which one would be trained?)."""
    from dpltm.errors import DpltmUserError

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
