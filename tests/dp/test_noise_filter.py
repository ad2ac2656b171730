"""DOPPLER's low-pass filter over the noisy gradients (dpltm.dp.noise_filter): it is the filter the paper writes
(scipy's lfilter with the start-up correction), it reads only the released noisy gradients (so ε is unchanged), it keeps
pruned weights at exactly zero, and its history survives a save and resume bit for bit."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scipy.signal import lfilter
from torch import Tensor

import dpltm
from dpltm.dp.noise_filter import NOISE_FILTERS, NoiseFilter, make_noise_filter
from dpltm.dp.step import DpSgdStep
from dpltm.errors import DpltmUserError
from dpltm.settings import TrainSettings
from tests.apidata import blobs, mlp

DOPPLER = NOISE_FILTERS["doppler"]
assert DOPPLER is not None


def reference(sequence: np.ndarray) -> np.ndarray:
    """m̂_t by scipy: lfilter(b, [1, a…]) over the sequence (axis 0), divided by the same filter over 1, 1, …"""
    b, a = list(DOPPLER.b), [1.0, *DOPPLER.a]
    m = lfilter(b, a, sequence, axis=0)
    c = lfilter(b, a, np.ones(len(sequence)))
    return m / c.reshape(-1, *([1] * (sequence.ndim - 1)))


def test_the_filter_is_the_papers_with_its_start_up_correction() -> None:
    g = torch.Generator().manual_seed(0)
    seq = {"w": torch.randn(40, 3, 4, generator=g, dtype=torch.float64),
           "b": torch.randn(40, 3, generator=g, dtype=torch.float64)}
    f = NoiseFilter("doppler", {k: v[0] for k, v in seq.items()})
    out = [f.step({k: v[t] for k, v in seq.items()}) for t in range(40)]
    for name, values in seq.items():
        got = torch.stack([o[name] for o in out]).numpy()
        np.testing.assert_allclose(got, reference(values.numpy()), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(out[0][name], values[0], rtol=1e-15, atol=0)  # m̂_1 = b_0 ĝ_1 / b_0 = ĝ_1
    assert -sum(DOPPLER.a) + sum(DOPPLER.b) == pytest.approx(1.0)  # unit gain at frequency 0


def test_a_constant_gradient_passes_unchanged_and_alternating_noise_is_removed() -> None:
    """Low-pass: frequency 0 (a constant ĝ) passes with gain 1 from the first step on (the correction); the highest
    frequency (ĝ flipping sign each step) is nulled by the zero at z = −1 once the start-up has decayed."""
    ones = torch.ones(5, dtype=torch.float64)
    f = NoiseFilter("doppler", {"w": ones})
    assert all(torch.allclose(f.step({"w": ones * 3.0})["w"], ones * 3.0, rtol=1e-12) for _ in range(30))
    f = NoiseFilter("doppler", {"w": ones})
    last = [f.step({"w": ones * (-1.0) ** t})["w"] for t in range(200)][-1]
    assert float(last.abs().max()) < 1e-8


def test_pruned_coordinates_get_zero_in_and_zero_out() -> None:
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(6, 7, generator=g) < 0.4
    f = NoiseFilter("doppler", {"w": torch.zeros(6, 7)})
    for _ in range(25):
        out = f.step({"w": torch.randn(6, 7, generator=g) * 1e3 * mask})["w"]
        assert torch.count_nonzero(out[~mask]) == 0


def test_the_state_saved_mid_run_continues_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(2)
    seq = [{"w": torch.randn(4, 5, generator=g), "b": torch.randn(5, generator=g)} for _ in range(20)]
    shapes = {k: torch.zeros_like(v) for k, v in seq[0].items()}
    whole = NoiseFilter("doppler", shapes)
    straight = [whole.step(s) for s in seq]
    first = NoiseFilter("doppler", shapes)
    for s in seq[:9]:
        first.step(s)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)  # through a file, as a checkpoint carries it
    buffer.seek(0)
    second = NoiseFilter("doppler", shapes)
    second.load_state_dict(torch.load(buffer, weights_only=True))
    for s, expected in zip(seq[9:], straight[9:], strict=True):
        got = second.step(s)
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    with pytest.raises(ValueError, match="other parameters"):
        NoiseFilter("doppler", {"w": torch.zeros(4, 5)}).load_state_dict(first.state_dict())


def test_none_builds_no_filter() -> None:
    assert make_noise_filter("none", {"w": torch.zeros(2)}) is None
    with pytest.raises(ValueError):
        NoiseFilter("none", {"w": torch.zeros(2)})


@pytest.mark.parametrize("hostile", ["Doppler", "", "lowpass", 3, None, ["doppler"]])
def test_hostile_filter_names_are_refused_in_one_line(hostile: Any) -> None:
    with pytest.raises(DpltmUserError, match="must be one of none, doppler") as error:
        TrainSettings(noise_filter=hostile)
    assert "\n" not in str(error.value)
    model = mlp()
    with pytest.raises(DpltmUserError, match="noise_filter must be one of none, doppler"):
        dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), blobs(100, 0), target_epsilon=1.0,
                           epochs=1, batch_size=20, noise_filter=hostile)
    with pytest.raises(DpltmUserError, match="noise_filter must be one of none, doppler"):
        dpltm.DPCallback(target_epsilon=1.0, noise_filter=hostile)


def seeded_run(noise_filter: str, masks: dict[str, Tensor]) -> tuple[Any, torch.nn.Module]:
    data = blobs(600, 0)
    torch.manual_seed(0)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.5)
    run = dpltm.make_private(model, optimizer, data, target_epsilon=1.0, epochs=2, batch_size=60, masks=masks,
                             masks_from="public", noise_seed=7, noise_filter=noise_filter)
    return run, model


def test_the_noise_filter_touches_only_released_noisy_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """A seeded DP run: the filter's inputs are exactly the noisy means the step released (the same tensors, unchanged),
    once per step; the optimiser reads the filter of that sequence and nothing else; ε and the ledger are those of the
    same run without the filter; pruned weights stay exactly zero."""
    released: list[dict[str, Tensor]] = []
    seen: list[tuple[dict[str, Tensor], dict[str, Tensor]]] = []
    read: list[dict[str, Tensor]] = []
    noisy_gradients, filter_step = DpSgdStep.noisy_gradients, NoiseFilter.step

    def spy_release(self: DpSgdStep, sums: dict[str, Tensor]) -> dict[str, Tensor]:
        grads = noisy_gradients(self, sums)
        released.append({k: v.clone() for k, v in grads.items()})
        released[-1]["__ids__"] = grads  # type: ignore[assignment]
        return grads

    def spy_filter(self: NoiseFilter, grads: Any, out: Any = None) -> dict[str, Tensor]:
        seen.append((grads, {k: v.clone() for k, v in grads.items()}))
        return filter_step(self, grads, out)

    monkeypatch.setattr(DpSgdStep, "noisy_gradients", spy_release)
    monkeypatch.setattr(NoiseFilter, "step", spy_filter)
    masks = {"0.weight": torch.rand(16, 10, generator=torch.Generator().manual_seed(1)) < 0.5}
    run, model = seeded_run("doppler", masks)
    run.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: read.append({n: p.grad.clone() for n, p in model.named_parameters()}))
    run.fit()
    assert len(released) == len(seen) == len(read) == run.steps_done == 20
    names = [n for n, _ in model.named_parameters()]
    for ours, (given, at_call) in zip(released, seen, strict=True):
        assert given is ours["__ids__"]  # the very tensors the step released, nothing recomputed
        assert all(torch.equal(at_call[n], ours[n]) for n in names)
    replay = NoiseFilter("doppler", {n: torch.zeros_like(p) for n, p in model.named_parameters()})
    for ours, grads in zip(released, read, strict=True):
        expected = filter_step(replay, {n: ours[n] for n in names})
        assert all(torch.equal(grads[n], expected[n]) for n in names)  # the optimiser read m̂ of the ĝ sequence
    assert not torch.equal(read[5]["0.weight"], released[5]["0.weight"])  # and m̂ is not ĝ: the filter ran
    assert torch.count_nonzero(model[0].weight.detach()[~masks["0.weight"]]) == 0
    monkeypatch.undo()
    plain, _ = seeded_run("none", masks)
    plain.fit()
    assert run.epsilon == plain.epsilon and run.plan.noise_multiplier == plain.plan.noise_multiplier
    assert run.ledger().to_json() == plain.ledger().to_json()  # type: ignore[union-attr]


def test_a_saved_run_resumes_with_its_filter_history(tmp_path: Path) -> None:
    masks = {"0.weight": torch.ones(16, 10, dtype=torch.bool)}
    run, _ = seeded_run("doppler", masks)
    run.fit(epochs=1)
    path = run.save(tmp_path / "run.pt")
    model = mlp()
    resumed = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.5), blobs(600, 0),
                                 target_epsilon=1.0, epochs=2, batch_size=60, masks=masks, masks_from="public",
                                 resume_from=path, noise_filter="doppler")
    saved, now = run._filter.state_dict(), resumed._filter.state_dict()
    assert all(torch.equal(x, y) for k in ("inputs", "outputs") for n in saved[k]
               for x, y in zip(saved[k][n], now[k][n], strict=True))
    assert torch.equal(saved["c"], now["c"]) and torch.equal(saved["taken"], now["taken"])
    probe = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    a, b = run._filter.step(probe), resumed._filter.step(probe)
    assert all(torch.equal(a[n], b[n]) for n in probe)  # the next step filters exactly as the uninterrupted run's
    resumed.fit()
    model = mlp()
    with pytest.raises(DpltmUserError, match="noise_filter='doppler' \\(given 'none'\\)"):
        dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.5), blobs(600, 0),
                           target_epsilon=1.0, epochs=3, batch_size=60, masks=masks, masks_from="public",
                           resume_from=path)


def test_the_callback_filters_the_noisy_gradients_and_checkpoints_the_filter(monkeypatch: pytest.MonkeyPatch) -> None:
    """DPCallback: the optimiser reads m̂ of the noisy means the callback released; the filter's history travels in the
    callback's checkpoint state, and a checkpoint is resumed with the same filter only."""
    import lightning as L

    from tests.api.test_api import Classifier

    released: list[dict[str, Tensor]] = []
    read: list[dict[str, Tensor]] = []
    noisy_gradients = DpSgdStep.noisy_gradients

    def spy_release(self: DpSgdStep, sums: dict[str, Tensor]) -> dict[str, Tensor]:
        grads = noisy_gradients(self, sums)
        released.append({k: v.clone() for k, v in grads.items()})
        return grads

    class Reader(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # type: ignore[no-untyped-def]
            read.append({n: p.grad.detach().clone() for n, p in pl_module.named_parameters()})

    monkeypatch.setattr(DpSgdStep, "noisy_gradients", spy_release)
    x, y = blobs(400, 0)
    module = Classifier()
    masks = {"model.0.weight": torch.rand(16, 10, generator=torch.Generator().manual_seed(1)) < 0.5}
    callback = dpltm.DPCallback(target_epsilon=2.0, max_grad_norm=0.5, masks=masks, masks_from="public",
                                noise_seed=4, noise_filter="doppler")
    trainer = L.Trainer(max_epochs=1, callbacks=[callback, Reader()], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(module, dpltm.lightning.poisson_loader(torch.utils.data.TensorDataset(x, y), batch_size=40, seed=5))
    assert len(released) == len(read) == callback.steps_done == 10
    replay = NoiseFilter("doppler", {n: torch.zeros_like(p) for n, p in module.named_parameters()})
    for ours, grads in zip(released, read, strict=True):
        expected = replay.step({n: ours[n] for n in grads})
        assert all(torch.equal(grads[n], expected[n]) for n in grads)
    assert bool((module.model[0].weight[~masks["model.0.weight"]] == 0).all())
    state = callback.state_dict()
    assert state["noise_filter"]["name"] == "doppler"
    again = dpltm.DPCallback(target_epsilon=2.0, masks=masks, masks_from="public", noise_filter="doppler")
    again.load_state_dict(state)
    with pytest.raises(DpltmUserError, match="noise_filter='doppler': resume with the same \\(given 'none'\\)"):
        dpltm.DPCallback(target_epsilon=2.0, masks=masks, masks_from="public").load_state_dict(state)
