"""Opacus's names in dpltm's API: each either works or is refused in one line that says what to use instead.

An Opacus script ported to dpltm should never meet a bare TypeError. `make_private` takes Opacus's keyword
names for its three inputs (`module`, `optimizer`, `data_loader`), accepts Opacus's arguments whose value
means what dpltm does anyway (Poisson sampling, batch-first inputs), and refuses the rest naming dpltm's way;
`make_private_with_epsilon` is `make_private` with the budget required. docs/api.md has the table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dpltm.errors import DpltmUserError

INPUT_NAMES = {"module": "model", "data_loader": "train"}
"""Opacus's keyword names of make_private's inputs → dpltm's."""

ACCEPTED = {"poisson_sampling": True, "batch_first": True, "secure_mode": False}
"""Opacus arguments taken when their value is what dpltm does anyway."""

INSTEAD = {
    "poisson_sampling": "dpltm always samples Poisson batches (the subsampled Gaussian's accounting assumes them)",
    "batch_first": "dpltm takes the record dimension first: permute the inputs in the model",
    "secure_mode": "dpltm seeds its noise from the OS CSPRNG (secrets) but draws it with torch's generator, which "
                   "is not cryptographically secure and not hardened against floating-point attacks (Mironov 2012); "
                   "drop secure_mode",
    "noise_generator": "pass noise_seed=<int> to reproduce a run (DP then holds only while the seed stays secret); "
                       "by default the noise is seeded from OS randomness",
    "grad_sample_mode": "dpltm chooses each layer's per-sample rule itself (ghost norms where they pay): drop it",
    "loss_reduction": "make_private takes a per-record loss (loss=..., reduction='none'); loss_reduction belongs "
                      "to dpltm.DPCallback",
    "normalize_clipping": "dpltm divides the clipped sum by the expected batch size: drop normalize_clipping",
    "total_steps": "give epochs= (the steps are epochs × the expected steps per epoch)",
}
"""What to use instead of each Opacus argument dpltm does not take."""


class PrivacyEngine:
    """Opacus's entry point. dpltm has none: `dpltm.make_private` returns the private run itself."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise DpltmUserError("dpltm has no PrivacyEngine: call dpltm.make_private(model, optimizer, train_loader, "
                             "target_epsilon=..., epochs=...) (or noise_multiplier=...): it returns the private run "
                             "(run.fit(), run.step(), run.epsilon, run.get_epsilon(delta)); docs/api.md, 'Coming "
                             "from Opacus'")


def resolve_inputs(model: Any, optimizer: Any, train: Any, extra: dict[str, Any],
                   function: str = "make_private") -> tuple[Any, Any, Any]:
    """make_private's model, optimizer and training data from its arguments or Opacus's keywords for them; every
    other Opacus argument in `extra` taken (its value is dpltm's behaviour) or refused in one line."""
    given = {"model": model, "optimizer": optimizer, "train": train}
    for opacus, ours in INPUT_NAMES.items():
        if opacus in extra:
            if given[ours] is not None:
                raise DpltmUserError(f"{function}: give the {ours} once ({opacus}= is Opacus's name for it)")
            given[ours] = extra.pop(opacus)
    check_opacus_arguments(extra, function)
    missing = [name for name, value in given.items() if value is None]
    if missing:
        raise DpltmUserError(f"{function} needs the {', the '.join(missing)}: {function}(model, optimizer, train, "
                             "...), train being (features, labels), a Dataset or a DataLoader")
    return given["model"], given["optimizer"], given["train"]


def check_opacus_arguments(extra: Mapping[str, Any], function: str) -> None:
    """Refuse any argument `function` does not take: an Opacus one naming dpltm's way, another as unknown."""
    for name, value in extra.items():
        if name in ACCEPTED and _same(value, ACCEPTED[name]):
            continue
        if name in INSTEAD:
            raise DpltmUserError(f"{function}: {name}={value!r} is Opacus's; {INSTEAD[name]}")
        raise DpltmUserError(f"{function} has no argument {name!r} (docs/api.md lists its arguments)")


def _same(value: Any, accepted: Any) -> bool:
    return type(value) is type(accepted) and value == accepted
