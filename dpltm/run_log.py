"""A run's log: a versioned folder per run, written through Lightning's loggers.

`logs/<command>/<dataset>/version_<N>/` (N one past the highest there, as Lightning numbers its
own runs; claimed with an exclusive `mkdir`, so two runs started together get two folders and a
re-run never overwrites an earlier one). Lightning's CSV, TensorBoard or MLflow logger writes the
settings (hparams) and the per-epoch / per-round metrics; `run.json` (format `dpltm-run-v1`, read
by `dpltm plot`) holds the run's history and final report in float64, with its status: `running`,
`finished`, `failed` or `interrupted` (an interrupted run keeps its folder; no model was kept).

What is logged is what the run releases anyway: the released model's accuracies and the ε spent
(DP runs), the rounds' accuracies and densities and the training loss (non-private IMP). A DP
run's training loss, clipping rate or per-batch timing is never logged: it would be a release
of the private data outside the accountant.

TensorBoard keeps scalars in float32, which can round a value *down*; ε is therefore logged
as the smallest float32 ≥ ε (`float32_at_least`), so no logger ever shows less than was spent.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from dpltm.choices import Logger
from dpltm.errors import DpltmUserError
from dpltm.strict_json import dumps

LOG_DIR_ENV = "DPLTM_LOG_DIR"
RUN_FILE = "run.json"
FORMAT = "dpltm-run-v1"
LOGGERS = tuple(choice.value for choice in Logger)
_VERSION = re.compile(r"version_(\d+)$")


def default_log_root() -> Path:
    """$DPLTM_LOG_DIR, else ./logs (beside ./checkpoints)."""
    return Path(os.environ[LOG_DIR_ENV]).expanduser() if os.environ.get(LOG_DIR_ENV) else Path("logs")


def float32_at_least(value: float) -> float:
    """The smallest float32 that is ≥ `value` (as a Python float): what a float32 logger may show of
    an ε without understating it."""
    if not math.isfinite(value):
        return value
    rounded = np.float32(value)
    if float(rounded) < value:
        rounded = np.nextafter(rounded, np.float32(np.inf))
    return float(rounded)


def check_log_root(root: Path | None, command: str | None = None, dataset: str | None = None) -> Path:
    """The log root, checked before any work (read-only: creates nothing): a directory, or a path
    whose nearest existing ancestor is a writable directory; and so is the run's own folder under it
    (`<command>/<dataset>`), so a file in its place is refused before any work, not when the run starts."""
    from dpltm.outputs import check_writable
    from dpltm.paths import check_path_length

    source = "--log-dir" if root is not None else f"${LOG_DIR_ENV}" if os.environ.get(LOG_DIR_ENV) else "the log root"
    root = root if root is not None else default_log_root()
    check_path_length(root, source, file=False)
    if root.exists() and not root.is_dir():
        raise DpltmUserError(f"{source} {root} is not a directory")
    try:
        check_writable(root / "version_0")
    except DpltmUserError as exc:
        raise DpltmUserError(f"{source} {root}: {exc}") from None
    folder = root / (command or "") / (dataset or "")
    for part in (folder.parent, folder) if command is not None else ():
        if part.exists() and not part.is_dir():
            raise DpltmUserError(f"{source} {root}: {part} is not a directory, and the run's log goes in {folder}: "
                                 "remove it or log elsewhere")
    return root


def claim_version_folder(parent: Path) -> Path:
    """Create and return `parent/version_<N>`, N one past the highest existing; `mkdir` without
    `exist_ok` makes the claim exclusive, so concurrent runs never share a folder."""
    try:
        parent.mkdir(parents=True, exist_ok=True)
        taken = [int(m.group(1)) for p in parent.iterdir() if (m := _VERSION.match(p.name))]
    except OSError as exc:
        raise DpltmUserError(f"cannot create the log folder {parent}: {exc.strerror or exc}") from None
    version = max(taken, default=-1) + 1
    for _ in range(1000):
        folder = parent / f"version_{version}"
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            version += 1
        except OSError as exc:
            raise DpltmUserError(f"cannot create the log folder {folder}: {exc.strerror or exc}") from None
    raise DpltmUserError(f"cannot claim a free version folder under {parent}")


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested settings as `section/key` scalars (what every logger's hparams accept)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, f"{name}/"))
        else:
            out[name] = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value
    return out


def mlflow_tracking_uri(root: Path) -> str:
    """$MLFLOW_TRACKING_URI (the user's server or database) if set, else a SQLite store beside the
    run folders (`<log-dir>/mlflow.db`): MLflow 3 no longer writes its file store by default."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(root / 'mlflow.db').resolve()}"


def check_logger(kind: str) -> None:
    """Before any work: the logger's package is installed (found, not imported: MLflow is slow to
    import), so a run is not refused only when its first metrics are logged."""
    import importlib.util

    needs = {"tensorboard": (("tensorboard", "tensorboardX"), "TensorBoard", "tensorboard"),
             "mlflow": (("mlflow",), "MLflow", "mlflow")}
    if kind not in needs:
        return
    modules, name, extra = needs[kind]
    if not any(importlib.util.find_spec(m) is not None for m in modules):
        raise DpltmUserError(f"--logger {kind} needs {name}, which is not installed: pip install 'dpltm[{extra}]', "
                             "or pick another --logger")


def lightning_logger(kind: str, folder: Path) -> Any:
    """Lightning's logger of `kind`, writing into the run folder (MLflow: a file store beside it)."""
    save_dir, name, version = folder.parent.parent, folder.parent.name, int(folder.name.split("_")[1])
    if kind == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(save_dir, name=name, version=version)
    if kind == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        try:
            return TensorBoardLogger(save_dir, name=name, version=version, default_hp_metric=False)
        except ModuleNotFoundError:
            raise DpltmUserError("--logger tensorboard needs TensorBoard: pip install 'dpltm[tensorboard]'") from None
    if kind == "mlflow":
        from lightning.pytorch.loggers import MLFlowLogger

        try:
            return MLFlowLogger(experiment_name=f"dpltm-{folder.parent.parent.name}-{name}",
                                run_name=folder.name, tracking_uri=mlflow_tracking_uri(folder.parent.parent.parent))
        except ModuleNotFoundError as exc:
            raise DpltmUserError(f"--logger mlflow needs MLflow ({exc}): pip install 'dpltm[mlflow]'") from None
    raise DpltmUserError(f"--logger must be one of {', '.join(LOGGERS)}, got {kind!r}")


class RunLog:
    """One run's folder and logger. Only the process that writes outputs makes one (rank 0)."""

    def __init__(self, command: str, dataset: str, logger: str = "csv", root: Path | None = None,
                 settings: dict[str, Any] | None = None, mode: str | None = None) -> None:
        if logger not in LOGGERS:
            raise DpltmUserError(f"--logger must be one of {', '.join(LOGGERS)}, got {logger!r}")
        root = check_log_root(root)
        self.folder = claim_version_folder(root / command / dataset)
        self.kind = logger
        self.body: dict[str, Any] = {"format": FORMAT, "command": command, "dataset": dataset, "mode": mode,
                                     "logger": logger, "status": "running", "started": _now(),
                                     "settings": settings or {}}
        self.metrics_logged = 0
        from dpltm.provenance import environment

        self.body["environment"] = environment()
        try:
            self.logger = None if logger == "none" else lightning_logger(logger, self.folder)
            if self.logger is not None and settings:
                self.logger.log_hyperparams(_flat(settings))
            self._write()
        except BaseException as exc:
            shutil.rmtree(self.folder, ignore_errors=True)  # nothing was logged: leave no version behind
            if isinstance(exc, (DpltmUserError, KeyboardInterrupt)) or not isinstance(exc, Exception):
                raise
            first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
            raise DpltmUserError(f"cannot start the {logger} logger: {first}") from None

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        """Numbers only; ε (keys starting with `epsilon`) as the float32 at least ε."""
        self.metrics_logged += 1  # the run has started: from now on its folder is kept, whatever happens
        if self.logger is None:
            return
        numbers = {k: (float32_at_least(float(v)) if k.startswith("epsilon") else float(v))
                   for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))}
        if numbers:
            self.logger.log_metrics(numbers, step=step)
            if self.kind == "csv":
                self.logger.save()  # the CSV is readable while the run goes on

    def update(self, **fields: Any) -> None:
        """Add fields to run.json (history, tickets, report, output) and rewrite it atomically."""
        self.body.update(fields)
        self._write()

    def finish(self, status: str = "finished", **fields: Any) -> None:
        self.body.update(fields, status=status, ended=_now())
        self._write()
        if self.logger is not None:  # Lightning's words; MLflow's own for an interrupted run
            self.logger.finalize({"finished": "success", "failed": "failed"}.get(
                status, "KILLED" if self.kind == "mlflow" else status))

    @contextlib.contextmanager
    def closed_on_error(self) -> Iterator[RunLog]:
        """Mark run.json `interrupted` (a signal) or `failed` (anything else) if the block raises."""
        from dpltm.errors import Interrupted

        try:
            yield self
        except DpltmUserError:
            if self.metrics_logged == 0:  # a user's mistake found before anything ran: leave nothing
                with contextlib.suppress(Exception):
                    if self.logger is not None:
                        self.logger.finalize("failed")
                shutil.rmtree(self.folder, ignore_errors=True)
                raise
            with contextlib.suppress(Exception):
                self.finish("failed", error="stopped by a user error")
            raise
        except BaseException as exc:
            status = "interrupted" if isinstance(exc, (KeyboardInterrupt, Interrupted)) else "failed"
            with contextlib.suppress(Exception):  # the original error is what the user must see
                self.finish(status, error=str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            raise

    def _write(self) -> None:
        from dpltm.outputs import write_text_atomic

        write_text_atomic(dumps(self.body) + "\n", self.folder / RUN_FILE)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
