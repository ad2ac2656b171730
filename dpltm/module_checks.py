"""What DPCallback checks of a user's LightningModule: the sample-independence probe on its batches, its trainable
parameters, and the writes a training step may not make (an update on the raw gradient, a batch statistic).

Per-sample clipping bounds one record's influence only if each sample's loss depends on its own record alone
(docs/privacy.md §3), and the noisy step is DP only if nothing else updates the weights from the batch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from dpltm.dp.independence import PROBE_ROWS, check_samples_independent
from dpltm.errors import DpltmUserError


def probe_first_batch(module: torch.nn.Module, batch: Any, rows: int = PROBE_ROWS) -> None:
    """The sample-independence probe (dpltm.dp.independence) on the module's forward and on each of its child
    modules, for each input of the batch they take: the batch itself, the first tensor of an (x, y, …) batch,
    or every tensor of a {"x": …, "y": …} batch. The children too, since training_step may route through
    one the module's own (inference) forward does not use. A network that takes something else cannot be
    probed; its layers that own parameters are still checked by the engine (dpltm.dp.rules.check_adds_up)."""
    if isinstance(batch, Tensor):
        inputs = [batch]
    elif isinstance(batch, (tuple, list)):
        inputs = batch[:1]
    elif isinstance(batch, Mapping):
        inputs = list(batch.values())
    else:
        inputs = []
    for x in inputs:
        if not isinstance(x, Tensor) or x.dim() == 0 or x.shape[0] == 0:
            continue
        for name, candidate in (("", module), *module.named_children()):
            if _is_metric(candidate):  # aggregates over the batch by design, and is no part of the gradient's path
                continue
            try:
                check_samples_independent(candidate, x[:1], prefix=name, rows=rows)
            except DpltmUserError:
                raise
            except Exception:  # this forward takes something else (a dict, several tensors): not probed on x
                continue


def _is_metric(module: torch.nn.Module) -> bool:
    """A torchmetrics Metric (told by its classes' module, so torchmetrics is never imported here)."""
    return any(cls.__module__.split(".")[0] == "torchmetrics" for cls in type(module).__mro__)


def trainable_names(module: torch.nn.Module) -> frozenset[str]:
    """The names of the parameters that take gradients now."""
    return frozenset(name for name, parameter in module.named_parameters() if parameter.requires_grad)


def state_marks(pl_module: torch.nn.Module) -> dict[str, tuple[int, float]]:
    """Each parameter's and buffer's version counter (every in-place write moves it) and norm (a write through
    `.data`, which leaves the counter alone, moves that): compared across a step, they show a write."""
    tensors = list(itertools.chain(pl_module.named_parameters(), pl_module.named_buffers()))
    floats = [(name, t.detach()) for name, t in tensors if t.is_floating_point() and t.numel()]
    norms = torch._foreach_norm([t for _, t in floats]) if floats else []
    values = torch.stack([n.to(torch.float64) for n in norms]).tolist() if floats else []
    norm_of = {name: value for (name, _), value in zip(floats, values)}
    return {name: (t._version, norm_of.get(name, 0.0)) for name, t in tensors}


def written_message(name: str, when: str) -> str:
    return (f"{name} was written during the training step, {when} (an update on the raw gradient, a perturbation, "
            "a running statistic of the batch): the model is no longer differentially private. dpltm cannot tell "
            "a write that does not depend on the batch (a step counter, a clamp of the weights) from one that "
            "does: do such writes after the step, in on_train_batch_end")


def first_written(before: Mapping[str, tuple[int, float]], now: Mapping[str, tuple[int, float]]) -> str | None:
    for name, (version, norm) in now.items():
        was = before.get(name)
        if was is None:
            continue
        same_norm = was[1] == norm or (math.isnan(was[1]) and math.isnan(norm))
        if was[0] != version or not same_norm:
            return name
    return None
