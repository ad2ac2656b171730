"""The sample-independence probe: layers without parameters that mix a batch's records, or update buffers
in their forward pass, are refused before any step; row-wise models pass and are left as they were."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpltm
from dpltm.dp.independence import check_samples_independent, probe_batch
from dpltm.errors import DpltmUserError
from dpltm.lightning import poisson_loader


class Centre(nn.Module):
    """No parameters, so no rule sees it: subtracts the batch mean (each output row depends on every record)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h - h.mean(0, keepdim=True)


class RollPairs(nn.Module):
    """Mixes neighbouring rows only."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + 0.5 * h.roll(1, dims=0)


class RunningMean(nn.Module):
    """Keeps a running mean of the records it sees: a statistic released without noise."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(10))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.mean.mul_(0.9).add_(0.1 * h.mean(0))
        return h


def net(middle: nn.Module) -> nn.Sequential:
    return nn.Sequential(middle, nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(300, 10, generator=g), torch.randint(0, 3, (300,), generator=g)


@pytest.mark.parametrize(("middle", "match"), [
    (Centre(), "^layer 0 \\(Centre\\) mixes the records of a batch"),
    (RollPairs(), "^layer 0 \\(RollPairs\\) mixes the records of a batch"),
    (RunningMean(), "^the model's forward pass updates buffer '0.mean'"),
])
def test_make_private_refuses_parameter_free_mixing_and_buffer_updates(middle: nn.Module, match: str) -> None:
    model = net(middle)
    with pytest.raises(DpltmUserError, match=match):
        dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data(), noise_multiplier=1.0,
                           batch_size=30)


def test_the_probe_leaves_buffers_random_state_and_mode_as_they_were() -> None:
    model = net(RunningMean())
    model[0].mean.fill_(3.0)
    model.eval()
    example = torch.randn(1, 10)
    state = torch.get_rng_state()
    with pytest.raises(DpltmUserError):
        check_samples_independent(model, example)
    assert bool((model[0].mean == 3.0).all()) and not model.training
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("middle", [nn.Dropout(0.5), nn.Identity(), nn.LayerNorm(10)])
def test_row_wise_models_pass_dropout_included(middle: nn.Module) -> None:
    """Dropout draws the same masks in both passes (one seed), so its randomness is not taken for mixing."""
    model = net(middle).train()
    check_samples_independent(model, torch.randn(1, 10))
    model = net(middle)
    run = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data(), noise_multiplier=1.0,
                             batch_size=30)
    run.fit()
    assert run.steps_done > 0


def test_float_probes_use_no_record_values_and_differ_in_one_end_row_each() -> None:
    example = torch.full((1, 4, 4), 7.0)
    first, second, third = probe_batch(example)
    assert first.shape == second.shape == third.shape == (6, 4, 4) and not bool((first == 7.0).any())
    assert not torch.equal(first[0], second[0]) and torch.equal(first[1:], second[1:])
    assert not torch.equal(first[-1], third[-1]) and torch.equal(first[:-1], third[:-1])
    tokens = torch.tensor([[3, 1, 4]])
    first, second, third = probe_batch(tokens)
    assert first.dtype == torch.long and bool((first == tokens).all())
    assert bool((second[0] == 0).all()) and bool((third[-1] == 0).all())


class LookAhead(nn.Module):
    """Mixes each row with the next one only: row 0 changed leaves rows 1… alone; the last row changed does not."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([h[:-1] + h[1:], h[-1:]])


class Roots(nn.Module):
    """NaN on Gaussian rows (sqrt of negatives): the comparison must not break on it."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.sqrt().nan_to_num(0.0) + h.sqrt() * 0


class ByteTokens(nn.Module):
    """Token ids stored as bytes (floats when they arrive): Gaussian rows are no ids; copies of the record are."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(x.long()).mean(1))


def test_mixing_with_later_rows_nan_outputs_and_byte_token_ids() -> None:
    with pytest.raises(DpltmUserError, match="^layer 0 \\(LookAhead\\) mixes the records"):
        check_samples_independent(net(LookAhead()), torch.randn(1, 10))
    check_samples_independent(net(Roots()), torch.randn(1, 10))  # NaN rows agree with NaN rows: no crash
    x = torch.randint(0, 10, (300, 5), dtype=torch.uint8)
    y = torch.randint(0, 3, (300,))
    model = ByteTokens()
    run = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
                             batch_size=30)
    run.fit()
    assert run.steps_done == 10


def test_a_backbone_frozen_in_eval_mode_stays_in_eval_mode() -> None:
    """check_data_fits_model and evaluate restore each module's own mode, not the root's for all."""
    backbone = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16))
    backbone.eval()
    for p in backbone.parameters():
        p.requires_grad_(False)
    model = nn.Sequential(backbone, nn.Tanh(), nn.Linear(16, 3))
    model.train()
    backbone.eval()
    x, y = data()
    run = dpltm.make_private(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
                             (x, y), noise_multiplier=1.0, batch_size=30)
    assert not backbone.training and not backbone[1].training
    before = backbone[1].running_mean.clone()
    run.fit()
    dpltm.evaluate(model, (x[:20], y[:20]))
    assert not backbone[1].training and torch.equal(backbone[1].running_mean, before)


class TokenMixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens).mean(1)
        return self.out(h - h.mean(0, keepdim=True))


def test_integer_records_are_probed_too() -> None:
    with pytest.raises(DpltmUserError, match="mixes the records of a batch"):
        check_samples_independent(TokenMixer(), torch.tensor([[3, 1, 4]]))


class Wrapped(L.LightningModule):
    """A LightningModule without a forward of its own: training_step calls its child."""

    def __init__(self, middle: nn.Module) -> None:
        super().__init__()
        self.model = net(middle)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_callback_probes_its_first_batch() -> None:
    x, y = data()
    trainer = L.Trainer(max_epochs=1, callbacks=[dpltm.DPCallback(noise_multiplier=1.0)], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu")
    with pytest.raises(DpltmUserError, match="^layer model.0 \\(Centre\\) mixes the records of a batch"):
        trainer.fit(Wrapped(Centre()), poisson_loader(torch.utils.data.TensorDataset(x, y), batch_size=30, seed=1))


def test_a_fit_refused_before_its_first_step_leaves_the_loader_seed_usable() -> None:
    """The probe refuses the first batch; the same seeded loader then trains the corrected module."""
    x, y = data()
    callback = dpltm.DPCallback(noise_multiplier=1.0)

    def fit(module: L.LightningModule) -> None:
        trainer = L.Trainer(max_epochs=1, callbacks=[callback], logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
        trainer.fit(module, poisson_loader(torch.utils.data.TensorDataset(x, y), batch_size=30, seed=7))

    with pytest.raises(DpltmUserError, match="mixes the records"):
        fit(Wrapped(Centre()))
    fit(Wrapped(nn.Identity()))
    assert callback.steps_done == 10
    with pytest.raises(DpltmUserError, match="would replay the batches"):
        fit(Wrapped(nn.Identity()))


class TiedHead(nn.Module):
    """The first layer's weight read again in the output (a tied head through a functional call)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(10, 16)
        self.middle = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.middle(torch.tanh(self.first(x))))
        return F.linear(h, self.first.weight.T[:3])


def test_a_weight_used_outside_its_layer_is_refused_and_row_wise_models_pass() -> None:
    x, y = data()
    with pytest.raises(DpltmUserError, match="^parameter first.weight: its per-sample gradients do not add up"):
        model = TiedHead()
        dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
                           batch_size=30)
    for model in (net(nn.Dropout(0.3)), nn.Sequential(nn.Unflatten(1, (1, 10)), nn.Conv1d(1, 4, 3), nn.Flatten(),
                                                      nn.LayerNorm(32), nn.Linear(32, 3))):
        run = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
                                 batch_size=30)
        run.fit()
        assert run.steps_done == 10


class KeyBiasAttention(nn.Module):
    """Self-attention from Linear layers: the key's bias has a zero gradient in exact arithmetic (softmax ignores a
    shift of every logit), so both sides of the check hold float noise there."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(1, 8)
        self.query, self.key, self.value = (nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x.reshape(-1, 10, 1)))  # (B, 10, 8): each feature a token
        attended = F.scaled_dot_product_attention(self.query(h), self.key(h), self.value(h))
        return self.head(attended.mean(1))


def test_a_gradient_that_is_zero_in_exact_arithmetic_is_not_taken_for_a_tied_weight() -> None:
    x, y = data()
    model = KeyBiasAttention()
    run = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
                             batch_size=30)
    run.step()
    assert run.steps_done == 1
