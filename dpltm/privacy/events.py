"""What ran, as dp-accounting `DpEvent`s, and their JSON form for checkpoints.

Describing mechanisms as data (dp-accounting's design) lets any accountant re-derive ε
later, including accountants that do not exist yet. The checkpoint stores the event tree
as plain JSON: each event is a dict with its class name under ``"type"`` and its attrs
fields beside it; nested events are nested dicts, lists stay lists.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import attr
import dp_accounting  # type: ignore[import-untyped]
from dp_accounting import dp_event
from dp_accounting.dp_event import DpEvent as DpEvent  # type: ignore[import-untyped]

from dpltm.errors import DpltmUserError
from dpltm.privacy.exponential import check_eps1

JsonDict = dict[str, Any]

#: The smallest noise multiplier σ dpltm accounts for. Below it DP-SGD gives no meaningful
#: privacy (ε in the hundreds within a few full-batch steps: ε ≈ 60 after 5 steps at q = 1,
#: σ = 0.3), and the PLD accountant's cost grows as 1/σ² (its support spans the privacy-loss
#: range at a 1e-4 grid): at σ = 1e-9 it asks for more memory than exists.
MIN_NOISE_MULTIPLIER = 0.3

#: The largest noise multiplier accepted. σ = 10⁴ already drowns any clipped gradient (ε ≈ 0.008 for
#: 1000 full-batch steps); beyond it dp-accounting's ε underflows to 0, below the true (tiny) ε, and
#: at 1e300 its PLD fails outright.
MAX_NOISE_MULTIPLIER = 1e4

#: The most DP-SGD steps dpltm accounts for. The paper's runs take 7 500 (50 epochs of batch
#: 400 on 60 000 records); 10⁶ is a thousand epochs at batch 64. Bounds what the accountants
#: are asked: PLD's self-composition slows with T (at T = 10⁷ one evaluation can take 40 s,
#: at 10⁶ about a second), and T = 10¹² would ask for terabytes.
MAX_STEPS = 10**6

#: Every concrete event class dp-accounting 0.6.0 defines, by class name. Deserialisation
#: only ever instantiates these: a checkpoint cannot make us import or call anything else.
EVENT_TYPES: dict[str, type] = {
    name: obj
    for name, obj in vars(dp_event).items()
    if isinstance(obj, type) and issubclass(obj, dp_event.DpEvent) and obj is not dp_event.DpEvent
}


def dpsgd_event(sample_rate: float, noise_multiplier: float, steps: int) -> DpEvent:
    """DP-SGD as run in phase 3: T steps of the Poisson-subsampled Gaussian mechanism.

    `SelfComposed(PoissonSampled(q, Gaussian(σ)), T)` (docs/privacy.md §3): each record joins a
    batch independently with probability q, the clipped sum gets N(0, σ²C²) noise. This is
    the event the PLD and RDP accountants analyse exactly (Mironov, Talwar & Zhang 2019;
    Koskela et al. 2020), which is why sampling must really be Poisson.
    """
    q = float(sample_rate)
    if not (0.0 < q <= 1.0):
        raise DpltmUserError(f"sample rate q must lie in (0, 1], got {sample_rate}")
    sigma = float(noise_multiplier)
    if not (math.isfinite(sigma) and sigma > 0.0):
        raise DpltmUserError(
            f"noise multiplier must be positive and finite, got {noise_multiplier}"
            " (record non-private training as NonPrivateDpEvent instead)"
        )
    if sigma < MIN_NOISE_MULTIPLIER:
        raise DpltmUserError(
            f"noise multiplier σ = {sigma:g} is below {MIN_NOISE_MULTIPLIER:g}: no meaningful privacy, and "
            f"too costly to account"
        )
    check_steps(steps)
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), int(steps)
    )


def check_steps(steps: int) -> int:
    """`steps` as an int in [1, MAX_STEPS], or a DpltmUserError."""
    if isinstance(steps, bool) or not isinstance(steps, numbers.Real) or not math.isfinite(steps) \
            or int(steps) != steps or int(steps) < 1:
        raise DpltmUserError(f"steps must be a positive integer, got {steps}")
    if int(steps) > MAX_STEPS:
        raise DpltmUserError(f"steps must be at most {MAX_STEPS:.0e}, got {int(steps)}")
    return int(steps)


def selection_event(eps1: float) -> DpEvent:
    """The ε1-DP exponential mechanism of phase 2, as `ZCDpEvent(ε1²/8)`.

    Why: with utility scaled by ε1/(2Δ) the exponential mechanism is ε1-bounded-range
    (Durfee & Rogers 2019), and an ε-bounded-range mechanism is ε²/8-zCDP (Cesar & Rogers
    2021, "Bounding, Concentrating, and Truncating"), i.e.
    (α, α·ε1²/8)-RDP for all α. dp-accounting 0.6.0 has no exponential-mechanism event
    (docs/privacy.md §2); the RDP accountant composes this one with DP-SGD, the PLD accountant
    rejects it. The pure ε1-DP fact is used separately for basic
    composition (see `accounting.composition_bounds`).
    """
    e = check_eps1(eps1)
    return dp_accounting.ZCDpEvent(rho=e * e / 8.0)


# ---- JSON ---------------------------------------------------------------------------------


def _value_to_json(value: Any) -> Any:
    if isinstance(value, dp_event.DpEvent):
        return event_to_json(value)
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float | str) or value is None:
        return value
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return value.item()
    if isinstance(value, list | tuple):
        return [_value_to_json(v) for v in value]
    raise DpltmUserError(f"cannot store {type(value).__name__} value {value!r} in a DpEvent record")


def event_to_json(event: DpEvent) -> JsonDict:
    """A plain-JSON dict for `event`: ``{"type": "<ClassName>", <field>: <value>, ...}``.

    Uses the attrs fields that dp-accounting's own `DpEvent.to_named_tuple` uses, but
    writes nested events as nested dicts so the result is `json.dumps`-able as is.
    """
    cls = type(event)
    if EVENT_TYPES.get(cls.__name__) is not cls:
        raise DpltmUserError(f"not a dp-accounting DpEvent: {event!r}")
    out: JsonDict = {"type": cls.__name__}
    for field in attr.fields(cls):
        out[field.name] = _value_to_json(getattr(event, field.name))
    return out


def _value_from_json(value: Any) -> Any:
    if isinstance(value, Mapping):
        return event_from_json(value)
    if isinstance(value, list):
        return [_value_from_json(v) for v in value]
    return value


def event_from_json(data: Mapping[str, Any]) -> DpEvent:
    """The `DpEvent` that `event_to_json` wrote; sequences come back as lists.

    Only classes of `dp_accounting.dp_event` can be named; unknown types, missing or
    extra fields raise DpltmUserError (a corrupt or foreign privacy record).
    """
    if not isinstance(data, Mapping) or "type" not in data:
        raise DpltmUserError(f"a DpEvent record must be a dict with a 'type' key, got {data!r}")
    name = data["type"]
    cls = EVENT_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise DpltmUserError(f"unknown DpEvent type {name!r} in privacy record")
    names = [f.name for f in attr.fields(cls)]
    required = {f.name for f in attr.fields(cls) if f.default is attr.NOTHING}
    given = set(data) - {"type"}
    if not required <= given or not given <= set(names):
        raise DpltmUserError(
            f"{name} record has fields {sorted(given)}, expected {sorted(names)}"
        )
    kwargs = {key: _value_from_json(data[key]) for key in names if key in data}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise DpltmUserError(f"invalid {name} record: {exc}") from None
