"""Augmentation multiplicity (De et al. 2022, §3): a record's gradient is the mean over its K views *before*
clipping, so its clipped contribution is one record's (norm ≤ C), and the sampling and ε do not depend on K."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import functional_call, grad, vmap

from dpltm.data.types import DatasetSplits
from dpltm.data.views import VIEW_OFFSETS, shifted, view_stack
from dpltm.dp import step as dp_step
from dpltm.dp.engine import per_sample_cross_entropy, view_mean_cross_entropy
from dpltm.dp.ghost import MaskLayout
from dpltm.dp.mechanism import NoiseContext
from dpltm.errors import DpltmUserError
from dpltm.feature_cache import cache_key, network_inputs
from dpltm.masks import apply_masks_, prunable_weights
from dpltm.networks.lenet import LeNet, build_architecture, build_network
from dpltm.pruning import paper_prune_rates, prune_layerwise
from dpltm.settings import TrainSettings
from dpltm.training.plan import plan_training
from dpltm.training.private import DPTrainingModule, per_record_loss, run_private
from tests.conftest import make_blobs

SIDE = 4


def ticket(activation: str = "tanh") -> tuple[LeNet, dict[str, Tensor]]:
    """An MLP over 4×4 images with both layers pruned (the masked weights are zero)."""
    model = LeNet(build_architecture(SIDE * SIDE, 3, (8,), None, activation), torch.Generator().manual_seed(0))
    masks = prune_layerwise(model.weights(), model.full_masks(), paper_prune_rates(model.mask_names()))
    return model, apply_masks_(model, masks)


def view_mean_reference(model: torch.nn.Module, masks: dict[str, Tensor], x: Tensor, y: Tensor,
                        clip: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Each record's gradient of (1/K) Σ_k ℓ(view_k, y_i) by torch.func (vmap of grad, one record at a time), over
    the surviving weights; its norm; and Σ_i min(1, C/‖g_i‖) g_i."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: dict[str, Tensor], views: Tensor, label: Tensor) -> Tensor:  # views: (K, in)
        return F.cross_entropy(functional_call(model, p, (views,)), label.expand(views.shape[0]))  # mean over K

    per_record = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    per_record = {k: g * masks[k] if k in masks else g for k, g in per_record.items()}
    norms = torch.sqrt(sum((g.flatten(1) ** 2).sum(1) for g in per_record.values()))
    factors = (clip / norms).clamp(max=1.0)
    return norms, {k: (g * factors.view(-1, *[1] * (g.dim() - 1))).sum(0) for k, g in per_record.items()}


def scatter_ticket() -> tuple[torch.nn.Module, dict[str, Tensor]]:
    """A ScatterNet MLP head (8×8 images: 324 features) with its weights pruned to 30 %, fed features directly."""
    arch = build_architecture(64, 3, (6,), None, "tanh", "scatter-mlp")
    model = build_network(arch, torch.Generator().manual_seed(0))
    masks = {name: (torch.rand(w.shape, generator=torch.Generator().manual_seed(3)) < 0.3).float()
             for name, w in prunable_weights(model).items()}
    return model, apply_masks_(model, masks)


@pytest.mark.parametrize(("views", "network"), [(2, "mlp"), (5, "mlp"), (4, "scatter-mlp")])
def test_a_record_contributes_its_clipped_mean_over_views(views: int, network: str) -> None:
    model, masks = ticket() if network == "mlp" else scatter_ticket()
    g = torch.Generator().manual_seed(1)
    x = (view_stack(torch.rand(12, SIDE * SIDE, generator=g), views) if network == "mlp"  # the views of images
         else torch.rand(12, views, model.front.out_features, generator=g))  # the views' scattering features
    y = torch.randint(0, 3, (12,), generator=torch.Generator().manual_seed(2))
    norms, expected = view_mean_reference(model, masks, x, y, clip=1.0)
    clip = float(norms.median())  # half the records are clipped
    _, expected = view_mean_reference(model, masks, x, y, clip)
    layout = dp_step.step_layout(model, masks, views=views)
    assert isinstance(layout, dp_step.EngineLayout)  # the fused ghost norm is for one row per record
    batch = dp_step.clipped_batch(model, layout, x, y, clip, loss=view_mean_cross_entropy)
    torch.testing.assert_close(batch.norms, norms, rtol=1e-5, atol=1e-6)
    for name, total in expected.items():
        torch.testing.assert_close(batch.grad_sums[name], total, rtol=1e-5, atol=1e-6)
        if name in masks:
            assert bool((batch.grad_sums[name][masks[name] == 0] == 0).all())  # pruned: exactly zero
    # each record alone: its contribution is its clipped mean, of norm ≤ C
    for i in range(x.shape[0]):
        one = dp_step.clipped_batch(model, layout, x[i:i + 1], y[i:i + 1], clip, loss=view_mean_cross_entropy)
        size = torch.sqrt(sum((g ** 2).sum() for g in one.grad_sums.values()))
        assert float(size) <= clip * (1 + 1e-5)


def test_one_view_leaves_the_step_as_it_was(tiny_splits: DatasetSplits) -> None:
    model, masks = ticket()
    assert network_inputs(model, tiny_splits, views=1) is tiny_splits
    assert per_record_loss(TrainSettings()) is per_sample_cross_entropy
    assert isinstance(dp_step.step_layout(model, masks), MaskLayout)
    assert TrainSettings().augmult == 1


def square_blobs(n: int, seed: int) -> Any:
    return make_blobs(n, SIDE * SIDE, 3, seed)


def test_sampling_and_epsilon_do_not_depend_on_views(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same Poisson batches of records (indices into N, not into N·K), the same plan (q, σ, T) and so the same
    accountant event, whatever K; the pruned weights stay exactly zero."""
    data = DatasetSplits(name="blobs16", source_split="train", train=square_blobs(256, 0), val=square_blobs(64, 1),
                         test=square_blobs(64, 2), num_features=SIDE * SIDE, num_classes=3, fingerprint="b16")
    drawn: dict[int, list[Tensor]] = {}
    original = DPTrainingModule.training_step
    plans = {}
    for views in (1, 3):
        settings = TrainSettings(epochs=2, batch_size=32, eps2=1.0, lr=0.5, augmult=views)
        plans[views] = plan_training(settings, len(data.train))
        model, masks = ticket()
        inputs = network_inputs(model, data, views=views)
        assert inputs.train.features.shape == ((256, views, SIDE * SIDE) if views > 1 else (256, SIDE * SIDE))
        assert inputs.val.features is data.val.features and inputs.test.features is data.test.features  # view 0
        batches: list[Tensor] = []

        def recording(self: DPTrainingModule, batch: Tensor, index: int, batches: list[Tensor] = batches) -> None:
            batches.append(batch.clone())
            original(self, batch, index)

        monkeypatch.setattr(DPTrainingModule, "training_step", recording)
        run_private(model, inputs, plans[views], settings, seed=5, epsilon_after=None, progress=False,
                    noise_context=NoiseContext(model=model, masks=masks, clip=settings.clip, private_dataset="b16"))
        drawn[views] = batches
        for name, mask in masks.items():
            assert bool((dict(model.named_parameters())[name][mask == 0] == 0).all())
    assert plans[1] == plans[3]
    assert len(drawn[1]) == len(drawn[3]) == plans[1].steps
    assert all(torch.equal(a, b) for a, b in zip(drawn[1], drawn[3]))
    assert all(int(b.max()) < 256 for b in drawn[3] if b.numel())


def test_views_are_shifts_with_zero_fill() -> None:
    image = torch.arange(1.0, 17.0).reshape(1, 16)
    assert torch.equal(shifted(image, (0, 0)), image)
    down = shifted(image, (1, 0)).reshape(4, 4)
    assert torch.equal(down[0], torch.zeros(4)) and torch.equal(down[1:], image.reshape(4, 4)[:3])
    left = shifted(image, (0, -2)).reshape(4, 4)
    assert torch.equal(left[:, :2], image.reshape(4, 4)[:, 2:]) and torch.equal(left[:, 2:], torch.zeros(4, 2))
    assert len(set(VIEW_OFFSETS)) == len(VIEW_OFFSETS) and VIEW_OFFSETS[0] == (0, 0)


class CountingFront:
    """A fixed front end (the features_of protocol): the records times two, counting its calls."""

    in_features, out_features = SIDE * SIDE, SIDE * SIDE + 1

    def __init__(self) -> None:
        self.calls = 0

    def settings(self) -> dict[str, Any]:
        return {"transform": "twice"}

    def __call__(self, x: Tensor) -> Tensor:
        self.calls += 1
        return torch.cat([2 * x, x.sum(1, keepdim=True)], dim=1)


class FrontModel(torch.nn.Module):
    fully_connected = True

    def __init__(self) -> None:
        super().__init__()
        self.front = CountingFront()


def test_each_view_has_its_own_cache_entry(tmp_path: Path) -> None:
    data = DatasetSplits(name="blobs16", source_split="train", train=square_blobs(40, 0), val=square_blobs(8, 1),
                         test=square_blobs(8, 2), num_features=SIDE * SIDE, num_classes=3, fingerprint="b16")
    model = FrontModel()
    folder = tmp_path / "features"
    out = network_inputs(model, data, cache_dir=folder, views=3)
    front = model.front
    assert out.train.features.shape == (40, 3, front.out_features)
    for k, offset in enumerate(VIEW_OFFSETS[:3]):
        torch.testing.assert_close(out.train.features[:, k], front(shifted(data.train.features, offset)))
    names = {p.stem for p in folder.glob("*.pt")}
    assert len(names) == 5  # train's three views, val's and test's view 0
    assert cache_key(front.settings(), data.train.features) in names  # view 0: the records' own entry
    shifted_key = cache_key({**front.settings(), "view": [0, 1]}, shifted(data.train.features, (0, 1)))
    assert shifted_key in names
    front.calls = 0
    import dpltm.feature_cache as cache

    cache._recent.clear()
    again = network_inputs(model, data, cache_dir=folder, views=3)
    assert front.calls == 0 and torch.equal(again.train.features, out.train.features)  # read back, not computed


def test_networks_that_take_one_image_per_record_are_refused(tiny_splits: DatasetSplits) -> None:
    lenet5 = LeNet(build_architecture(28 * 28, 10, (8,), None, "tanh", "lenet5"), torch.Generator().manual_seed(0))
    data = DatasetSplits(name="x", source_split="train", train=make_blobs(4, 28 * 28, 3, 0),
                         val=make_blobs(2, 28 * 28, 3, 1), test=make_blobs(2, 28 * 28, 3, 2), num_features=784,
                         num_classes=3, fingerprint="x")
    with pytest.raises(DpltmUserError, match="lenet5 takes one image per record"):
        network_inputs(lenet5, data, views=2)
    mlp = LeNet(build_architecture(20, 4, (8,), None, "tanh"), torch.Generator().manual_seed(0))
    with pytest.raises(DpltmUserError, match="shifts square images"):
        network_inputs(mlp, tiny_splits, views=2)


def test_noise_geometries_refuse_views() -> None:
    model, masks = ticket()
    scales = {"hidden.0.weight": torch.ones(8, SIDE * SIDE)}
    with pytest.raises(DpltmUserError, match="--augmult trains with --noise gaussian"):
        dp_step.step_layout(model, masks, scales=scales, views=2)
