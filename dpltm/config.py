"""One configuration path: YAML defaults → dataset YAML → --config file → CLI flags.

Settings are frozen dataclasses; a resolved config round-trips to a plain dict (stored in
every checkpoint) and its hash names what a run produced, so a resumed run can check it is
continuing the same experiment.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources

try:
    from importlib.resources.abc import Traversable
except ImportError:  # Python 3.10
    from importlib.abc import Traversable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from dpltm.errors import DpltmUserError
from dpltm.model import ACTIVATIONS, ARCHS, check_network_size
from dpltm.privacy.accountants import accountant_entry
from dpltm.privacy.accounting import check_target_epsilon
from dpltm.privacy.events import MAX_NOISE_MULTIPLIER, MIN_NOISE_MULTIPLIER
from dpltm.privacy.exponential import check_eps1
from dpltm.strict_yaml import DuplicateKeyError, ExponentFloat, safe_load_strict

CONFIG_DIR: Traversable = resources.files("dpltm.configs")
"""The packaged YAML (defaults, per-dataset, experiment profiles): shipped as package data, so an
installed wheel reads the same settings as a checkout."""


#: The largest learning rate accepted: far beyond any that trains (the paper uses 0.1); larger
#: ones only turn the weights into inf/NaN.
MAX_LR = 1e3

#: The largest --config file read: a config is a few hundred bytes; this refuses /dev/zero.
MAX_CONFIG_BYTES = 1 << 20

#: The most SGD iterations per ticket `generate` runs (paper: 5000); a loss curve is kept per ticket.
MAX_ITERATIONS = 1_000_000
MAX_ROUNDS = 100
MAX_CLIP = 1e6
"""Per-sample gradient norms of the networks dpltm trains are O(1)–O(100); C above this only scales the noise."""
MIN_CLIP = 1e-6
"""The smallest clipping norm C: float32 resolves about 7 digits (and 1e-38 is its smallest normal number), so
clipped gradients of norm C and the noise σ·C at this size would lose all precision beside the O(0.01–1) weights
they update, and far below it they round to 0 or to denormals (C = 1e-300 is 0 in float32): no training at all.
Compared with a relative slack of 1e-6 (`check_clip_range`), so 1e-6 read back from float32 is still 1e-6."""


def check_clip_range(clip: float, name: str) -> None:
    """C within [MIN_CLIP, MAX_CLIP] (`name`: the flag or argument that gave it), the one check of the CLI's
    settings and the API's `max_grad_norm`."""
    if clip > MAX_CLIP:  # the noise σC swamps float32 weights: a run that can only diverge
        raise DpltmUserError(f"{name} must be at most {MAX_CLIP:g} (the noise is σ·C per coordinate), got {clip:g}")
    if clip < MIN_CLIP * (1 - 1e-6):  # the clipped sums and the noise σC vanish in float32: a run that cannot move
        raise DpltmUserError(f"{name} must be at least {MIN_CLIP:g} (below it the clipped gradients and the noise "
                             f"σ·C lose all precision in float32), got {clip:g}")

#: Seeds are non-negative and fit in 63 bits (what torch and numpy generators accept).
MAX_SEED = 2**63 - 1


def _require_positive(option: str, value: float | None) -> None:
    """One-line user error unless `value` (when given) is > 0 (NaN fails too)."""
    if value is not None and not value > 0:
        raise DpltmUserError(f"{option} must be positive, got {value}")


#: Settings whose CLI option is not their field name with dashes.
OPTION_OF_FIELD = {"eps2": "--eps"}


def _require_finite(settings: Any) -> None:
    """One-line user error for any inf/NaN float field (or element of a float tuple)."""
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, float) and not math.isfinite(v):
                option = OPTION_OF_FIELD.get(f.name, f"--{f.name.replace('_', '-')}")
                raise DpltmUserError(f"{option} must be a finite number, got {v}")


def _require_lr(lr: float) -> None:
    if not 0.0 < lr <= MAX_LR:
        raise DpltmUserError(f"--lr must lie in (0, {MAX_LR:g}], got {lr:g}")


def _require_seed(seed: int) -> None:
    if not 0 <= seed <= MAX_SEED:
        raise DpltmUserError(f"--seed must lie in [0, 2**63 - 1], got {seed}")


@dataclass(frozen=True)
class DataSettings:
    dataset: str = "kmnist"
    split: str = "train"
    val_fraction: float = 0.1

    def __post_init__(self) -> None:
        _require_finite(self)
        from dpltm.data.loaders import MAX_VAL_FRACTION  # the loader's own bound, stated once

        if not 0.0 <= self.val_fraction < MAX_VAL_FRACTION:
            raise DpltmUserError(f"--val-fraction must lie in [0, {MAX_VAL_FRACTION:g}), got {self.val_fraction}")


@dataclass(frozen=True)
class ModelSettings:
    """Hidden widths (and an optional input projection); the size limit needs the dataset's input
    width, so `resolve_generate_config` checks it (and `model.Architecture` checks it again).

    `activation` is the hidden layers' (relu, the paper's; or tanh, bounded: Papernot et al. 2021).
    Training uses it for the network it trains, a ticket's included (dpltm.training.transfer)."""

    hidden: tuple[int, ...] = (300, 100)
    project_to: int | None = None
    activation: str = "relu"
    arch: str = "mlp"
    """mlp (the paper's), or lenet5: LeNet-5's two 5×5 convolutions (6 and 16 maps, each followed by the
    activation and 2×2 average pooling) in front of the `hidden` layers (28×28 images only)."""

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise DpltmUserError(f"--arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        if self.arch != "mlp" and self.project_to is not None:
            raise DpltmUserError("--project-to applies to --arch mlp")
        if any(h < 1 for h in self.hidden):
            raise DpltmUserError(f"--hidden takes positive integers, got {list(self.hidden)}")
        _require_positive("--project-to", self.project_to)
        if self.activation not in ACTIVATIONS:
            raise DpltmUserError(f"--activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")


MAX_NU = 1e6
"""The score's density weight ν: beyond this S = A·(1 − ν·C) is −ν·C to every digit a float keeps, so
the accuracy no longer counts; ν up to 1e6 leaves room for any sane sweep."""


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
    rewind_step: int = 0
    """K: every round after the first rewinds to the dense network's weights after K steps of round 0 (and trains
    the remaining iterations − K), not to θ0: IMP with late rewinding (Frankle et al. 2020, "Linear mode
    connectivity and the lottery ticket hypothesis"). 0: θ0 (Frankle & Carbin 2019, the paper's). The ticket
    set keeps that iterate, where `train --rewind K` starts."""

    def __post_init__(self) -> None:
        _require_finite(self)
        if not 0 <= self.rounds <= MAX_ROUNDS:
            raise DpltmUserError(f"--rounds must lie in [0, {MAX_ROUNDS}] (at 20–30 % pruned a round, 100 rounds leave "
                                 f"under 1e-9 of the weights), got {self.rounds}")
        _require_positive("--iterations", self.iterations)
        if self.iterations > MAX_ITERATIONS:
            raise DpltmUserError(f"--iterations must be at most {MAX_ITERATIONS} per ticket (the paper uses 5000), "
                                 f"got {self.iterations}")
        if not 0 <= self.rewind_step < self.iterations:
            raise DpltmUserError(f"--rewind-step must lie in [0, --iterations) = [0, {self.iterations}) (the iterate "
                                 f"of round 0 every later round rewinds to), got {self.rewind_step}")
        _require_positive("--batch-size", self.batch_size)
        _require_lr(self.lr)
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

    def __post_init__(self) -> None:
        _require_seed(self.seed)


T = TypeVar("T")


def to_dict(settings: Any) -> dict[str, Any]:
    """Plain, JSON-able dict (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(settings)))


def config_hash(settings: Any) -> str:
    """Every setting, under its own name: a setting added or renamed changes every hash, so it comes
    with a new checkpoint format (dpltm.checkpoint.FORMAT_VERSION), which refuses older files in one
    line rather than calling their settings other ones. tests/core/test_config.py pins the defaults' hashes."""
    blob = json.dumps(to_dict(settings), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def from_dict(cls: type[T], data: Mapping[str, Any], where: str = "") -> T:
    """Build a (nested) frozen dataclass, refusing unknown keys and coercing simple types."""
    if not isinstance(data, Mapping):
        raise DpltmUserError(f"config section '{where or cls.__name__}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(map(str, set(data) - names))
    if unknown:
        raise DpltmUserError(f"unknown config key(s) {unknown} in '{where or 'top level'}'")
    kwargs = {k: _coerce(hints[k], v, f"{where}.{k}".strip(".")) for k, v in data.items()}
    return cls(**kwargs)


def _invalid(where: str, value: Any, what: str) -> DpltmUserError:
    return DpltmUserError(f"config value {where}={value!r} is not a valid {what}")


YAML_FAILURES = (yaml.YAMLError, ValueError, TypeError, IndexError, OverflowError, RecursionError)
"""What PyYAML's safe loader raises on text it cannot build: its own errors, and Python's from a constructor
(`!!float abc`, `2020-13-45` as a date, `!!int 0x`) or from nesting too deep."""


def _yaml_scalar(text: str) -> Any:
    """One piece of a comma list as the YAML scalar it spells (read as a settings file reads it: `1e-5` a float)."""
    try:
        return safe_load_strict(text)
    except YAML_FAILURES:
        return text


def _coerce(tp: Any, value: Any, where: str) -> Any:
    """`value` as type `tp`, strictly: what YAML or the CLI gives must already mean that type.

    bool only from booleans (or the strings "true"/"false"); int only from integers (not bool)
    or whole floats; float only from numbers (not bool): a quoted "0.1" is a string, refused like
    any other (dpltm.strict_yaml reads an unquoted `1e-5` as a float); str only from strings; a
    section (dataclass) only from a mapping (or null: all defaults). Range checks (finite,
    positive, ...) are the settings' own.
    """
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, {} if value is None else value, where)  # type: ignore[arg-type]
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        if len(args) == 1:
            return _coerce(args[0], value, where)
        for arg in args:  # the first type that takes the value (`str | int`: "public" or 500)
            try:
                return _coerce(arg, value, where)
            except DpltmUserError:
                pass
        names = {str: "string", int: "int", float: "float", bool: "boolean"}
        raise _invalid(where, value, " or ".join(names.get(a, getattr(a, "__name__", str(a))) for a in args))
    if origin is tuple:
        if isinstance(value, str):  # "300,100": each piece read as the YAML scalar it spells
            if "," in value and any(not piece.strip() for piece in value.split(",")):  # "30," or ",,": a slip
                raise _invalid(where, value, "list (an item between its commas is empty)")
            value = [_yaml_scalar(v) for v in value.replace(",", " ").split() if v]
        if not isinstance(value, (list, tuple)):
            value = [value]
        inner = typing.get_args(tp)[0]
        return tuple(_coerce(inner, v, where) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise _invalid(where, value, "boolean (true or false)")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and math.isfinite(value) and value.is_integer() and abs(value) <= 2**53:
            return int(value)  # above 2⁵³ a float no longer holds every integer: 1234567890123456789e0 is another
        raise _invalid(where, value, "int")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and isinstance(_yaml_scalar(value), (int, float)):
            raise _invalid(where, value, "float: it is a string (in quotes); write the number without them")
        raise _invalid(where, value, "float")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, ExponentFloat):  # `dataset: 1e5`, `--search 1e3`: text that reads as a number
            return value.text
        raise _invalid(where, value, "string")
    return float(value) if isinstance(value, ExponentFloat) else value  # a plain float in what is saved


#: What a config file may hold at the top level: the sections (one settings class each) and `seed`.
SECTIONS: dict[str, type] = {}  # filled below, once every settings class exists
TOP_LEVEL_SCALARS: dict[str, type] = {"seed": int}


PAIRED_KEYS = {("train", "ema_warmup"): "ema"}
"""A key that needs another (its dataclass refuses it alone): a file may set it while the other comes from
another layer (the CLI, a recipe), so a section is checked alone without it, and in full once merged."""


def check_config_tree(tree: Mapping[str, Any], source: str) -> dict[str, Any]:
    """A user's config file, checked whole: known sections, known keys, valid values.

    Every section is checked, not only those the running stage reads, so a typo (`trian:`) or
    a wrong value in another stage's section is reported rather than silently ignored. A
    section left empty (`train:` with nothing under it) means no overrides and is dropped.
    """
    known = ", ".join([*SECTIONS, *TOP_LEVEL_SCALARS])
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if key in TOP_LEVEL_SCALARS:
            try:
                out[key] = _coerce(TOP_LEVEL_SCALARS[key], value, str(key))
            except DpltmUserError as error:
                raise DpltmUserError(f"{error} (in {source})") from error
            continue
        if key not in SECTIONS:
            raise DpltmUserError(f"unknown section '{key}' in config file {source}; known: {known}")
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise DpltmUserError(f"config section '{key}' in {source} must be a mapping, got {value!r}")
        cls = SECTIONS[key]
        hints = typing.get_type_hints(cls)
        unknown = sorted(map(str, set(value) - set(hints)))
        if unknown:
            raise DpltmUserError(f"unknown config key(s) {unknown} in section '{key}' of {source}")
        try:
            section = {k: _coerce(hints[k], v, f"{key}.{k}") for k, v in value.items()}
            alone = {k: v for k, v in section.items() if PAIRED_KEYS.get((key, k), k) in section}
            cls(**alone)  # the section's own range checks (the rest at their defaults)
        except DpltmUserError as error:  # it names the key or the flag; the value is in this file
            raise DpltmUserError(f"{error} (in section '{key}' of {source})") from error
        out[key] = section
    return out


def read_yaml(path: Path | Traversable) -> dict[str, Any]:
    """A YAML mapping from `path` (at most MAX_CONFIG_BYTES of UTF-8); any problem is one line.

    Schema-free: the experiment profiles are read with it too. See `read_config_file`.
    """
    if isinstance(path, Path):
        from dpltm.paths import check_input_file

        check_input_file(path, "config file")
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise DpltmUserError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise DpltmUserError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise DpltmUserError(f"config file {path} is larger than {MAX_CONFIG_BYTES // 1024} KiB: not a config")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise DpltmUserError(f"config file {path} is not UTF-8 text") from None
    try:
        data = safe_load_strict(text) or {}
    except DuplicateKeyError as exc:
        raise DpltmUserError(f"config file {path} gives the key {exc.key!r} twice "
                             f"(line {exc.problem_mark.line + 1}): keep one") from None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or (str(exc).splitlines() or ["syntax error"])[0]
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise DpltmUserError(f"config file {path} is not valid YAML: {problem}{where}") from None
    except RecursionError:
        raise DpltmUserError(f"config file {path} is nested too deeply") from None
    except YAML_FAILURES as exc:  # a constructor's own error: `!!float abc`, a date that is no date
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise DpltmUserError(f"config file {path} is not valid YAML: {first}") from None
    if not isinstance(data, dict):
        raise DpltmUserError(f"config file {path} must hold a mapping at the top level")
    return data


def read_config_file(path: Path | Traversable) -> dict[str, Any]:
    """`read_yaml` then `check_config_tree`: a settings file (defaults, dataset or --config)."""
    return check_config_tree(read_yaml(path), str(path))


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
    """Merge the layers; keeps only `sections` (plus top-level scalars) of each YAML file.

    Every file is checked whole first (`check_config_tree`), so what is not kept here was
    still validated."""
    user = read_config_file(config_file) if config_file is not None else {}
    return _merge_layers(cli, user, sections)


def _is_plain_name(name: Any) -> bool:
    """A dataset name that can only name a file inside configs/datasets/."""
    return isinstance(name, str) and bool(name) and not name.startswith(".") and "/" not in name \
        and "\\" not in name


def _merge_layers(cli: Mapping[str, Any], user: Mapping[str, Any],
                  sections: tuple[str, ...]) -> dict[str, Any]:
    def pick(tree: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in tree.items() if k in sections or not isinstance(v, Mapping)}

    defaults = read_config_file(CONFIG_DIR / "defaults.yaml")
    cli_tree = drop_none(cli)
    layers = [pick(defaults), pick(user), cli_tree]
    dataset = _merge_budgets(layers).get("data", {}).get("dataset")
    if _is_plain_name(dataset) and (dataset_file := CONFIG_DIR / "datasets" / f"{dataset}.yaml").is_file():
        layers = [pick(defaults), pick(read_config_file(dataset_file)), pick(user), cli_tree]
    return _merge_budgets(layers)


BUDGET_KEYS = ("eps2", "sigma")
"""train.eps2 (σ calibrated to it) and train.sigma (ε reported) are one setting given two ways: a layer that sets
one replaces what earlier layers set for the other (`--eps 0.1` over a config file's `sigma: 0.5` trains at
ε = 0.1, not at the file's σ)."""


def _merge_budgets(layers: list[dict[str, Any]]) -> dict[str, Any]:
    """The layers merged in order (later wins), with train.eps2 and train.sigma treated as one setting."""
    merged: dict[str, Any] = {}
    for layer in layers:
        train = layer.get("train")
        if isinstance(train, Mapping):
            given = [key for key in BUDGET_KEYS if train.get(key) is not None]
            if len(given) == 2:
                raise DpltmUserError("the settings give both train.eps2 and train.sigma: give one of them (σ is "
                                     "calibrated to eps2, or ε is reported for sigma)")
            if given and isinstance(merged.get("train"), Mapping):
                other = BUDGET_KEYS[1 - BUDGET_KEYS.index(given[0])]
                merged["train"] = {k: v for k, v in merged["train"].items() if k != other}
        merged = deep_merge(merged, layer)
    return merged


def resolve_generate_config(cli: Mapping[str, Any], config_file: Path | None) -> GenerateConfig:
    """The generation settings; the network's size is checked here against the dataset's input
    width, before any data is read."""
    tree = layered_config(cli, config_file, ("data", "model", "generate"))
    tree = {k: v for k, v in tree.items() if k in ("data", "model", "generate", "seed")}
    cfg = from_dict(GenerateConfig, tree)
    if cfg.data.val_fraction == 0.0:  # A, the score's accuracy, would be NaN for every ticket
        raise DpltmUserError("--val-fraction 0 leaves no validation records, and each ticket is scored by its "
                             "validation accuracy: give a fraction in (0, 1) for generate")
    from dpltm.data.loaders import SPECS  # the dataset's fixed shape, without reading any data

    spec = SPECS.get(cfg.data.dataset)
    if spec is not None:
        check_network_size(spec.num_features, cfg.model.hidden, spec.num_classes, cfg.model.project_to)
        if cfg.model.arch != "mlp":  # the images' shape, before any data is read
            from dpltm.model import build_architecture

            build_architecture(spec.num_features, spec.num_classes, cfg.model.hidden, None, cfg.model.activation,
                               cfg.model.arch)
    return cfg


MAX_HALVING = 10
"""More rungs than this would score candidates after under T/1000 steps."""


@dataclass(frozen=True)
class SelectSettings:
    """Phase 2 (paper §4.2): ε1 = 10 % of the budget, ν = 50."""

    eps1: float = 0.1
    nu: float = 50.0
    halving: int = 0
    """Rungs of successive halving in the noise-aware choice (dpltm.selection.noise_aware.rung_steps); 0: every
    candidate trains the whole planned run."""
    search: tuple[str, ...] = ()
    """What the noise-aware choice searches besides the ticket (SEARCHABLE); the winner's variant is what
    `train` then runs, below the --config file and flags."""

    def __post_init__(self) -> None:
        _require_finite(self)
        check_eps1(self.eps1, "--eps1")
        object.__setattr__(self, "search", check_search(self.search))
        if not 0 <= self.halving <= MAX_HALVING:
            raise DpltmUserError(f"--halving must lie in [0, {MAX_HALVING}] (rungs after T/2, T/4, …), got "
                                 f"{self.halving}")
        if not 0 <= self.nu <= MAX_NU:
            raise DpltmUserError(f"--nu must lie in [0, {MAX_NU:g}] (S = A·(1 − ν·C) with C ≤ 1: the paper uses "
                                 f"0.1 to 1), got {self.nu}")


SEARCHABLE = ("start", "release", "freeze")
"""What the noise-aware choice may change besides the ticket (`select.search`, `--search`):
where the run starts (θ0 or the ticket's public-trained weights), what it releases (the final iterate or an
EMA with warm-up), and whether the first layer is held at its public weights
(dpltm.selection.noise_aware.searched_trainings, searched_releases)."""


def check_search(search: Any) -> tuple[str, ...]:
    """`search` as a tuple of known dimensions, in SEARCHABLE's order; a one-line refusal of anything else."""
    if isinstance(search, str) or not isinstance(search, (list, tuple)) or not all(isinstance(d, str) for d in search):
        raise DpltmUserError(f"--search takes a list of {', '.join(SEARCHABLE)}, got {search!r}")
    if tuple(d.strip().lower() for d in search) == ("none",):  # `search: none` in a config file, as on the CLI
        return ()
    unknown = [d for d in search if d not in SEARCHABLE]
    if unknown:
        raise DpltmUserError(f"--search: unknown {', '.join(map(repr, unknown))}; choose among "
                             f"{', '.join(SEARCHABLE)}")
    return tuple(d for d in SEARCHABLE if d in set(search))


SEARCH_FIXED_BY = {"start": ("rewind", "output_layer"), "release": ("ema", "ema_warmup"), "freeze": ("freeze",)}
"""The `train:` settings that fix a searchable dimension when the user gives them (flag or --config file)."""


def fixed_dimensions(cli: Mapping[str, Any], config_file: Path | None) -> dict[str, str]:
    """Which searchable dimensions the user fixed, each with the setting that fixed it: a `train:` key given
    as a flag (`cli`, None: not given) or in the --config file. A recipe's settings fix nothing (they are
    defaults the choice may change)."""
    given = {k for k, v in cli.get("train", {}).items() if v is not None}
    if config_file is not None:
        given |= set(read_config_file(config_file).get("train", {}) or {})
    return {dimension: key for dimension, keys in SEARCH_FIXED_BY.items() for key in keys if key in given}


OPTIMIZERS = ("sgd", "adam")
TICKET_STARTS = ("init", "public")
"""`train.rewind`: a ticket's training starts from θ0 or from the weights its public IMP round ended with
(dpltm.training.transfer.start_weights), or from iterate K of public training (a step number, `late_rewind_step`)."""


def late_rewind_step(start: str | int) -> int | None:
    """K of a start that names a step of public training (`--rewind K`, late rewinding: Frankle et al. 2020),
    None for `init` and `public`; anything else is refused in one line."""
    if isinstance(start, str) and start in TICKET_STARTS:
        return None
    text = str(start) if isinstance(start, (str, int)) and not isinstance(start, bool) else ""
    if re.fullmatch(r"[0-9]{1,7}", text) and int(text) >= 1:
        return int(text)
    raise DpltmUserError(f"--rewind must be init, public or a step K ≥ 1 of public training (late rewinding; the "
                         f"tickets made with generate --rewind-step K), got {start!r}")


def canonical_start(start: str | int) -> str:
    """A start as stored and compared: `init`, `public`, or K's digits without leading zeros."""
    step = late_rewind_step(start)
    return str(start) if step is None else str(step)


def describe_start(start: str) -> str:
    """Where a start (`train --rewind`) takes a ticket's weights from, in words: every message and report says it so."""
    if start == "public":
        return "its public-trained weights"
    return "θ0" if start == "init" else f"its iterate {start} of public training (late rewinding)"


OUTPUT_LAYERS = ("reinit", "keep")
"""`train.output_layer`: a public start's output layer, θ0's or the public-trained one."""


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
    max_eps: float | None = None
    patience: int | None = None
    momentum: float = 0.0
    """SGD momentum on the privatized gradients (post-processing); 0: plain SGD (sgd only)."""
    ema: float | None = None
    """Decay of an exponential moving average of the iterates, evaluated and released instead of
    the final iterate (post-processing of the released iterates, docs/privacy.md §7); None: off."""
    ema_warmup: bool = False
    """Warm the EMA up (decay_t = min(ema, (1 + t)/(10 + t)), TensorFlow's rule): without it the first
    iterates keep a large weight (decay^T), which drags a public-trained start back (dpltm.dp.averaging)."""
    lr_sigma: float | None = None
    """When set, a DP run's learning rate is lr_sigma / σ (σ the effective noise multiplier, a
    function of public q, T, ε and δ only), so the noise an update carries, lr·σC/L, stays the same
    across budgets; chosen on public data (configs/recipes/tuned.yaml). Non-private runs use `lr`."""
    rewind: str | int = "init"
    """Where a ticket's training starts: θ0 (init, the paper's), the weights its public IMP round ended
    with (public: the public training is kept; public data adds nothing to the privacy ledger), or K, the
    iterate K steps into public training that late-rewound tickets keep (`generate --rewind-step K`). Public
    starts are refused for tickets made on the private data itself (dpltm.training.pipeline.check_start).
    Stored as a string ("init", "public", "500")."""
    output_layer: str = "reinit"
    """With rewind public: θ0's output layer (reinit; the public one was trained for other classes) or the
    public-trained one (keep, only for as many classes)."""
    freeze: tuple[str, ...] = ()
    """Layers (e.g. hidden.0) held at their start weights — public-trained with rewind public, else θ0 —
    and not trained: no clipped gradient, no noise, no update (dpltm.model.freeze_layers_). Public
    knowledge: nothing is added to the privacy ledger."""

    def __post_init__(self) -> None:
        _require_finite(self)
        _require_positive("--epochs", self.epochs)
        _require_positive("--batch-size", self.batch_size)
        _require_positive("--clip", self.clip)
        check_clip_range(self.clip, "--clip")
        _require_lr(self.lr)
        if self.optimizer not in OPTIMIZERS:
            raise DpltmUserError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer}")
        if self.eps2 is not None:
            check_target_epsilon(self.eps2, "--eps")
        if self.sigma is not None and not self.sigma >= MIN_NOISE_MULTIPLIER:
            raise DpltmUserError(f"--sigma must be at least {MIN_NOISE_MULTIPLIER:g} (less gives no meaningful "
                                 f"privacy), got {self.sigma:g}")
        if self.sigma is not None and self.sigma > MAX_NOISE_MULTIPLIER:
            raise DpltmUserError(f"--sigma must be at most {MAX_NOISE_MULTIPLIER:g} (more noise drowns every "
                                 f"gradient, and the accountants cannot state its tiny ε), got {self.sigma:g}")
        if not 0 < self.delta < 1:
            raise DpltmUserError(f"--delta must lie in (0, 1), got {self.delta}")
        if self.max_eps is not None:
            check_target_epsilon(self.max_eps, "--max-eps")
            if self.sigma is None and self.eps2 is not None and self.max_eps >= self.eps2:
                raise DpltmUserError(f"--max-eps {self.max_eps:g} cannot stop a run whose σ is calibrated to spend "
                                     f"--eps {self.eps2:g} in all: drop --max-eps, or give --sigma and cap its ε")
        _require_positive("--patience", self.patience)
        accountant_entry(self.accountant, "--accountant")
        # the CLI's and the API's spellings (replace-one) too, stored in the accountant's (replace_one)
        object.__setattr__(self, "neighboring", self.neighboring.strip().lower().replace("-", "_"))
        if self.neighboring not in ("add_remove", "replace_one"):
            raise DpltmUserError(f"neighboring must be add_remove or replace_one (or add-remove, replace-one), got "
                                 f"{self.neighboring}")
        if not 0.0 <= self.momentum < 1.0:
            raise DpltmUserError(f"--momentum must lie in [0, 1), got {self.momentum:g}")
        if self.momentum and self.optimizer != "sgd":
            raise DpltmUserError(f"--momentum is for --optimizer sgd ({self.optimizer} keeps its own moments)")
        if self.lr_sigma is not None and not 0.0 < self.lr_sigma <= MAX_LR:
            raise DpltmUserError(f"--lr-sigma must lie in (0, {MAX_LR:g}], got {self.lr_sigma:g}")
        if self.ema is not None and not 0.0 < self.ema < 1.0:
            raise DpltmUserError(f"--ema must lie in (0, 1), got {self.ema:g}")
        if self.ema_warmup and self.ema is None:  # checked once the layers merge (the decay may come from
            # another), and for settings built directly (the API, the grid): never a silent no-op
            raise DpltmUserError("--ema-warmup (train.ema_warmup) warms up the moving average of the iterates: give "
                                 "its decay too, --ema DECAY (train.ema)")
        object.__setattr__(self, "rewind", canonical_start(self.rewind))
        if self.output_layer not in OUTPUT_LAYERS:
            raise DpltmUserError(f"--output-layer must be one of {', '.join(OUTPUT_LAYERS)}, got {self.output_layer}")


REWIND_POINTS = ("warmup", "init")


@dataclass(frozen=True)
class PrivateTicketSettings:
    """A ticket made on the private data with privacy (`dpltm generate --private`, docs/privacy.md §7):
    `rounds` DP-SGD warm-up rounds of `warmup_epochs` epochs each (the `train:` recipe, one σ for
    every phase), masks by magnitude of the DP weights down to `density`, then training from the
    masked warm-up weights (`rewind: warmup`) or from the initialisation θ0 (`rewind: init`)."""

    warmup_epochs: int = 10
    rounds: int = 1
    density: float = 0.25
    rewind: str = "warmup"

    def __post_init__(self) -> None:
        _require_finite(self)
        _require_positive("--warmup-epochs", self.warmup_epochs)
        _require_positive("--rounds", self.rounds)
        if self.rounds > 20:
            raise DpltmUserError(f"--rounds {self.rounds} with --private: at most 20 DP warm-up rounds")
        if not 0.0 < self.density < 1.0:
            raise DpltmUserError(f"--density must lie in (0, 1), got {self.density:g}")
        if self.rewind not in REWIND_POINTS:
            raise DpltmUserError(f"--rewind must be one of {', '.join(REWIND_POINTS)}, got {self.rewind}")


@dataclass(frozen=True)
class TrainConfig:
    data: DataSettings = field(default_factory=lambda: DataSettings(dataset="mnist"))
    train: TrainSettings = field(default_factory=TrainSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    """The dense network's shape (--dense and --non-private baselines); a ticket brings its own."""
    private_ticket: PrivateTicketSettings = field(default_factory=PrivateTicketSettings)
    """How `generate --private` makes a ticket on the private data (unused by `train`)."""
    seed: int = 0

    def __post_init__(self) -> None:
        _require_seed(self.seed)


SECTIONS.update(data=DataSettings, model=ModelSettings, generate=GenerateSettings, select=SelectSettings,
                train=TrainSettings, private_ticket=PrivateTicketSettings)


def resolve_select_config(cli: Mapping[str, Any], config_file: Path | None) -> SelectSettings:
    tree = layered_config(cli, config_file, ("select",))
    return from_dict(SelectSettings, tree.get("select", {}), "select")


RECIPES = ("paper", "tuned", "scatter", "cnn")
"""Training recipes: the paper's settings (defaults.yaml), the DP recipe chosen on public data
(configs/recipes/tuned.yaml, for MNIST-sized sets), the ScatterNet one (configs/recipes/scatter.yaml:
the scattering front end and a linear head, chosen on public data too), or LeNet-5's
(configs/recipes/cnn.yaml, chosen on public data the same way)."""


def recipe_tree(recipe: str | None) -> dict[str, Any]:
    """The settings a recipe adds over defaults.yaml (layered like a --config file, below it)."""
    if recipe is None or recipe == "paper":
        return {}
    if recipe not in RECIPES:
        raise DpltmUserError(f"--recipe must be one of {', '.join(RECIPES)}, got {recipe}")
    return read_config_file(CONFIG_DIR / "recipes" / f"{recipe}.yaml")


RECIPE_TUNED_ON = {"tuned": ("kmnist", ("test", "all")), "scatter": ("kmnist", ("test", "all")),
                   "cnn": ("kmnist", ("test", "all"))}
"""The public data each recipe was chosen on: a run that protects those very records cannot use it."""


def resolve_train_config(cli: Mapping[str, Any], config_file: Path | None, recipe: str | None = None,
                         base: Mapping[str, Any] | None = None) -> TrainConfig:
    """Training reads `data:`, `train:` and `model:` (the dense baselines' shape). Its dataset is the
    private one: --dataset, else the --config file's `data.dataset`, else MNIST (defaults.yaml's
    dataset is for generation). A `recipe` (or the CLI tree's `recipe` key) and then `base` (e.g. the
    settings a private ticket was planned with) sit between the defaults and the --config file."""
    recipe = recipe or cli.get("recipe")
    cli = {k: v for k, v in cli.items() if k != "recipe"}
    user = _merge_budgets([recipe_tree(recipe), dict(base or {}),  # eps2/sigma: the later layer's choice
                           read_config_file(config_file) if config_file is not None else {}])
    dataset = cli.get("data", {}).get("dataset") or user.get("data", {}).get("dataset") or "mnist"
    cli = {**cli, "data": {**cli.get("data", {}), "dataset": dataset}}
    tree = _merge_layers(cli, user, ("data", "train", "model", "private_ticket"))
    cfg = from_dict(TrainConfig, {k: tree[k] for k in ("data", "train", "model", "private_ticket", "seed")
                                  if k in tree})
    if recipe == "scatter" and not cfg.model.arch.startswith("scatter-") and not cfg.model.hidden:
        # the recipe's `hidden: []` is scatter-linear's; another network would silently lose its hidden layers
        raise DpltmUserError(f"--recipe scatter is for the ScatterNet heads (--arch scatter-linear, scatter-mlp, "
                             f"scatter-cnn); --arch {cfg.model.arch} trains with --recipe tuned or paper")
    if recipe == "cnn" and cfg.model.arch != "lenet5":  # its hidden widths and rates are LeNet-5's
        raise DpltmUserError(f"--recipe cnn is LeNet-5's (--arch lenet5); --arch {cfg.model.arch} trains with "
                             "--recipe tuned, paper or scatter")
    if cfg.train.patience is not None and cfg.data.val_fraction == 0.0:
        raise DpltmUserError("--patience stops on validation accuracy, and --val-fraction 0 leaves no validation "
                             "records: give a fraction in (0, 0.5), or leave --patience out")
    if recipe in RECIPE_TUNED_ON:
        name, splits = RECIPE_TUNED_ON[recipe]
        if cfg.data.dataset == name and cfg.data.split in splits:
            raise DpltmUserError(f"--recipe {recipe} was chosen on {name}'s test split: those records are not public "
                                 f"for a run that protects them; use --recipe paper (or tune on other public data)")
    return cfg
