"""Hostile uses of the Python API that a second adversarial review found: optimisers that hold other tensors
than the module's, interrupted steps, runs that share a model or an optimiser, wrapped models, losses and layers
that mix the batch, tainted Lightning runs, non-finite or out-of-range data, overwritten files, odd devices and
argument types. Each refusal is a `DpltmUserError` raised before any private step (nothing spent, nothing moved)."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from dp_accounting import dp_event, pld
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data._utils.collate import default_collate

import dpltm
from dpltm.errors import DpltmUserError
from dpltm.lightning import PoissonBatchSampler, poisson_loader
from tests.apidata import blobs, mlp


def data(n: int = 200, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return blobs(n, seed)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def trainer(callback: L.Callback, max_epochs: int = 1) -> L.Trainer:
    return L.Trainer(max_epochs=max_epochs, callbacks=[callback], logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")


def loader(n: int = 200, batch_size: int = 20) -> DataLoader:  # type: ignore[type-arg]
    return poisson_loader(TensorDataset(*data(n)), batch_size=batch_size)


def independent_epsilon(q: float, sigma: float, steps: int, delta: float) -> float:
    """dp-accounting's PLD accountant fed the event by hand."""
    accountant = pld.PLDAccountant()
    accountant.compose(dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps))
    return float(accountant.get_epsilon(delta))


class Classifier(L.LightningModule):
    def __init__(self, net: nn.Module | None = None) -> None:
        super().__init__()
        self.net = net if net is not None else mlp()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


# ---- S1: the callback's optimiser must update exactly the module's parameters ---------------------------

class Leaky(Classifier):
    """A layer held in a plain list (not registered on the module) whose parameters the optimiser updates."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = [nn.Linear(10, 10)]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(self.hidden[0](x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(list(self.parameters()) + list(self.hidden[0].parameters()), lr=0.1)


class Partial(Classifier):
    """An optimiser that leaves one trainable parameter of the module out."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for n, p in self.named_parameters() if n != "net.0.bias"], lr=0.1)


def test_callback_refuses_an_optimizer_holding_a_parameter_the_module_does_not_own() -> None:
    """DPCallback refuses, before any step, an optimiser updating an unregistered layer from its raw gradient."""
    module = Leaky()
    before = module.hidden[0].weight.detach().clone()
    callback = dpltm.DPCallback(noise_multiplier=1.0)
    with pytest.raises(DpltmUserError):
        trainer(callback).fit(module, loader())
    assert callback.steps_done == 0
    assert torch.equal(module.hidden[0].weight, before)


def test_callback_refuses_an_optimizer_that_leaves_out_a_trainable_parameter() -> None:
    """DPCallback refuses, before any step, an optimiser that does not update every trainable parameter."""
    module = Partial()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    callback = dpltm.DPCallback(noise_multiplier=1.0)
    with pytest.raises(DpltmUserError):
        trainer(callback).fit(module, loader())
    assert callback.steps_done == 0
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())


# ---- S2: an interrupted step is counted --------------------------------------------------------------

def test_a_step_interrupted_inside_the_optimizer_is_counted() -> None:
    """A KeyboardInterrupt in an optimiser post-hook (after the update) leaves that step counted in steps_done and ε."""
    model = mlp()
    optimizer = sgd(model)
    run = dpltm.make_private(model, optimizer, data(), noise_multiplier=2.0, batch_size=20)  # σ 2: quick PLDs
    calls = {"n": 0}

    def interrupt(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt

    optimizer.register_step_post_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        for _ in range(6):
            run.step()
    assert calls["n"] == 5
    assert run.steps_done == 5
    truth = independent_epsilon(run.plan.sample_rate, run.plan.noise_multiplier, 5, run.settings.delta)
    assert run.epsilon >= truth * (1 - 1e-9)


# ---- S3, S4, 16: runs that share a model or an optimiser ------------------------------------------------

def test_two_runs_on_one_model_cannot_interleave_their_steps() -> None:
    """A second run on a model another live run stepped is refused at its step (each ledger counts only its own)."""
    x, y = data()
    model = mlp()
    r1 = dpltm.make_private(model, sgd(model), (x, y), noise_multiplier=1.0, batch_size=20)
    r2 = dpltm.make_private(model, sgd(model), (x, y), noise_multiplier=1.0, batch_size=20)
    r1.step()
    with pytest.raises(DpltmUserError, match="already took"):
        r2.step()
    assert r2.steps_done == 0
    r1.step()
    assert r1.steps_done == 2


def test_a_wrapped_model_another_run_trained_is_refused_and_fresh_weights_are_accepted() -> None:
    """A new run on a wrapper (nn.Sequential or a LightningModule) of privately stepped weights is refused;
    after fresh weights are loaded it is accepted."""
    x, y = data()
    net = mlp()
    theta0 = {k: v.detach().clone() for k, v in net.state_dict().items()}
    first = dpltm.make_private(net, sgd(net), (x, y), noise_multiplier=1.0, batch_size=20)
    first.fit()  # kept alive: the guard knows runs by id, which a freed run's successor could reuse
    wrapper = nn.Sequential(net)
    with pytest.raises(DpltmUserError):
        dpltm.make_private(wrapper, sgd(wrapper), (x, y), noise_multiplier=1.0, batch_size=20)
    with pytest.raises(DpltmUserError):
        trainer(dpltm.DPCallback(noise_multiplier=1.0)).fit(Classifier(net), loader())
    net.load_state_dict(theta0)
    wrapper = nn.Sequential(net)
    run = dpltm.make_private(wrapper, sgd(wrapper), (x, y), noise_multiplier=1.0, batch_size=20)
    run.step()
    assert run.steps_done == 1


def test_a_fresh_net_wrapped_by_a_callback_after_load_state_dict_is_accepted() -> None:
    """After a make_private run, loading θ0 into the net lets a DPCallback fit of a module wrapping it run."""
    x, y = data()
    net = mlp()
    theta0 = {k: v.detach().clone() for k, v in net.state_dict().items()}
    first = dpltm.make_private(net, sgd(net), (x, y), noise_multiplier=1.0, batch_size=20)
    first.fit()  # kept alive: the guard knows runs by id, which a freed run's successor could reuse
    net.load_state_dict(theta0)
    callback = dpltm.DPCallback(noise_multiplier=1.0)
    trainer(callback).fit(Classifier(net), loader())
    assert callback.steps_done == 10


def test_a_second_run_with_the_optimizer_of_a_live_run_is_refused() -> None:
    """Two live runs cannot share one optimiser: the second is refused at construction."""
    x, y = data()
    model = mlp()
    optimizer = sgd(model)
    first = dpltm.make_private(model, optimizer, (x, y), noise_multiplier=1.0, batch_size=20)
    with pytest.raises(DpltmUserError, match="optimizer"):
        dpltm.make_private(model, optimizer, (x, y), noise_multiplier=1.0, batch_size=20)
    first.step()
    assert first.steps_done == 1


# ---- S5, S6: losses and layers that mix the batch --------------------------------------------------------

@pytest.mark.parametrize("loss", [
    lambda o, t: F.cross_entropy(o, t, reduction="none") + 50 * (o.mean(0) ** 2).sum(),
    lambda o, t: F.cross_entropy(o, t, reduction="none") - F.cross_entropy(o, t, reduction="none").mean(),
], ids=["plus-batch-mean-penalty", "minus-batch-mean-loss"])
def test_a_per_sample_loss_whose_rows_depend_on_other_rows_is_refused(loss: Any) -> None:
    """make_private refuses a loss whose per-sample values mix the batch (its clipped sum's sensitivity exceeds C)."""
    model = mlp()
    with pytest.raises(DpltmUserError, match="loss"):
        dpltm.make_private(model, sgd(model), data(), noise_multiplier=1.0, batch_size=20, loss=loss)


@pytest.mark.parametrize("loss", [
    None,
    lambda o, t: F.cross_entropy(o, t, reduction="none", label_smoothing=0.1),
], ids=["default", "label-smoothing"])
def test_per_sample_losses_are_accepted(loss: Any) -> None:
    """The default loss and a per-sample loss with label smoothing are not mistaken for mixing losses."""
    model = mlp()
    kwargs = {} if loss is None else {"loss": loss}
    run = dpltm.make_private(model, sgd(model), data(), noise_multiplier=1.0, batch_size=20, **kwargs)
    run.step()
    assert run.steps_done == 1


class BatchCentre(nn.Module):
    """Mixes records only in training mode."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h - h.mean(0, keepdim=True) if self.training else h


class CentreAboveSix(nn.Module):
    """Mixes records only when the batch has more than 6 rows."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h - h.mean(0, keepdim=True) if h.shape[0] > 6 else h


def test_a_layer_that_mixes_only_in_training_mode_is_refused_at_the_first_step() -> None:
    """A mixing layer probed in eval mode at make_private is caught once the model is put in training mode."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), BatchCentre(), nn.Tanh(), nn.Linear(16, 3))
    model.eval()
    run = dpltm.make_private(model, sgd(model), data(), noise_multiplier=1.0, batch_size=20)
    model.train()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with pytest.raises(DpltmUserError, match="mixes"):
        run.step()
    assert run.steps_done == 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_layer_that_mixes_only_large_batches_is_refused_before_any_step() -> None:
    """A layer that mixes only batches of more than 6 rows is refused at make_private or the first step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), CentreAboveSix(), nn.Tanh(), nn.Linear(16, 3))
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    run = None
    with pytest.raises(DpltmUserError):
        run = dpltm.make_private(model, sgd(model), data(), noise_multiplier=1.0, batch_size=20)
        run.step()
    assert run is None or run.steps_done == 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# ---- S7: a tainted callback run reports no finite guarantee anywhere -----------------------------------

class Raw(Classifier):
    """An optimizer_step override that makes one extra raw (non-private) optimiser step."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):  # type: ignore[no-untyped-def]
        optimizer.step(closure=optimizer_closure)
        if batch_idx == 3:
            optimizer.optimizer.step()


def test_a_tainted_callback_run_claims_no_finite_epsilon_in_its_ledger() -> None:
    """After a raw optimiser step, ε, the ledger's report and its statement all say the run is not DP."""
    callback = dpltm.DPCallback(noise_multiplier=1.0)
    with pytest.raises(DpltmUserError):
        trainer(callback).fit(Raw(), loader())
    assert callback.epsilon == float("inf")
    ledger = callback.ledger()
    assert ledger is not None  # DP steps ran before the raw one
    report = ledger.report()
    assert report["end_to_end_dp"] is False and report["overall_epsilon"] == "inf"
    assert report["non_private_updates"] == 1
    assert "NOT differentially private" in ledger.statement()
    assert callback.state_dict()["non_private_updates"] == 1  # and it travels in Lightning's checkpoint


# ---- bad data, found before any step -------------------------------------------------------------------

@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_features_are_refused_at_construction(value: float) -> None:
    """make_private refuses in-memory features holding NaN or inf before any step."""
    x, y = data()
    x = x.clone()
    x[123, 4] = value
    model = mlp()
    with pytest.raises(DpltmUserError, match="(?i)nan|finite"):
        dpltm.make_private(model, sgd(model), (x, y), noise_multiplier=1.0, batch_size=20)


def test_a_late_label_out_of_range_is_refused_at_construction() -> None:
    """make_private checks every in-memory label against the model's classes, not only the first record's."""
    x, y = data()
    y = y.clone()
    y[150] = 7
    model = mlp()
    with pytest.raises(DpltmUserError):
        dpltm.make_private(model, sgd(model), (x, y), noise_multiplier=1.0, batch_size=20)


def test_fit_refuses_non_finite_validation_features_before_any_step() -> None:
    """fit(val=…) with NaN in the validation features fails before the first private step."""
    model = mlp()
    run = dpltm.make_private(model, sgd(model), data(), noise_multiplier=1.0, batch_size=20, epochs=2)
    xv, yv = blobs(50, 1)
    xv = xv.clone()
    xv[7, 0] = float("nan")
    with pytest.raises(DpltmUserError):
        run.fit(val=(xv, yv))
    assert run.steps_done == 0
    assert run.epochs_done == 0


# ---- save over a file that is not the run's -------------------------------------------------------------

def test_save_refuses_to_overwrite_a_file_that_is_not_a_dpltm_checkpoint(tmp_path: Path) -> None:
    """save() never replaces a foreign file; saving twice over its own run file works."""
    model = mlp()
    run = dpltm.make_private(model, sgd(model), data(), noise_multiplier=1.0, batch_size=20)
    run.step()
    foreign = tmp_path / "notes.pt"
    foreign.write_text("my notes, not a checkpoint\n")
    original = foreign.read_bytes()
    with pytest.raises(DpltmUserError):
        run.save(foreign)
    assert foreign.read_bytes() == original
    own = tmp_path / "run.pt"
    assert run.save(own) == own
    run.step()
    assert run.save(own) == own
    resumed_model = mlp()
    resumed = dpltm.make_private(resumed_model, sgd(resumed_model), data(), noise_multiplier=1.0, batch_size=20,
                                 epochs=2, resume_from=own)
    assert resumed.steps_done == 2


# ---- tickets ------------------------------------------------------------------------------------------

class ScaleLayer(nn.Module):
    """A per-feature scale: its only parameter is one-dimensional (nothing a ticket can prune)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def test_generate_tickets_refuses_a_model_with_no_prunable_weight() -> None:
    """generate_tickets on a model with no prunable weight fails in one line rather than deep in the pruning."""
    model = nn.Sequential(nn.Flatten(), ScaleLayer())
    assert not dpltm.api.prunable_weights(model)
    with pytest.raises(DpltmUserError):
        dpltm.generate_tickets(model, data(), rounds=1, iterations=5)


def test_generate_tickets_with_an_unreduced_loss_works_or_says_why() -> None:
    """A loss returning one value per sample either trains tickets or is refused with a DpltmUserError."""
    try:
        tickets = dpltm.generate_tickets(mlp(), data(), rounds=1, iterations=5,
                                         loss=lambda o, t: F.cross_entropy(o, t, reduction="none"))
    except DpltmUserError:
        return
    assert [t.round for t in tickets] == [0, 1]


def test_generate_tickets_casts_float32_data_for_a_float64_model() -> None:
    """A float64 model takes float32 training and validation features (no dtype error)."""
    tickets = dpltm.generate_tickets(mlp().double(), data(), val=blobs(60, 1), rounds=1, iterations=5)
    assert [t.round for t in tickets] == [0, 1] and all(t.accuracy is not None for t in tickets)


def _tickets() -> list[Any]:
    return dpltm.generate_tickets(mlp(), data(), val=blobs(60, 1), rounds=1, iterations=5)


def test_select_ticket_refuses_nu_as_text() -> None:
    """select_ticket(nu="50") is refused in one line, not scored with a string."""
    with pytest.raises(DpltmUserError):
        dpltm.select_ticket(_tickets(), rule="best", nu="50")  # type: ignore[arg-type]


def test_select_ticket_refuses_a_negative_accuracy_sensitivity() -> None:
    """A negative sensitivity would turn the exponential mechanism's preference around: refused."""
    with pytest.raises(DpltmUserError):
        dpltm.select_ticket(_tickets(), eps1=0.5, accuracy_sensitivity=-5, seed=1)


# ---- devices, layouts and argument types --------------------------------------------------------------

@pytest.mark.parametrize("kind", ["meta", "sparse"])
def test_make_private_refuses_meta_and_sparse_features(kind: str) -> None:
    """Features without values (meta) or in a sparse layout are refused in one line."""
    x, y = data()
    features = x.to("meta") if kind == "meta" else x.to_sparse()
    model = mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(DpltmUserError):
            dpltm.make_private(model, sgd(model), (features, y), noise_multiplier=1.0, batch_size=20)


def test_evaluate_refuses_meta_features() -> None:
    """evaluate() on features on the meta device fails in one line."""
    x, y = data()
    with pytest.raises(DpltmUserError):
        dpltm.evaluate(mlp(), (x.to("meta"), y))


@pytest.mark.parametrize("clip", [1e30, 1e-300])
def test_an_absurd_clip_norm_is_refused_in_the_apis_words(clip: float) -> None:
    """max_grad_norm=1e30 (noise that swamps the weights) or 1e-300 (0 in float32) is refused by make_private
    (naming no CLI option) and by DPCallback at construction."""
    model = mlp()
    with pytest.raises(DpltmUserError, match="^max_grad_norm must be at") as refused:
        dpltm.make_private(model, sgd(model), data(), noise_multiplier=1.0, batch_size=20, max_grad_norm=clip)
    assert "--clip" not in str(refused.value)
    with pytest.raises(DpltmUserError):
        dpltm.DPCallback(max_grad_norm=clip, noise_multiplier=1.0)


def test_in_memory_must_be_a_bool() -> None:
    """in_memory="no" is refused, not read as its truth value."""
    model = mlp()
    with pytest.raises(DpltmUserError):
        dpltm.make_private(model, sgd(model), data(), noise_multiplier=1.0, batch_size=20,
                           in_memory="no")  # type: ignore[arg-type]


# ---- 1: a sampler over fewer records than the dataset --------------------------------------------------

def test_callback_refuses_a_sampler_over_fewer_records_than_the_dataset() -> None:
    """A PoissonBatchSampler for 200 records over a 500-record dataset is refused at fit start (q would be wrong)."""
    x, y = blobs(500, 0)

    def collate(items: list[Any]) -> Any:
        return default_collate(items) if items else (x[:0], y[:0])

    batches = DataLoader(TensorDataset(x, y), batch_sampler=PoissonBatchSampler(200, 20), collate_fn=collate)
    module = Classifier()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    callback = dpltm.DPCallback(noise_multiplier=1.0)
    with pytest.raises(DpltmUserError):
        trainer(callback).fit(module, batches)
    assert callback.steps_done == 0
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())


def test_callback_refuses_a_sampler_drawing_other_than_the_planned_steps() -> None:
    """A sampler drawing 20 batches an epoch where σ is planned for N/L = 10 is refused at fit start, not when the
    budget runs out mid-fit."""
    x, y = blobs(200, 0)

    def collate(items: list[Any]) -> Any:
        return default_collate(items) if items else (x[:0], y[:0])

    batches = DataLoader(TensorDataset(x, y), batch_sampler=PoissonBatchSampler(200, 20, steps=20), collate_fn=collate)
    callback = dpltm.DPCallback(target_epsilon=1.0)
    with pytest.raises(DpltmUserError, match="planned for 10 .N/L."):
        trainer(callback).fit(Classifier(), batches)
    assert callback.steps_done == 0


def test_run_tokens_are_never_reused() -> None:
    """The stepped-weights guard names runs by a token, not by id(): a later run at a dead run's address is
    another run."""
    from dpltm.weight_guard import _run_token

    class Run:
        pass

    tokens = set()
    for _ in range(50):
        run = Run()  # each dies at the next iteration, so CPython reuses its address
        tokens.add(_run_token(run))
        assert _run_token(run) == _run_token(run)
    assert len(tokens) == 50


class Unfreezes(Classifier):
    """Starts with its first layer frozen and unfreezes it after two steps."""

    def __init__(self) -> None:
        super().__init__()
        self.net[0].requires_grad_(False)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx == 2:
            self.net[0].requires_grad_(True)
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def test_callback_refuses_layers_frozen_or_unfrozen_mid_fit_in_one_line() -> None:
    """Unfreezing a layer mid-fit is refused in dpltm's words (it was a KeyError from inside the callback)."""
    callback = dpltm.DPCallback(noise_multiplier=1.0)
    with pytest.raises(DpltmUserError, match="trainable parameters changed"):
        trainer(callback).fit(Unfreezes(), loader())
    assert callback.steps_done == 2


class LateBadItem(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """200 records, the last of which the user's __getitem__ cannot read."""

    def __init__(self) -> None:
        self.x, self.y = data()

    def __len__(self) -> int:
        return 200

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == 199:
            raise KeyError(f"record {i} is missing")
        return self.x[i], self.y[i]


def test_a_lazy_dataset_that_fails_mid_run_says_so_in_dpltm_words_and_spends_nothing_for_it() -> None:
    """in_memory=False reads per batch: a record the user's dataset cannot give is a DpltmUserError naming the
    cause, raised before the step is counted; float64 models get their lazy features cast as in memory."""
    model = mlp().double()
    run = dpltm.make_private(model, sgd(model), LateBadItem(), noise_multiplier=1.0, batch_size=150, epochs=20,
                             in_memory=False)  # 40 planned steps: the budget cannot run out before record 199
    with pytest.raises(DpltmUserError, match="reading a batch of the training dataset failed .KeyError"):
        for _ in range(20):  # each batch holds record 199 with probability 0.75
            run.step()
    assert run.steps_done < 20


def test_a_loss_with_its_own_randomness_is_probed_under_fixed_draws() -> None:
    """A per-sample loss that draws noise (or dropout) is per-sample: the probe calls it under the same draws each
    time instead of calling the differing draws mixing."""
    model = mlp()

    def noisy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(F.dropout(outputs + 0.1 * torch.randn_like(outputs), 0.1), targets, reduction="none")

    run = dpltm.make_private(model, sgd(model), data(), noise_multiplier=1.0, batch_size=20, loss=noisy)
    run.step()
    assert run.steps_done == 1


def test_resuming_with_the_same_optimizer_while_the_first_run_lives_is_accepted(tmp_path: Path) -> None:
    """`run = make_private(..., resume_from=p)` with the run's own optimizer (a notebook cell run again): the resume
    takes the optimizer over, and the first run refuses further steps in one line."""
    model = mlp()
    optimizer = sgd(model)
    first = dpltm.make_private(model, optimizer, data(), noise_multiplier=1.0, epochs=2, batch_size=20)
    for _ in range(4):
        first.step()
    path = first.save(tmp_path / "run.pt")
    resumed = dpltm.make_private(model, optimizer, data(), noise_multiplier=1.0, epochs=2, batch_size=20,
                                 resume_from=path)
    resumed.step()
    assert resumed.steps_done == 5
    with pytest.raises(DpltmUserError, match="belongs to a newer private run"):
        first.step()
    assert first.steps_done == 4


def test_a_late_token_id_past_the_embedding_is_refused_at_construction() -> None:
    """Token ids of an in-memory record past the embedding's rows are refused before any step (an IndexError
    mid-run before)."""
    model = nn.Sequential(nn.Embedding(50, 8), nn.Flatten(), nn.Linear(8 * 4, 3))
    ids, labels = torch.randint(0, 50, (200, 4)), torch.randint(0, 3, (200,))
    ids[150, 2] = 50
    with pytest.raises(DpltmUserError, match=r"token ids in \[0, 50\], but the model's embedding has 50 rows"):
        dpltm.make_private(model, sgd(model), (ids, labels), noise_multiplier=1.0, batch_size=20)
    ids[150, 2] = 49
    dpltm.make_private(model, sgd(model), (ids, labels), noise_multiplier=1.0, batch_size=20).step()


def test_a_mask_that_prunes_a_whole_layer_is_refused() -> None:
    model = mlp()
    masks = {"0.weight": torch.zeros_like(model[0].weight)}
    with pytest.raises(DpltmUserError, match="prunes every weight of the layer"):
        dpltm.make_private(model, sgd(model), data(), noise_multiplier=1.0, batch_size=20, masks=masks,
                           masks_from="public data")


def test_an_empty_validation_set_is_named_as_such() -> None:
    model = mlp()
    run = dpltm.make_private(model, sgd(model), data(), noise_multiplier=1.0, batch_size=20)
    with pytest.raises(DpltmUserError, match="^the validation data is empty"):
        run.fit(val=(data()[0][:0], data()[1][:0]))
    assert run.steps_done == 0


# ---- the second review's leftovers ------------------------------------------------------------------------

def saved_run(tmp_path: Path, steps: int, **budget: float) -> Path:
    """A run of epochs=2 at L = 20 of 200 records (10 steps an epoch), saved after `steps` steps by hand."""
    model = mlp()
    run = dpltm.make_private(model, sgd(model), data(), epochs=2, batch_size=20, **budget)
    for _ in range(steps):
        run.step()
    return run.save(tmp_path / "run.pt")


def resumed_run(path: Path, batch_size: int = 20, **budget: float) -> Any:
    model = mlp()
    return dpltm.make_private(model, sgd(model), data(), epochs=2, batch_size=batch_size, resume_from=path, **budget)


def test_a_run_saved_mid_epoch_resumes_for_what_is_left_of_its_epochs(tmp_path: Path) -> None:
    """Steps taken by hand and saved mid-epoch count toward the run's epochs: the resume trains the rest, not
    whole epochs more (it trained 25 of 20 planned steps, and spent ε for them)."""
    resumed = resumed_run(saved_run(tmp_path, 5, noise_multiplier=2.0), noise_multiplier=2.0)
    assert resumed.plan.steps == 15
    history = resumed.fit()
    assert resumed.steps_done == 20 and [r["epoch"] for r in history] == [1, 2]
    assert [r["steps"] for r in history] == [10, 20]
    assert resumed.epsilon == pytest.approx(independent_epsilon(0.1, 2.0, 20, 1e-5), rel=1e-9)


def test_a_resume_at_a_new_batch_size_counts_the_epochs_already_run(tmp_path: Path) -> None:
    """Epochs done are counted at each segment's own batch size: 10 steps at L = 20 of 200 are one epoch, and one
    epoch at L = 40 is 5 steps, so epochs=2 leaves 5."""
    resumed = resumed_run(saved_run(tmp_path, 10, noise_multiplier=2.0), batch_size=40, noise_multiplier=2.0)
    assert resumed.plan.steps == 5
    resumed.fit()
    assert [s["steps"] for s in resumed.segments.records()] == [10, 5]


def test_fit_after_steps_by_hand_finishes_the_epoch_begun() -> None:
    """fit() after 5 steps taken by hand runs the epoch's other 5, then the whole next one: the planned 20."""
    model = mlp()
    run = dpltm.make_private(model, sgd(model), data(), noise_multiplier=2.0, epochs=2, batch_size=20)
    for _ in range(5):
        run.step()
    history = run.fit()
    assert run.steps_done == 20 and [(r["epoch"], r["steps"]) for r in history] == [(1, 10), (2, 20)]


def test_a_resumed_budget_calibrates_for_the_steps_left(tmp_path: Path) -> None:
    """With target_epsilon the resume's σ covers the steps left, and the whole run meets the target."""
    resumed = resumed_run(saved_run(tmp_path, 7, target_epsilon=2.0), target_epsilon=2.0)
    resumed.fit()
    assert resumed.steps_done == 20 and 1.9 < resumed.epsilon <= 2.0


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.head = nn.LSTM(10, 8, batch_first=True), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x.unsqueeze(1))
        return self.head(out[:, -1])


def test_generate_tickets_refuses_a_model_make_private_refuses() -> None:
    """An LSTM (a tuple output dpltm cannot clip per sample) is refused before any round, not pruned in its head
    alone into tickets no private run can use."""
    model = Recurrent()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with pytest.raises(DpltmUserError, match="lstm .*returns a tuple"):
        dpltm.generate_tickets(model, data(), val=data(60, 1), rounds=1, iterations=5)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_generate_tickets_takes_a_custom_batch_loss() -> None:
    """The layer check runs a custom batch loss row by row (it needs one loss per sample)."""
    tickets = dpltm.generate_tickets(mlp(), data(), val=data(60, 1), rounds=1, iterations=5,
                                     loss=lambda out, y: F.nll_loss(F.log_softmax(out, 1), y))
    assert len(tickets) == 2


def test_select_ticket_refuses_tickets_of_different_models() -> None:
    small = dpltm.generate_tickets(mlp(), data(), val=data(60, 1), rounds=1, iterations=5)
    torch.manual_seed(0)
    wide = dpltm.generate_tickets(nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3)), data(),
                                  val=data(60, 1), rounds=1, iterations=5)
    for eps1 in (None, 0.5):
        with pytest.raises(DpltmUserError, match=r"tickets\[1\] masks other weights .*different models"):
            dpltm.select_ticket([small[0], wide[1]], eps1=eps1)
    assert dpltm.select_ticket([small[0], small[1]], rule="best") in small


class Weighted(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """(features, label, weight) items: a third field dpltm would have dropped."""

    def __len__(self) -> int:
        return 200

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        x, y = data()
        return x[i], y[i], 0.5


def test_a_dataset_item_with_a_third_field_is_refused() -> None:
    model = mlp()
    for in_memory in (True, False):
        with pytest.raises(DpltmUserError, match="must be a \\(features, label\\) pair"):
            dpltm.make_private(model, sgd(model), Weighted(), noise_multiplier=1.0, batch_size=20,
                               in_memory=in_memory).step()


class LateIds(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Token ids read per batch; with `past`, every record after the first names a row past the embedding's 50."""

    def __init__(self, past: bool = True) -> None:
        self.past = past

    def __len__(self) -> int:
        return 200

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((4,), 50 if self.past and i else i % 50), torch.tensor(i % 3)


def test_token_ids_read_lazily_stay_ids() -> None:
    """in_memory=False read integer features as floats, which no embedding takes: a lazy text dataset failed."""
    model = nn.Sequential(nn.Embedding(50, 8), nn.Flatten(), nn.Linear(8 * 4, 3))
    run = dpltm.make_private(model, sgd(model), LateIds(past=False), noise_multiplier=1.0, batch_size=20,
                             in_memory=False)
    run.step()
    assert run.steps_done == 1


def test_a_lazily_read_token_id_past_the_embedding_is_refused_before_its_step() -> None:
    model = nn.Sequential(nn.Embedding(50, 8), nn.Flatten(), nn.Linear(8 * 4, 3))
    run = dpltm.make_private(model, sgd(model), LateIds(), noise_multiplier=1.0, batch_size=20, in_memory=False)
    with pytest.raises(DpltmUserError, match=r"\(the step was not taken\) holds token ids in \[(0|50), 50\]"):
        run.step()
    assert run.steps_done == 0


class LayerNormNet(Classifier):
    def __init__(self) -> None:
        super().__init__(nn.Sequential(nn.Linear(10, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3)))
        self.net[1].eval()  # a trainable layer in eval mode trains as any other


def test_the_callback_trains_a_trainable_layer_in_eval_mode() -> None:
    """A trainable LayerNorm in eval mode was skipped by the callback's hooks ('no gradient reached')."""
    module = LayerNormNet()
    weight = module.net[1].weight.detach().clone()
    callback = dpltm.DPCallback(noise_multiplier=1.0)
    trainer(callback).fit(module, loader())
    assert callback.steps_done == 10 and not torch.equal(module.net[1].weight, weight)


class TrainModeAtEpochTwo(Classifier):
    """Its mixing layer is in eval mode for the first epoch (probed then) and in training mode after."""

    def __init__(self) -> None:
        super().__init__(nn.Sequential(nn.Linear(10, 16), BatchCentre(), nn.Tanh(), nn.Linear(16, 3)))

    def on_train_epoch_start(self) -> None:
        self.net[1].train(self.current_epoch > 0)


def test_the_callback_probes_again_when_the_modules_change_mode() -> None:
    callback = dpltm.DPCallback(noise_multiplier=1.0)
    with pytest.raises(DpltmUserError, match="mixes"):
        trainer(callback, max_epochs=2).fit(TrainModeAtEpochTwo(), loader())
    assert callback.steps_done == 10


def test_the_rdp_underflow_message_names_a_tiny_sampling_rate_too() -> None:
    with pytest.raises(DpltmUserError, match="sampling rate so small"):
        dpltm.account(sample_rate=1e-8, noise_multiplier=1.0, steps=1, accountant="rdp")


def test_one_generate_tickets_call_keeps_one_theta0_apart_from_the_model() -> None:
    """The tickets share one copy of θ0 (rounds + 1 copies of a large model add up), which training the model
    afterwards leaves as it was."""
    model = mlp()
    tickets = dpltm.generate_tickets(model, data(), val=data(60, 1), rounds=2, iterations=5)
    assert all(t.theta0 is tickets[0].theta0 for t in tickets)
    kept = {k: v.clone() for k, v in tickets[0].theta0.items()}
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert all(torch.equal(tickets[0].theta0[k], v) for k, v in kept.items())


# ---- the review of the fixes above -------------------------------------------------------------------------

class EvalPassForLogging(Classifier):
    """A second forward in eval mode with gradients on, detached (training accuracy for a log): it trains nothing."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.net.eval()
        _ = self.net(x).detach()
        self.net.train()
        return F.cross_entropy(self.net(x), y)


class TwoUses(Classifier):
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y) + F.cross_entropy(self.net(x), y)


def test_the_callback_keeps_the_forward_that_took_the_gradient() -> None:
    """A detached extra forward is not weight sharing (it was refused as 'ran twice'); two forwards that both take
    a gradient still are."""
    callback = dpltm.DPCallback(noise_multiplier=1.0)
    trainer(callback).fit(EvalPassForLogging(), loader())
    assert callback.steps_done == 10
    callback = dpltm.DPCallback(noise_multiplier=1.0)
    with pytest.raises(DpltmUserError, match="ran twice in one step"):
        trainer(callback).fit(TwoUses(), loader())
    assert callback.steps_done == 0


class MixingNet(Classifier):
    def __init__(self) -> None:
        super().__init__(nn.Sequential(nn.Linear(10, 16), BatchCentre(), nn.Tanh(), nn.Linear(16, 3)))
        self.net[1].eval()


class ModeInOwnHook(MixingNet):
    """Puts its mixing layer in training mode in its own on_train_batch_start (after the callback's)."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.net[1].train(True)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.net[1].train(False)


class ModeInStep(MixingNet):
    """Puts its mixing layer in training mode around the forward alone."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.net[1].train(True)
        outputs = self.net(x)
        self.net[1].train(False)
        return F.cross_entropy(outputs, y)


@pytest.mark.parametrize("module", [ModeInOwnHook, ModeInStep])
def test_the_callback_probes_the_modes_the_forward_ran_in(module: type[L.LightningModule]) -> None:
    """Modes set after the callback's batch start trained a mixing layer unprobed, with a finite ε reported."""
    callback = dpltm.DPCallback(noise_multiplier=1.0)
    with pytest.raises(DpltmUserError, match="mixes the records of a batch"):
        trainer(callback).fit(module(), loader())
    assert callback.steps_done == 0


def test_generate_tickets_takes_losses_the_probe_cannot_feed_made_up_targets() -> None:
    """BCE on probabilities refuses Gaussian targets: the layer check uses the record's own target instead."""
    x, y = data()
    targets = (y == 0).float()[:, None]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 1))
    tickets = dpltm.generate_tickets(net, (x, targets), rounds=1, iterations=5,
                                     loss=lambda o, t: F.binary_cross_entropy(torch.sigmoid(o), t))
    assert len(tickets) == 2
    with pytest.raises(DpltmUserError, match="must return the batch loss .* got float"):
        dpltm.generate_tickets(mlp(), data(), rounds=1, iterations=5, loss=lambda o, t: 0.5)


def test_generate_tickets_takes_several_targets_a_record() -> None:
    """One-hot targets for an MSE loss: the records' content keys take the target row (a ValueError before)."""
    x, y = data()
    tickets = dpltm.generate_tickets(mlp(), (x, F.one_hot(y, 3).float()), rounds=1, iterations=5, loss=F.mse_loss)
    assert len(tickets) == 2 and len(tickets[0].public_records) == 200


def test_a_resume_at_another_batch_size_never_trains_past_the_epochs(tmp_path: Path) -> None:
    """A quarter epoch run at L = 30 of 100 is half a step at L = 50: counted as a whole step (rounded half to
    even, it was 0, and the run trained 2.25 epochs of 2)."""
    model = mlp()
    first = dpltm.make_private(model, sgd(model), data(100), noise_multiplier=2.0, epochs=2, batch_size=30)
    first.step()
    path = first.save(tmp_path / "run.pt")
    model2 = mlp()
    resumed = dpltm.make_private(model2, sgd(model2), data(100), noise_multiplier=2.0, epochs=2, batch_size=50,
                                 resume_from=path)
    assert resumed.plan.steps == 3  # 0.25 + 3 / 2 = 1.75 epochs ≤ 2


def test_a_dataset_of_single_tensors_is_refused_not_split_into_rows() -> None:
    """An item that is one tensor was read as (its row 0, its row 1)."""
    class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 200

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.randn(2, 10)

    model = mlp()
    with pytest.raises(DpltmUserError, match="item 0 is a Tensor"):
        dpltm.make_private(model, sgd(model), Rows(), noise_multiplier=1.0, batch_size=20)


# ---- a privacy review of DPCallback against what Lightning users write ------------------------------------

class ReplacesTheGradient(Classifier):
    """Puts the raw batch gradient back in its own on_before_optimizer_step, which Lightning calls after every
    callback's."""

    def on_after_backward(self) -> None:
        self.raw = [p.grad.detach().clone() for p in self.parameters()]

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        for p, raw in zip(self.parameters(), self.raw):
            p.grad = raw


class AddsTheRawGradient(L.Callback):
    """A callback listed after DPCallback that adds the raw gradient in place."""

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.raw = [p.grad.detach().clone() for p in module.parameters()]

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        for p, raw in zip(module.parameters(), self.raw):
            p.grad.add_(raw)


class SharpnessAware(Classifier):
    """SAM as Lightning users write it: a closure, a step of ρ along the raw gradient, the closure again."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        optimizer_closure()
        with torch.no_grad():
            for p in self.parameters():
                p.add_(0.05 * p.grad)
        optimizer.step(closure=optimizer_closure)


def _not_dp_and_guarded(callback: Any, module: L.LightningModule) -> None:
    assert callback.epsilon == math.inf and callback.ledger().non_private_updates >= 1
    with pytest.raises(DpltmUserError, match="already took .* steps in another private run"):
        trainer(dpltm.DPCallback(noise_multiplier=1.0)).fit(module, loader())


@pytest.mark.parametrize("case", ["module hook", "later callback"])
def test_a_noisy_gradient_changed_after_the_callback_is_refused_before_the_update(case: str) -> None:
    """Both moved the weights on the raw gradient while the callback reported ε = 2.85 for 10 steps; the step's
    closure is now checked before the optimiser updates."""
    module = ReplacesTheGradient() if case == "module hook" else Classifier()
    before = {k: v.detach().clone() for k, v in module.state_dict().items()}
    callback = dpltm.DPCallback(noise_multiplier=1.0)
    callbacks: list[L.Callback] = [callback] + ([AddsTheRawGradient()] if case == "later callback" else [])
    with pytest.raises(DpltmUserError, match="refused before the optimiser's update"):
        L.Trainer(max_epochs=1, callbacks=callbacks, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, accelerator="cpu").fit(module, loader())
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    assert callback.steps_done == 1 and math.isfinite(callback.epsilon)  # counted before the update: over-stated


@pytest.mark.parametrize("case", ["in-backward update", "SAM"])
def test_an_update_the_callback_did_not_noise_makes_the_run_not_dp(case: str) -> None:
    """Each of these moved the weights on the raw gradient while the callback reported ε = 2.85 for 10 steps."""
    module = SharpnessAware() if case == "SAM" else Classifier()
    callbacks: list[L.Callback] = [dpltm.DPCallback(noise_multiplier=1.0)]
    if case == "in-backward update":  # PyTorch's "optimizer in backward": an update inside the backward pass
        def update(p: torch.Tensor) -> None:
            p.data.add_(p.grad, alpha=-0.1)

        for parameter in module.parameters():
            parameter.register_post_accumulate_grad_hook(update)
    with pytest.raises(DpltmUserError, match="no longer differentially private"):
        L.Trainer(max_epochs=1, callbacks=callbacks, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, accelerator="cpu").fit(module, loader())
    if case == "in-backward update":
        for parameter in module.parameters():
            parameter._post_accumulate_grad_hooks = None  # the user removes it (as a fix) before training again
    _not_dp_and_guarded(callbacks[0], module)


class SwapsTheOptimizer(L.Callback):
    def on_train_epoch_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.current_epoch == 1:
            trainer.strategy.optimizers = [torch.optim.SGD(module.parameters(), lr=0.1)]


def test_an_optimizer_swapped_mid_fit_is_refused_before_its_step() -> None:
    callback = dpltm.DPCallback(noise_multiplier=1.0)
    with pytest.raises(DpltmUserError, match="the optimiser changed during the fit"):
        L.Trainer(max_epochs=2, callbacks=[callback, SwapsTheOptimizer()], logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, accelerator="cpu").fit(Classifier(), loader())
    assert callback.steps_done == 10 and math.isfinite(callback.epsilon)


def test_lightnings_gradient_clipping_and_tuners_are_refused_before_any_step() -> None:
    from lightning.pytorch.callbacks import LearningRateFinder

    module = Classifier()
    before = {k: v.detach().clone() for k, v in module.state_dict().items()}
    with pytest.raises(DpltmUserError, match="gradient_clip_val"):
        L.Trainer(max_epochs=1, callbacks=[dpltm.DPCallback(noise_multiplier=1.0)], gradient_clip_val=1.0,
                  logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  accelerator="cpu").fit(module, loader())
    with pytest.raises(DpltmUserError, match="^LearningRateFinder trains on the raw gradients"):
        L.Trainer(max_epochs=1, callbacks=[LearningRateFinder(num_training_steps=5), dpltm.DPCallback(
            noise_multiplier=1.0)], logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, accelerator="cpu").fit(module, loader())
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())


class FrozenRenormalised(Classifier):
    """A frozen embedding with max_norm: its forward rescales, in place, the rows a batch looks up."""

    def __init__(self) -> None:
        super().__init__(nn.Sequential(nn.Embedding(50, 8, max_norm=1.0), nn.Flatten(), nn.Linear(8 * 4, 3)))
        self.net[0].weight.requires_grad_(False)


def test_an_embedding_with_max_norm_is_refused_trainable_or_not() -> None:
    """Which rows a batch renormalised showed in the released weights: a membership test at a finite ε."""
    with pytest.raises(DpltmUserError, match="has max_norm"):
        trainer(dpltm.DPCallback(noise_multiplier=1.0)).fit(FrozenRenormalised(), loader())
    net = FrozenRenormalised().net
    with pytest.raises(DpltmUserError, match="has max_norm"):
        dpltm.make_private(net, torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1),
                           (torch.randint(0, 50, (200, 4)), torch.randint(0, 3, (200,))), noise_multiplier=1.0,
                           batch_size=20)


class DictBatches(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 200

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = data()
        return {"x": x[i], "y": y[i]}


class MixesThroughDicts(MixingNet):
    def __init__(self) -> None:
        super().__init__()
        self.net[1].train()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.net(batch["x"]), batch["y"])


class CleanForwardMixingStep(L.LightningModule):
    """Its forward (inference) is clean; training_step goes through a child that mixes the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.centre = mlp(), BatchCentre()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(self.centre(x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_probe_reaches_dict_batches_and_the_children_training_step_uses() -> None:
    """Both trained a batch-mixing layer (a measured sensitivity of 1.42 C) at a finite ε."""
    callback = dpltm.DPCallback(noise_multiplier=1.0)
    with pytest.raises(DpltmUserError, match="mixes the records of a batch"):
        trainer(callback).fit(MixesThroughDicts(), poisson_loader(DictBatches(), batch_size=20))
    with pytest.raises(DpltmUserError, match="mixes the records of a batch"):
        trainer(dpltm.DPCallback(noise_multiplier=1.0)).fit(CleanForwardMixingStep(), loader())
    assert callback.steps_done == 0


class FailsAfterTheStep(L.Callback):
    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == 5:
            raise RuntimeError("disk full while logging")


def test_weights_a_run_stepped_are_guarded_even_if_it_failed_before_its_batch_ended() -> None:
    module = Classifier()
    first = dpltm.DPCallback(noise_multiplier=1.0)
    with pytest.raises(RuntimeError, match="disk full"):
        L.Trainer(max_epochs=1, callbacks=[FailsAfterTheStep(), first], logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, accelerator="cpu").fit(module, loader())
    assert first.steps_done == 5
    with pytest.raises(DpltmUserError, match="already took 5 steps in another private run"):
        trainer(dpltm.DPCallback(noise_multiplier=1.0)).fit(module, loader())


class ScaledOutput(Classifier):
    """A 0-dim parameter of the module itself (a temperature) used in its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)


def test_a_scalar_parameter_trains_and_a_lazy_layer_is_one_line() -> None:
    """A 0-dim parameter ended in an IndexError in the engine's norms; a LazyLinear in torch's ValueError."""
    callback = dpltm.DPCallback(noise_multiplier=1.0)
    module = ScaledOutput()
    trainer(callback).fit(module, loader())
    assert callback.steps_done == 10 and float(module.scale) != 1.0
    with pytest.raises(DpltmUserError, match="net.0 \\(LazyLinear\\) has parameters not made yet"):
        trainer(dpltm.DPCallback(noise_multiplier=1.0)).fit(
            Classifier(nn.Sequential(nn.LazyLinear(16), nn.Tanh(), nn.Linear(16, 3))), loader())


@pytest.mark.parametrize("move", ["device", "float64"])
def test_weights_moved_after_a_fit_are_still_guarded(move: str) -> None:
    """Lightning moves a GPU module back to the CPU after a fit (new storage), and precision='64-true' converts it:
    either way a second DPCallback counted only its own steps on weights that carry the first fit's."""
    module = Classifier()
    trainer(dpltm.DPCallback(noise_multiplier=1.0)).fit(module, loader())
    if move == "device":
        module._apply(lambda t: t.clone())  # what module.cpu() after a GPU fit does to the storage
        second = trainer(dpltm.DPCallback(noise_multiplier=1.0))
    else:
        second = L.Trainer(max_epochs=1, callbacks=[dpltm.DPCallback(noise_multiplier=1.0)], precision="64-true",
                           logger=False, enable_checkpointing=False, enable_progress_bar=False,
                           enable_model_summary=False, accelerator="cpu")
    with pytest.raises(DpltmUserError, match="already took 10 steps in another private run"):
        second.fit(module, loader())
    fresh = Classifier()  # new weights: accepted
    module.load_state_dict(fresh.state_dict())
    trainer(dpltm.DPCallback(noise_multiplier=1.0)).fit(module.double() if move == "float64" else module,
                                                        loader() if move == "device" else poisson_loader(
                                                            TensorDataset(data()[0].double(), data()[1]),
                                                            batch_size=20))


# ---- the final review of the above ----------------------------------------------------------------------------

class WithMeanMetric(Classifier):
    """The Lightning-Hydra layout: a torchmetrics aggregator as a child, fed the detached loss."""

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.train_loss = torchmetrics.MeanMetric()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.train_loss(loss.detach())
        return loss


def test_a_metric_child_is_not_probed_as_a_layer() -> None:
    """Probing every child called the MeanMetric on made-up rows and refused it as mixing the batch."""
    callback = dpltm.DPCallback(noise_multiplier=1.0)
    trainer(callback).fit(WithMeanMetric(), loader())
    assert callback.steps_done == 10


class WritesAfterTheCallback(ReplacesTheGradient):
    """Adds the raw gradient to the weights themselves in its own on_before_optimizer_step (after DPCallback's)."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        for p, raw in zip(self.parameters(), self.raw):
            p.data.add_(raw, alpha=-0.1)


def test_a_write_after_the_callbacks_hook_makes_the_run_not_dp_and_survives_a_reload() -> None:
    module = WritesAfterTheCallback()
    callback = dpltm.DPCallback(noise_multiplier=1.0)
    with pytest.raises(DpltmUserError, match="was written during the training step, before the optimiser.s update"):
        trainer(callback).fit(module, loader())
    reloaded = dpltm.DPCallback(noise_multiplier=1.0)
    reloaded.load_state_dict(callback.state_dict())
    ledger = reloaded.ledger()
    assert reloaded.epsilon == math.inf and ledger is not None and ledger.non_private_updates == 1
    assert "NOT differentially private" in (ledger.warning() or "")
