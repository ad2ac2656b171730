"""Each option is declared once, on its request's field: the CLI's options are derived from those fields, the
defaults `--help` shows come from configs/defaults.yaml through the same keys, and a request built in Python is
the one the command line parses."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from dpltm import cli
from dpltm.cli_options import parameters, request_command
from dpltm.errors import DpltmUserError
from dpltm.options import flag_of
from dpltm.stages.audit import AuditRequest
from dpltm.stages.requests import CommandRequest, GenerateRequest, SelectRequest
from dpltm.stages.run import RunRequest
from dpltm.stages.tools import (
    AccountRequest,
    DownloadRequest,
    ExportRequest,
    InspectRequest,
    PlotRequest,
    PredictRequest,
)
from dpltm.stages.train import TrainRequest

REQUESTS = {"generate": GenerateRequest, "select": SelectRequest, "train": TrainRequest, "audit": AuditRequest,
            "run": RunRequest, "account": AccountRequest, "inspect": InspectRequest, "predict": PredictRequest,
            "export": ExportRequest, "plot": PlotRequest, "download": DownloadRequest}
DEFAULTS = yaml.safe_load((Path(__file__).parents[2] / "configs" / "defaults.yaml").read_text("utf-8"))


def test_every_command_takes_exactly_its_requests_fields_in_their_order() -> None:
    commands = typer.main.get_command(cli.app).commands
    assert set(commands) == set(REQUESTS)
    for name, request_type in REQUESTS.items():
        flagged = [f.name for f in dataclasses.fields(request_type) if flag_of(f) is not None]
        assert [p.name for p in commands[name].params] == flagged, name
        assert [p.name for p in parameters(request_type)] == flagged
        for param, field in zip(commands[name].params, (f for f in dataclasses.fields(request_type) if flag_of(f))):
            assert param.help == flag_of(field).help  # type: ignore[union-attr]


def test_every_config_key_an_option_names_is_a_setting_and_a_shown_default_is_in_the_defaults_file() -> None:
    from dpltm.config import SECTIONS, TOP_LEVEL_SCALARS

    for request_type in REQUESTS.values():
        for field in dataclasses.fields(request_type):
            flag = flag_of(field)
            if flag is None or flag.config is None:
                continue
            where = f"{request_type.__name__}.{field.name}: {flag.config}"
            section, _, key = flag.config.partition(".")
            assert (key in {f.name for f in dataclasses.fields(SECTIONS[section])} if key
                    else section in TOP_LEVEL_SCALARS), f"{where} names no setting"
            if flag.shown is None:  # --help shows defaults.yaml's value
                node = DEFAULTS
                for part in flag.config.split("."):
                    assert part in node, f"{where} is not in defaults.yaml"
                    node = node[part]


def test_a_requests_overrides_are_its_options_under_their_config_keys() -> None:
    request = TrainRequest(dataset="digits", eps=0.5, sigma=None, lr_sigma=3.0, neighboring="replace_one", seed=4)
    given = request.overrides("data", "train", "seed")
    assert given.get("data.dataset") == "digits" and given.get("seed") == 4
    assert given.get("train.eps2") == 0.5 and given.get("train.lr_sigma") == 3.0
    assert given.get("train.neighboring") == "replace_one" and given.get("train.sigma") is None
    assert not any(key.startswith("model.") for key in given.values) and "train.activation" not in given.values
    assert set(SelectRequest(eps1=0.2).overrides("select").values) == {f"select.{k}" for k in ("eps1", "nu", "halving",
                                                                                                 "search")}


def test_help_shows_the_defaults_files_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    shown = CliRunner().invoke(cli.app, ["train", "--help"]).output
    assert f"{DEFAULTS['train']['eps2']} from config" in shown
    assert f"{DEFAULTS['train']['batch_size']} from config" in shown


@pytest.fixture
def parsed() -> list[CommandRequest]:
    return []


def _parse(request_type: type[CommandRequest], argv: list[str], into: list[CommandRequest]) -> CommandRequest:
    app = typer.Typer()

    @app.command()
    @request_command(request_type)
    def command(request: CommandRequest) -> None:
        into.append(request)

    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    return into[-1]


def test_the_command_line_parses_into_the_request_a_caller_would_build(parsed: list[CommandRequest]) -> None:
    request = _parse(TrainRequest, ["--dense", "--dataset", "digits", "--eps", "1", "--neighbouring", "replace-one",
                                    "--recipe", "tuned"], parsed)
    assert request == TrainRequest(dense=True, dataset="digits", eps=1.0, neighboring="replace_one", recipe="tuned")
    assert request.given == {"dense", "dataset", "eps", "neighboring", "recipe"}
    assert _parse(RunRequest, [], parsed) == RunRequest()
    assert _parse(DownloadRequest, ["mnist", "kmnist"], parsed).datasets == ("mnist", "kmnist")  # type: ignore[attr-defined]


def test_a_request_built_in_python_gets_the_commands_checks() -> None:
    with pytest.raises(DpltmUserError, match="--dense trains the full network: drop --ticket"):
        TrainRequest(dense=True, ticket=Path("winner.pt")).check()
    with pytest.raises(DpltmUserError, match="--best picks without privacy"):
        SelectRequest(best=True, eps1=0.1).check()
