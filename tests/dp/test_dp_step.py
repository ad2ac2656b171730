"""DP-SGD step on a ticket (a plain MLP and its masks beside it): norms, clipping, noise, sampling."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from scipy import stats

from dpltm.dp.gaussian import GaussianNoise
from dpltm.dp.ghost import MaskLayout, clipped_gradient_sum, first_layer_input_terms
from dpltm.dp.sampling import PoissonBatches, poisson_sample
from dpltm.dp.step import apply_gradients, private_gradients
from dpltm.masks import Masks, PrunedWeights, apply_masks_
from dpltm.networks.lenet import LeNet, build_architecture
from dpltm.pruning import paper_prune_rates, prune_layerwise
from tests.dp.reference import masked_reference


def prune(model: LeNet, rounds: int) -> Masks:
    """`rounds` rounds of the paper's layerwise magnitude pruning, installed (pruned weights zeroed)."""
    masks = model.full_masks()
    for _ in range(rounds):
        masks = apply_masks_(model, prune_layerwise(model.weights(), masks, paper_prune_rates(model.mask_names())))
    return masks


def model_with(rounds: int, project_to: int | None = None, seed: int = 0,
               activation: str = "relu") -> tuple[LeNet, Masks]:
    model = LeNet(build_architecture(12, 5, (10, 7), project_to, activation), torch.Generator().manual_seed(seed))
    masks = prune(model, rounds)
    return model.double(), masks


def layout_of(model: LeNet, masks: Masks) -> MaskLayout:
    return MaskLayout.of(model, masks, torch.float64)


def batch(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 12, generator=g, dtype=torch.float64), torch.randint(0, 5, (n,), generator=g)


def masked_grads(model: LeNet, masks: Masks) -> dict[str, torch.Tensor]:
    """Each parameter's .grad restricted to the ticket's surviving weights (a pruned weight is zero but not
    trained: autograd still gives it a gradient, the ticket's step does not)."""
    by_parameter = dict(masks)
    return {name: p.grad * by_parameter[name].to(p.grad.dtype) if name in by_parameter else p.grad  # type: ignore[operator]
            for name, p in model.named_parameters()}


def loop_norms(model: LeNet, masks: Masks, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Reference: one backward pass per sample, norm of the gradient over the surviving weights."""
    norms = []
    for i in range(x.shape[0]):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1], reduction="sum").backward()
        sq = sum(float((g**2).sum()) for g in masked_grads(model, masks).values())
        norms.append(math.sqrt(sq))
    return torch.tensor(norms, dtype=torch.float64)


@pytest.mark.parametrize("rounds", [0, 3])
@pytest.mark.parametrize("project_to", [None, 9])
@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_ghost_norms_equal_single_sample_loop(rounds: int, project_to: int | None, activation: str) -> None:
    model, masks = model_with(rounds, project_to, activation=activation)
    x, y = batch(17)
    ghost = clipped_gradient_sum(model, x, y, clip=float("inf"), layout=layout_of(model, masks)).norms
    torch.testing.assert_close(ghost, loop_norms(model, masks, x, y), rtol=1e-10, atol=1e-12)


def test_sparse_and_dense_norm_operators_agree() -> None:
    """Big sparse layers take the CSR path; it must give the same norms as the dense one."""
    model = LeNet(build_architecture(1800, 5, (60,), None), torch.Generator().manual_seed(0)).double()
    masks = prune(model, 6)  # density 0.7**6 ≈ 0.12 on the first layer: below SPARSE_BELOW_DENSITY
    layout = layout_of(model, masks)
    assert layout.norm_masks[0] is not None and layout.norm_masks[0].layout == torch.sparse_csr
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(9, 1800, generator=g, dtype=torch.float64), torch.randint(0, 5, (9,), generator=g)
    assert layout.sum_masks[0] is not None  # the clipped sum takes the sampled-matmul path too
    batch = clipped_gradient_sum(model, x, y, clip=float("inf"), layout=layout)
    torch.testing.assert_close(batch.norms, loop_norms(model, masks, x, y), rtol=1e-10, atol=1e-12)
    # with no clipping the sum is the gradient of the summed loss (masked)
    model.zero_grad()
    F.cross_entropy(model(x), y, reduction="sum").backward()
    for name, grad_sum in masked_grads(model, masks).items():
        torch.testing.assert_close(batch.grad_sums[name], grad_sum, msg=name)
    for name, mask in dict(masks).items():
        assert torch.count_nonzero(batch.grad_sums[name][~mask]) == 0, name  # exactly: pruned weights get none


@pytest.mark.parametrize(("width", "rounds", "sparse", "scaled"),
                         [(12, 0, True, False), (12, 3, True, False), (1800, 6, True, False),
                          (1800, 6, False, False), (1800, 6, True, True), (12, 0, True, True)])
def test_precomputed_first_layer_terms_give_the_same_norms(width: int, rounds: int, sparse: bool,
                                                           scaled: bool) -> None:
    """The first layer's share of every record's masked norm, tabulated once per run and gathered per
    batch, gives the norms and clipped sums of the per-batch computation, for a dense first layer,
    a masked one (dense and CSR operators) and a noise geometry's scaled one."""
    model = LeNet(build_architecture(width, 5, (60, 7), None), torch.Generator().manual_seed(0)).double()
    masks = prune(model, rounds)
    g = torch.Generator().manual_seed(2)
    scales = ({name: 0.5 + torch.rand(p.shape, generator=g, dtype=torch.float64)
               for name, p in model.named_parameters()} if scaled else None)
    layout = MaskLayout.of(model, masks, torch.float64, scales, allow_sparse=sparse)
    if width > 1000:  # a big sparse first layer: the CSR operator when allowed
        assert (layout.norm_masks[0].layout == torch.sparse_csr) == sparse  # type: ignore[union-attr]
    features = torch.randn(50, width, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 5, (50,), generator=g)
    table = first_layer_input_terms(features, layout, rows_at_once=16)
    assert table is not None and table.shape[0] == 50
    index = torch.tensor([3, 7, 8, 20, 41, 49])
    direct = clipped_gradient_sum(model, features[index], labels[index], 0.3, layout)
    looked_up = clipped_gradient_sum(model, features[index], labels[index], 0.3, layout, input_terms=table[index])
    torch.testing.assert_close(looked_up.norms, direct.norms, rtol=1e-12, atol=1e-12)
    if not scaled:
        torch.testing.assert_close(looked_up.norms, loop_norms(model, masks, features[index], labels[index]),
                                   rtol=1e-10, atol=1e-12)
    for name in direct.grad_sums:
        torch.testing.assert_close(looked_up.grad_sums[name], direct.grad_sums[name], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("activation", "project_to"), [("relu", None), ("tanh", None), ("tanh", 9)])
def test_clipped_sum_equals_torch_func_per_sample_gradients(activation: str, project_to: int | None) -> None:
    """Masked ghost norms and the clipped sum match per-sample gradients from torch.func (vmap of
    grad), restricted to the surviving weights, whatever the activation: the identity does not depend
    on it."""
    model, masks = model_with(2, project_to, activation=activation)
    assert model.arch.activation == activation
    x, y = batch(23)
    ref = masked_reference(model, masks, x, y)
    got = clipped_gradient_sum(model, x, y, clip=ref.clip, layout=layout_of(model, masks))
    torch.testing.assert_close(got.norms, ref.norms)
    for name, value in ref.clipped_sum.items():
        torch.testing.assert_close(got.grad_sums[name], value)
    assert float((ref.norms * ref.factors).max()) <= ref.clip * (1 + 1e-9)


def test_no_noise_no_clipping_equals_plain_masked_sgd() -> None:
    """The DP step without noise or clipping is the non-private masked SGD step: a plain SGD step, then
    the ticket's pruned weights re-zeroed (`PrunedWeights`, what non-private training does)."""
    (dp_model, masks), (plain, plain_masks) = model_with(2), model_with(2)
    x, y = batch(32)
    opt_dp = torch.optim.SGD(dp_model.parameters(), lr=0.3)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.3)
    keep_pruned = PrunedWeights(plain, plain_masks)
    layout = layout_of(dp_model, masks)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        grads, _, _ = private_gradients(dp_model, x, y, clip=float("inf"), noise=GaussianNoise(0.0),
                                        expected_batch_size=32, generator=g, layout=layout)
        apply_gradients(dp_model, grads, opt_dp)
        opt_plain.zero_grad()
        F.cross_entropy(plain(x), y).backward()
        opt_plain.step()
        keep_pruned()
    for (name, a), b in zip(dp_model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, msg=name)
    for name, weight in dp_model.weights().items():
        assert torch.count_nonzero(weight[~masks[name]]) == 0, name  # the DP step alone kept them at zero


def test_noise_scale_on_zero_gradients_and_none_on_pruned() -> None:
    model, ticket_masks = model_with(3)
    model = model.float()
    layout = MaskLayout.of(model, ticket_masks)
    masks = {f"{n.removesuffix('.weight')}.{part}": (ticket_masks[n] if part == "weight"
                                                                              else None)
             for n, _ in model.layers_in_order() for part in ("weight", "bias")}
    sigma, clip, expected_batch = 1.7, 0.8, 50.0
    zeros = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    draws = [GaussianNoise(sigma).perturb({k: v.clone() for k, v in zeros.items()}, layout.surviving, clip, g)
             for _ in range(400)]
    for name, mask in masks.items():
        stacked = torch.stack([d[name] for d in draws]) / expected_batch
        if mask is None:
            surviving = stacked.flatten()
        else:
            assert torch.count_nonzero(stacked[:, ~mask]) == 0, name
            surviving = stacked[:, mask].flatten()
        std = float(surviving.std())
        assert std == pytest.approx(sigma * clip / expected_batch, rel=0.05), name


def test_pruned_weights_stay_zero_under_noisy_adam() -> None:
    model, masks = model_with(3)
    layout = layout_of(model, masks)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    for step in range(5):
        x, y = batch(20, seed=step)
        grads, _, _ = private_gradients(model, x, y, clip=1.0, noise=GaussianNoise(2.0),
                                        expected_batch_size=20, generator=g, layout=layout)
        apply_gradients(model, grads, opt)
    for name, weight in model.weights().items():
        assert torch.count_nonzero(weight[~masks[name]]) == 0


def test_empty_batch_is_a_legal_noise_only_step() -> None:
    model, masks = model_with(1)
    x, y = batch(0)
    grads, norms, _ = private_gradients(model, x, y, clip=1.0, noise=GaussianNoise(1.0),
                                        expected_batch_size=10, generator=torch.Generator().manual_seed(0),
                                        layout=layout_of(model, masks))
    assert norms.numel() == 0
    assert all(torch.isfinite(v).all() for v in grads.values())
    assert any(torch.count_nonzero(v) > 0 for v in grads.values())


def test_poisson_batch_sizes_are_binomial() -> None:
    n, q = 1000, 0.02
    sizes = [len(b) for b in PoissonBatches(n, q, steps=3000, seed=0)]
    # Chi-square goodness of fit against Binomial(n, q), tails pooled so every bin expects ≥ 5.
    binom = stats.binom(n, q)
    edges = list(range(int(binom.ppf(0.005)), int(binom.ppf(0.995)) + 1))
    observed = [sum(1 for s in sizes if s <= edges[0])]
    expected = [binom.cdf(edges[0])]
    for k in edges[1:-1]:
        observed.append(sizes.count(k))
        expected.append(binom.pmf(k))
    observed.append(sum(1 for s in sizes if s >= edges[-1]))
    expected.append(binom.sf(edges[-1] - 1))
    expected = [e * len(sizes) / sum(expected) for e in expected]
    assert stats.chisquare(observed, expected).pvalue > 1e-3
    small = [len(poisson_sample(5, 0.05, torch.Generator().manual_seed(s))) for s in range(400)]
    assert small.count(0) > 0  # empty batches happen and are returned as such
    indices = poisson_sample(100, 0.5, torch.Generator().manual_seed(0))
    assert indices.unique().numel() == indices.numel()  # no record twice in a batch


def test_non_finite_record_is_dropped_not_spread() -> None:
    """One record with an infinite input must not turn the released sum into NaN."""
    model, masks = model_with(2)
    layout = layout_of(model, masks)
    x, y = batch(6)
    x[2, 0] = float("inf")
    result = clipped_gradient_sum(model, x, y, clip=1.0, layout=layout)
    assert all(torch.isfinite(v).all() for v in result.grad_sums.values())
    clean = clipped_gradient_sum(model, torch.cat([x[:2], x[3:]]), torch.cat([y[:2], y[3:]]), clip=1.0,
                                 layout=layout)
    for name, value in clean.grad_sums.items():
        torch.testing.assert_close(result.grad_sums[name], value)
