"""Every shipped config loads, and defaults.yaml agrees with the dataclass defaults."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from grid import PROFILES

from dpltm.config import (
    CONFIG_DIR,
    MAX_CONFIG_BYTES,
    _coerce,
    check_config_tree,
    config_hash,
    from_dict,
    read_yaml,
    resolve_generate_config,
    resolve_select_config,
    resolve_train_config,
    to_dict,
)
from dpltm.errors import DpltmUserError
from dpltm.networks.lenet import MAX_PARAMETERS, Architecture, check_network_size, parameter_count
from dpltm.privacy.accounting import MAX_EPSILON
from dpltm.privacy.events import MIN_NOISE_MULTIPLIER
from dpltm.privacy.exponential import MAX_EPS1
from dpltm.selection.noise_aware import check_search
from dpltm.settings import (
    MAX_CLIP,
    MAX_LR,
    MAX_SEED,
    MIN_CLIP,
    DataSettings,
    GenerateConfig,
    GenerateSettings,
    ModelSettings,
    SelectSettings,
    TrainConfig,
    TrainSettings,
)


def _yaml_files(group: str) -> list[Path]:
    """The packaged YAML files of one group (read through importlib.resources, as installed)."""
    return sorted(Path(str(p)) for p in (CONFIG_DIR / group).iterdir() if p.name.endswith(".yaml"))


def test_defaults_yaml_matches_dataclass_defaults() -> None:
    tree = read_yaml(CONFIG_DIR / "defaults.yaml")
    from_yaml = from_dict(GenerateConfig, {k: tree[k] for k in ("data", "model", "generate", "seed")})
    assert to_dict(from_yaml) == to_dict(GenerateConfig())


@pytest.mark.parametrize("path", _yaml_files("datasets"), ids=lambda p: p.name)
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


@pytest.mark.parametrize("path", sorted(PROFILES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_experiment_profile_is_complete(path: Path) -> None:
    """The reproduction's profiles name only known methods and build valid settings."""
    from grid.experiment import METHODS

    from dpltm.data import DATASETS
    from dpltm.settings import ModelSettings, PrivateTicketSettings

    spec = read_yaml(path)
    assert set(spec["methods"]) <= set(METHODS)
    assert all(entry["name"] in DATASETS for entry in spec["datasets"])
    assert all(0 < e for e in spec["epsilons"]) and 0 < spec["selection_fraction"] < 1
    generate = dict(spec["generate"])
    if "activation" in generate:  # the tickets' own activation (grid.experiment.Experiment.tickets)
        ModelSettings(activation=generate.pop("activation"))
    GenerateSettings(**generate)
    TrainSettings(**spec["train"])
    ModelSettings(**spec.get("model", {}))
    PrivateTicketSettings(**spec.get("private_ticket", {}))
    for overrides in [*spec.get("dataset_train", {}).values(), spec.get("small_dataset", {})]:
        TrainSettings(**{**spec["train"], **overrides})
    for name, options in spec.get("dataset_model", {}).items():
        assert name in DATASETS
        ModelSettings(**{**spec.get("model", {}), **options})
    assert set(spec.get("method_seeds", {})) <= set(spec["methods"])
    assert set(spec.get("method_datasets", {})) <= set(spec["methods"])
    noise_aware = spec.get("noise_aware", {})
    assert set(noise_aware) <= {"rounds", "halving", "search"}  # grid.experiment.Experiment.noise_aware_winner
    check_search(noise_aware.get("search", ()))
    SelectSettings(halving=noise_aware.get("halving", 0))


# ---- strict types, unknown sections and keys --------------------------------------------------


@pytest.mark.parametrize(
    ("tp", "value", "expected"),
    [
        (bool, True, True), (bool, "false", False), (bool, "True", True),
        (int, 5, 5), (int, 5.0, 5), (int, 2**70, 2**70),
        (float, 1, 1.0), (float, 1e-5, 1e-5), (float, 0.5, 0.5),
        (str, "mnist", "mnist"),
        (tuple[int, ...], "300,100", (300, 100)), (tuple[int, ...], [300], (300,)),
        (int | None, None, None),
    ],
)
def test_coerce_accepts_what_means_the_type(tp: object, value: object, expected: object) -> None:
    assert _coerce(tp, value, "x") == expected


@pytest.mark.parametrize(
    ("tp", "value"),
    [
        (bool, "maybe"), (bool, 1), (bool, "yes!"), (bool, None),
        (int, True), (int, "5"), (int, 5.5), (int, math.inf), (int, "x"), (int, [1]),
        (float, True), (float, "x"), (float, None), (float, [1.0]), (float, "0.1"), (float, "1e-5"),
        (str, 5), (str, None), (str, ["a"]),
        (tuple[int, ...], [True]),
    ],
)
def test_coerce_refuses_the_wrong_type(tp: object, value: object) -> None:
    with pytest.raises(DpltmUserError, match=r"config value x=.* is not a valid"):
        _coerce(tp, value, "x")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("generate: {controls: maybe}\n", "generate.controls='maybe' is not a valid boolean"),
        ("seed: true\n", "seed=True is not a valid int"),
        ('data: "x"\n', "section 'data'.*must be a mapping"),
        ("train: {epochs: x}\n", "train.epochs='x' is not a valid int"),
        ("trian: {epochs: 3}\n",
         "unknown section 'trian'.*known: data, model, generate, select, train, private_ticket, seed"),
        ("select: {eps: 3}\n", r"unknown config key\(s\) \['eps'\] in section 'select'"),
        ("model: {hidden: [0]}\n", "--hidden takes positive integers.*in section 'model' of .*u.yaml"),
        ("train: {ema: 1.5}\n", r"--ema must lie in \(0, 1\), got 1.5 \(in section 'train' of .*u.yaml\)"),
        ("select: {halving: 11}\n", r"--halving must lie in \[0, 10\].* \(in section 'select' of"),
        ("- 1\n- 2\n", "mapping at the top level"),
        ("a: [\n", "not valid YAML"),
    ],
)
@pytest.mark.parametrize("stage", ["generate", "select", "train"])
def test_every_stage_checks_the_whole_config_file(tmp_path: Path, text: str, message: str, stage: str) -> None:
    user = tmp_path / "u.yaml"
    user.write_text(text)
    resolve = {"generate": resolve_generate_config, "select": resolve_select_config,
               "train": resolve_train_config}[stage]
    with pytest.raises(DpltmUserError, match=message):
        resolve({}, user)


def test_a_setting_that_needs_another_is_checked_after_the_layers_merge(tmp_path: Path) -> None:
    """`ema_warmup` needs `ema`, which may come from the CLI or a recipe rather than the same file."""
    user = tmp_path / "u.yaml"
    user.write_text("train: {ema_warmup: true}\n")
    assert resolve_train_config({"train": {"ema": 0.9}}, user).train.ema_warmup
    assert resolve_train_config({}, user, recipe="tuned").train.ema == 0.999  # the recipe's decay
    with pytest.raises(DpltmUserError, match=r"--ema-warmup \(train.ema_warmup\) warms up .*--ema DECAY \(train.ema\)"):
        resolve_train_config({}, user)
    with pytest.raises(DpltmUserError, match=r"--ema-warmup \(train.ema_warmup\) warms up"):  # built directly
        TrainSettings(ema_warmup=True)
    assert TrainSettings(ema=0.99, ema_warmup=True).ema_warmup


def test_empty_sections_mean_no_overrides(tmp_path: Path) -> None:
    user = tmp_path / "u.yaml"
    user.write_text("data:\ntrain:\nselect: {nu: 2}\n")
    assert resolve_train_config({}, user).data.dataset == "mnist"
    assert resolve_select_config({}, user).nu == 2.0


@pytest.mark.parametrize(("text", "where"), [
    ('train: {lr: "0.1"}\n', "train.lr='0.1'"),
    ("train: {delta: '1e-5'}\n", "train.delta='1e-5'"),
    ('generate: {min_density: "0.01"}\n', "generate.min_density='0.01'"),
    ('train:\n  clip: "2"\n', "train.clip='2'"),
])
def test_a_quoted_number_is_a_string_refused_naming_the_key_and_the_file(tmp_path: Path, text: str,
                                                                         where: str) -> None:
    """A number in quotes is YAML's string: it was read through float() and taken; now one line names the key and
    the file (real numbers, below, still work)."""
    user = tmp_path / "u.yaml"
    user.write_text(text)
    with pytest.raises(DpltmUserError) as caught:
        resolve_train_config({}, user)
    line = str(caught.value)
    assert f"config value {where} is not a valid float: it is a string (in quotes)" in line, line
    assert f"of {user})" in line and "\n" not in line
    user.write_text('seed: "3"\n')
    with pytest.raises(DpltmUserError, match=re.escape(f"seed='3' is not a valid int (in {user})")):
        resolve_train_config({}, user)


def test_real_numbers_in_every_yaml_spelling_still_work(tmp_path: Path) -> None:
    """YAML 1.1 (PyYAML) reads `1e-6` and `1.5e-3` (no dot, or no exponent sign) as strings; dpltm's loader reads
    them as the numbers they are, so refusing quoted strings loses none of them."""
    user = tmp_path / "u.yaml"
    user.write_text("train: {lr: 1.5e-3, delta: 1e-6, clip: 2, max_eps: 0.5, eps2: 1E0}\n"
                    "generate:\n  prune_rates: 0.2,1e-1,5E-2\n  lr: 0.1\n")
    train = resolve_train_config({}, user).train
    assert (train.lr, train.delta, train.clip, train.max_eps, train.eps2) == (1.5e-3, 1e-6, 2.0, 0.5, 1.0)
    assert isinstance(train.clip, float)  # an int where a float is allowed
    generate = resolve_generate_config({}, user).generate
    assert generate.prune_rates == (0.2, 0.1, 0.05) and generate.lr == 0.1


def test_the_strict_loader_reads_exponents_as_floats_and_keeps_everything_else() -> None:
    import yaml

    from dpltm.strict_yaml import safe_load_strict

    text = 'a: [1e-5, 1E3, 1.5e3, -2e+2, .5e1, 1.0e-5, "1e-5", "0.1", 0.1, 12, 1_000, e5, 1e, 1e-3x, .inf]'
    assert safe_load_strict(text)["a"] == [1e-5, 1e3, 1.5e3, -200.0, 5.0, 1e-5, "1e-5", "0.1", 0.1, 12, 1000, "e5",
                                           "1e", "1e-3x", math.inf]
    assert safe_load_strict("a: 1") == {"a": 1} and isinstance(safe_load_strict("a: 1e3")["a"], float)
    assert yaml.safe_load("a: 1e-5") == {"a": "1e-5"}  # PyYAML's own loader is left as it is


def test_check_config_tree_passes_valid_trees_through() -> None:
    tree = {"seed": 3, "train": {"delta": 1e-6, "epochs": 2}, "data": None}
    assert check_config_tree(tree, "t") == {"seed": 3, "train": {"delta": 1e-6, "epochs": 2}}


def test_binary_or_huge_config_files_are_one_line(tmp_path: Path) -> None:
    binary = tmp_path / "b.yaml"
    binary.write_bytes(bytes(range(256)))
    with pytest.raises(DpltmUserError, match="is not UTF-8 text"):
        read_yaml(binary)
    huge = tmp_path / "h.yaml"
    huge.write_bytes(b"#" * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(DpltmUserError, match="larger than 1024 KiB"):
        read_yaml(huge)
    with pytest.raises(DpltmUserError, match="is a directory, not a file"):
        read_yaml(tmp_path)


def test_a_dataset_name_cannot_reach_outside_the_config_folder(tmp_path: Path) -> None:
    cfg = resolve_generate_config({"data": {"dataset": "../defaults"}}, None)
    assert cfg.generate.iterations == 5000  # no dataset file was read; the loader refuses the name later


# ---- bounds on numbers ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (GenerateSettings, {"lr": math.inf}, "--lr must be a finite number"),
        (GenerateSettings, {"lr": math.nan}, "--lr must be a finite number"),
        (GenerateSettings, {"lr": 1e30}, r"--lr must lie in \(0, 1000\]"),
        (GenerateSettings, {"lr": 0.0}, r"--lr must lie in \(0, 1000\]"),
        (GenerateSettings, {"prune_rates": (0.3, math.nan)}, "--prune-rates must be a finite"),
        (GenerateSettings, {"min_density": math.nan}, "--min-density must be a finite"),
        (TrainSettings, {"lr": 1e4}, r"--lr must lie in \(0, 1000\]"),
        (TrainSettings, {"clip": math.inf}, "--clip must be a finite number"),
        (TrainSettings, {"clip": 1e-300}, r"--clip must be at least 1e-06 \(below it the clipped gradients"),
        (TrainSettings, {"clip": 5e-7}, "--clip must be at least 1e-06"),
        (TrainSettings, {"delta": math.nan}, "--delta must be a finite number"),
        (TrainSettings, {"eps2": 1e6}, r"--eps must lie in \(0, 100\]"),
        (TrainSettings, {"eps2": math.inf}, "--eps must be a finite number"),
        (TrainSettings, {"eps2": None, "sigma": 1e-9}, "--sigma must be at least 0.3"),
        (TrainSettings, {"eps2": None, "sigma": math.inf}, "--sigma must be a finite number"),
        (TrainSettings, {"max_eps": 1e3}, r"--max-eps must lie in \(0, 100\]"),
        (SelectSettings, {"eps1": 1e308}, r"--eps1 must lie in \(0, 100\]"),
        (SelectSettings, {"eps1": math.nan}, "--eps1 must be a finite number"),
        (SelectSettings, {"nu": math.inf}, "--nu must be a finite number"),
        (DataSettings, {"val_fraction": math.nan}, "--val-fraction must be a finite number"),
        (DataSettings, {"val_fraction": 1.0}, r"--val-fraction must lie in \[0, 0.5\)"),
        (DataSettings, {"val_fraction": 0.5}, r"--val-fraction must lie in \[0, 0.5\)"),
        (ModelSettings, {"hidden": (300, 0)}, "--hidden takes positive integers"),
        (ModelSettings, {"project_to": 0}, "--project-to must be positive"),
        (GenerateConfig, {"seed": -1}, "--seed must lie in"),
        (TrainConfig, {"seed": 2**63}, "--seed must lie in"),
    ],
)
def test_settings_refuse_non_finite_and_absurd_numbers(cls: type, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(DpltmUserError, match=message):
        cls(**kwargs)


def test_settings_accept_the_bounds() -> None:
    assert GenerateSettings(lr=MAX_LR).lr == MAX_LR
    assert TrainSettings(clip=MIN_CLIP).clip == MIN_CLIP and TrainSettings(clip=MAX_CLIP).clip == MAX_CLIP
    assert TrainSettings(eps2=MAX_EPSILON).eps2 == MAX_EPSILON
    assert TrainSettings(eps2=None, sigma=1.0, max_eps=MAX_EPSILON).max_eps == MAX_EPSILON
    with pytest.raises(DpltmUserError, match="--max-eps 1 cannot stop a run whose σ is calibrated to spend --eps 1"):
        TrainSettings(eps2=1.0, max_eps=1.0)  # a cap at or above the calibrated budget never binds
    assert TrainSettings(eps2=None, sigma=MIN_NOISE_MULTIPLIER).sigma == MIN_NOISE_MULTIPLIER
    assert SelectSettings(eps1=MAX_EPS1).eps1 == MAX_EPS1
    assert GenerateConfig(seed=MAX_SEED).seed == MAX_SEED


def test_the_network_size_is_checked_against_the_dataset_before_any_data_is_read() -> None:
    with pytest.raises(DpltmUserError, match=r"100000,100000 makes a network of 1e\+10 parameters"):
        resolve_generate_config({"data": {"dataset": "digits"}, "model": {"hidden": (100000, 100000)}}, None)
    # one wide layer: fine on DIGITS' 64 inputs, too big on MNIST's 784
    assert resolve_generate_config({"data": {"dataset": "digits"}, "model": {"hidden": (200000,)}}, None)
    with pytest.raises(DpltmUserError, match="784 inputs"):
        resolve_generate_config({"data": {"dataset": "mnist"}, "model": {"hidden": (200000,)}}, None)
    with pytest.raises(DpltmUserError, match="--project-to 1000000"):
        resolve_generate_config({"data": {"dataset": "digits"}, "model": {"project_to": 1000000}}, None)


def test_parameter_count_and_the_architecture_check() -> None:
    assert parameter_count(784, (300, 100), 10) == 266_610  # LeNet-300-100
    assert parameter_count(64, (300, 100), 10, project_to=784) == 64 * 784 + 784 + 266_610
    check_network_size(784, (300, 100), 10)
    with pytest.raises(DpltmUserError, match="dpltm builds at most 1e\\+08"):
        Architecture(784, (100000, 100000), 10)
    widest = (MAX_PARAMETERS - 1) // 3  # 1 → h → 1 has 3h + 1 parameters
    assert parameter_count(1, (widest,), 1) == MAX_PARAMETERS
    check_network_size(1, (widest,), 1)
    with pytest.raises(DpltmUserError):
        check_network_size(1, (widest + 1,), 1)


# ---- the recipe options: activation, momentum, EMA ---------------------------------------------


def test_recipe_options_are_read_from_a_config_file(tmp_path: Path) -> None:
    user = tmp_path / "recipe.yaml"
    user.write_text("model: {activation: tanh}\ntrain: {momentum: 0.9, ema: 0.999}\n")
    cfg = resolve_train_config({}, user)
    assert (cfg.model.activation, cfg.train.momentum, cfg.train.ema) == ("tanh", 0.9, 0.999)
    assert resolve_generate_config({}, user).model.activation == "tanh"
    cli = resolve_train_config({"train": {"ema": 0.99}, "model": {"activation": "relu"}}, user)
    assert (cli.model.activation, cli.train.ema) == ("relu", 0.99)  # CLI beats --config
    defaults = resolve_train_config({}, None)  # defaults.yaml: the paper's recipe
    assert (defaults.model.activation, defaults.train.momentum, defaults.train.ema) == ("relu", 0.0, None)
    tree = read_yaml(CONFIG_DIR / "defaults.yaml")
    assert from_dict(TrainSettings, tree["train"]) == TrainSettings()  # every key listed, same defaults


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (TrainSettings, {"momentum": 1.0}, r"--momentum must lie in \[0, 1\)"),
        (TrainSettings, {"momentum": -0.1}, r"--momentum must lie in \[0, 1\)"),
        (TrainSettings, {"momentum": math.nan}, "--momentum must be a finite number"),
        (TrainSettings, {"momentum": 0.9, "optimizer": "adam"}, "--momentum is for --optimizer sgd"),
        (TrainSettings, {"ema": 1.0}, r"--ema must lie in \(0, 1\)"),
        (TrainSettings, {"ema": 0.0}, r"--ema must lie in \(0, 1\)"),
        (TrainSettings, {"ema": math.inf}, "--ema must be a finite number"),
        (ModelSettings, {"activation": "gelu"}, "--activation must be one of relu, tanh"),
    ],
)
def test_recipe_options_refuse_bad_values(cls: type, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(DpltmUserError, match=message):
        cls(**kwargs)


def test_config_hashes_are_pinned() -> None:
    """The hash names what a run produced (a resumed `generate` checks it): pinned, so that an edit
    cannot orphan existing ticket sets unnoticed. Changing a setting's name or adding one changes
    these; for the generate settings (the hash a ticket set stores) that comes with a new checkpoint
    format (dpltm.artefacts.format.FORMAT_VERSION). No file stores the train settings' hash: it is pinned so a
    change is seen. Every setting counts,
    at its default too."""
    assert config_hash(GenerateConfig()) == "63c8efb2cd518678"
    assert config_hash(TrainConfig()) == "46f62bb8803b9888"
    assert config_hash(GenerateConfig(model=ModelSettings(activation="tanh"))) != "63c8efb2cd518678"
    assert config_hash(TrainConfig(train=TrainSettings(ema=0.999))) != "dea32ab76e772ac9"
    assert to_dict(GenerateConfig())["model"]["activation"] == "relu"  # still stored in full


def test_a_config_file_takes_the_neighbouring_relation_as_the_flag_does() -> None:
    """`--neighbouring replace-one` and the API take the hyphen; a config file's `neighboring: replace-one` too,
    stored in the accountant's spelling."""
    from dpltm.settings import TrainSettings

    assert TrainSettings(neighboring="replace-one").neighboring == "replace_one"
    assert TrainSettings(neighboring="ADD-REMOVE").neighboring == "add_remove"
    with pytest.raises(DpltmUserError, match="neighboring must be 'add_remove' or 'replace_one'"):
        TrainSettings(neighboring="replace-two")


@pytest.mark.parametrize("text", ["generate: {lr: ._e5}\n", "generate: {lr: '._e5'}\n",
                                  'generate: {lr: "!!float abc"}\n',
                                  "generate: {lr: 2020-13-45}\n", "generate: {lr: !!float abc}\n",
                                  'generate: {prune_rates: "!!float abc"}\n',
                                  'generate: {lr: "' + "[" * 3000 + '"}\n'])
def test_yaml_a_constructor_cannot_build_is_one_line(tmp_path: Path, text: str) -> None:
    """PyYAML's constructors raise Python's errors (ValueError, IndexError, RecursionError), not YAMLError: they
    ended in a traceback."""
    user = tmp_path / "u.yaml"
    user.write_text(text)
    with pytest.raises(DpltmUserError) as caught:
        resolve_generate_config({}, user)
    assert "\n" not in str(caught.value)


def test_text_settings_keep_what_was_written_when_it_reads_as_a_number(tmp_path: Path) -> None:
    """`1e5` is a float to the strict loader, but a setting that takes text gets the text, not '100000.0'; an int
    setting takes whole floats only where a float holds every integer (≤ 2⁵³)."""
    from dpltm.strict_yaml import ExponentFloat, safe_load_strict

    value = safe_load_strict("a: 1e5")["a"]
    assert isinstance(value, ExponentFloat) and value == 1e5 and str(value) == "1e5"
    from dpltm.config import _coerce

    assert _coerce(str, value, "data.dataset") == "1e5"
    with pytest.raises(DpltmUserError, match="--optimizer must be one of sgd, adam, got 1e5"):  # as written
        check_config_tree({"train": {"optimizer": value}}, "t")
    assert check_config_tree({"seed": safe_load_strict("a: 1e3")["a"]}, "t")["seed"] == 1000
    with pytest.raises(DpltmUserError, match="is not a valid int"):
        check_config_tree({"seed": safe_load_strict("a: 1234567890123456789e0")["a"]}, "t")


@pytest.mark.parametrize("written", ["0100", "010", "0_1", "1:00", "-1:30.5"])
def test_numbers_only_yaml_1_1_reads_as_numbers_are_refused_in_one_line(written: str, tmp_path: Path) -> None:
    """`batch_size: 0100` was read as octal 64 and `seed: 1:00` as 60: silently other settings."""
    config = tmp_path / "c.yaml"
    config.write_text(f"train:\n  batch_size: {written}\n")
    with pytest.raises(DpltmUserError, match="a number only in YAML 1.1"):
        resolve_train_config({}, config)
    config.write_text("train:\n  batch_size: 100\n  clip: 0.5\n  delta: 1e-5\n")  # plain decimals read as before
    train = resolve_train_config({}, config).train
    assert (train.batch_size, train.clip, train.delta) == (100, 0.5, 1e-5)
