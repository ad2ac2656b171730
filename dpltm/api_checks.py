"""Argument checks for the library API (`make_private`, `DPCallback`), in its own words.

The CLI's checks name CLI flags (`--batch-size`); a library user passed Python arguments, so these
name the Python parameters and say what was received. Everything here runs at construction, before
any private record is read for training: a mistake costs no privacy and leaves nothing half done.
"""

from __future__ import annotations

import math
import numbers
import os
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from dpltm.errors import DpltmUserError
from dpltm.privacy.accountants import accountant_entry
from dpltm.privacy.accounting import check_accountant, check_delta, check_neighboring
from dpltm.privacy.display import format_epsilon
from dpltm.privacy.events import MAX_NOISE_MULTIPLIER, MAX_STEPS, MIN_NOISE_MULTIPLIER
from dpltm.settings import MAX_SEED, TrainSettings, check_clip_range


def _shown(value: Any) -> str:
    """A value for an error message: its repr, bounded (never a 40 MB line)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_count(value: Any, name: str, minimum: int = 1, maximum: int | None = None) -> int:
    """A whole number ≥ `minimum` (any integral type, NumPy's included; bool refused: True is not a count)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise DpltmUserError(f"{name} must be an integer, got {_shown(value)}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"at least {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise DpltmUserError(f"{name} must be {bound}, got {value}")
    return int(value)


def check_seed(value: Any, name: str) -> int:
    """A seed: a whole number in [0, 2⁶³) (torch.Generator.manual_seed takes no more), bool refused."""
    return check_count(value, name, minimum=0, maximum=MAX_SEED)


def check_flag(value: Any, name: str) -> None:
    """True or False (NumPy's bools too): a privacy flag given as "no" must not be read as its truth value."""
    if not isinstance(value, (bool, np.bool_)):
        raise DpltmUserError(f"{name} must be True or False, got {_shown(value)}")


def check_callable(value: Any, name: str) -> None:
    """None or a callable, checked before any private step runs (not when it is first called)."""
    if value is not None and not callable(value):
        raise DpltmUserError(f"{name} must be callable (or None), got {_shown(value)}")


def user_path(value: Any, name: str) -> Path:
    """A file path given as a string or a path object, not empty or blank (Path("") is the current directory)."""
    if not isinstance(value, (str, os.PathLike)) or isinstance(value, bytes):
        raise DpltmUserError(f"{name} must be a file path, got {_shown(value)}")
    text = os.fspath(value)
    if not isinstance(text, str) or not text.strip():
        raise DpltmUserError(f"{name} must be a file path, got an empty one")
    return Path(text)


def check_positive(value: Any, name: str, *, minimum: float = 0.0, inclusive: bool = False) -> float:
    """A finite real number > `minimum` (≥ with `inclusive`; any real type, NumPy's included)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise DpltmUserError(f"{name} must be a number, got {_shown(value)}")
    x = float(value)
    ok = math.isfinite(x) and (x >= minimum if inclusive else x > minimum)
    if not ok:
        raise DpltmUserError(f"{name} must be a finite number {'≥' if inclusive else '>'} {minimum:g}, got {x:g}")
    return x


def check_clip(value: Any, name: str = "max_grad_norm") -> float:
    """The clipping bound C: between MIN_CLIP and MAX_CLIP (the noise is σ·C per coordinate: beyond it the
    noise swamps float32 weights and the run can only diverge; below it C and σ·C vanish in float32)."""
    clip = check_positive(value, name)
    check_clip_range(clip, name)
    return clip


CLIPPINGS = ("flat", "per_layer")


def layer_clip_bounds(model: nn.Module, max_grad_norm: Any, clipping: Any) -> tuple[float, dict[str, float] | None]:
    """The bound on a record's whole gradient, and per-layer bounds C_l by layer name (None: one flat bound).

    `clipping="per_layer"` clips each trainable layer's part of a record's gradient to its own C_l: given as a dict
    {layer name: C_l} covering every trainable layer, or one float C split evenly (C_l = C/√L over L layers). The
    record's whole gradient then has norm ≤ √(Σ C_l²), the sensitivity the noise is scaled to (McMahan et al. 2018,
    §3): the same Gaussian mechanism at the same noise multiplier, so the same accounting."""
    from dpltm.dp.engine import trainable_layers

    if clipping not in CLIPPINGS:
        raise DpltmUserError(f"clipping must be one of {', '.join(CLIPPINGS)}, got {_shown(clipping)}")
    if clipping == "flat":
        if isinstance(max_grad_norm, Mapping):
            raise DpltmUserError("max_grad_norm per layer (a dict) needs clipping='per_layer'")
        return check_clip(max_grad_norm), None
    layers = [name for name, _ in trainable_layers(model)]
    if isinstance(max_grad_norm, Mapping):
        unknown, missing = sorted(set(max_grad_norm) - set(layers)), [n for n in layers if n not in max_grad_norm]
        if unknown or missing:
            raise DpltmUserError(f"max_grad_norm per layer must name each trainable layer once: {layers}"
                                 + (f"; unknown {unknown}" if unknown else "")
                                 + (f"; missing {missing}" if missing else ""))
        bounds = {name: check_clip(max_grad_norm[name], f"max_grad_norm[{name!r}]") for name in layers}
    elif isinstance(max_grad_norm, (list, tuple)):
        raise DpltmUserError("max_grad_norm per layer is a dict {layer name: bound} (Opacus's list is one bound per "
                             f"parameter; dpltm clips per layer): the trainable layers are {layers}")
    else:
        share = check_clip(max_grad_norm) / math.sqrt(len(layers))
        bounds = {name: share for name in layers}
    total = math.nextafter(math.sqrt(math.fsum(c * c for c in bounds.values())), math.inf)  # rounded the safe way
    return check_clip(total, "the per-layer bounds' √(Σ C_l²)"), bounds


FINITE_CHECK_ROWS = 1 << 14
"""Rows checked for NaN/∞ at a time: the check's temporary stays small for data of any size."""


def check_finite(values: Tensor, what: str) -> None:
    """Refuse records holding NaN or ±∞: the engine drops a non-finite record's gradient (so one bad record
    cannot break the step), which would train silently on whatever is left, pure noise for all-NaN data."""
    if not values.is_floating_point() or values.numel() == 0:
        return
    rows = values.reshape(values.shape[0], -1) if values.dim() else values.reshape(1, 1)
    for start in range(0, rows.shape[0], FINITE_CHECK_ROWS):
        finite = torch.isfinite(rows[start:start + FINITE_CHECK_ROWS]).all(dim=1)
        if not bool(finite.all()):
            first = start + int((~finite).nonzero()[0])
            raise DpltmUserError(f"{what} hold NaN or infinite values (the first in record {first}): clean or impute "
                                 "them first")


def delta_or_target_delta(delta: Any, target_delta: Any = None) -> float:
    """δ in (0, 1), 1e-5 if neither is given; `target_delta` is Opacus's name for the same thing (give one, or the
    same value)."""
    if target_delta is not None:
        target_delta = check_delta(target_delta)
        if delta is not None and check_delta(delta) != target_delta:
            raise DpltmUserError(f"delta={delta!r} and target_delta={target_delta!r} disagree: give one of them")
        delta = target_delta
    return check_delta(1e-5 if delta is None else delta)


def check_budget(target_epsilon: Any, noise_multiplier: Any) -> tuple[float | None, float | None]:
    """Exactly one of target_epsilon (σ is calibrated) and noise_multiplier (ε is reported)."""
    if (target_epsilon is None) == (noise_multiplier is None):
        raise DpltmUserError("give target_epsilon (σ is calibrated) or noise_multiplier (ε is reported), not both")
    if target_epsilon is not None:
        from dpltm.privacy.accounting import MAX_EPSILON

        eps = check_positive(target_epsilon, "target_epsilon")
        if eps > MAX_EPSILON:
            raise DpltmUserError(f"target_epsilon must be at most {MAX_EPSILON:g} (beyond it DP-SGD protects "
                                 f"nothing meaningful), got {eps:g}")
        return eps, None
    sigma = check_positive(noise_multiplier, "noise_multiplier")
    if sigma < MIN_NOISE_MULTIPLIER:
        raise DpltmUserError(f"noise_multiplier must be at least {MIN_NOISE_MULTIPLIER:g} (less gives no meaningful "
                             f"privacy), got {sigma:g}")
    if sigma > MAX_NOISE_MULTIPLIER:
        raise DpltmUserError(f"noise_multiplier must be at most {MAX_NOISE_MULTIPLIER:g} (the accountants cannot "
                             f"state the tiny ε of more noise), got {sigma:g}")
    return None, sigma


def check_batch_size(batch_size: Any, dataset_size: int) -> int:
    """Expected batch size L with 0 < L < N (q = L/N < 1: Poisson sampling must leave records out)."""
    L_ = check_count(batch_size, "batch_size")
    if L_ >= dataset_size:
        raise DpltmUserError(f"batch_size ({L_}) must be smaller than the number of training records ({dataset_size})")
    return L_


DEFAULT_BATCH_SIZE = 256


def check_epochs(epochs: Any, target_epsilon: float | None) -> int:
    """`epochs`, required with `target_epsilon`: σ is calibrated for the planned steps, so a silent default would
    calibrate it for a run other than the one the user has in mind. With a noise multiplier, 1 by default."""
    if epochs is None:
        if target_epsilon is not None:
            raise DpltmUserError("target_epsilon needs epochs=...: σ is calibrated so that exactly the planned epochs "
                                 "spend the budget")
        return 1
    return check_count(epochs, "epochs")


def expected_batch_size(train: Any, batch_size: Any) -> Any:
    """The expected Poisson batch size L: `batch_size`, else a DataLoader's own batch size (as Opacus takes it),
    else 256. A loader whose batch size disagrees with `batch_size` is refused, never silently overridden."""
    from torch.utils.data import DataLoader

    loader_size = train.batch_size if isinstance(train, DataLoader) else None
    if batch_size is None:
        return loader_size if loader_size is not None else DEFAULT_BATCH_SIZE
    if loader_size is not None and batch_size != loader_size:
        raise DpltmUserError(f"the DataLoader's batch_size is {loader_size} and batch_size={_shown(batch_size)}: dpltm "
                             "replaces the loader's batching by Poisson batches of expected size batch_size, so give "
                             "one of the two (or the same value)")
    return batch_size


def check_steps(epochs: int, batch_size: int, dataset_size: int) -> None:
    steps = epochs * math.ceil(dataset_size / batch_size)
    if steps > MAX_STEPS:
        raise DpltmUserError(f"epochs={epochs} at batch_size={batch_size} is {steps} steps; dpltm accounts for at "
                             f"most {MAX_STEPS}")


FULL_PRECISION = (torch.float32, torch.float64)


def check_model_and_optimizer(model: Any, optimizer: Any) -> None:
    """An nn.Module with full-precision trainable parameters, and an optimiser over exactly them (noise that reaches
    no parameter, or a parameter updated from its non-private gradient, would both be wrong; a half-precision
    clipped norm can exceed C by rounding: the sensitivity the accountant assumes would not hold)."""
    if not isinstance(model, nn.Module):
        raise DpltmUserError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise DpltmUserError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    check_not_meta(model)
    check_single_evaluation(optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    optimised = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = sum(1 for p in optimised if id(p) not in names)
    if foreign:
        raise DpltmUserError(f"optimizer holds {foreign} parameter(s) that are not the model's: build it from "
                             "model.parameters()")
    check_full_precision(model)
    missing = sorted(set(n for n, p in model.named_parameters() if p.requires_grad) - {names[id(p)] for p in optimised})
    if missing:
        raise DpltmUserError(f"optimizer does not update the model's trainable parameter(s) {missing[:5]}"
                             + (" …" if len(missing) > 5 else ""))


def check_full_precision(model: nn.Module) -> None:
    """Trainable parameters in float32 or float64: in half precision a clipped gradient's norm can exceed C by
    rounding (up to 8e-3 relative in bfloat16, dpltm.dp.ghost.clip_factors), a sensitivity no accountant sees."""
    for name, parameter in model.named_parameters():
        if parameter.requires_grad and parameter.dtype not in FULL_PRECISION:
            raise DpltmUserError(f"trainable parameter {name!r} is {str(parameter.dtype).removeprefix('torch.')}: DP "
                                 "training needs float32 or float64 parameters (in half precision a clipped gradient's "
                                 "norm can exceed the clip norm by rounding, up to 8e-3 relative in bfloat16, which no "
                                 "accountant sees); call model.float() first")


def check_single_evaluation(optimizer: torch.optim.Optimizer) -> None:
    """Refuse optimisers whose step evaluates the closure more than once (LBFGS): each evaluation would be
    another noisy gradient of the same batch, which one Poisson step does not account for."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise DpltmUserError("LBFGS evaluates the loss several times per step on the same batch; DP-SGD's "
                             "accounting covers one noisy gradient per Poisson batch: use SGD, Adam or AdamW")


def first_parameter(model: Any) -> nn.Parameter:
    """The model's first parameter (its device and dtype), or a one-line refusal of a non-module or an empty one."""
    if not isinstance(model, nn.Module):
        raise DpltmUserError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    parameter = next(model.parameters(), None)
    if parameter is None:
        raise DpltmUserError("the model has no parameters")
    check_not_meta(model)
    return parameter


def check_not_meta(model: nn.Module) -> None:
    """Parameters on the meta device hold no values (a model built for its shapes only): nothing can train."""
    if any(p.device.type == "meta" for p in model.parameters()):
        raise DpltmUserError("the model's parameters are on the meta device (shapes without values): "
                             "materialise them first (model.to_empty(device=…) and initialise, or load weights)")


@contextmanager
def evaluation_mode(model: nn.Module) -> Iterator[None]:
    """The model in eval mode, then every module back in *its own* mode (`model.train(was)` would put a backbone the
    user froze in eval mode, batch norm included, back in training mode: its running statistics would then follow
    the private batches)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def check_data_fits_model(model: nn.Module, features: Tensor, labels: Tensor, classification: bool,
                          what: str = "the training data") -> int | None:
    """One forward pass on the first record (no gradient, nothing kept or released): the features' shape
    must suit the model, class labels must name one of its outputs, and token ids its one embedding's rows.
    Returns the model's number of classes (None: not `classification`)."""
    if features.shape[0] == 0:
        raise DpltmUserError(f"{what} is empty")
    check_token_ids(model, features, what)
    try:
        with torch.no_grad(), evaluation_mode(model):
            outputs = model(features[:1])
    except Exception as exc:  # the model's own error: shape, dtype, device
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise DpltmUserError(f"the model does not accept the features (one record of shape "
                             f"{tuple(features.shape[1:])}): {first}") from None
    if not isinstance(outputs, Tensor):
        raise DpltmUserError(f"the model must return a tensor, got {type(outputs).__name__}")
    if not classification:
        return None
    if outputs.dim() != 2:
        raise DpltmUserError(f"class labels need outputs of shape (batch, classes), got {tuple(outputs.shape)}")
    check_class_labels(labels, outputs.shape[1], what)
    return outputs.shape[1]


def check_class_labels(labels: Tensor, classes: int, what: str) -> None:
    """Class labels: integers of shape (N,), each naming one of the model's `classes` outputs."""
    if labels.is_floating_point():
        raise DpltmUserError("class labels must be integers (got floating-point labels); for soft labels or "
                             "regression pass your own per-sample loss")
    if labels.dim() != 1:
        raise DpltmUserError(f"class labels must have shape (N,), got {tuple(labels.shape)}")
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= classes:
        raise DpltmUserError(f"labels must lie in [0, {classes - 1}] (the model has {classes} outputs), found "
                             f"labels in [{low}, {high}] in {what}")


def check_token_ids(model: nn.Module, features: Tensor, what: str) -> None:
    """Integer features of a model with exactly one embedding are its token ids: every one must name a row of it
    (a later record's id past the table failed mid-run, with an IndexError, after steps were spent)."""
    if features.is_floating_point() or features.is_complex() or features.numel() == 0:
        return
    tables = [m for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    if len(tables) != 1:
        return  # which table reads the ids is the model's business
    rows = tables[0].num_embeddings
    low, high = int(features.min()), int(features.max())
    if low < 0 or high >= rows:
        raise DpltmUserError(f"{what} holds token ids in [{low}, {high}], but the model's embedding has {rows} rows "
                             f"(ids 0 to {rows - 1})")


def check_mask_values(masks: Any) -> Mapping[str, Any]:
    if masks is None:
        return {}
    if not isinstance(masks, Mapping):
        raise DpltmUserError(f"masks must be a mapping of weight names to 0/1 tensors, got {type(masks).__name__}")
    return masks


@dataclass(frozen=True)
class PrivacyOptions:
    """The arguments `make_private` and `DPCallback` share, checked: the budget (exactly one of ε and σ), δ, the
    accountant and neighbouring relation, the ticket's masks and what is known of them, the noise seed (never
    stored) and the physical batch bound."""

    target_epsilon: float | None
    noise_multiplier: float | None
    delta: float
    accountant: str
    neighboring: str
    masks: Mapping[str, Any]
    masks_private: bool
    selection_eps1: float | None
    noise_seed: int | None
    max_physical_batch_size: int | None

    @classmethod
    def checked(cls, *, target_epsilon: Any, noise_multiplier: Any, delta: Any, target_delta: Any, accountant: Any,
                neighboring: Any, masks: Any, masks_from: Any, masks_private: Any, selection_eps1: Any,
                noise_seed: Any, max_physical_batch_size: Any, where_from: str) -> PrivacyOptions:
        """Each argument checked before any record is read. `where_from`: how the refusal of masks without a
        `masks_from` tells the caller to say where they came from."""
        target_epsilon, noise_multiplier = check_budget(target_epsilon, noise_multiplier)
        delta = delta_or_target_delta(delta, target_delta)
        if max_physical_batch_size is not None:
            max_physical_batch_size = check_count(max_physical_batch_size, "max_physical_batch_size")
        accountant, neighboring = check_accountant(accountant), check_neighboring(neighboring)
        accountant_entry(accountant).check_delta(delta, "delta")
        masks = check_mask_values(masks)
        if noise_seed is not None:
            noise_seed = check_seed(noise_seed, "noise_seed")
        check_flag(masks_private, "masks_private")
        if selection_eps1 is not None and not masks:
            raise DpltmUserError("selection_eps1 is the ε1 of choosing a ticket: pass the ticket's masks too")
        if selection_eps1 is not None:
            check_positive(selection_eps1, "selection_eps1")
        if masks and (masks_from is None or (isinstance(masks_from, str) and not masks_from.strip())):
            raise DpltmUserError(f"say where the masks come from ({where_from}): tickets made on the private records "
                                 "are not differentially private")
        return cls(target_epsilon, noise_multiplier, delta, accountant, neighboring, masks, bool(masks_private),
                   selection_eps1, noise_seed, max_physical_batch_size)

    def train_settings(self, *, epochs: int, batch_size: int, clip: float, noise_filter: str = "none") -> TrainSettings:
        """The run's settings as the planner takes them: these options' budget, δ, accountant and relation."""
        return TrainSettings(epochs=epochs, batch_size=batch_size, clip=clip, eps2=self.target_epsilon,
                             sigma=self.noise_multiplier, delta=self.delta, accountant=self.accountant,
                             neighboring=self.neighboring, noise_filter=noise_filter)


@dataclass(frozen=True)
class Provenance:
    """What a run's stated ε rests on besides its spent segments, which a resume must keep: masks from these private
    records (then not DP end to end), the ε1 of choosing the ticket, the neighbouring relation."""

    masks_private: bool
    selection_eps1: float | None
    neighboring: str

    def differences(self, given: Provenance) -> str:
        """Each field stored (`self`) other than `given`, as `name=stored (given value)`; "" when none."""
        return ", ".join(f"{f.name}={getattr(self, f.name)!r} (given {getattr(given, f.name)!r})"
                         for f in fields(self) if getattr(self, f.name) != getattr(given, f.name))


def warn_if_delta_above_one_over_n(delta: float, n: int, stacklevel: int) -> None:
    """δ > 1/N allows releasing a record outright: allowed, and warned (`stacklevel` from the caller's caller)."""
    if delta > 1.0 / n:
        warnings.warn(f"delta={delta:g} is above 1/N = {1.0 / n:.3g}: a (ε, δ) guarantee with δ > 1/N allows "
                      "releasing a record outright; the usual choice is δ ≪ 1/N", stacklevel=stacklevel + 1)



MIN_BUDGET_LEFT = 0.01
"""A new segment needs at least this fraction of target_epsilon left: less still gives a sound
bound, but at a σ so large (hundreds) that the steps only add noise."""


def check_budget_left(spent: list[Any], target_epsilon: float | None, delta: float, accountant: str,
                      neighboring: str, selection_eps1: float | None = None) -> None:
    """Refuse a new fit when the segments already spent, and any ε1 of choosing the ticket, leave (almost) nothing
    of target_epsilon: ε of what ran as the ledger states it (the best of its composition bounds)."""
    if target_epsilon is None or not spent:
        return
    import dp_accounting  # type: ignore[import-untyped]

    from dpltm.privacy.accounting import best_bound, composition_bounds

    used = best_bound(composition_bounds(selection_eps1, dp_accounting.ComposedDpEvent(list(spent)), delta,
                                         accountant, neighboring)).epsilon
    if used >= (1.0 - MIN_BUDGET_LEFT) * target_epsilon:
        spent_by = "the steps already taken" + (" and the ticket's selection" if selection_eps1 else "")
        raise DpltmUserError(f"cannot reach epsilon {target_epsilon:g} with more training: {spent_by} spent epsilon "
                             f"{format_epsilon(used, 6)} of it; raise target_epsilon to train on")
