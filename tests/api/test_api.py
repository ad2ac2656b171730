"""The Python API on users' own models and data: tickets, selection, make_private, the Lightning
callback, accounting, loading — with the CLI's mechanism (Poisson sampling, masked clipping, noise
on surviving weights, the ledger's ε)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from dp_accounting import dp_event, pld
from torch import nn

import dpltm
from dpltm.dp.engine import clipped_gradient_sum_of
from dpltm.dp.gaussian import GaussianNoise
from dpltm.errors import DpltmUserError
from dpltm.lightning import poisson_loader
from tests.apidata import blobs, mlp


def independent_epsilon(q: float, sigma: float, steps: int, delta: float) -> float:
    """dp-accounting's PLD accountant fed the event by hand."""
    accountant = pld.PLDAccountant()
    accountant.compose(dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps))
    return float(accountant.get_epsilon(delta))


def test_make_private_trains_a_users_sequential_at_the_target_epsilon() -> None:
    model = mlp()
    masks = {"0.weight": torch.rand(16, 10, generator=torch.Generator().manual_seed(1)) < 0.5}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    private = dpltm.make_private(model, optimizer, blobs(600, 0), target_epsilon=1.0, delta=1e-5, epochs=4,
                                 batch_size=60, masks=masks, masks_from="random mask", noise_seed=3)
    assert private.epsilon == 0.0
    history = private.fit(val=blobs(200, 1))
    plan = private.plan
    assert [r["epoch"] for r in history] == [1, 2, 3, 4] and private.steps_done == plan.steps == 40
    assert 0.95 < private.epsilon <= 1.0
    assert private.epsilon == pytest.approx(independent_epsilon(plan.sample_rate, plan.noise_multiplier, 40, 1e-5),
                                            rel=1e-9)
    assert private.epsilon == dpltm.account(sample_rate=plan.sample_rate, noise_multiplier=plan.noise_multiplier,
                                            steps=40)
    assert bool((model[0].weight[~masks["0.weight"]] == 0).all())  # AdamW's decay and moments: still zero
    assert private.evaluate(blobs(300, 2)) > 0.8
    report = private.report()
    assert report["end_to_end_dp"] is True and "random mask" in report["statement"]
    with pytest.raises(DpltmUserError, match="budget is spent"):
        private.step()


def test_make_private_reports_the_epsilon_of_a_given_sigma_and_takes_a_dataset() -> None:
    x, y = blobs(300, 0)
    dataset = torch.utils.data.TensorDataset(x, y)
    model = mlp()
    private = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset, noise_multiplier=1.5,
                                 epochs=1, batch_size=30)
    private.fit()
    assert private.epsilon == pytest.approx(independent_epsilon(0.1, 1.5, 10, 1e-5), rel=1e-9)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"masks": {"0.weight": torch.ones(16, 10)}, "target_epsilon": 1.0, "epochs": 1}, "come from"),
    ({"masks": {"9.weight": torch.ones(2, 2)}, "masks_from": "x", "target_epsilon": 1.0, "epochs": 1},
     "not \\(or cannot mask\\)"),
    ({"masks": {"0.weight": torch.ones(3, 3)}, "masks_from": "x", "target_epsilon": 1.0, "epochs": 1}, "shape"),
    ({"target_epsilon": 1.0}, "^target_epsilon needs epochs=...: σ is calibrated"),
    ({}, "target_epsilon"),
    ({"target_epsilon": 1.0, "noise_multiplier": 1.0}, "target_epsilon"),
])
def test_make_private_refuses_bad_input_in_one_line(kwargs: dict, match: str) -> None:  # type: ignore[type-arg]
    model = mlp()
    with pytest.raises(DpltmUserError, match=match):
        dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), blobs(100, 0), batch_size=10,
                           **kwargs)


def test_provenance_and_selection_reach_the_report() -> None:
    masks = {"0.weight": torch.ones(16, 10, dtype=torch.bool)}
    masks["0.weight"][0] = False
    model = mlp()
    same_data = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), blobs(200, 0),
                                   noise_multiplier=1.0, batch_size=20, masks=masks, masks_from="these records",
                                   masks_private=True)
    same_data.step()
    assert same_data.report()["end_to_end_dp"] is False and same_data.report()["overall_epsilon"] == "inf"
    assert same_data.epsilon == float("inf") and 0 < same_data.epsilon_dp_part < float("inf")
    model = mlp()
    selected = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), blobs(200, 0),
                                  noise_multiplier=1.0, batch_size=20, masks=masks, masks_from="public",
                                  selection_eps1=0.1)
    selected.step()
    alone = dpltm.account(sample_rate=0.1, noise_multiplier=1.0, steps=1)
    assert selected.epsilon > alone and selected.report()["end_to_end_dp"] is True


def test_unsupported_layer_fails_before_any_step() -> None:
    model = nn.Sequential(nn.Linear(10, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    with pytest.raises(DpltmUserError, match="1 \\(BatchNorm1d\\)"):
        dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), blobs(100, 0), target_epsilon=1.0,
                           epochs=1, batch_size=10)


def test_tickets_for_a_users_cnn_and_their_selection() -> None:
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))
    x, y = blobs(200, 0, d=36)
    images = x.reshape(-1, 1, 6, 6)
    tickets = dpltm.generate_tickets(cnn, (images, y), val=(images[:50], y[:50]), rounds=2, iterations=20,
                                     batch_size=32)
    assert [t.round for t in tickets] == [0, 1, 2]
    assert tickets[0].density == 1.0 and tickets[0].density > tickets[1].density > tickets[2].density
    assert set(tickets[1].masks) == {"0.weight", "3.weight"}
    assert abs(float(tickets[1].masks["0.weight"].float().mean()) - 0.7) < 0.03  # 30 % of the conv pruned
    best = dpltm.select_ticket(tickets, rule="best", nu=0.0)
    assert best.accuracy == max(t.accuracy for t in tickets)  # type: ignore[type-var]
    drawn = dpltm.select_ticket(tickets, eps1=0.5, seed=1)
    assert drawn in tickets


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = mlp()
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.seen.append((x, y))
        return F.cross_entropy(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class GradientSpy(L.Callback):
    def __init__(self) -> None:
        self.first: dict[str, torch.Tensor] | None = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # type: ignore[no-untyped-def]
        if self.first is None:
            self.first = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters()}


def test_lightning_callback_runs_the_same_mechanism() -> None:
    x, y = blobs(400, 0)
    module = Classifier()
    theta0 = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    masks = {"model.0.weight": torch.rand(16, 10, generator=torch.Generator().manual_seed(1)) < 0.5}
    callback = dpltm.DPCallback(target_epsilon=2.0, max_grad_norm=0.5, masks=masks, masks_from="public",
                                noise_seed=4)
    spy = GradientSpy()
    trainer = L.Trainer(max_epochs=2, callbacks=[callback, spy], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(module, poisson_loader(torch.utils.data.TensorDataset(x, y), batch_size=40, seed=5))
    plan = callback.plan
    assert plan is not None and callback.steps_done == plan.steps == 20
    assert 1.9 < callback.epsilon <= 2.0
    assert callback.epsilon == pytest.approx(independent_epsilon(0.1, plan.noise_multiplier, 20, 1e-5), rel=1e-9)
    assert [r["epoch"] for r in callback.history] == [1, 2]
    # what Lightning's loggers get (a float32 tensor) never shows less than was spent
    shown = trainer.callback_metrics["epsilon"]
    assert shown.dtype == torch.float32 and float(shown) >= callback.epsilon
    assert bool((module.model[0].weight[~masks["model.0.weight"]] == 0).all())
    # the first step's gradient is make_private's: masked clipped sum + one noise draw, over L
    reference = mlp()
    reference.load_state_dict(theta0)
    with torch.no_grad():
        reference[0].weight.mul_(masks["model.0.weight"])
    bx, by = module.seen[0]
    sums = clipped_gradient_sum_of(reference, bx, by, 0.5, {"0.weight": masks["model.0.weight"]}).grad_sums
    surviving = {n: None for n in sums}
    surviving["0.weight"] = masks["model.0.weight"].flatten().nonzero().squeeze(1)
    noisy = GaussianNoise(plan.noise_multiplier).perturb(sums, surviving, 0.5, torch.Generator().manual_seed(4))
    assert spy.first is not None
    for name, value in noisy.items():
        torch.testing.assert_close(spy.first[f"model.{name}"], value / 40, rtol=1e-4, atol=1e-6)


def test_callback_needs_a_poisson_loader() -> None:
    x, y = blobs(100, 0)
    trainer = L.Trainer(max_epochs=1, callbacks=[dpltm.DPCallback(target_epsilon=1.0)], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu")
    with pytest.raises(DpltmUserError, match="Poisson"):
        trainer.fit(Classifier(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=10))


def test_callback_refuses_half_precision_parameters() -> None:
    """Lightning's "32-true" leaves a bfloat16 module as it is; its clipped norms could exceed C by rounding."""
    x, y = blobs(100, 0)
    trainer = L.Trainer(max_epochs=1, callbacks=[dpltm.DPCallback(target_epsilon=1.0)], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu")
    with pytest.raises(DpltmUserError, match="^trainable parameter 'model.0.weight' is bfloat16"):
        trainer.fit(Classifier().to(torch.bfloat16),
                    poisson_loader(torch.utils.data.TensorDataset(x.bfloat16(), y), batch_size=10, seed=3))


@pytest.mark.slow
def test_import_dpltm_is_light_and_exports_the_api() -> None:
    import subprocess
    import sys

    code = "import sys, dpltm; assert 'torch' not in sys.modules; print(sorted(dpltm.__all__))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for name in ("make_private", "DPCallback", "generate_tickets", "select_ticket", "account", "load_model"):
        assert name in out


def test_load_model_returns_the_released_model_of_a_train_checkpoint(tmp_path, monkeypatch, cli) -> None:  # type: ignore[no-untyped-def]

    from dpltm.data import load_dataset
    from tests.datafiles import write_digits

    data = write_digits(tmp_path / "data")
    monkeypatch.setenv("DPLTM_DATA_DIR", str(data))
    out = tmp_path / "m.pt"
    result = cli("train", "--dense", "--dataset", "digits", "--eps2", "1", "--epochs", "1",
                 "--batch-size", "32", "--device", "cpu", "--no-progress", "--json",
                 "--out", str(out))
    report = json_report(result.output)
    model = dpltm.load_model(out)
    assert not model.training
    test = load_dataset("digits", device="cpu").test
    assert dpltm.evaluate(model, (test.features, test.labels)) == pytest.approx(report["test_accuracy"])
    with pytest.raises(DpltmUserError, match="does not exist"):
        dpltm.load_model(tmp_path / "missing.pt")
    # `dpltm inspect` reads model files too: the ledger's ε and statement, recomputed
    inspected = cli("inspect", str(out), "--json")
    summary = json_report(inspected.output)
    assert summary["kind"] == "model" and summary["test_accuracy"] == report["test_accuracy"]
    assert summary["ledger"]["epsilon"] == report["epsilon"] and "-DP for digits" in summary["statement"]
    human = cli("inspect", str(out), ok=False)
    assert human.exit_code == 0 and "-DP for digits" in human.output


def json_report(output: str) -> dict:  # type: ignore[type-arg]
    import json

    return json.loads(output[output.index("{"):])  # type: ignore[no-any-return]


class Centring(nn.Module):
    """A user's layer that mixes the batch (subtracts its mean): per-sample clipping cannot bound it."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(dim=0, keepdim=True)) * self.gain


class Mixer(nn.Module):
    """A user's layer owning a weight and a child layer: the torch.func rule re-runs it per sample,
    child included, which must not disturb what the callback recorded for the child."""

    def __init__(self) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.eye(16) + 0.1 * torch.randn(16, 16, generator=torch.Generator().manual_seed(2)))
        self.child = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(x @ self.W)


class NormClassifier(Classifier):
    def __init__(self, middle: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(10, 16), middle, nn.Tanh(), nn.Linear(16, 3))


@pytest.mark.parametrize("limit", [None, 7])
@pytest.mark.parametrize("middle", [nn.LayerNorm, Mixer])
def test_the_api_and_the_callback_train_other_layers_with_the_same_engine(middle: type[nn.Module],
                                                                          limit: int | None) -> None:
    """LayerNorm and a user's own layer (the torch.func rule) train through make_private and the callback, whole or
    in physical batches of `limit` rows: masked weights stay zero and the callback's first gradient is the engine's;
    a layer that mixes the batch is refused."""
    x, y = blobs(400, 0)
    masks = {"model.0.weight": torch.rand(16, 10, generator=torch.Generator().manual_seed(1)) < 0.5}
    module = NormClassifier(middle(16) if middle is nn.LayerNorm else middle())
    theta0 = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    callback = dpltm.DPCallback(target_epsilon=2.0, max_grad_norm=0.5, masks=masks, masks_from="public",
                                noise_seed=4, max_physical_batch_size=limit)
    spy = GradientSpy()
    trainer = L.Trainer(max_epochs=1, callbacks=[callback, spy], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(module, poisson_loader(torch.utils.data.TensorDataset(x, y), batch_size=40, seed=5))
    assert callback.steps_done == 10 and bool((module.model[0].weight[~masks["model.0.weight"]] == 0).all())
    reference = NormClassifier(middle(16) if middle is nn.LayerNorm else middle()).model
    reference.load_state_dict(theta0)
    with torch.no_grad():
        reference[0].weight.mul_(masks["model.0.weight"])
    bx, by = module.seen[0]
    sums = clipped_gradient_sum_of(reference, bx, by, 0.5, {"0.weight": masks["model.0.weight"]}).grad_sums
    assert set(sums) == {n for n, _ in reference.named_parameters()} and len(sums) >= 6
    surviving = {n: None for n in sums}
    surviving["0.weight"] = masks["model.0.weight"].flatten().nonzero().squeeze(1)
    noisy = GaussianNoise(callback.plan.noise_multiplier).perturb(  # type: ignore[union-attr]
        sums, surviving, 0.5, torch.Generator().manual_seed(4))
    assert spy.first is not None
    for name, value in noisy.items():
        torch.testing.assert_close(spy.first[f"model.{name}"], value / 40, rtol=1e-4, atol=1e-6)

    model = NormClassifier(middle(16) if middle is nn.LayerNorm else middle()).model
    private = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), target_epsilon=1.0,
                                 epochs=1, batch_size=40, masks={"0.weight": masks["model.0.weight"]},
                                 masks_from="public", max_physical_batch_size=limit)
    private.fit()
    assert private.steps_done == 10 and bool((model[0].weight[~masks["model.0.weight"]] == 0).all())

    mixing = NormClassifier(Centring())
    trainer = L.Trainer(max_epochs=1, callbacks=[dpltm.DPCallback(target_epsilon=2.0, max_physical_batch_size=limit)],
                        logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu")
    with pytest.raises(DpltmUserError, match="model.1 \\(Centring\\).*depends on other (samples|records)"):
        trainer.fit(mixing, poisson_loader(torch.utils.data.TensorDataset(x, y), batch_size=40, seed=5))


def test_make_private_steps_on_its_own_copy_of_tensor_records() -> None:
    """A masked step reads each record's norm share from a table made at the first step: the records it
    was made from are copied then, so the caller writing into their tensor afterwards changes nothing
    (the table and the sampled rows could otherwise disagree, and the clipping with them)."""
    def run(write_after_first_step: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = mlp()
        x, y = blobs(300, 0)
        masks = {"0.weight": torch.rand(16, 10, generator=torch.Generator().manual_seed(1)) < 0.5}
        private = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
                                     epochs=1, batch_size=30, masks=masks, masks_from="random mask", noise_seed=3)
        private.step()
        assert private.records.features.data_ptr() != x.data_ptr()  # type: ignore[union-attr]
        if write_after_first_step:
            x.mul_(100.0)
        for _ in range(3):
            private.step()
        return model[0].weight.detach().clone()

    torch.testing.assert_close(run(True), run(False), rtol=0, atol=0)
