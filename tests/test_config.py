"""Every shipped config loads, and defaults.yaml agrees with the dataclass defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpltm.config import (
    CONFIG_DIR,
    GenerateConfig,
    from_dict,
    read_yaml,
    resolve_generate_config,
    to_dict,
)
from dpltm.errors import DpltmUserError


def test_defaults_yaml_matches_dataclass_defaults() -> None:
    tree = read_yaml(CONFIG_DIR / "defaults.yaml")
    from_yaml = from_dict(GenerateConfig, {k: tree[k] for k in ("data", "model", "generate", "seed")})
    assert to_dict(from_yaml) == to_dict(GenerateConfig())


@pytest.mark.parametrize("path", sorted((CONFIG_DIR / "datasets").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_dataset_config_resolves(path: Path) -> None:
    cfg = resolve_generate_config({"data": {"dataset": path.stem}}, None)
    assert cfg.data.dataset == path.stem


def test_precedence_defaults_dataset_file_cli(tmp_path: Path) -> None:
    user = tmp_path / "u.yaml"
    user.write_text("generate: {iterations: 77, lr: 0.05}\nseed: 3\n")
    cfg = resolve_generate_config({"data": {"dataset": "digits"}, "generate": {"lr": 0.2}}, user)
    assert cfg.generate.batch_size == 100  # configs/datasets/digits.yaml
    assert cfg.generate.iterations == 77  # --config beats the dataset file
    assert cfg.generate.lr == 0.2  # CLI beats --config
    assert cfg.seed == 3


def test_bad_values_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(DpltmUserError, match="min-density"):
        resolve_generate_config({"generate": {"min_density": 1.5}}, None)
    with pytest.raises(DpltmUserError, match="not a valid int"):
        resolve_generate_config({"generate": {"rounds": "many"}}, None)


@pytest.mark.parametrize("path", sorted((CONFIG_DIR / "experiments").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_experiment_profile_is_complete(path: Path) -> None:
    """The reproduction's profiles name only known methods and build valid settings."""
    from dpltm.config import GenerateSettings, TrainSettings
    from dpltm.data import DATASETS

    spec = read_yaml(path)
    assert set(spec["methods"]) <= {"dpltm-same", "dpltm-public", "dpsgd", "nonprivate"}
    assert all(entry["name"] in DATASETS for entry in spec["datasets"])
    assert all(0 < e for e in spec["epsilons"]) and 0 < spec["selection_fraction"] < 1
    GenerateSettings(**spec["generate"])
    TrainSettings(**spec["train"])
