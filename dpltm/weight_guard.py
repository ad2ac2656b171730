"""Which private run last stepped a parameter tensor in this process: a new run on weights another run
already stepped would state only its own ε, so it is refused."""

from __future__ import annotations

import hashlib
import itertools
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from dpltm.errors import DpltmUserError

Data = tuple[Tensor, Tensor] | torch.utils.data.Dataset  # type: ignore[type-arg]
Masks = dict[str, Tensor]


@dataclass(frozen=True)
class _Stepped:
    """One trainable parameter as a private run left it: the run (by id, so the entry keeps neither the run nor
    its records alive), its steps by then, and the tensor's storage and version counter just after that step."""

    parameter: weakref.ref[Tensor]
    run: int  # `_run_token`, unique in the process (an id could be reused by a later run)
    steps: int
    storage: int
    version: int
    digest: bytes | None = None
    """The values' digest (`weights_digest`), where the run noted them at its end (DPCallback's fit): a move to
    another device or dtype (Lightning moves a GPU module back to the CPU after a fit) keeps the values."""

    def holds(self, parameter: Tensor) -> bool:
        """The entry still describes `parameter`: the same tensor, not written since (`load_state_dict`, an
        optimiser step and `copy_` all move the version counter; `.data = …` moves the storage), or, where the
        digest was noted, moved with its values intact."""
        if self.parameter() is not parameter:
            return False
        if self.storage == parameter.data_ptr() and self.version == parameter._version:
            return True
        return self.digest is not None and self.digest == weights_digest(parameter)


def weights_digest(parameter: Tensor) -> bytes:
    """A digest of the values as float32 on the CPU: the same wherever the tensor lives, in float32 or float64."""
    values = parameter.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return hashlib.blake2b(values, digest_size=16).digest()


_STEPPED: dict[int, _Stepped] = {}
"""By id of the parameter tensor: which private run (make_private's PrivateTraining, or a DPCallback) last stepped
it in this process. Keyed on the tensors, not the module: a wrapper around the same weights (`nn.Sequential(net)`,
a LightningModule holding `net`) is the same weights."""


def _forget(key: int) -> Callable[[Any], None]:
    return lambda _: _STEPPED.pop(key, None)


_RUN_TOKENS = itertools.count(1)


def _run_token(run: Any) -> int:
    """A number for `run` that no other run in this process gets (ids are reused once an object dies)."""
    token = run.__dict__.get("_dpltm_run_token")
    if token is None:
        token = run.__dict__["_dpltm_run_token"] = next(_RUN_TOKENS)
    return int(token)


def note_fit_end(model: nn.Module, run: Any) -> None:
    """At the end of a fit, the digests of the weights `run` last stepped (one copy to the CPU), so the guard
    still knows them after the module moves device or dtype (`_Stepped.digest`)."""
    for parameter in model.parameters():
        entry = _STEPPED.get(id(parameter))
        if entry is not None and entry.run == _run_token(run) and entry.holds(parameter):
            _STEPPED[id(parameter)] = replace(entry, digest=weights_digest(parameter))


def note_private_step(model: nn.Module, run: Any) -> None:
    """Note that `run` stepped these weights: its DP steps, and any update it saw outside them (DPCallback's raw
    steps), so that a new run on them is refused even when only the latter happened."""
    steps = int(run.steps_done) + int(getattr(run, "_raw_steps", 0))
    token = _run_token(run)
    for parameter in model.parameters():
        if parameter.requires_grad:  # a frozen parameter carries nothing of the records
            key = id(parameter)
            entry = _STEPPED.get(key)
            ref = entry.parameter if entry is not None and entry.parameter() is parameter else \
                weakref.ref(parameter, _forget(key))  # one weakref per tensor, not one per step
            _STEPPED[key] = _Stepped(ref, token, steps, parameter.data_ptr(), parameter._version)


def _held_entries(model: nn.Module) -> dict[int, _Stepped]:
    entries = {}
    for parameter in model.parameters():
        entry = _STEPPED.get(id(parameter))
        if entry is not None and entry.holds(parameter):
            entries[id(parameter)] = entry
    return entries


def _renote(model: nn.Module, entries: Mapping[int, _Stepped]) -> None:
    """Put back entries after the weights were restored in place (which moved their version counters)."""
    for parameter in model.parameters():
        entry = entries.get(id(parameter))
        if entry is not None:
            _STEPPED[id(parameter)] = replace(entry, storage=parameter.data_ptr(), version=parameter._version)


def privately_stepped(model: nn.Module, run: Any = None) -> int:
    """The DP steps another private run took on these very weights (0: none, or they were replaced since). A guard
    against accidents, not a taint tracker: weights copied or edited in place after the run are not followed."""
    token = None if run is None else _run_token(run)
    others = [entry.steps for entry in _held_entries(model).values() if entry.run != token]
    return max(others, default=0)


def check_not_trained_elsewhere(model: nn.Module, run: Any = None) -> None:
    """Refuse a new private run on weights another run in this process has stepped and nothing has replaced
    since: the new run's ε would count only its own steps, not the earlier ones the weights carry (continue
    or resume that run, or load other weights, e.g. θ0, first)."""
    steps = privately_stepped(model, run)
    if steps:
        raise DpltmUserError(f"this model already took {steps} steps in another private run: continue that run, "
                             "or save it and resume from the file; a new run would report only its own steps")
