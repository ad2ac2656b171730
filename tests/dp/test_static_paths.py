"""The CUDA-graph step's arithmetic, checked on the CPU where every other path can be compared with it:
clip factors in every float type, the static step against the eager one for each kind of layer and
noise geometry (one chunk and several), the first layer's norm table with its bias share, and the
masks applied once at the end."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from dpltm.data.types import LabeledTensors
from dpltm.dp import ghost, graphed
from dpltm.dp.gaussian import GaussianNoise
from dpltm.dp.ghost import MaskLayout, clip_factors, first_layer_input_terms
from dpltm.dp.graphed import StaticShapeDpStep
from dpltm.dp.sampling import poisson_batches_at_once
from dpltm.dp.step import apply_gradients, noisy_mean, private_gradients
from dpltm.masks import Masks, apply_masks_, full_masks, prunable_weights
from dpltm.networks.lenet import LeNet, build_architecture
from dpltm.pruning import paper_prune_rates, prune_layerwise

N = 120


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("clip", [1e-3, 0.5, 3.0])
def test_clip_factors_are_min_one_c_over_norm_and_zero_where_not_finite(dtype: torch.dtype, clip: float) -> None:
    values = [0.0, -0.0, 1e-6, clip / 2, clip, clip * 1.0001, 2 * clip, 100.0, 6e4, float("inf"), float("nan")]
    norms = torch.tensor(values, dtype=dtype)
    got = clip_factors(norms, clip).double()
    exact = norms.double()
    expected = torch.where(torch.isfinite(exact), (clip / exact).clamp(max=1.0).nan_to_num(nan=1.0),
                           torch.zeros_like(exact))
    expected[exact == 0] = 1.0
    expected = expected.to(dtype).double()  # what the type can hold (1.7e-8 is 0 in float16)
    assert bool((got <= 1.0).all()) and bool((got >= 0).all())
    tolerance = {torch.float64: 1e-14, torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=torch.finfo(dtype).tiny)
    assert got[-1] == 0 and got[-2] == 0  # NaN and inf: the record is dropped
    assert got[values.index(100.0)] > 0  # 100 / 1e-3 overflows float16; the factor 1e-5 does not


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_row_clips_give_a_padding_row_factor_zero_and_a_sampled_row_the_same_factor(dtype: torch.dtype) -> None:
    """The static step's numerator C_i ∈ {C, 0}: bit for bit the factor C / max(‖g‖, C) where C_i = C, exactly 0
    where C_i = 0 (a padding row, even with a NaN or infinite norm), in every float type."""
    clip = 0.7
    norms = torch.tensor([0.0, 0.3, clip, 2.0, 6e4, float("inf"), float("nan")] * 2, dtype=dtype)
    row_clips = torch.tensor([clip] * 7 + [0.0] * 7, dtype=dtype)
    got = clip_factors(norms, clip, row_clips)
    assert torch.equal(got[:7], clip_factors(norms[:7], clip))
    assert got[7:].tolist() == [0.0] * 7
    left = clip_factors(norms, clip, row_clips, zero_non_finite=False)  # for a caller that zeroes NaN rows itself
    assert bool(left[6].isnan()) and bool(left[13].isnan()) and left[5] == 0 and left[12] == 0
    assert torch.equal(left[:6], got[:6]) and torch.equal(left[7:13], got[7:13])
    with pytest.raises(ValueError, match="finite"):
        clip_factors(norms, float("inf"), row_clips)


def test_without_clipping_a_non_finite_record_is_still_dropped() -> None:
    norms = torch.tensor([0.5, float("inf"), float("nan"), 1e9])
    assert clip_factors(norms, float("inf")).tolist() == [1.0, 0.0, 0.0, 1.0]


class BiasScaled(GaussianNoise):
    """Gaussian noise with a per-coordinate geometry on the biases only (or on everything): the norm table's
    one column widens to one per unit."""

    def __init__(self, sigma: float, scales: dict[str, torch.Tensor | None]) -> None:
        super().__init__(sigma)
        self._scales = scales

    def coordinate_scales(self) -> dict[str, torch.Tensor | None]:
        return self._scales


def mlp_ticket(keep_middle_dense: bool = False, dense: bool = False,
               hidden: tuple[int, ...] = (10, 7)) -> tuple[LeNet, Masks]:
    model = LeNet(build_architecture(12, 5, hidden, None), torch.Generator().manual_seed(0)).double()
    masks = model.full_masks() if dense else prune_layerwise(model.weights(), model.full_masks(),
                                                             paper_prune_rates(model.mask_names()))
    if keep_middle_dense:
        name = model.mask_names()[1]
        masks[name] = torch.ones_like(masks[name])
    return model, apply_masks_(model, masks)


def lenet5_ticket(dense: bool = False) -> tuple[LeNet, Masks]:
    model = LeNet(build_architecture(784, 10, (20, 12), None, "relu", "lenet5"),
                  torch.Generator().manual_seed(0)).double()
    weights = prunable_weights(model)
    masks = (full_masks(model) if dense
             else prune_layerwise(weights, full_masks(model), paper_prune_rates(list(weights))))
    return model, apply_masks_(model, masks)


def records(features: int, classes: int, poison: bool) -> LabeledTensors:
    g = torch.Generator().manual_seed(1)
    data = LabeledTensors(torch.randn(N, features, generator=g, dtype=torch.float64),
                          torch.randint(0, classes, (N,), generator=g))
    if poison:
        data.features[3] = float("nan")
        data.features[8, 2] = float("inf")
    return data


def random_scales(model: LeNet, biases_only: bool) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(4)
    return {name: (0.5 + torch.rand(p.shape, generator=g, dtype=torch.float64)
                   if name.endswith("bias") or not biases_only else None)
            for name, p in model.named_parameters()}


CASES = {
    "mlp": (mlp_ticket, 12, 5, None),
    "mlp, dense middle layer": (lambda: mlp_ticket(keep_middle_dense=True), 12, 5, None),
    "mlp, bias geometry": (mlp_ticket, 12, 5, "biases"),
    "mlp, full geometry": (mlp_ticket, 12, 5, "all"),
    "lenet5": (lenet5_ticket, 784, 10, None),
    # dense networks: the noise drawn straight (one layer) or scattered into the flat layout in the eager order
    "mlp, dense": (lambda: mlp_ticket(dense=True), 12, 5, None),
    "one layer, dense": (lambda: mlp_ticket(dense=True, hidden=()), 12, 5, None),
    "lenet5, dense": (lambda: lenet5_ticket(dense=True), 784, 10, None),
}


def case_noise(model: LeNet, geometry: str | None) -> GaussianNoise:
    """A case's noise: plain Gaussian, or with a per-coordinate geometry on the biases or on everything."""
    return GaussianNoise(1.1) if geometry is None else BiasScaled(1.1, random_scales(model, geometry == "biases"))


def eager_steps(case: str, batches: list[torch.Tensor], poison: bool, momentum: float) -> LeNet:
    """The case's network after the eager step on `batches` (C = 0.5, L = 0.2·N, noise seed 5): the reference."""
    make, features, classes, geometry = CASES[case]
    (eager, masks), data = make(), records(features, classes, poison)
    mechanism = case_noise(eager, geometry)
    optimizer = torch.optim.SGD(eager.parameters(), lr=0.2, momentum=momentum)
    layout = MaskLayout.of(eager, masks, torch.float64, mechanism.coordinate_scales())
    generator = torch.Generator().manual_seed(5)
    for index in batches:
        grads, _, _ = private_gradients(eager, data.features[index], data.labels[index], clip=0.5, noise=mechanism,
                                        expected_batch_size=N * 0.2, generator=generator, layout=layout)
        apply_gradients(eager, grads, optimizer)
    return eager


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("capacity", [40, 8])
@pytest.mark.parametrize("poison", [False, True])
def test_the_static_step_is_the_eager_step(case: str, capacity: int, poison: bool) -> None:
    """Same weights after a few steps (same noise draws on the CPU), one chunk or several, with records whose
    features are NaN or infinite (dropped by both), and the pruned weights exactly zero."""
    make, features, classes, geometry = CASES[case]
    batches = poisson_batches_at_once(N, 0.2, 4, torch.Generator().manual_seed(9))
    if case.startswith("lenet5"):
        batches = batches[:2]
    eager = eager_steps(case, batches, poison, momentum=0.5)
    (static, static_masks), data = make(), records(features, classes, poison)
    step = StaticShapeDpStep(static, static_masks, data, clip=0.5, noise=case_noise(static, geometry),
                             expected_batch_size=N * 0.2, capacity=capacity, generator=torch.Generator().manual_seed(5),
                             optimizer=torch.optim.SGD(static.parameters(), lr=0.2, momentum=0.5))
    assert any(len(b) > capacity for b in batches) == (capacity == 8)
    for index in batches:
        step.step(index)
    for (name, a), b in zip(eager.named_parameters(), static.parameters(), strict=True):
        assert bool(torch.isfinite(b).all()), name
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12, msg=name)
    for name, weight in prunable_weights(static).items():
        assert torch.count_nonzero(weight.detach()[~static_masks[name]]) == 0, name


@pytest.mark.parametrize("table", ["joined", "first layer", "labels only"])
@pytest.mark.parametrize("case", ["mlp", "mlp, dense", "mlp, bias geometry"])
def test_the_static_step_is_the_eager_step_whatever_table_it_gathers(table: str, case: str) -> None:
    """The rows a static step gathers: every layer's norm terms joined beside the labels (what fits), the first
    layer's terms alone (a joined table too big), or the labels alone (the first layer's table too big too): the
    same weights as the eager step, with a NaN and an infinite record among them."""
    make, features, classes, geometry = CASES[case]
    batches = poisson_batches_at_once(N, 0.2, 3, torch.Generator().manual_seed(9))
    eager = eager_steps(case, batches, poison=True, momentum=0.0)
    (static, static_masks), data = make(), records(features, classes, True)
    limit = {"joined": 1 << 30, "first layer": N * 10 * 8, "labels only": 8}[table]
    with mock.patch.object(graphed, "INPUT_TERMS_MAX_BYTES", limit), \
            mock.patch.object(ghost, "INPUT_TERMS_MAX_BYTES", limit):
        step = StaticShapeDpStep(static, static_masks, data, clip=0.5, noise=case_noise(static, geometry),
                                 expected_batch_size=N * 0.2, capacity=40, generator=torch.Generator().manual_seed(5),
                                 optimizer=torch.optim.SGD(static.parameters(), lr=0.2, momentum=0.0))
    assert step.terms_joined == (table == "joined")
    assert (step.terms_width == 0) == (table == "labels only")
    assert step.record_rows.shape[1] == step.terms_width + classes
    for index in batches:
        step.step(index)
    for (name, a), b in zip(eager.named_parameters(), static.parameters(), strict=True):
        assert bool(torch.isfinite(b).all()), name
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12, msg=name)


def test_one_reduce_a_step_on_either_path_and_no_noise_where_told() -> None:
    """Under DDP every rank reduces once a step, whether its batch fit one chunk or several; a rank that adds
    no noise (not rank 0) adds none."""
    calls: list[int] = []

    def reduce(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        calls.append(1)
        return sums

    (model, masks), data = mlp_ticket(), records(12, 5, False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = StaticShapeDpStep(model, masks, data, clip=0.5, noise=GaussianNoise(50.0), expected_batch_size=24.0,
                             capacity=16, generator=torch.Generator().manual_seed(5),
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1), reduce=reduce, add_noise=False)
    step.step(torch.arange(10))
    step.step(torch.arange(40))  # three chunks
    assert len(calls) == 2
    (reference, _), data = mlp_ticket(), records(12, 5, False)
    layout = MaskLayout.of(reference, masks, torch.float64)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for index in (torch.arange(10), torch.arange(40)):
        grads, _, _ = private_gradients(reference, data.features[index], data.labels[index], clip=0.5,
                                        noise=GaussianNoise(50.0), expected_batch_size=24.0,
                                        generator=torch.Generator(), layout=layout, add_noise=False)
        apply_gradients(reference, grads, optimizer)
    for (name, a), b in zip(reference.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=name)  # σ = 50 would show if drawn
        assert not torch.equal(b, before[name]) or name.endswith("bias"), name


@pytest.mark.parametrize("geometry", [None, "biases", "all"])
def test_the_first_layers_table_holds_its_weights_and_bias_shares(geometry: str | None) -> None:
    model, masks = mlp_ticket()
    scales = None if geometry is None else random_scales(model, geometry == "biases")
    layout = MaskLayout.of(model, masks, torch.float64, scales)
    x = torch.randn(9, 12, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    table = first_layer_input_terms(x, layout, rows_at_once=4)
    name = model.mask_names()[0]
    weight_scale = 1.0 if scales is None or scales[name] is None else scales[name] ** 2
    bias_name = name.removesuffix(".weight") + ".bias"
    bias_scale = 1.0 if scales is None else scales[bias_name] ** 2
    expected = (x * x) @ (masks[name].double() / weight_scale).T + 1.0 / bias_scale
    assert table is not None
    torch.testing.assert_close(table, expected.expand_as(table) if table.shape[1] > 1 else expected, rtol=1e-12,
                               atol=1e-12)
    with mock.patch.object(ghost, "INPUT_TERMS_MAX_BYTES", table.numel() * 8 - 1):
        assert first_layer_input_terms(x, layout) is None  # the size check counts the widened table


def test_a_dense_unscaled_first_layer_needs_one_column() -> None:
    model = LeNet(build_architecture(12, 5, (10,), None), torch.Generator().manual_seed(0)).double()
    x = torch.randn(6, 12, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    table = first_layer_input_terms(x, MaskLayout.of(model, model.full_masks(), torch.float64))
    assert table is not None and table.shape == (6, 1)
    torch.testing.assert_close(table[:, 0], (x * x).sum(1) + 1.0)


def test_masks_for_unmasked_sums_need_the_output_buffers() -> None:
    sums = {"w": torch.ones(3)}
    with pytest.raises(ValueError, match="needs out"):
        noisy_mean(sums, noise=GaussianNoise(0.0), surviving={"w": None}, clip=1.0, expected_batch_size=2.0,
                   generator=torch.Generator(), out_scales={"w": torch.ones(3)})
    out = {"w": torch.empty(3)}
    noisy_mean({"w": torch.tensor([4.0, 1e30, 6.0])}, noise=GaussianNoise(0.0), surviving={"w": None}, clip=1.0,
               expected_batch_size=2.0, generator=torch.Generator(), out=out,
               out_scales={"w": torch.tensor([1.0, 0.0, 1.0]) / 2.0})
    assert out["w"].tolist() == [2.0, 0.0, 3.0]  # a pruned coordinate's unmasked sum becomes exactly 0


def test_the_static_steps_clip_is_fixed_and_its_joined_terms_stand_alone() -> None:
    """Each row's bound C_i is C, made when the step is built: C cannot change afterwards (a factor would exceed 1).
    `joined_terms` replaces `input_terms`: both at once is refused, not one silently ignored."""
    (model, masks), data = mlp_ticket(), records(12, 5, False)
    step = StaticShapeDpStep(model, masks, data, clip=0.5, noise=GaussianNoise(1.0), expected_batch_size=24.0,
                             capacity=32, generator=torch.Generator().manual_seed(5),
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert step.clip == 0.5 and bool((step._row_clips[:32] == 0.5).all()) and bool((step._row_clips[32:] == 0).all())
    with pytest.raises(AttributeError):
        step.clip = 2.0  # type: ignore[misc]
    assert step.terms_joined
    rows = step.record_rows[:4, : step.terms_width].clone()
    with pytest.raises(ValueError, match="without input_terms"):
        ghost.clipped_gradient_sum(model, data.features[:4], data.labels[:4], 0.5, step.layout,
                                   row_clips=torch.full((4,), 0.5, dtype=torch.float64), input_terms=rows[:, :10],
                                   joined_terms=rows)
