"""One CLI vocabulary: each idea has one option name across commands, choices are enums that
match the registries they select from, `--help` shows them with the effective defaults, and
renamed options answer with their new name."""

from __future__ import annotations

import re
from collections import defaultdict

import pytest
import typer.main

from dpltm import choices
from dpltm.cli import app


def test_enums_match_the_registries() -> None:
    from dpltm.audit.canaries import THREAT_MODELS
    from dpltm.data.loaders import DATASETS, SPLITS
    from dpltm.dp.distributed import STRATEGIES
    from dpltm.dp.noise import NOISE_PLUGINS
    from dpltm.dp.noise_filter import NOISE_FILTERS
    from dpltm.networks.lenet import ACTIVATIONS, ARCHS
    from dpltm.run_log import LOGGERS
    from dpltm.selection.rules import SELECTION_RULES
    from dpltm.settings import OPTIMIZERS, OUTPUT_LAYERS, REWIND_POINTS
    from dpltm.stages.predict import PARTS

    pairs = [(choices.Dataset, DATASETS), (choices.Split, SPLITS), (choices.Activation, ACTIVATIONS),
             (choices.Arch, ARCHS), (choices.Optimizer, OPTIMIZERS), (choices.Noise, NOISE_PLUGINS),
             (choices.Rewind, REWIND_POINTS), (choices.Strategy, STRATEGIES), (choices.Accountant, ("pld", "rdp")),
             (choices.Logger, LOGGERS), (choices.Part, PARTS), (choices.ThreatModel, THREAT_MODELS),
             (choices.SelectionRuleName, SELECTION_RULES),
             (choices.OutputLayer, OUTPUT_LAYERS), (choices.NoiseFilterName, NOISE_FILTERS)]
    for enum, registry in pairs:
        assert [m.value for m in enum] == list(registry), enum.__name__


def _options() -> dict[str, dict[str, tuple[str, ...]]]:
    """command -> parameter name -> its option strings (visible options only)."""
    group = typer.main.get_command(app)
    out: dict[str, dict[str, tuple[str, ...]]] = {}
    for name, command in group.commands.items():  # type: ignore[attr-defined]
        out[name] = {p.name: tuple(p.opts) for p in command.params if not getattr(p, "hidden", False)}
    return out


def test_one_option_name_per_idea_across_commands() -> None:
    spellings: dict[str, set[tuple[str, ...]]] = defaultdict(set)
    for params in _options().values():
        for opts in params.values():
            for opt in opts:
                spellings[opt].add(opts)
    # an option string always travels with the same aliases
    assert {opt: seen for opt, seen in spellings.items() if len(seen) > 1} == {}
    every = {opt for params in _options().values() for opts in params.values() for opt in opts}
    assert "--public-data" not in every and "--target-eps" not in every
    assert {"--eps", "--eps2"} <= set(_options()["train"]["eps"]) and "--max-eps" in every
    assert _options()["select"]["tickets"] == ("--tickets",)
    assert _options()["run"]["ticket_source"] == ("--ticket-source",)


@pytest.mark.parametrize("command", ["generate", "select", "train", "run", "account", "inspect"])
def test_help_shows_choices_and_effective_defaults(command: str, cli) -> None:
    result = cli(command, "-h", env={"COLUMNS": "200"})
    text = result.output
    if command in ("generate", "train"):
        assert re.search(r"mnist\|fashion-mnist\|kmnist\|har\|isolet\|digits", text)
        assert "relu|tanh" in text and "from config" in text
    if command == "train":
        assert "sgd|adam" in text and "gaussian|dpd|shaped" in text and "pld|rdp" in text
        assert "0.9 from config" in text and "50 from config" in text  # defaults.yaml's eps2 and epochs
        assert "csv|tensorboard|mlflow|none" in text and "dpltm[tensorboard]" in text  # markup kept
    if command == "select":
        assert "0.1 from config" in text and "50 from config" in text  # ε1 and ν
    if command == "run":
        assert "--ticket-source" in text and "public|private" in text and "[default: mnist]" in text
    if command == "account":
        assert "gaussian|dpd|shaped" in text and "--eps,--eps2" in text.replace(" ", "")
    if command == "inspect":
        assert ".safetensors" in text


@pytest.mark.parametrize("argv", [["train", "--dense", "--target-eps", "1"], ["run", "--tickets", "private"]])
def test_options_from_before_the_redesign_are_plain_unknown_options(argv: list[str], cli) -> None:
    """0.1.0's renamed spellings are gone (no hidden options that only say "renamed")."""
    result = cli(*argv, ok=False)
    assert result.exit_code == 2 and "No such option" in result.output and "Traceback" not in result.output


@pytest.mark.slow
def test_a_bad_choice_is_one_line_from_the_real_entry_point() -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "dpltm.cli", "train", "--dense", "--dataset", "mnsit"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "dpltm: error: Invalid value for '--dataset': 'mnsit' is not one of 'mnist', 'fashion-mnist', "
        "'kmnist', 'har', 'isolet', 'digits'."]
