"""The layer-rule benchmark times every case in every column, and puts each layer's rule back afterwards."""

from __future__ import annotations

import re

import pytest
import torch
from bench_layer_rules import CASES, main

from dpltm.dp import conv_ghost
from dpltm.dp.rules import RULES, embedding


def test_each_case_reports_the_rule_and_the_fallback(capsys: pytest.CaptureFixture[str]) -> None:
    rules, choosers = dict(RULES), (conv_ghost.use_grams, embedding.use_gram)
    threads = torch.get_num_threads()
    try:
        main(["--batch-size", "2", "--repeats", "1"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    for case in CASES:
        row = re.search(rf"^{re.escape(case.name)}\s+([0-9.]+)\s+([0-9.]+|—)\s+([0-9.]+)\s+([0-9.]+)$", out,
                        re.MULTILINE)
        assert row is not None, out
        assert (row.group(2) == "—") == (case.other_form is None)
    assert RULES == rules and (conv_ghost.use_grams, embedding.use_gram) == choosers
