"""The commands that read, check or convert what the pipeline wrote (inspect, predict, export, plot), fetch data
(download) or do the privacy arithmetic alone (account): their requests, declared as every command's are."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpltm import options as opt
from dpltm.choices import Dataset, Noise, Part, Split
from dpltm.options import option
from dpltm.stages.requests import CommandRequest

Warn = Callable[[str], None]


@dataclass(frozen=True)
class InspectRequest(CommandRequest):
    """`dpltm inspect`: any dpltm file as tables."""

    path: Path = option(required=True, argument=True,
        help=('A ticket file (`dpltm generate`), a winner (`dpltm select`), a model (`dpltm train`), its export'
              ' (.safetensors) or a library run (`make_private(...).save`).'))
    json_out: bool = opt.JSON(False)

    def run(self, warn: Warn) -> tuple[dict[str, Any], Any]:
        """The file's summary and a function that prints it as tables."""
        from dpltm.stages.inspect import inspect_file

        return inspect_file(self.path, warn=warn)


@dataclass(frozen=True)
class PredictRequest(CommandRequest):
    """`dpltm predict`: a trained model's accuracy on a dataset, and its predictions."""

    model: Path = option(required=True,
        help='A model: a `dpltm train` checkpoint or its `dpltm export` (.safetensors).')
    dataset: str | None = option(shown="the one the model was trained on", choices=Dataset,
        help='Dataset to predict on.')
    split: str | None = option(shown="the model's own on its training dataset, else train", choices=Split,
        help=('Official split to draw from, as in training (train: the official test set is the test set; '
              'test/all: a per-record 80/20 split of that pool).'))
    part: str = option(choices=Part, default='test',
        help=("Which records: the test set, the validation hold-out or the training set (with the model's own "
              'data settings when the dataset is its training dataset).'))
    device: str = opt.DEVICE("auto")
    data_dir: Path | None = opt.DATA_DIR()
    download: bool = opt.DOWNLOAD(False)
    out: Path | None = option(
        help='Write the predictions here as CSV: index, label, prediction and one probability per class.')
    overwrite: bool = option(default=False, help='Replace an existing --out file.')
    expose_training_records: bool = option("--expose-training-records", default=False,
        help=("Allow --part train on the model's own dataset: its output holds per-record labels and model "
              'outputs of the private training records, which are not differentially private.'))
    json_out: bool = opt.JSON(False)

    def run(self) -> dict[str, Any]:
        from dpltm.stages.predict import stage_predict

        return stage_predict(self.model, self.dataset, self.part, self.data_dir, self.device, self.out, self.overwrite,
                             download=self.download, split=self.split,
                             expose_training_records=self.expose_training_records)


@dataclass(frozen=True)
class ExportRequest(CommandRequest):
    """`dpltm export`: a trained model as safetensors with its privacy statement."""

    model: Path = option(required=True,
        help='A `dpltm train` checkpoint, or a library run saved by `PrivateTraining.save`.')
    out: Path | None = option(shown="the model's path with .safetensors", help='The safetensors file.')
    overwrite: bool = option(default=False, help='Replace an existing file.')
    json_out: bool = opt.JSON(False)

    def run(self, warn: Warn) -> Any:
        from dpltm.stages.export import stage_export

        return stage_export(self.model, self.out, self.overwrite, warn=warn)


@dataclass(frozen=True)
class PlotRequest(CommandRequest):
    """`dpltm plot`: a run's curves."""

    runs: tuple[Path, ...] = option(required=True, argument=True,
        help='Run folders (logs/<command>/<dataset>/version_N) or their run.json; several overlay.')
    out: Path | None = option(shown="plot.png in the first run's folder", help='Figure file (.png, .pdf or .svg).')
    overwrite: bool = option(default=False, help='Replace an existing --out file.')

    def run(self) -> Path:
        from dpltm.plotting import plot_runs

        return plot_runs(list(self.runs), self.out, self.overwrite)


@dataclass(frozen=True)
class DownloadRequest(CommandRequest):
    """`dpltm download`: the official files, md5-checked."""

    datasets: tuple[str, ...] = option(required=True, choices=Dataset, argument=True,
        help="Datasets to fetch (mnist, fashion-mnist, kmnist: through torchvision's dataset classes).")
    data_dir: Path | None = opt.DATA_DIR()
    mirror: str | None = option(
        help=("URL base to fetch the official files from instead of torchvision's mirrors (else "
              '$DPLTM_DOWNLOAD_MIRROR).'))

    def run(self) -> Iterator[str]:
        """One summary line per dataset, as each is fetched."""
        from dpltm.data.download import download_dataset

        for name in self.datasets:
            yield download_dataset(name, self.data_dir, mirror=self.mirror).summary()


@dataclass(frozen=True)
class AccountRequest(CommandRequest):
    """`dpltm account`: ε of Poisson-subsampled DP-SGD by each accountant (or σ for a target ε)."""

    q: float | None = option("--q", help='Poisson sampling rate.')
    sigma: float | None = option(help='Noise multiplier σ.')
    steps: int | None = option(help='Number of steps T.')
    delta: float = option(default=1e-5, help='δ.')
    dataset_size: int | None = option(help='N (with --batch-size and --epochs instead of --q/--steps).')
    batch_size: int | None = option(help='Expected batch size L.')
    epochs: int | None = option(help='Epochs (⌈N/L⌉ steps each).')
    eps: float | None = option("--eps", "--eps2", help='Solve for σ reaching this ε instead.')
    eps1: float | None = option(help='Also compose with an ε1 exponential-mechanism selection.')
    noise: str = option(choices=Noise, default='gaussian',
        help=("Noise plug-in --sigma belongs to: gaussian, dpd (accounted as 2σ; adds the DPD paper's own zCDP "
              'figure as a labelled comparison) or shaped.'))
    neighboring: str | None = opt.NEIGHBORING()
    json_out: bool = opt.JSON(False)

    def run(self) -> dict[str, Any]:
        from dpltm.accounting_report import account_report

        return account_report(q=self.q, sigma=self.sigma, steps=self.steps, delta=self.delta,
                              dataset_size=self.dataset_size, batch_size=self.batch_size, epochs=self.epochs,
                              eps=self.eps, eps1=self.eps1, noise=self.noise,
                              neighboring=self.neighboring or "add_remove")
