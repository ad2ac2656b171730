"""A physical batch limit: the Poisson batch in chunks of at most that many rows, their clipped sums added before
the one noise draw. The mechanism and ε are the unchunked step's; only the order of additions moves, so the
released weights are bit-equal wherever the sums are exact (integer records, power-of-two clip factors), in
float32 and float64 alike, and equal to rounding elsewhere (float64: the summation order changes the last bit)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import dpltm
from dpltm.dp.gaussian import GaussianNoise
from dpltm.dp.step import DpSgdStep, record_terms, step_layout
from dpltm.errors import DpltmUserError
from dpltm.networks.lenet import build_architecture, build_network
from dpltm.settings import TrainSettings

ROWS = torch.tensor([[0, 0, 0, 0, 0], [1, 1, 1, 0, 0], [-1, 1, 0, 1, 0], [3, 2, 1, 1, 0], [1, -3, 1, 2, 0]])
"""Records whose per-sample gradient norms are powers of two under `picked_output` (‖x‖² + 1 = 1, 4, 4, 16, 16):
with C = 2 their clip factors are 1 or 1/2, and every clipped sum is exact. The last feature is 0 (pruned)."""


def picked_output(outputs: Tensor, targets: Tensor) -> Tensor:
    """A per-sample loss linear in the outputs: the output gradient is one-hot, whatever the weights."""
    return outputs.gather(1, targets[:, None]).squeeze(1)


def exact_run(limit: int | None, dtype: torch.dtype) -> tuple[list[Tensor], float]:
    g = torch.Generator().manual_seed(0)
    x = ROWS[torch.randint(0, len(ROWS), (400,), generator=g)].to(dtype)
    y = torch.randint(0, 3, (400,), generator=g)
    model = nn.Linear(5, 3).to(dtype)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=g))
    masks = {"weight": torch.ones(3, 5, dtype=torch.bool)}
    masks["weight"][:, 4] = False
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    private = dpltm.make_private(model, optimizer, (x, y), noise_multiplier=1.0, epochs=2, batch_size=60,
                                 max_grad_norm=2.0, masks=masks, masks_from="a test", loss=picked_output,
                                 noise_seed=3, max_physical_batch_size=limit)
    private.fit()
    return [p.detach().clone() for p in model.parameters()], private.epsilon


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("limit", [1, 7, 1000])
def test_make_private_in_chunks_releases_the_unchunked_weights_bit_for_bit(limit: int, dtype: torch.dtype) -> None:
    whole, eps = exact_run(None, dtype)
    chunked, chunked_eps = exact_run(limit, dtype)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))
    assert chunked_eps == eps  # the same mechanism: the same ε


def fused_run(limit: int | None) -> tuple[list[Tensor], torch.Generator]:
    """Five steps of the fused (LeNet MLP, cross-entropy) step in float64, with its per-record norm tables."""
    model = build_network(build_architecture(20, 4, (12, 8), None, "relu", "mlp"),
                          torch.Generator().manual_seed(0)).double()
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(200, 20, generator=g, dtype=torch.float64), torch.randint(0, 4, (200,), generator=g)
    layout = step_layout(model, None, torch.float64)
    noise = torch.Generator().manual_seed(2)
    step = DpSgdStep(model, layout, 1.0, GaussianNoise(1.0), 50.0, noise, torch.optim.SGD(model.parameters(), lr=0.1),
                     terms=record_terms(model, layout, x), max_physical_batch_size=limit)
    sampling = torch.Generator().manual_seed(9)
    for _ in range(5):
        index = (torch.rand(200, generator=sampling) < 0.25).nonzero().squeeze(1)
        step.step(x[index], y[index], index)
    return [p.detach().clone() for p in model.parameters()], noise


def test_the_fused_step_in_chunks_takes_the_same_draws_and_the_same_sums_to_rounding() -> None:
    """Cross-entropy's softmax makes the sums inexact: the chunks' order of addition moves the last bit in float64."""
    whole, whole_noise = fused_run(None)
    chunked, chunked_noise = fused_run(7)
    assert torch.equal(whole_noise.get_state(), chunked_noise.get_state())  # one draw per step, the same draws
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("value, message", [(0, "must be at least 1, got 0"), (-3, "must be at least 1, got -3"),
                                            (2.5, "must be an integer, got 2.5"), (True, "must be an integer")])
def test_a_bad_physical_batch_is_one_line(value: object, message: str) -> None:
    model = nn.Linear(5, 3)
    data = (torch.randn(100, 5), torch.randint(0, 3, (100,)))
    with pytest.raises(DpltmUserError, match=f"^max_physical_batch_size {message}"):
        dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data, noise_multiplier=1.0,
                           batch_size=10, max_physical_batch_size=value)  # type: ignore[arg-type]
    with pytest.raises(DpltmUserError, match=f"^--physical-batch {message}"):
        TrainSettings(physical_batch=value)  # type: ignore[arg-type]


def callback_run(limit: int | None) -> list[Tensor]:
    import lightning as L

    from dpltm.lightning import poisson_loader

    class Picked(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(5, 3))

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            x, y = batch
            return picked_output(self.net(x), y).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    g = torch.Generator().manual_seed(0)
    x, y = ROWS[torch.randint(0, len(ROWS), (300,), generator=g)].float(), torch.randint(0, 3, (300,), generator=g)
    module = Picked()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=g))
    callback = dpltm.DPCallback(noise_multiplier=1.0, max_grad_norm=2.0, loss_reduction="sum", noise_seed=4,
                                max_physical_batch_size=limit)
    loader = poisson_loader(torch.utils.data.TensorDataset(x, y), batch_size=40, seed=6)
    L.Trainer(max_epochs=2, callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, accelerator="cpu").fit(module, loader)
    return [p.detach().clone() for p in module.parameters()]


def test_the_callback_in_chunks_releases_the_unchunked_weights_bit_for_bit() -> None:
    whole = callback_run(None)
    assert all(torch.equal(a, b) for a, b in zip(whole, callback_run(6)))
    with pytest.raises(DpltmUserError, match="^max_physical_batch_size must be at least 1, got 0$"):
        dpltm.DPCallback(noise_multiplier=1.0, max_physical_batch_size=0)


class Scaled(nn.Module):
    """A user's layer (the torch.func rule, checked against its batch gradient): per-sample, or with `centred`
    the batch's mean subtracted first, which mixes the records."""

    def __init__(self, centred: bool) -> None:
        super().__init__()
        self.gain, self.centred = nn.Parameter(torch.linspace(0.5, 1.5, 4)), centred

    def forward(self, x: Tensor) -> Tensor:
        return ((x - x.mean(dim=0, keepdim=True)) if self.centred else x) * self.gain


@pytest.mark.parametrize("centred", [False, True])
def test_chunks_check_a_layer_not_known_per_sample_on_the_batch_total(centred: bool) -> None:
    from dpltm.dp.engine import clip_and_sum, clip_and_sum_in_chunks
    from dpltm.dp.rules import LayerCall

    g = torch.Generator().manual_seed(1)
    layer, x, out_grad = Scaled(centred), torch.randn(12, 4, generator=g), torch.randn(12, 4, generator=g)
    call = LayerCall("scaled", layer)
    output = layer(x)
    call.record(layer, (x,), {}, output, keep_output=False)
    call.batch_grads = {"gain": torch.autograd.grad(output, layer.gain, out_grad)[0]}
    if centred:
        with pytest.raises(DpltmUserError, match="do not add up to the batch gradient"):
            clip_and_sum_in_chunks([call], [out_grad], {}, 1.0, 12, 5)
        return
    whole, _ = clip_and_sum([call], [out_grad], {}, 1.0, batch_size=12)
    chunked = clip_and_sum_in_chunks([call], [out_grad], {}, 1.0, 12, 5)
    torch.testing.assert_close(chunked["scaled.gain"], whole["scaled.gain"])
