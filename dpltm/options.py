"""Each command-line option, declared once: on the field of the request it fills.

A request (dpltm.stages.requests and its siblings) is a frozen dataclass whose fields carry a `Flag`: the
option's names, help, choices, bounds and the config key its default falls through to. The CLI derives each
command's typer signature from those fields (dpltm.cli_options), `--help` shows the config's default
(configs/defaults.yaml) from the same key, and a library caller builds the same request in Python. This is
open_lth's design (flags derived from the hparams dataclasses) with typer as the parser: a setting is written
in one place and the flags, the signature and the request follow from it. Torch-free: `--help` imports it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from dpltm.choices import (
    Accountant,
    Activation,
    Arch,
    Dataset,
    Logger,
    Neighboring,
    Noise,
    NoiseFilterName,
    Optimizer,
    PrivatePrune,
    Split,
)

FLAG = "dpltm.flag"
"""The key of a request field's metadata that holds its `Flag`."""

MAX_SEED = 2**63 - 1
"""Seeds fit torch's and numpy's generators (config.MAX_SEED, without importing torch)."""


@functools.cache
def _defaults_yaml() -> dict[str, Any]:
    """configs/defaults.yaml, read without importing the config machinery (it loads torch)."""
    from importlib import resources

    import yaml

    return yaml.safe_load((resources.files("dpltm.configs") / "defaults.yaml").read_text("utf-8")) or {}


def config_default(dotted: str) -> str:
    """`--help`'s text for an option whose default falls through to the config: defaults.yaml's value, marked as
    the config's (a dataset's yaml or --config may override it)."""
    node: Any = _defaults_yaml()
    for part in dotted.split("."):
        node = node[part]
    shown = "none" if node is None else ",".join(map(str, node)) if isinstance(node, list) else str(node)
    return f"{shown} from config"


@dataclass(frozen=True)
class Flag:
    """One option: what typer needs to parse it and `--help` to explain it.

    `decls` are its names (default: the field's name with dashes); `choices` the enum a string field is parsed
    with (the request holds the plain value); `config` the dotted key of configs/defaults.yaml its default falls
    through to; `shown` the default `--help` shows instead (False: none)."""

    help: str
    decls: tuple[str, ...] = ()
    config: str | None = None
    shown: str | bool | None = None
    choices: type[Enum] | None = None
    metavar: str | None = None
    min: int | None = None
    max: int | None = None
    argument: bool = False

    def __call__(self, default: Any = None) -> Any:
        """A request field that takes this option, with `default` when it is not given."""
        return dataclasses.field(default=default, metadata={FLAG: self})

    def show_default(self) -> str | bool:
        if self.shown is not None:
            return self.shown
        return config_default(self.config) if self.config is not None else True


def flag(*decls: str, help: str, **details: Any) -> Flag:
    return Flag(help, decls, **details)


def option(*decls: str, help: str, default: Any = None, required: bool = False, **details: Any) -> Any:
    """A request field for an option of one command (shared ones are the `Flag`s below); a `required` one has
    no default."""
    return flag(*decls, help=help, **details)(dataclasses.MISSING if required else default)


def flag_of(field: dataclasses.Field[Any]) -> Flag | None:
    return field.metadata.get(FLAG)


@dataclass(frozen=True)
class Overrides:
    """Settings given by flags or a library caller, each under its dotted config key (`train.eps2`, `seed`; None:
    not given, the config's), and the recipe they train with: what a request hands its stage. dpltm.config layers
    them over the YAML files, the one place a settings tree is built."""

    values: Mapping[str, Any] = field(default_factory=dict)
    recipe: str | None = None

    @classmethod
    def from_tree(cls, tree: Mapping[str, Any]) -> Overrides:
        """A tree shaped as a config file (`{"train": {"eps2": 1.0}}`, a `recipe` key beside the sections)."""
        values: dict[str, Any] = {}
        for key, value in tree.items():
            if isinstance(value, Mapping):
                values.update({f"{key}.{inner}": v for inner, v in value.items()})
            elif key != "recipe":
                values[key] = value
        return cls(values, tree.get("recipe"))

    def get(self, key: str) -> Any:
        return self.values.get(key)

    def given(self, section: str) -> set[str]:
        """The keys of `section` that are given (not None)."""
        return {key.split(".", 1)[1] for key, value in self.values.items()
                if key.startswith(f"{section}.") and value is not None}

    def section(self, name: str) -> Mapping[str, Any]:
        """The values under section `name`, by their key inside it (a None among them included)."""
        return {key.split(".", 1)[1]: value for key, value in self.values.items() if key.startswith(f"{name}.")}

    def updated(self, values: Mapping[str, Any], section: str | None = None) -> Overrides:
        """These with `values` over them (their keys under `section` when it is named)."""
        prefix = f"{section}." if section is not None else ""
        return replace(self, values={**self.values, **{prefix + key: v for key, v in values.items()}})


# The options several commands share, declared once here.

ACCOUNTANT = flag(config="train.accountant", choices=Accountant,
    help='Privacy accountant: pld (tight numerical) or rdp.')
ACTIVATION = flag(config="model.activation", choices=Activation,
    help='Hidden activation: relu (paper) or tanh (bounded; helps under DP, Papernot et al. 2021).')
ARCH = flag("--arch", shown="mlp", choices=Arch,
    help=("Network: mlp (LeNet-300-100 by default; the paper's), lenet5 (two 5×5 convolutions with 6 and 16"
          ' maps, each followed by the activation and 2×2 average pooling, then --hidden, default 120,84; '
          "masks on convolution and linear weights; 28×28 images) or dp-cnn (the DP-SGD benchmarks' small "
          'CNN: 16 8×8/2 and 32 4×4/2 convolutions with 2×2/1 max pooling, then --hidden, default 32; '
          'images of 14×14 or more), or a fixed ScatterNet front end (wavelet scattering, no weights, costs'
          ' no privacy; features cached per record) with a head: scatter-linear (one linear layer), '
          "scatter-mlp (--hidden, default 100) or scatter-cnn (Tramèr & Boneh's small CNN)."))
BATCH_SIZE = flag(config="train.batch_size", help='Expected batch size L (Poisson sampling, q = L/N).')
PHYSICAL_BATCH = flag("--physical-batch", config="train.physical_batch", shown="none",
    help=('The most rows whose per-sample gradients are computed at once (memory): a larger Poisson batch runs '
          'in chunks whose clipped sums are added before the one noise draw (the same mechanism and ε).'))
CLIP = flag(config="train.clip", help='Per-sample clipping norm C (paper: 1).')
CONFIG_FILE = flag("--config", help='YAML file overriding configs/defaults.yaml.')
CUDA_GRAPHS = flag("--cuda-graphs",
    help=('Replay each training step from CUDA graphs (one CUDA device): the same batches and updates '
          'without per-step kernel launches; DP batches are padded to a fixed capacity with zero-weight '
          'rows (overflow in extra chunks, noise once per step): the same mechanism.'))
DATA_DIR = flag("--data-dir", help='Data root (else $DPLTM_DATA_DIR, else ../shared/data).')
DELTA = flag(config="train.delta", help='δ (paper: 1e-5).')
DEVICE = flag("--device", help='auto, cpu, cuda or cuda:N.')
DOWNLOAD = flag("--download",
    help=('First fetch missing official files of the datasets used into the data root: mnist, fashion-mnist'
          " and kmnist, md5-checked, through torchvision's dataset classes (pip install "
          "'dpltm\\[download]'); har, isolet and digits must already be there."))
EPOCHS = flag(config="train.epochs", help='Epochs (paper: 50).')
JSON = flag("--json", help='Print the final report as one JSON object on stdout.')
LEARNING_RATE = flag(config="train.lr", help='Learning rate (paper: 0.1).')
LOG_DIR = flag("--log-dir", help='Root of the run folders (else $DPLTM_LOG_DIR, else ./logs).')
LOGGER = flag("--logger", choices=Logger,
    help=("Lightning logger of the run's versioned folder (<log-dir>/<command>/<dataset>/version_N): csv, "
          "tensorboard (pip install 'dpltm\\[tensorboard]'), mlflow (pip install 'dpltm\\[mlflow]'; "
          '$MLFLOW_TRACKING_URI, else <log-dir>/mlflow.db) or none (run.json only, which `dpltm plot` '
          'reads).'))
AUGMULT = flag("--augmult", metavar="K", config="train.augmult",
    help=("Augmentation multiplicity (De et al. 2022): each record's gradient is the mean over K fixed shifted "
          "views of its image (view 0 the image) before clipping, so it stays one record's: the same "
          'sensitivity, sampling and ε. For --arch mlp, scatter-linear and scatter-mlp over square images; '
          "the ScatterNet's features of each view are computed once and cached. 1: off."))
MOMENTUM = flag(config="train.momentum", help='SGD momentum on the privatized gradients, in [0, 1).')
NEIGHBORING = flag("--neighbouring", "--neighboring", config="train.neighboring", shown="add-remove",
                   choices=Neighboring,
    help=('Neighbouring datasets ε is stated for: add-remove (one record added or removed; the number of '
          'training records N is treated as public, as Opacus and TF Privacy do) or replace-one (one record'
          ' replaced, N fixed; a larger ε for the same run).'))
NOISE_FILTER = flag(config="train.noise_filter", choices=NoiseFilterName,
    help=('A low-pass filter over the noisy gradients before the optimiser: doppler (Zhang et al. 2024, a first-'
          'order filter, unit gain) or none. Post-processing of the released gradients: no ε.'))
NOISE = flag(config="train.noise", choices=Noise,
    help=('Noise plug-in: gaussian, dpd (differentially private dropout; --sigma is its σ, accounted as 2σ)'
          ' or shaped (needs --public-dataset).'))
PRIVATE_PRUNE = flag("--prune", config="private_ticket.prune", choices=PrivatePrune,
    help=('With a private ticket: what its mask removes, single weights by magnitude (weights) or whole input '
          'features of the first linear layer by the norm of their DP warm-up weights (inputs: DP feature '
          'selection; --density is then the fraction of features kept).'))
OPTIMIZER = flag(config="train.optimizer", choices=Optimizer, help='sgd, or adam (NoisyAdam).')
PRIVATE_DATASET = flag(config="data.dataset", shown="mnist", choices=Dataset,
    help="Private dataset to train on (or the --config file's data.dataset).")
SEED = flag(config="seed", help='Seed for the data split and any fresh layer.')
NOISE_SEED = flag("--noise-seed", min=0, max=MAX_SEED,
    help=('Seed the noise and Poisson sampling (reproducible; DP only while the seed stays secret). '
          'Default: a fresh OS-CSPRNG seed, never stored.'))
SIGMA = flag(config="train.sigma", shown=True, help='Noise multiplier σ (skips calibration; ε is reported).')
SPLIT = flag(config="data.split", choices=Split,
    help=('Official split to draw from (train: the official training portion, the official test set as test'
          ' set; test/all: a per-record 80/20 split of that pool).'))
VAL_FRACTION = flag(config="data.val_fraction", help='Fraction of the training pool held out for validation.')

PROGRESS = flag("--progress/--no-progress", help="Show progress bars.")

HALVING = flag("--halving", metavar="RUNGS", config="select.halving", shown="the config's select.halving (0)",
    help=('Successive halving in the noise-aware choice: after T/2^RUNGS, …, T/4, T/2 steps only the dense '
          'network and the better half of the tickets train on (5 candidates, 2 rungs: the cost of 3 full '
          'runs instead of 5). 0: every candidate trains all T steps.'))
EMA = flag("--ema", metavar="DECAY", config="train.ema", shown=True,
    help=('Release and evaluate an exponential moving average of the iterates with this decay, e.g. 0.999 '
          '(post-processing: free). Default: the final iterate.'))
EMA_WARMUP = flag("--ema-warmup/--no-ema-warmup", config="train.ema_warmup", shown="the recipe's",
    help=("Warm the moving average up: decay_t = min(DECAY, (1 + t)/(10 + t)) (TensorFlow's rule), so the "
          'first iterates (a far-away start) do not keep a weight of DECAY^T. Needs --ema.'))
