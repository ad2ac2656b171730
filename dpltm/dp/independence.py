"""Whether a model treats the records of a batch independently: what per-sample clipping needs.

DP-SGD's sensitivity bound (Abadi et al. 2016, Alg. 1; docs/privacy.md §3) holds when each record's loss
depends on that record alone: then removing a record removes exactly one clipped gradient from the sum.
A layer that mixes the rows of a batch (centring by the batch mean, attention across the batch, batch
statistics) lets one record move every other record's gradient, so clipping each one bounds nothing; a
buffer updated in the forward pass (running statistics) releases a statistic of the private batch with
no noise at all. The engine refuses such layers by type when they own parameters
(`dpltm.dp.engine.trainable_layers`); this probe covers every other module, parameter-free ones included,
by behaviour: two forward passes on synthetic rows that differ in the first row only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from dpltm.dp.engine import PER_RECORD_LOSS
from dpltm.errors import DpltmUserError

PROBE_ROWS = 6
"""Rows in the probe batch: several, so that a layer mixing only some rows (pairs, neighbours) shows."""
PROBE_ROWS_MAX = 64
"""At most this many rows: a layer that mixes only large batches shows at the expected batch size, up to this."""
PROBE_SEED = 20211
"""The probe's rows and the model's own randomness (dropout) in both passes: the same draws each time."""


def probe_batch(example: Tensor, rows: int = PROBE_ROWS, synthetic: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """Three batches shaped like `example` (one record, batch dimension first): the first, the first with row 0
    changed, and the first with its last row changed. `synthetic` floating-point records get Gaussian values (no
    record's values are used); otherwise (integer records: token ids; or a model the Gaussian rows do not suit)
    every row is a copy of the example, and the changed rows are zeros."""
    shape = (rows, *example.shape[1:])
    if synthetic and example.is_floating_point():
        generator = torch.Generator().manual_seed(PROBE_SEED)
        first = torch.randn(shape, generator=generator, dtype=torch.float64)
        changed = torch.randn((2, *shape[1:]), generator=generator, dtype=torch.float64)
        first = first.to(example.device, example.dtype)
        changed = changed.to(example.device, example.dtype)
    else:
        first = example[:1].expand(shape).clone()
        changed = torch.zeros_like(first[:2])
    second, third = first.clone(), first.clone()
    second[0], third[-1] = changed[0], changed[1]
    return first, second, third


@contextmanager
def _buffers_kept(model: nn.Module) -> Iterator[None]:
    """Whatever the forward passes inside write to the model's buffers is undone on the way out."""
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in saved:
                    b.copy_(saved[name])


@contextmanager
def _same_randomness(device: torch.device) -> Iterator[None]:
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(PROBE_SEED)
        yield


def _run(model: nn.Module, batch: Tensor, outputs: list[tuple[str, Tensor]] | None = None, prefix: str = "") -> Any:
    """The model's output, and (in `outputs`, when given) every module's tensor output with one row per record, in
    the order the modules finished (innermost first)."""
    handles = []
    for name, module in model.named_modules() if outputs is not None else ():
        def hook(module: nn.Module, args: Any, output: Any, name: str = name) -> None:
            if isinstance(output, Tensor) and output.dim() > 0 and output.shape[0] == batch.shape[0]:
                name = ".".join(part for part in (prefix, name) if part)
                label = f"{name} ({type(module).__name__})" if name else type(module).__name__
                outputs.append((label, output.detach().clone()))
        handles.append(module.register_forward_hook(hook))
    try:
        with _same_randomness(batch.device), torch.no_grad():
            return model(batch)
    finally:
        for handle in handles:
            handle.remove()


def _same(a: Tensor, b: Tensor) -> bool:
    """Two outputs agree to float rounding (NaN where both are NaN; the scale from the finite values)."""
    a, b = a.double(), b.double()
    finite = a[torch.isfinite(a)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return bool(torch.allclose(a, b, rtol=1e-4, atol=1e-6 * max(scale, 1.0), equal_nan=True))


def _agree(a: Tensor, b: Tensor, rows: slice) -> bool:
    return a.shape == b.shape and a.dim() > 0 and _same(a[rows], b[rows])


def module_modes(model: nn.Module) -> tuple[bool, ...]:
    """Each module's training flag, in order: what a probe's verdict holds for."""
    return tuple(module.training for module in model.modules())


def probe_rows(expected_batch_size: int) -> int:
    """Rows to probe a model with before a run at this expected batch size: the batch size itself (a layer that
    mixes records only in batches above some size shows), between PROBE_ROWS and PROBE_ROWS_MAX."""
    return max(PROBE_ROWS, min(int(expected_batch_size), PROBE_ROWS_MAX))


def check_samples_independent(model: nn.Module, example: Tensor, prefix: str = "", rows: int = PROBE_ROWS) -> None:
    """Refuse, in one line naming the layer, a model whose output for one record depends on other records
    of the batch, or whose forward pass updates a buffer. `example` is one record as the model takes it
    (only its shape and dtype are used for floating-point records, unless the model cannot take Gaussian rows:
    then copies of the record are used). The model is probed in the modes its modules are in (as DP-SGD will
    run them) and left as it was: buffers and random state restored. `prefix`: the model's own name in the
    module that holds it (for the message); `rows`: the probe batch's rows (`probe_rows`)."""
    _on_probe_rows(example, lambda batches: _probe(model, batches, prefix), rows)


def _on_probe_rows(example: Tensor, check: Callable[[tuple[Tensor, Tensor, Tensor]], Any],
                   rows: int = PROBE_ROWS) -> Any:
    """`check` on the Gaussian probe rows, or, where the model cannot take them (token ids, say), on copies of the
    record itself. A refusal (DpltmUserError) is the check's verdict and passes through."""
    try:
        return check(probe_batch(example, rows))
    except DpltmUserError:
        raise
    except Exception:
        return check(probe_batch(example, rows, synthetic=False))


def _probe(model: nn.Module, batches: tuple[Tensor, Tensor, Tensor], prefix: str) -> None:
    first, second, third = batches
    written = {name: (b.data_ptr(), b._version) for name, b in model.named_buffers()}  # NaN-safe, unlike equality
    with _buffers_kept(model):
        outputs = [_run(model, first)]  # the outputs alone: every module's would cost several training steps' memory
        changed = [name for name, b in model.named_buffers() if written.get(name) != (b.data_ptr(), b._version)]
        if changed:
            name = ".".join(part for part in (prefix, changed[0]) if part)
            raise DpltmUserError(f"the model's forward pass updates buffer {name!r} (running statistics of "
                                 "the training records would be released without noise): freeze it or use a layer "
                                 "without running statistics")
        outputs += [_run(model, second), _run(model, third)]
    if not all(isinstance(out, Tensor) for out in outputs):
        return  # the caller checks the output's type; nothing row-wise to compare
    for other, rows in ((1, slice(1, None)), (2, slice(None, -1))):  # row 0 changed, then the last row
        if _agree(outputs[0], outputs[other], rows):
            continue
        culprit = _culprit(model, batches[0], batches[other], rows, prefix)
        raise DpltmUserError(f"layer {culprit} mixes the records of a batch: its output for one record depends on "
                             "other records, which per-sample clipping cannot bound")


def _culprit(model: nn.Module, first: Tensor, other: Tensor, rows: slice, prefix: str) -> str:
    """The first module (innermost first) whose output differs on the unchanged rows: the passes again, now
    keeping every module's output (only on the way to a refusal)."""
    seen: list[list[tuple[str, Tensor]]] = [[], []]
    try:
        with _buffers_kept(model):
            _run(model, first, seen[0], prefix)
            _run(model, other, seen[1], prefix)
    except Exception:  # out of memory, say: the refusal stands, without the layer's name
        return type(model).__name__
    return next((name for (name, a), (_, b) in zip(seen[0], seen[1]) if a.shape == b.shape
                 and not _agree(a, b, rows)), type(model).__name__)


def check_gradients_reach_their_layers(model: nn.Module, example: Tensor, example_label: Tensor,
                                       loss: Callable[[Tensor, Tensor], Tensor]) -> None:
    """Refuse a model whose batch gradient the engine's per-layer rules do not see whole: without clipping,
    the per-sample gradients the rules form (dpltm.dp.engine) must add up to autograd's gradient of the
    summed loss, parameter by parameter. A weight used outside its own layer (tied through
    `F.linear(h, other.weight)`, read in a parent's forward) gets part of its gradient from a use no rule
    records: its norms would be too small and its update wrong. Checked once, on synthetic rows."""
    name = _on_probe_rows(example, lambda batches: _untracked_gradient(model, batches[0], example_label, loss))
    if name is not None:
        raise DpltmUserError(f"parameter {name}: its per-sample gradients do not add up to its batch gradient, so "
                             "part of its gradient comes from a use outside its own layer (a weight tied through "
                             "a functional call?), which per-sample clipping cannot see: not supported")


def _untracked_gradient(model: nn.Module, rows: Tensor, example_label: Tensor,
                        loss: Callable[[Tensor, Tensor], Tensor]) -> str | None:
    """The first trainable parameter whose engine sum (no clipping) and autograd gradient differ on `rows`; None when
    all agree, or when the rows give a non-finite loss (nothing to compare: the engine drops such records)."""
    with torch.no_grad(), _buffers_kept(model), _same_randomness(rows.device):
        outputs = model(rows)  # a model that cannot take these rows raises: _on_probe_rows tries the record's copies
    if not isinstance(outputs, Tensor) or outputs.dim() == 0:
        return None  # the caller refuses outputs of the wrong kind
    classes = 0 if example_label.is_floating_point() else outputs.shape[-1]
    made_up = _probe_targets(example_label, rows.shape[0], classes, torch.Generator().manual_seed(PROBE_SEED))
    own = example_label[:1].expand(rows.shape[0], *example_label.shape[1:]).clone()
    # a loss that cannot take made-up targets (probabilities, class maps) gets the record's own; one that takes
    # neither is left unprobed (its first step fails on it anyway)
    labels = next((t for t in (made_up, own) if _takes(loss, outputs, t)), None)
    return None if labels is None else _differing_parameter(model, rows, labels, loss)


def _takes(loss: Callable[[Tensor, Tensor], Tensor], outputs: Tensor, targets: Tensor) -> bool:
    try:
        with torch.no_grad(), _same_randomness(outputs.device):
            loss(outputs, targets)
    except DpltmUserError:
        raise
    except Exception:
        return False
    return True


def _differing_parameter(model: nn.Module, rows: Tensor, labels: Tensor,
                         loss: Callable[[Tensor, Tensor], Tensor]) -> str | None:
    from dpltm.dp.engine import clipped_gradient_sum_of

    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    with _buffers_kept(model):
        with _same_randomness(rows.device):
            sums = clipped_gradient_sum_of(model, rows, labels, float("inf"), loss=loss).grad_sums
        with _same_randomness(rows.device), torch.enable_grad():
            total = loss(model(rows), labels).sum()
            if not bool(torch.isfinite(total)):
                return None
            batch = torch.autograd.grad(total, list(trainable.values()), allow_unused=True)
    expected_of = {name: torch.zeros_like(p) if g is None else g for (name, p), g in zip(trainable.items(), batch)}
    if not all(bool(torch.isfinite(g).all()) for g in expected_of.values()):
        return None
    # float rounding's floor: a gradient that is zero in exact arithmetic (an attention key's bias: softmax ignores a
    # shift of every logit) is float noise a million times below the model's largest gradient on either side
    floor = 1e-6 * max((float(g.abs().max()) for g in expected_of.values() if g.numel()), default=0.0)
    for name, expected in expected_of.items():
        mine = sums.get(name)
        if mine is None:
            continue
        scale = float(expected.abs().max()) if expected.numel() else 0.0
        if not torch.allclose(mine.double(), expected.double(), rtol=1e-3, atol=max(1e-5 * scale, floor, 1e-17)):
            return name
    return None


def _probe_targets(example_label: Tensor, rows: int, classes: int, generator: torch.Generator) -> Tensor:
    """Made-up targets shaped like `example_label`'s rows: Gaussian for float targets, else classes in [0, classes)."""
    shape = (rows, *example_label.shape[1:])
    labels = torch.randn(shape, generator=generator) if example_label.is_floating_point() else \
        torch.randint(0, max(classes, 1), shape, generator=generator)
    return labels.to(example_label.device, example_label.dtype)


def check_loss_shape(model: nn.Module, example: Tensor, example_label: Tensor,
                     loss: Callable[[Tensor, Tensor], Tensor]) -> None:
    """Refuse, before any other probe, a loss that reduces the batch (`F.cross_entropy`, `nn.CrossEntropyLoss()` with
    their default reduction='mean'): per-sample clipping needs each record's loss. Asked of two copies of the first
    record, so the message speaks of the batch, not of a probe's row count."""
    rows, labels = example[:1].expand(2, *example.shape[1:]), example_label[:1].expand(2, *example_label.shape[1:])
    try:
        with torch.no_grad(), _buffers_kept(model), _same_randomness(rows.device):
            losses = loss(model(rows), labels)
    except DpltmUserError:
        raise
    except Exception:  # the model or the loss cannot run here: the later checks say why
        return
    if not isinstance(losses, Tensor) or tuple(losses.shape) != (2,):
        got = f"shape {tuple(losses.shape)}" if isinstance(losses, Tensor) else type(losses).__name__
        raise DpltmUserError(f"loss(outputs, targets) must give one loss per record of the batch, shape (batch,); got "
                             f"{got}: {PER_RECORD_LOSS}")


def check_loss_per_sample(model: nn.Module, example: Tensor, example_label: Tensor,
                          loss: Callable[[Tensor, Tensor], Tensor], rows: int = PROBE_ROWS) -> None:
    """Refuse a per-sample loss whose value for one record depends on other records of the batch (a penalty on
    the batch's mean output, a loss centred by the batch mean): the engine takes row i of the gradient at the
    outputs as record i's, which bounds one record's influence only when loss(outputs, targets)[i] reads row i
    alone. Probed on the model's outputs for synthetic rows: changing one row's output and target must leave
    every other row's loss and its gradient as they were."""
    _on_probe_rows(example, lambda batches: _check_loss(model, batches[0], example_label, loss), rows)


def _check_loss(model: nn.Module, rows: Tensor, example_label: Tensor,
                loss: Callable[[Tensor, Tensor], Tensor]) -> None:
    with torch.no_grad(), _buffers_kept(model), _same_randomness(rows.device):
        outputs = model(rows)
    if not isinstance(outputs, Tensor) or outputs.dim() == 0 or outputs.shape[0] != rows.shape[0] \
            or not outputs.is_floating_point():
        return  # the caller refuses outputs of the wrong kind
    n = outputs.shape[0]
    generator = torch.Generator().manual_seed(PROBE_SEED + 1)
    labels = _probe_targets(example_label, n, int(outputs.shape[-1]), generator)
    scale = float(outputs.detach().abs().max()) if outputs.numel() else 1.0
    shift = torch.randn(outputs.shape[1:], generator=generator).to(outputs.device, outputs.dtype) * max(scale, 1.0)
    values = []
    for row in (None, 0, n - 1):
        changed, targets = outputs.detach().clone(), labels.clone()
        if row is not None:
            changed[row] += shift
            if not labels.is_floating_point():
                targets[row] = (targets[row] + 1) % max(int(outputs.shape[-1]), 1)
            else:
                targets[row] = -targets[row]
        changed.requires_grad_(True)
        try:  # the same random draws in every call (a loss with noise or dropout in it)
            with torch.enable_grad(), _same_randomness(changed.device):
                per_sample = loss(changed, targets)
                if not isinstance(per_sample, Tensor) or per_sample.shape[:1] != (n,):
                    return  # the caller refuses a loss that does not give one value per sample
                (gradient,) = torch.autograd.grad(per_sample.sum(), changed, allow_unused=True)
        except DpltmUserError:
            raise
        except Exception:  # the loss cannot take the made-up targets (class maps, probabilities): not probed
            return
        if not bool(torch.isfinite(per_sample).all()):
            return  # nothing to compare: the engine drops non-finite records
        values.append((per_sample.detach(), None if gradient is None else gradient.detach(), row))
    (base, base_grad, _), *others = values
    for per_sample, gradient, row in others:
        keep = torch.ones(n, dtype=torch.bool, device=base.device)
        keep[row] = False
        same_grad = (gradient is None and base_grad is None) or (
            gradient is not None and base_grad is not None and _same(base_grad[keep], gradient[keep]))
        if not (_same(base[keep], per_sample[keep]) and same_grad):
            raise DpltmUserError("the loss mixes the records of a batch: loss(outputs, targets)[i] must depend on "
                                 "row i alone (no batch means or penalties over the batch), or per-sample clipping "
                                 "bounds nothing")
