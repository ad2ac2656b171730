"""One configuration path: YAML defaults → dataset YAML → --config file → CLI flags.

The settings are frozen dataclasses (dpltm.settings); a resolved config round-trips to a plain dict (stored in
every checkpoint) and its hash names what a run produced, so a resumed run can check it is
continuing the same experiment.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import types
import typing
from collections.abc import Mapping
from importlib import resources

try:
    from importlib.resources.abc import Traversable
except ImportError:  # Python 3.10
    from importlib.abc import Traversable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from dpltm.choices import Recipe
from dpltm.errors import DpltmUserError
from dpltm.networks.lenet import check_network_size
from dpltm.options import Overrides
from dpltm.settings import (
    DataSettings,
    GenerateConfig,
    GenerateSettings,
    ModelSettings,
    PrivateTicketSettings,
    SelectSettings,
    TrainConfig,
    TrainSettings,
)
from dpltm.strict_yaml import DuplicateKeyError, ExponentFloat, safe_load_strict

CONFIG_DIR: Traversable = resources.files("dpltm.configs")
"""The packaged YAML (defaults, per-dataset, experiment profiles): shipped as package data, so an
installed wheel reads the same settings as a checkout."""

#: The largest --config file read: a config is a few hundred bytes; this refuses /dev/zero.
MAX_CONFIG_BYTES = 1 << 20

T = TypeVar("T")


def _tree(cli: Overrides | Mapping[str, Any]) -> dict[str, Any]:
    """The overrides as a settings tree, the shape of a config file (a tree is taken as it is)."""
    if not isinstance(cli, Overrides):
        return {k: v for k, v in cli.items() if k != "recipe"}
    tree: dict[str, Any] = {}
    for dotted, value in cli.values.items():
        *path, key = dotted.split(".")
        node = tree
        for part in path:
            node = node.setdefault(part, {})
        node[key] = value
    return tree


def _recipe_of(cli: Overrides | Mapping[str, Any]) -> str | None:
    return cli.recipe if isinstance(cli, Overrides) else cli.get("recipe")


def to_dict(settings: Any) -> dict[str, Any]:
    """Plain, JSON-able dict (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(settings)))


def config_hash(settings: Any) -> str:
    """Every setting, under its own name: a setting added or renamed changes every hash, so it comes
    with a new checkpoint format (dpltm.artefacts.format.FORMAT_VERSION), which refuses older files in one
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
SECTIONS: dict[str, type] = {"data": DataSettings, "model": ModelSettings, "generate": GenerateSettings,
                             "select": SelectSettings, "train": TrainSettings,
                             "private_ticket": PrivateTicketSettings}

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


def layered_config(cli: Overrides | Mapping[str, Any], config_file: Path | None,
                   sections: tuple[str, ...]) -> dict[str, Any]:
    """Merge the layers; keeps only `sections` (plus top-level scalars) of each YAML file.

    Every file is checked whole first (`check_config_tree`), so what is not kept here was
    still validated."""
    return _merge_layers(_tree(cli), _config_file(config_file), sections)


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


def resolve_generate_config(cli: Overrides | Mapping[str, Any], config_file: Path | None) -> GenerateConfig:
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
            from dpltm.networks.lenet import build_architecture

            build_architecture(spec.num_features, spec.num_classes, cfg.model.hidden, None, cfg.model.activation,
                               cfg.model.arch)
    return cfg


SEARCH_FIXED_BY = {"start": ("rewind", "output_layer"), "release": ("ema", "ema_warmup"), "freeze": ("freeze",)}
"""The `train:` settings that fix a searchable dimension when the user gives them (flag or --config file)."""


def fixed_dimensions(cli: Overrides, config_file: Path | None) -> dict[str, str]:
    """Which searchable dimensions the user fixed, each with the setting that fixed it: a `train:` key given
    as a flag (`cli`, None: not given) or in the --config file. A recipe's settings fix nothing (they are
    defaults the choice may change)."""
    given = cli.given("train") | config_file_keys(config_file, "train")
    return {dimension: key for dimension, keys in SEARCH_FIXED_BY.items() for key in keys if key in given}


def _config_file(config_file: Path | None) -> dict[str, Any]:
    return read_config_file(config_file) if config_file is not None else {}


def config_file_keys(config_file: Path | None, section: str) -> set[str]:
    """The keys the --config file (if any) sets in `section`."""
    return set(_config_file(config_file).get(section) or {})


def resolve_select_config(cli: Overrides | Mapping[str, Any], config_file: Path | None) -> SelectSettings:
    tree = layered_config(cli, config_file, ("select",))
    return from_dict(SelectSettings, tree.get("select", {}), "select")


RECIPES = tuple(choice.value for choice in Recipe)
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


def recipe_settings(recipe: str | None) -> Overrides:
    """What a recipe sets, by dotted key (`model.arch`)."""
    return Overrides.from_tree(recipe_tree(recipe))


RECIPE_TUNED_ON = {"tuned": ("kmnist", ("test", "all")), "scatter": ("kmnist", ("test", "all")),
                   "cnn": ("kmnist", ("test", "all"))}
"""The public data each recipe was chosen on: a run that protects those very records cannot use it."""


def resolve_train_config(cli: Overrides | Mapping[str, Any], config_file: Path | None, recipe: str | None = None,
                         base: Overrides | None = None) -> TrainConfig:
    """Training reads `data:`, `train:` and `model:` (the dense baselines' shape). Its dataset is the
    private one: --dataset, else the --config file's `data.dataset`, else MNIST (defaults.yaml's
    dataset is for generation). A `recipe` (or the CLI tree's `recipe` key) and then `base` (e.g. the
    settings a private ticket was planned with) sit between the defaults and the --config file."""
    recipe = recipe or _recipe_of(cli)
    flags = _tree(cli)
    user = _merge_budgets([recipe_tree(recipe), _tree(base or Overrides()),  # eps2/sigma: the later layer's choice
                           _config_file(config_file)])
    dataset = flags.get("data", {}).get("dataset") or user.get("data", {}).get("dataset") or "mnist"
    flags = {**flags, "data": {**flags.get("data", {}), "dataset": dataset}}
    tree = _merge_layers(flags, user, ("data", "train", "model", "private_ticket"))
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
