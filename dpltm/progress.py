"""The progress bar of every long phase, without Lightning: the noise-aware choice, feature extraction and
the checks that plan a run import no Lightning (`RoundProgressBar`, in dpltm.training.plain, draws the
same bar inside a Lightning fit)."""

from __future__ import annotations

import sys
from typing import TypeVar

from tqdm import tqdm

Bar = TypeVar("Bar", bound=tqdm)

BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_noinv_fmt}{postfix}]"
"""Lightning's `TQDMProgressBar.BAR_FORMAT`: count, elapsed, ETA, rate."""


def step_bar(label: str, total: int | None = None, *, enabled: bool = True, position: int = 0,
             bar_class: type[Bar] = tqdm) -> Bar:  # type: ignore[assignment]
    """A bar on **stderr** in Lightning's format (count, elapsed, ETA, rate); `bar_class`: Lightning's own
    tqdm inside a fit."""
    return bar_class(total=total, desc=label, position=position, disable=not enabled, leave=True, dynamic_ncols=True,
                file=sys.stderr, smoothing=0, bar_format=BAR_FORMAT)
