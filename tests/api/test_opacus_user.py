"""An Opacus user at home: ε at any δ, a DataLoader's batch size, a loss that reduces the batch, and Opacus's
names, each working or refused in one line that names dpltm's way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpltm
from dpltm.dp.engine import clipped_gradient_sum_of
from dpltm.errors import DpltmUserError
from tests.api.test_api_privacy import composed_epsilon
from tests.apidata import blobs, mlp


def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = mlp()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_get_epsilon_reads_the_run_at_any_delta_live_and_saved(tmp_path: Path) -> None:
    model, optimizer = fresh()
    run = dpltm.make_private(model, optimizer, blobs(300, 0), noise_multiplier=1.1, batch_size=30, epochs=2)
    assert run.get_epsilon(1e-3) == 0.0  # before the first step
    run.fit()
    for delta in (1e-5, 1e-3, 0.05):
        assert run.get_epsilon(delta) == pytest.approx(composed_epsilon([(0.1, 1.1, 20)], delta), rel=1e-9)
    assert run.get_epsilon() == run.epsilon == pytest.approx(composed_epsilon([(0.1, 1.1, 20)]), rel=1e-9)
    assert run.get_epsilon(1e-3) < run.get_epsilon(1e-5)  # a larger δ, a smaller ε on the same curve
    path = run.save(tmp_path / "run.pt")
    assert dpltm.get_epsilon(path) == run.epsilon
    assert dpltm.get_epsilon(str(path), 1e-3) == run.get_epsilon(1e-3)
    for bad in (0, 1.5, "1e-5", float("nan")):
        with pytest.raises(DpltmUserError, match="^delta must"):
            run.get_epsilon(bad)  # type: ignore[arg-type]
    with pytest.raises(DpltmUserError, match="does not exist|no such|not found"):
        dpltm.get_epsilon(tmp_path / "missing.pt")


def test_a_run_not_dp_end_to_end_is_infinite_at_every_delta() -> None:
    model, optimizer = fresh()
    run = dpltm.make_private(model, optimizer, blobs(300, 0), noise_multiplier=1.1, batch_size=30,
                             masks={"0.weight": torch.ones(16, 10)}, masks_from="these records", masks_private=True)
    run.step()
    assert run.get_epsilon() == run.get_epsilon(1e-2) == float("inf")


def test_a_loaders_batch_size_is_the_expected_one_and_a_disagreeing_one_is_refused() -> None:
    x, y = blobs(300, 0)
    loader = DataLoader(TensorDataset(x, y), batch_size=60, shuffle=True)
    model, optimizer = fresh()
    run = dpltm.make_private(model, optimizer, loader, noise_multiplier=1.0)
    assert run.plan.expected_batch_size == 60 and run.plan.sample_rate == pytest.approx(0.2)
    model, optimizer = fresh()
    assert dpltm.make_private(model, optimizer, loader, noise_multiplier=1.0, batch_size=60).plan.sample_rate == \
        pytest.approx(0.2)
    model, optimizer = fresh()
    with pytest.raises(DpltmUserError, match=r"^the DataLoader's batch_size is 60 and batch_size=30: .*give one of"):
        dpltm.make_private(model, optimizer, loader, noise_multiplier=1.0, batch_size=30)
    model, optimizer = fresh()  # no loader: 256 unless given
    assert dpltm.make_private(model, optimizer, blobs(600, 0), noise_multiplier=1.0).plan.expected_batch_size == 256


@pytest.mark.parametrize("loss", [F.cross_entropy, nn.CrossEntropyLoss(), nn.CrossEntropyLoss(reduction="sum")],
                         ids=["F.cross_entropy", "CrossEntropyLoss()", "sum"])
def test_a_loss_that_reduces_the_batch_names_reduction_none(loss: Any) -> None:
    model, optimizer = fresh()
    with pytest.raises(DpltmUserError) as caught:
        dpltm.make_private(model, optimizer, blobs(300, 0), noise_multiplier=1.0, batch_size=30, loss=loss)
    message = str(caught.value)
    assert "reduction='none'" in message and "got shape ()" in message and "\n" not in message
    assert "(6,)" not in message  # no probe's row count passed off as the batch


def test_the_step_names_the_real_batch_when_its_loss_reduces() -> None:
    model, _ = fresh()
    x, y = blobs(17, 0)
    with pytest.raises(DpltmUserError, match=r"shape \(17,\) for this batch of 17; got shape \(\): .*reduction='none'"):
        clipped_gradient_sum_of(model, x, y, 1.0, {}, lambda out, t: F.cross_entropy(out, t))


def test_opacus_keyword_names_and_accepted_arguments_run_the_same_mechanism() -> None:
    x, y = blobs(300, 0)
    loader = DataLoader(TensorDataset(x, y), batch_size=30)
    model, optimizer = fresh()
    ours = dpltm.make_private(model, optimizer, loader, noise_multiplier=1.0, max_grad_norm=0.5, noise_seed=3)
    ours.fit()
    model2, optimizer2 = fresh()
    theirs = dpltm.make_private(module=model2, optimizer=optimizer2, data_loader=loader, noise_multiplier=1.0,
                                max_grad_norm=0.5, noise_seed=3, poisson_sampling=True, clipping="flat",
                                secure_mode=False, batch_first=True)
    theirs.fit()
    assert theirs.epsilon == ours.epsilon
    # the sampling generator is seeded from the OS, so the weights differ; the mechanism and its ledger do not
    assert theirs.report()["training"] == ours.report()["training"]


def test_make_private_with_epsilon_calibrates_as_make_private_does() -> None:
    model, optimizer = fresh()
    via_opacus_name = dpltm.make_private_with_epsilon(module=model, optimizer=optimizer, data_loader=blobs(300, 0),
                                                      target_epsilon=1.0, target_delta=1e-5, epochs=3,
                                                      max_grad_norm=1.0, batch_size=30)
    model, optimizer = fresh()
    direct = dpltm.make_private(model, optimizer, blobs(300, 0), target_epsilon=1.0, epochs=3, batch_size=30)
    assert via_opacus_name.plan.noise_multiplier == direct.plan.noise_multiplier
    for missing in ({"epochs": 3}, {"target_epsilon": 1.0}):
        model, optimizer = fresh()
        with pytest.raises(DpltmUserError, match="epochs|target_epsilon"):
            dpltm.make_private_with_epsilon(model, optimizer, blobs(300, 0), batch_size=30, **missing)


@pytest.mark.parametrize(("argument", "instead"), [
    ({"poisson_sampling": False}, "always samples Poisson batches"),
    ({"secure_mode": True}, "not cryptographically secure"),
    ({"noise_generator": torch.Generator()}, "noise_seed=<int>"),
    ({"grad_sample_mode": "ghost"}, "chooses each layer's per-sample rule itself"),
    ({"loss_reduction": "mean"}, "reduction='none'"),
    ({"batch_first": False}, "record dimension first"),
    ({"total_steps": 100}, "give epochs="),
    ({"max_physical_batchsize": 8}, "has no argument 'max_physical_batchsize'"),
])
def test_each_opacus_argument_dpltm_does_not_take_is_one_line_naming_its_way(argument: dict[str, Any],
                                                                            instead: str) -> None:
    model, optimizer = fresh()
    with pytest.raises(DpltmUserError) as caught:
        dpltm.make_private(model, optimizer, blobs(300, 0), noise_multiplier=1.0, batch_size=30, **argument)
    assert instead in str(caught.value) and "\n" not in str(caught.value)
    assert str(caught.value).startswith("make_private")


def test_inputs_given_twice_or_not_at_all_are_one_line() -> None:
    model, optimizer = fresh()
    with pytest.raises(DpltmUserError, match=r"^make_private: give the model once \(module= is Opacus's name"):
        dpltm.make_private(model, optimizer, blobs(300, 0), module=model, noise_multiplier=1.0)
    with pytest.raises(DpltmUserError, match=r"^make_private needs the train: "):
        dpltm.make_private(model, optimizer, noise_multiplier=1.0)


def test_privacy_engine_and_opacus_accountants_say_what_to_use() -> None:
    from dpltm import PrivacyEngine

    with pytest.raises(DpltmUserError, match=r"^dpltm has no PrivacyEngine: call dpltm.make_private\("):
        PrivacyEngine(accountant="prv")
    model, optimizer = fresh()
    with pytest.raises(DpltmUserError, match=r"^accountant 'prv': .*use 'pld'$"):
        dpltm.make_private(model, optimizer, blobs(300, 0), noise_multiplier=1.0, batch_size=30, accountant="prv")


def per_sample_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The reference: torch.func's per-sample gradients of the per-record loss."""
    parameters = {n: p.detach() for n, p in model.named_parameters()}

    def loss_of(params: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(model, params, (xi.unsqueeze(0),))
        return F.cross_entropy(out, yi.unsqueeze(0))

    return torch.func.vmap(torch.func.grad(loss_of), in_dims=(None, 0, 0))(parameters, x, y)


def test_per_layer_clipping_bounds_each_layer_and_matches_the_reference() -> None:
    torch.manual_seed(1)
    model = mlp().double()
    x, y = blobs(40, 0)
    x = x.double() * 5  # large gradients: every layer's bound binds
    bounds = {"0": 0.3, "2": 0.05}
    batch = clipped_gradient_sum_of(model, x, y, bounds, {})
    grads = per_sample_gradients(model, x, y)
    for layer, bound in bounds.items():
        names = [n for n in grads if n.startswith(layer + ".")]
        norms = torch.sqrt(sum(grads[n].flatten(1).pow(2).sum(1) for n in names))
        factors = torch.clamp(bound / norms, max=1.0)
        assert bool((norms > bound).any())
        for n in names:
            expected = (grads[n] * factors.view(-1, *[1] * (grads[n].dim() - 1))).sum(0)
            torch.testing.assert_close(batch.grad_sums[n], expected, rtol=1e-10, atol=1e-12)
    one = clipped_gradient_sum_of(model, x[:1], y[:1], bounds, {})  # one record's contribution, layer by layer
    for layer, bound in bounds.items():
        norm = torch.sqrt(sum(one.grad_sums[n].pow(2).sum() for n in one.grad_sums if n.startswith(layer + ".")))
        assert float(norm) <= bound * (1 + 1e-12)


def test_per_layer_clipping_scales_the_noise_to_the_bounds_norm_and_accounts_the_same() -> None:
    model, optimizer = fresh()
    run = dpltm.make_private(model, optimizer, blobs(300, 0), noise_multiplier=1.1, batch_size=30, epochs=1,
                             clipping="per_layer", max_grad_norm={"0": 0.6, "2": 0.8})
    assert run.settings.clip == pytest.approx(1.0, rel=1e-12) and run.settings.clip >= 1.0  # √(0.36 + 0.64), up
    run.fit()
    assert run.epsilon == pytest.approx(composed_epsilon([(0.1, 1.1, 10)]), rel=1e-9)
    model, optimizer = fresh()
    even = dpltm.make_private(model, optimizer, blobs(300, 0), noise_multiplier=1.1, batch_size=30,
                              clipping="per_layer", max_grad_norm=2.0)
    assert even._dp.layer_clips == pytest.approx({"0": 2 / 2**0.5, "2": 2 / 2**0.5}) and even.settings.clip >= 2.0


@pytest.mark.parametrize(("arguments", "match"), [
    ({"clipping": "per_layer", "max_grad_norm": [1.0, 1.0]}, r"is a dict \{layer name: bound\}"),
    ({"clipping": "per_layer", "max_grad_norm": {"0": 1.0}}, r"must name each trainable layer once: .*missing \['2'\]"),
    ({"clipping": "per_layer", "max_grad_norm": {"0": 1.0, "2": 1.0, "9": 1.0}}, r"unknown \['9'\]"),
    ({"clipping": "per_layer", "max_grad_norm": {"0": 1.0, "2": -1.0}}, r"^max_grad_norm\['2'\]"),
    ({"clipping": "flat", "max_grad_norm": {"0": 1.0, "2": 1.0}}, "needs clipping='per_layer'"),
    ({"clipping": "per_parameter"}, "^clipping must be one of flat, per_layer"),
])
def test_per_layer_bounds_that_do_not_fit_the_model_are_one_line(arguments: dict[str, Any], match: str) -> None:
    model, optimizer = fresh()
    with pytest.raises(DpltmUserError, match=match):
        dpltm.make_private(model, optimizer, blobs(300, 0), noise_multiplier=1.0, batch_size=30, **arguments)
