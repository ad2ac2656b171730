"""The closed sets of names the CLI offers, as enums, so `--help` lists them and typos fail early.

This module imports nothing heavy (no torch): `dpltm -h` stays fast. The names are owned by the
registries they select from (datasets: data/loaders.py, noise plug-ins: dp/noise.py, ...);
tests/cli/test_cli_vocabulary.py checks every enum here against its registry, so the two cannot drift.
"""

from __future__ import annotations

from enum import Enum

from dpltm.architectures import ARCHITECTURES
from dpltm.data.catalog import DATASET_ENTRIES
from dpltm.dp.noise import NOISE_PLUGINS
from dpltm.privacy.accountants import ACCOUNTANTS
from dpltm.selection.rules import SELECTION_RULES


class Choice(str, Enum):
    """A str enum whose members print as their value (typer shows `[mnist|kmnist|...]`)."""

    def __str__(self) -> str:
        return str(self.value)


Dataset = Choice("Dataset", {name.replace("-", "_"): name for name in DATASET_ENTRIES})  # type: ignore[misc]
"""`--dataset`: the datasets of dpltm/data/catalog.py."""


class Split(Choice):
    train = "train"
    test = "test"
    all = "all"


class Activation(Choice):
    relu = "relu"
    tanh = "tanh"


SelectionRuleName = Choice(  # type: ignore[misc]
    "SelectionRuleName", {name.replace("-", "_"): name for name in SELECTION_RULES})
"""`select --rule`: the selection rules of dpltm/selection/rules.py."""


Arch = Choice("Arch", {name: name for name in ARCHITECTURES})  # type: ignore[misc]
"""`--arch`: the built-in networks of dpltm/architectures.py."""


class Recipe(Choice):
    """`train --recipe`: the paper's settings, or a recipe chosen on public data (configs/recipes/)."""

    paper = "paper"
    tuned = "tuned"
    scatter = "scatter"
    cnn = "cnn"


RunRecipe = Choice("RunRecipe", {"auto": "auto", **{r.name: r.value for r in Recipe}})  # type: ignore[misc]
"""`run --recipe`: auto, which picks one of the recipes by the private set's size and shape (dpltm.stages.run),
or one of them."""


class Optimizer(Choice):
    sgd = "sgd"
    adam = "adam"


class NoiseFilterName(Choice):
    """`--noise-filter`: the filters over the noisy gradients of dpltm/dp/noise_filter.py."""

    none = "none"
    doppler = "doppler"


Noise = Choice("Noise", {name.replace("-", "_"): name for name in NOISE_PLUGINS})  # type: ignore[misc]
"""`--noise`: the plug-ins of dpltm/dp/noise.py."""


Accountant = Choice("Accountant", {name: name for name in ACCOUNTANTS})  # type: ignore[misc]
"""`--accountant`: the accountants of dpltm/privacy/accountants.py."""


class Neighboring(Choice):
    """The neighbouring relation ε is stated for (dpltm.privacy.accounting.NEIGHBORING, with hyphens)."""

    add_remove = "add-remove"
    replace_one = "replace-one"

    @property
    def relation(self) -> str:
        return self.value.replace("-", "_")


class Rewind(Choice):
    warmup = "warmup"
    init = "init"


class PrivatePrune(Choice):
    """`private_ticket.prune`: what a private ticket's mask removes, single weights or whole input features."""

    weights = "weights"
    inputs = "inputs"


class OutputLayer(Choice):
    """`train --output-layer`: a public start's output layer, θ0's or the public-trained one."""

    reinit = "reinit"
    keep = "keep"


class Strategy(Choice):
    auto = "auto"
    ddp = "ddp"


class Logger(Choice):
    """Lightning's loggers a run can write to (besides the run folder's own run.json)."""

    csv = "csv"
    tensorboard = "tensorboard"
    mlflow = "mlflow"
    none = "none"


class Part(Choice):
    """Which records of a loaded dataset `dpltm predict` runs on."""

    test = "test"
    val = "val"
    train = "train"


class ThreatModel(Choice):
    """What an audit's attack sees (dpltm.audit.canaries)."""

    white_box = "white-box"
    black_box = "black-box"
