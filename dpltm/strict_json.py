"""Strict JSON for reports and logs: JSON has no inf/NaN, so they are written as the strings the
privacy report uses ("inf", "-inf", "nan"); anything else unknown (paths) as its text."""

from __future__ import annotations

import json
import math
from typing import Any


def strict(value: Any) -> Any:
    """`value` with every non-finite float replaced by its string, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def dumps(value: Any) -> str:
    """One strict JSON document, indented for people."""
    return json.dumps(strict(value), indent=2, default=str, allow_nan=False)
