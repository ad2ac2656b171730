"""The DPCallback benchmark runs its three variants end to end (it runs unattended in the GPU check's short lease)."""

from __future__ import annotations

import re

import pytest
from bench_callback import main


def test_each_variant_reports_a_time_and_a_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--batch-size", "16", "--width", "16", "--steps", "3", "--warmup", "2", "--fits", "1"])
    out = capsys.readouterr().out
    times = dict(re.findall(r"^  (Lightning, no DP|Lightning \+ DPCallback|make_private step)\s+([0-9.]+) ms", out,
                            re.MULTILINE))
    assert len(times) == 3 and all(float(ms) > 0 for ms in times.values()), out
    assert re.search(r"DPCallback / make_private step: [0-9.]+x", out)
