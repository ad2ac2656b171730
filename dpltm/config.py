"""One configuration path: YAML defaults → dataset YAML → --config file → CLI flags.

Settings are frozen dataclasses; a resolved config round-trips to a plain dict (stored in
every checkpoint) and its hash names what a run produced, so a resumed run can check it is
continuing the same experiment.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from dpltm.errors import DpltmUserError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def _require_positive(option: str, value: float | None) -> None:
    """One-line user error unless `value` (when given) is > 0 (NaN fails too)."""
    if value is not None and not value > 0:
        raise DpltmUserError(f"{option} must be positive, got {value}")


@dataclass(frozen=True)
class DataSettings:
    dataset: str = "kmnist"
    split: str = "train"
    val_fraction: float = 0.1


@dataclass(frozen=True)
class ModelSettings:
    hidden: tuple[int, ...] = (300, 100)
    project_to: int | None = None


@dataclass(frozen=True)
class GenerateSettings:
    """Phase 1 (paper §4.2): 5000 iterations per ticket, batch 400, SGD at lr 0.1."""

    rounds: int = 10
    iterations: int = 5000
    batch_size: int = 400
    lr: float = 0.1
    prune_rates: tuple[float, ...] | None = None  # None: 0.3 per layer, 0.2 for the output
    min_density: float = 0.01
    controls: bool = False
    log_every: int = 100

    def __post_init__(self) -> None:
        if self.rounds < 0:
            raise DpltmUserError(f"--rounds must be ≥ 0, got {self.rounds}")
        _require_positive("--iterations", self.iterations)
        _require_positive("--batch-size", self.batch_size)
        _require_positive("--lr", self.lr)
        if not 0.0 <= self.min_density < 1.0:
            raise DpltmUserError(f"--min-density must lie in [0, 1), got {self.min_density}")
        _require_positive("log_every", self.log_every)
        for rate in self.prune_rates or ():
            if not 0.0 < rate < 1.0:
                raise DpltmUserError(f"prune rates must lie in (0, 1), got {rate}")


@dataclass(frozen=True)
class GenerateConfig:
    data: DataSettings = field(default_factory=DataSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    generate: GenerateSettings = field(default_factory=GenerateSettings)
    seed: int = 0


T = TypeVar("T")


def to_dict(settings: Any) -> dict[str, Any]:
    """Plain, JSON-able dict (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(settings)))


def config_hash(settings: Any) -> str:
    blob = json.dumps(to_dict(settings), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def from_dict(cls: type[T], data: Mapping[str, Any], where: str = "") -> T:
    """Build a (nested) frozen dataclass, refusing unknown keys and coercing simple types."""
    if not isinstance(data, Mapping):
        raise DpltmUserError(f"config section '{where or cls.__name__}' must be a mapping")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise DpltmUserError(f"unknown config key(s) {unknown} in '{where or 'top level'}'")
    kwargs = {k: _coerce(hints[k], v, f"{where}.{k}".strip(".")) for k, v in data.items()}
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value or {}, where)  # type: ignore[arg-type]
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(args[0], value, where)
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.replace(",", " ").split() if v]
        if not isinstance(value, (list, tuple)):
            value = [value]
        inner = typing.get_args(tp)[0]
        return tuple(_coerce(inner, v, where) for v in value)
    try:
        if tp is bool:
            if isinstance(value, str):
                return value.lower() in ("1", "true", "yes", "on")
            return bool(value)
        if tp is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if tp is float:
            return float(value)
        if tp is str:
            return str(value)
    except (TypeError, ValueError):
        raise DpltmUserError(f"config value {where}={value!r} is not a valid {tp.__name__}") from None
    return value


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise DpltmUserError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise DpltmUserError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise DpltmUserError(f"config file {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise DpltmUserError(f"config file {path} must hold a mapping at the top level")
    return data


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def drop_none(tree: Mapping[str, Any]) -> dict[str, Any]:
    """CLI flags left at None were not given: they must not override anything."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            inner = drop_none(value)
            if inner:
                out[key] = inner
        elif value is not None:
            out[key] = value
    return out


def layered_config(cli: Mapping[str, Any], config_file: Path | None,
                   sections: tuple[str, ...]) -> dict[str, Any]:
    """Merge the layers; keeps only `sections` (plus top-level scalars) of each YAML file."""
    def pick(tree: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in tree.items() if k in sections or not isinstance(v, Mapping)}

    defaults = read_yaml(CONFIG_DIR / "defaults.yaml") if (CONFIG_DIR / "defaults.yaml").exists() else {}
    user = read_yaml(config_file) if config_file is not None else {}
    cli_tree = drop_none(cli)
    merged = deep_merge(deep_merge(pick(defaults), pick(user)), cli_tree)
    dataset = merged.get("data", {}).get("dataset")
    dataset_file = CONFIG_DIR / "datasets" / f"{dataset}.yaml"
    if dataset and dataset_file.exists():
        layers = [pick(defaults), pick(read_yaml(dataset_file)), pick(user), cli_tree]
        merged = {}
        for layer in layers:
            merged = deep_merge(merged, layer)
    return merged


def resolve_generate_config(cli: Mapping[str, Any], config_file: Path | None) -> GenerateConfig:
    tree = layered_config(cli, config_file, ("data", "model", "generate"))
    tree = {k: v for k, v in tree.items() if k in ("data", "model", "generate", "seed")}
    return from_dict(GenerateConfig, tree)


@dataclass(frozen=True)
class SelectSettings:
    """Phase 2 (paper §4.2): ε1 = 10 % of the budget, ν = 50."""

    eps1: float = 0.1
    nu: float = 50.0

    def __post_init__(self) -> None:
        _require_positive("--eps1", self.eps1)
        if not self.nu >= 0:
            raise DpltmUserError(f"--nu must be ≥ 0, got {self.nu}")


OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True)
class TrainSettings:
    """Phase 3 (paper §4.2): 50 epochs, expected batch 400, clip 1, lr 0.1, δ = 1e-5."""

    epochs: int = 50
    batch_size: int = 400
    clip: float = 1.0
    lr: float = 0.1
    optimizer: str = "sgd"
    noise: str = "gaussian"
    eps2: float | None = 0.9
    sigma: float | None = None
    delta: float = 1e-5
    accountant: str = "pld"
    neighboring: str = "add_remove"
    target_eps: float | None = None
    patience: int | None = None

    def __post_init__(self) -> None:
        _require_positive("--epochs", self.epochs)
        _require_positive("--batch-size", self.batch_size)
        _require_positive("--clip", self.clip)
        _require_positive("--lr", self.lr)
        if self.optimizer not in OPTIMIZERS:
            raise DpltmUserError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer}")
        _require_positive("--eps2", self.eps2)
        _require_positive("--sigma", self.sigma)
        if not 0 < self.delta < 1:
            raise DpltmUserError(f"--delta must lie in (0, 1), got {self.delta}")
        _require_positive("--target-eps", self.target_eps)
        _require_positive("--patience", self.patience)
        if self.accountant not in ("pld", "rdp"):
            raise DpltmUserError(f"--accountant must be pld or rdp, got {self.accountant}")
        if self.neighboring not in ("add_remove", "replace_one"):
            raise DpltmUserError(f"neighboring must be add_remove or replace_one, got {self.neighboring}")


@dataclass(frozen=True)
class TrainConfig:
    data: DataSettings = field(default_factory=lambda: DataSettings(dataset="mnist"))
    train: TrainSettings = field(default_factory=TrainSettings)
    seed: int = 0


def resolve_select_config(cli: Mapping[str, Any], config_file: Path | None) -> SelectSettings:
    tree = layered_config(cli, config_file, ("select",))
    return from_dict(SelectSettings, tree.get("select", {}), "select")


def resolve_train_config(cli: Mapping[str, Any], config_file: Path | None) -> TrainConfig:
    """Training reads `data:` and `train:`. Its dataset is the private one: --dataset, else the
    --config file's `data.dataset`, else MNIST (defaults.yaml's dataset is for generation)."""
    user = read_yaml(config_file) if config_file is not None else {}
    user_data = user.get("data") if isinstance(user.get("data"), Mapping) else {}
    dataset = cli.get("data", {}).get("dataset") or user_data.get("dataset") or "mnist"
    cli = {**cli, "data": {**cli.get("data", {}), "dataset": dataset}}
    tree = layered_config(cli, config_file, ("data", "train"))
    return from_dict(TrainConfig, {k: tree[k] for k in ("data", "train", "seed") if k in tree})
