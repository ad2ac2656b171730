"""train.eps2 and train.sigma are one setting given two ways: a later layer's choice replaces the other."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpltm.config import layered_config
from dpltm.errors import DpltmUserError


def test_a_flag_eps_replaces_a_files_sigma_and_a_files_sigma_replaces_the_default_eps(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  sigma: 0.5\n")
    from_file = layered_config({}, config, ("train",))["train"]
    assert from_file["sigma"] == 0.5 and "eps2" not in from_file  # the default eps2 does not stay beside it
    flagged = layered_config({"train": {"eps2": 0.1, "sigma": None}}, config, ("train",))["train"]
    assert flagged["eps2"] == 0.1 and "sigma" not in flagged
    by_sigma_flag = layered_config({"train": {"sigma": 2.0}}, None, ("train",))["train"]
    assert by_sigma_flag["sigma"] == 2.0 and "eps2" not in by_sigma_flag


def test_a_file_giving_both_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  sigma: 0.5\n  eps2: 1.0\n")
    with pytest.raises(DpltmUserError, match="^the settings give both train.eps2 and train.sigma"):
        layered_config({}, config, ("train",))
