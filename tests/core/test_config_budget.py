"""train.eps2 and train.sigma are one setting given two ways: a later layer's choice replaces the other."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpltm.config import layered_config
from dpltm.errors import DpltmUserError
from dpltm.options import Overrides


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


def test_a_files_sigma_replaces_a_private_tickets_planned_eps(tmp_path: Path) -> None:
    """`train --ticket private.pt --config f.yaml` with only `train: {sigma: 2}` in f.yaml: σ = 2, as before."""
    from dpltm.config import resolve_train_config

    config = tmp_path / "f.yaml"
    config.write_text("train:\n  sigma: 2.0\n")
    cfg = resolve_train_config({}, config, base=Overrides({"train.eps2": 0.5}))
    assert cfg.train.sigma == 2.0
    assert resolve_train_config({}, None, base=Overrides({"train.eps2": 0.5})).train.sigma is None
