"""`train --freeze LAYER`: layers held at their start weights (public-trained with `--rewind public`, else
θ0) get no clipped gradient, no noise and no update (Adamczewski & Park 2023's parameter freezing, issue
21); the privacy ledger is the unfrozen run's, the model file keeps every layer's mask and loads, and
bad names are one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dpltm.checkpoint import load_trained_model, load_winner
from dpltm.dp.step import EngineLayout, step_layout
from dpltm.errors import DpltmUserError
from dpltm.masks import PrunedWeights, freeze_layers_, full_masks, stored_state
from dpltm.networks.lenet import build_architecture, build_network
from tests.cli.test_rewind import FAST_TRAIN, _one_line_error, _train, data_root, public_winner  # noqa: F401


def test_freezing_holds_the_named_layers_and_refuses_bad_names() -> None:
    model = build_network(build_architecture(784, 10, (32,), None, "tanh"))
    masks = full_masks(model)
    assert freeze_layers_(model, ("hidden.0",)) == ["hidden.0.weight", "hidden.0.bias"]
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["output.weight", "output.bias"]
    assert isinstance(step_layout(model, masks), EngineLayout)  # the fused LeNet step trains every layer
    PrunedWeights(model, masks)()  # a frozen layer's mask is not re-applied: it is never updated
    assert set(stored_state(model, masks)) >= {"mask_hidden_0_weight", "mask_output_weight"}
    with pytest.raises(DpltmUserError, match="names no layer of this network: hidden.7"):
        freeze_layers_(model, ("hidden.7",))
    with pytest.raises(DpltmUserError, match="nothing would be trained"):
        freeze_layers_(model, ("hidden.0", "output"))


def test_a_frozen_public_layer_stays_public_and_costs_nothing(cli, data_root: Path, public_winner: Path,  # type: ignore[no-untyped-def]  # noqa: F811
                                                             tmp_path: Path) -> None:
    winner = load_winner(public_winner)
    frozen = json.loads(_train(cli, data_root, public_winner, tmp_path / "f.pt", "--rewind", "public",
                               "--freeze", "hidden.0").stdout)
    plain = json.loads(_train(cli, data_root, public_winner, tmp_path / "p.pt", "--rewind", "public").stdout)
    assert frozen["epsilon"] == plain["epsilon"] and frozen["noise_multiplier"] == plain["noise_multiplier"]
    model = load_trained_model(tmp_path / "f.pt")
    state, masks = model.state_dict, {k: v for k, v in model.state_dict.items() if k.startswith("mask_")}
    public = winner.public_weights
    assert public is not None
    mask = winner.masks["hidden.0.weight"]
    assert torch.equal(state["hidden.0.weight"], public["hidden.0.weight"] * mask)  # held, pruned zeros kept
    assert torch.equal(state["hidden.0.bias"], public["hidden.0.bias"])
    assert not torch.equal(state["output.weight"], winner.theta0["output.weight"])  # the rest trained
    assert {"mask_hidden_0_weight", "mask_hidden_1_weight", "mask_output_weight"} <= set(masks)
    assert model.transfer.frozen_layers == ["hidden.0"]
    assert model.transfer.trained_parameters < sum(v.numel() for k, v in state.items() if not k.startswith("mask_"))
    shown = json.loads(cli("predict", "--model", str(tmp_path / "f.pt"), "--dataset", "fashion-mnist",
                           "--data-dir", str(data_root), "--json").stdout)
    assert shown["accuracy"] == pytest.approx(frozen["test_accuracy"])


@pytest.mark.parametrize("value, fragment", [("hidden.9", "names no layer"),
                                             ("hidden.0,hidden.1,output", "every layer")])
def test_bad_freeze_is_one_line(cli, data_root: Path, public_winner: Path, tmp_path: Path,  # type: ignore[no-untyped-def]  # noqa: F811
                                value: str, fragment: str) -> None:
    result: Any = _train(cli, data_root, public_winner, tmp_path / "x.pt", "--freeze", value, ok=False)
    _one_line_error(result, fragment)
    assert not (tmp_path / "x.pt").exists()

