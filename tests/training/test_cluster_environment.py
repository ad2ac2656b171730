"""A one-process Trainer's cluster environment: chosen as Lightning would, without starting MPI to rule MPI out."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins.environments import LightningEnvironment, MPIEnvironment, SLURMEnvironment

from dpltm.training.plain import MPI_LAUNCH_VARIABLES, lightning_trainer, single_process_environment

LAUNCHER_VARIABLES = (*MPI_LAUNCH_VARIABLES, "SLURM_NTASKS", "SLURM_JOB_NAME", "LSB_JOBID", "LSB_DJOB_RANKFILE",
                      "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_SIZE", "TORCHELASTIC_RUN_ID")


@pytest.fixture
def mpi_detections(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """No launcher in the environment; Lightning's MPI check recorded (and answering 'no MPI world') when it runs."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    calls: list[str] = []

    def detect() -> bool:
        calls.append("mpi")
        return False

    monkeypatch.setattr(MPIEnvironment, "detect", staticmethod(detect))
    return calls


def _environment(trainer: object) -> object:
    return trainer._accelerator_connector.cluster_environment  # type: ignore[attr-defined]


def test_a_process_no_launcher_started_gets_lightnings_plain_environment_without_the_mpi_check(
        mpi_detections: list[str]) -> None:
    trainer = lightning_trainer(torch.device("cpu"), max_steps=1)
    assert type(_environment(trainer)) is LightningEnvironment
    assert mpi_detections == []  # mpi4py never imported: MPI never started in this process


@pytest.mark.parametrize("variable", MPI_LAUNCH_VARIABLES)
def test_under_an_mpi_launcher_lightning_checks_mpi_itself(mpi_detections: list[str], variable: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(variable, "1")
    trainer = lightning_trainer(torch.device("cpu"), max_steps=1)
    assert mpi_detections == ["mpi"]
    assert type(_environment(trainer)) is LightningEnvironment  # a world of one, as Lightning decides


def test_under_slurm_lightning_keeps_its_slurm_environment(mpi_detections: list[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_JOB_NAME", "dpltm-train")
    trainer = lightning_trainer(torch.device("cpu"), max_steps=1)
    assert type(_environment(trainer)) is SLURMEnvironment  # its signal handling (requeue) as before


@pytest.mark.parametrize("launcher", [
    {"TORCHELASTIC_RUN_ID": "1"},
    {"LSB_JOBID": "1", "LSB_DJOB_RANKFILE": "/tmp/rankfile", "JSM_NAMESPACE_LOCAL_RANK": "0",
     "JSM_NAMESPACE_SIZE": "1"},
], ids=["torchelastic", "lsf"])
def test_other_launchers_leave_the_choice_to_lightning(mpi_detections: list[str], monkeypatch: pytest.MonkeyPatch,
                                                       launcher: dict[str, str]) -> None:
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    assert single_process_environment() is None


def test_a_callers_own_environment_is_kept(mpi_detections: list[str]) -> None:
    own = LightningEnvironment()
    trainer = lightning_trainer(torch.device("cpu"), max_steps=1, plugins=[own])
    assert _environment(trainer) is own


def test_a_callers_other_plugins_are_kept_beside_the_environment(mpi_detections: list[str]) -> None:
    from lightning.pytorch.plugins.precision import Precision

    precision = Precision()
    trainer = lightning_trainer(torch.device("cpu"), max_steps=1, plugins=[precision])
    assert trainer.precision_plugin is precision
    assert type(_environment(trainer)) is LightningEnvironment
    assert mpi_detections == []
