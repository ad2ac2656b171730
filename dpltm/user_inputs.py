"""A user's model, data and masks as dpltm reads them: tensors from tuples or Datasets, checked masks, the
noise's coordinates, the ledger of a user's run and plain accuracy."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor, nn

from dpltm.api_checks import (
    check_count,
    evaluation_mode,
    first_parameter,
)
from dpltm.data.splits import record_hashes
from dpltm.dp.engine import (
    prunable_weight_names,
)
from dpltm.errors import DpltmUserError
from dpltm.privacy.ledger import PrivacyLedger
from dpltm.privacy.segments import SpentSegments

Data = tuple[Tensor, Tensor] | torch.utils.data.Dataset  # type: ignore[type-arg]
Masks = dict[str, Tensor]


def as_tensors(data: Data, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """(features, labels) on `device`: tensors as given, or a map-style Dataset read once into tensors
    (every item stacked: later batches are index_select on the device, never per-sample decoding)."""
    if isinstance(data, list) and len(data) == 2 and all(isinstance(t, Tensor) for t in data):
        data = tuple(data)
    if isinstance(data, (str, bytes, Mapping)) or data is None:
        raise DpltmUserError(f"data must be (features, labels) or a map-style torch Dataset, got {type(data).__name__}")
    try:
        if isinstance(data, tuple):
            if len(data) != 2:
                raise DpltmUserError("data must be (features, labels) or a torch Dataset")
            features, labels = (torch.as_tensor(t) for t in data)
        else:
            items = [data[i] for i in range(len(data))]  # type: ignore[arg-type]
            if not items:
                raise DpltmUserError("the dataset is empty")
            odd = next((i for i, item in enumerate(items) if not isinstance(item, (tuple, list)) or len(item) != 2),
                       None)
            if odd is not None:  # a third field (a weight, an index) dropped, or a tensor's first two rows taken
                item = items[odd]
                got = f"{len(item)} field(s)" if isinstance(item, (tuple, list)) else f"a {type(item).__name__}"
                raise DpltmUserError(f"each record must be a (features, label) pair, but item {odd} is {got}")
            features = torch.stack([torch.as_tensor(item[0]) for item in items])
            labels = torch.stack([torch.as_tensor(item[1]) for item in items])
    except DpltmUserError:
        raise
    except (TypeError, KeyError, IndexError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
        raise DpltmUserError(f"data must be (features, labels) tensors or a map-style Dataset of (features, label) "
                             f"items ({first})") from None
    for name, values in (("features", features), ("labels", labels)):
        if values.layout != torch.strided:
            layout = str(values.layout).removeprefix("torch.")
            raise DpltmUserError(f"{name} must be a dense tensor, got layout {layout} (call .to_dense())")
        if values.is_meta:
            raise DpltmUserError(f"{name} are on the meta device (shapes without values): load the data itself")
    if features.dim() == 0 or labels.dim() == 0:
        raise DpltmUserError("features and labels need a first (record) dimension")
    if features.shape[0] != labels.shape[0]:
        raise DpltmUserError(f"{features.shape[0]} feature rows but {labels.shape[0]} labels")
    if features.dtype in (torch.uint8, torch.int8, torch.bool):  # pixels and flags; other integers: model_tensors
        features = features.float()
    target = torch.device(device) if device is not None else features.device
    if not labels.is_floating_point():  # class indices; float targets (regression, soft labels) stay as they are
        labels = labels.long()
    return features.to(target), labels.to(target)


def takes_ids(model: nn.Module) -> bool:
    """Whether integer features may be token ids for the model (it embeds): otherwise they are numbers."""
    return any(isinstance(module, (nn.Embedding, nn.EmbeddingBag)) for module in model.modules())


def model_tensors(model: nn.Module, data: Data, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """`as_tensors`, with integer features as floats unless the model embeds ids (int64 from NumPy or pandas is
    usually a measurement; a model with an nn.Embedding takes ids)."""
    features, labels = as_tensors(data, device)
    if features.is_complex():  # .float() would drop the imaginary part with only a warning
        raise DpltmUserError(f"features must be real numbers, got {str(features.dtype).removeprefix('torch.')}")
    if not features.is_floating_point() and not takes_ids(model):
        features = features.float()
    return features, labels


def prunable_weights(model: nn.Module) -> dict[str, Tensor]:
    """The weights a ticket masks: every trainable weight matrix or kernel (dpltm.dp.engine.prunable_weight_names;
    biases and normalisation scales never)."""
    parameters = dict(model.named_parameters())
    return {name: parameters[name] for name in prunable_weight_names(model)}


def check_user_masks(model: nn.Module, masks: Mapping[str, Tensor]) -> Masks:
    """Masks keyed by weight names, 0/1, of the weights' shapes, on their devices."""
    weights = prunable_weights(model)
    unknown = sorted(set(masks) - set(weights))
    if unknown:
        raise DpltmUserError(f"masks name weights the model has not (or cannot mask): {unknown}; "
                             f"maskable: {sorted(weights)}")
    out: Masks = {}
    for name, mask in masks.items():
        try:
            mask = torch.as_tensor(mask)
        except (TypeError, RuntimeError, ValueError):
            raise DpltmUserError(f"mask {name} must be a 0/1 tensor, got {type(mask).__name__}") from None
        if mask.layout != torch.strided or mask.is_meta:
            raise DpltmUserError(f"mask {name} must be a dense tensor with values (call .to_dense(); not on the "
                                 "meta device)")
        if tuple(mask.shape) != tuple(weights[name].shape):
            raise DpltmUserError(f"mask {name} has shape {tuple(mask.shape)}, the weight {tuple(weights[name].shape)}")
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise DpltmUserError(f"mask {name} must hold only 0 and 1")
        if mask.numel() and not bool(mask.any()):  # as generate_tickets refuses a round that would do it
            raise DpltmUserError(f"mask {name} prunes every weight of the layer: the network could not compute through "
                                 "it (use a ticket of an earlier round, or no mask for this layer)")
        # a copy: the run's noise positions are fixed from these masks, so a later edit of the caller's tensor
        # must not change which coordinates are clipped and re-masked
        out[name] = mask.to(device=weights[name].device, dtype=torch.bool, copy=True)
    return out


def user_run_ledger(segments: SpentSegments, delta: float, accountant: str, neighboring: str,
                    masks: Mapping[str, Tensor], masks_from: str | None, masks_private: bool,
                    selection_eps1: float | None, dataset_name: str,
                    non_private_updates: int = 0) -> PrivacyLedger | None:
    """What a `make_private` / `DPCallback` run spent: every DP-SGD segment as it ran (composed, never
    re-planned: docs/privacy.md §8), any ε1 of the selection, the masks' provenance (none; public; or
    these private records: then not DP end to end), and any optimiser step on an un-noised gradient (then not
    DP at all). None before the first step, unless an update outside the mechanism already ran: the ledger then
    says so, with the open segment counted as one step (a count that over-states, never under-states)."""
    records = segments.records()
    if not records and non_private_updates and segments.latest_mechanism is not None:
        records = [{**segments.latest_mechanism, "steps": 1}]
    if not records:
        return None
    phase1 = "none" if not masks else "same-data" if masks_private else "public"
    return PrivacyLedger(
        phase1=phase1, phase1_dataset=masks_from if masks else None, private_dataset=dataset_name,
        selection_eps1=selection_eps1, training=records[-1],
        earlier_training=tuple(records[:-1]) or None, delta=delta, neighboring=neighboring, accountant=accountant,
        held_out_records=False, non_private_updates=non_private_updates)


@torch.no_grad()
def apply_masks(model: nn.Module, masks: Mapping[str, Tensor]) -> None:
    """Zero the pruned weights in place (called every step: nothing to do without masks)."""
    if not masks:
        return
    parameters = dict(model.named_parameters())
    for name, mask in masks.items():  # a 0/1 mask of any dtype multiplies in the weight's own (no converted copy)
        parameters[name].mul_(mask)


def density_of(model: nn.Module, masks: Mapping[str, Tensor]) -> float:
    """Fraction of the maskable weights a ticket keeps."""
    weights = prunable_weights(model)
    kept = sum(int(masks[n].sum()) if n in masks else w.numel() for n, w in weights.items())
    return kept / sum(w.numel() for w in weights.values())


@torch.no_grad()
def evaluate(model: nn.Module, data: Data, batch_size: int = 4096) -> float:
    """Top-1 accuracy (no privacy: for held-out or public data). Empty data, non-finite features (whose scores'
    argmax is arbitrary) and labels the model has no class for are refused rather than scored."""
    batch_size = check_count(batch_size, "batch_size")
    parameter = first_parameter(model)
    features, labels = model_tensors(model, data, parameter.device)
    if labels.dim() != 1 or labels.is_floating_point():
        kind = str(labels.dtype).removeprefix("torch.")  # (N, 1) against (N,) would broadcast to N × N
        raise DpltmUserError(f"class labels must be integers of shape (N,), got {kind} of shape {tuple(labels.shape)}")
    if len(labels) == 0:
        raise DpltmUserError("there are no records to evaluate on")
    if features.is_floating_point():
        features = features.to(parameter.dtype)
        if not bool(torch.isfinite(features).all()):
            raise DpltmUserError("the features hold NaN or infinite values: their accuracy would be arbitrary")
    try:
        with evaluation_mode(model):
            return _accuracy(model, features, labels, batch_size)
    except (RuntimeError, ValueError, IndexError) as exc:
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise DpltmUserError(f"the model cannot be evaluated on this data: {first}") from None


@torch.no_grad()
def _accuracy(model: nn.Module, features: Tensor, labels: Tensor, batch_size: int) -> float:
    """Top-1 accuracy in batches (the caller sets the modes)."""
    correct = 0
    for i in range(0, len(labels), batch_size):
        outputs, targets = model(features[i : i + batch_size]), labels[i : i + batch_size]
        if not isinstance(outputs, Tensor) or outputs.dim() != 2 or outputs.shape[0] != len(targets):
            got = tuple(outputs.shape) if isinstance(outputs, Tensor) else type(outputs).__name__
            raise DpltmUserError(f"the model must return class scores of shape (batch, classes), got {got}")
        if i == 0:  # every label must name one of the model's classes (else it is never right: a silent 0)
            low, high = int(labels.min()), int(labels.max())
            if low < 0 or high >= outputs.shape[1]:
                raise DpltmUserError(f"class labels must lie in [0, {outputs.shape[1] - 1}] (the model's "
                                     f"{outputs.shape[1]} classes), got labels from {low} to {high}")
        correct += int((outputs.argmax(1) == targets).sum())
    return correct / max(len(labels), 1)


def record_keys(features: Tensor, labels: Tensor) -> np.ndarray:
    """Per-record content hashes (float32 features, int64 labels), as the CLI's overlap check uses."""
    x = features.detach().to("cpu", torch.float32)
    y = labels.detach().to("cpu")
    if y.dim() > 1:  # several targets a record (one-hot, multi-label): hashed as part of the record's row
        x = torch.cat([x.reshape(x.shape[0], -1), y.reshape(y.shape[0], -1).to(torch.float32)], dim=1)
        y = torch.zeros(y.shape[0], dtype=torch.long)
    return record_hashes(x, y.long() if not y.is_floating_point() else y.round().long(), seed=0)
