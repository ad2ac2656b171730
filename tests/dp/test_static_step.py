"""Static-shape DP steps (what CUDA graphs replay): padding adds zero, overflow is chunked, and the
step equals the eager one — on the CPU here, and captured in CUDA graphs where CUDA exists."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from dpltm.data.batches import BlocksOfIndices, ShuffledBatches
from dpltm.data.types import DatasetSplits, LabeledTensors
from dpltm.dp.averaging import Ema, make_averager, update_average
from dpltm.dp.dpd import DropoutNoise
from dpltm.dp.gaussian import GaussianNoise
from dpltm.dp.ghost import MaskLayout, clipped_gradient_sum
from dpltm.dp.graphed import StaticShapeDpStep
from dpltm.dp.mechanism import NoiseContext, add_gaussian
from dpltm.dp.noise_filter import make_noise_filter
from dpltm.dp.padding import batch_capacity, load_chunk, ones_then_zeros
from dpltm.dp.sampling import inclusion_threshold, poisson_batches_at_once
from dpltm.dp.shaped import ShapedNoise
from dpltm.dp.step import apply_gradients, private_gradients
from dpltm.errors import DpltmUserError
from dpltm.masks import Masks, apply_masks_
from dpltm.networks.lenet import LeNet, build_architecture
from dpltm.pruning import paper_prune_rates, prune_layerwise
from dpltm.settings import TrainSettings
from dpltm.training.plain import train_classifier
from dpltm.training.plan import plan_training
from dpltm.training.private import TrainOutcome, run_private
from tests.dp.reference import padded_chunks

N = 200


def ticket(dtype: torch.dtype = torch.float64, device: str = "cpu") -> tuple[LeNet, Masks]:
    model = LeNet(build_architecture(12, 5, (10, 7), None), torch.Generator().manual_seed(0))
    masks = model.full_masks()
    for _ in range(2):
        masks = apply_masks_(model, prune_layerwise(model.weights(), masks, paper_prune_rates(model.mask_names())))
    model = model.to(device=device, dtype=dtype)
    return model, apply_masks_(model, masks)  # the masks on the model's device (the weights are already 0)


def assert_pruned_weights_are_zero(model: LeNet, masks: Masks) -> None:
    """The ticket's pruned weights are exactly zero (the network carries no mask: what is zero is the weight)."""
    for name, weight in model.weights().items():
        assert torch.count_nonzero(weight.detach()[~masks[name].to(weight.device)]) == 0, name


def records(dtype: torch.dtype = torch.float64, device: str = "cpu") -> LabeledTensors:
    g = torch.Generator().manual_seed(1)
    return LabeledTensors(torch.randn(N, 12, generator=g, dtype=dtype).to(device),
                          torch.randint(0, 5, (N,), generator=g).to(device))


@pytest.mark.parametrize(("n", "q"), [(60000, 256 / 60000), (1000, 0.5), (50, 0.99), (10, 1e-6)])
def test_capacity_covers_the_tail_and_is_aligned(n: int, q: float) -> None:
    capacity = batch_capacity(n, q)
    mean, sd = n * q, math.sqrt(n * q * (1 - q))
    assert capacity <= n and (capacity % 8 == 0 or capacity == n)
    assert capacity >= min(n, mean + 4 * sd)
    assert stats.binom.sf(capacity, n, q) < 1e-4  # overflow (an extra chunk) is rare


def test_chunks_keep_every_sampled_record_once_and_pad_with_zero_weight() -> None:
    index = torch.tensor([3, 5, 8, 13, 21, 34, 55, 89, 144, 199, 7])
    for capacity in (16, 11, 4, 1):
        chunks = padded_chunks(index, capacity)
        assert len(chunks) == math.ceil(len(index) / capacity)
        assert all(c.index.numel() == capacity == c.weight.numel() for c in chunks)
        kept = torch.cat([c.index[c.weight == 1] for c in chunks])
        assert torch.equal(kept, index)  # all sampled records, in order, none twice
        assert float(sum(c.weight.sum() for c in chunks)) == len(index)
    empty = padded_chunks(index[:0], 8)
    assert len(empty) == 1 and float(empty[0].weight.sum()) == 0.0


def test_chunks_loaded_into_the_steps_buffers_are_the_padded_chunks() -> None:
    """`load_chunk` (the static step's per-chunk copy, no allocation): the same sampled rows with weight 1
    as `padded_chunks`, weight 0 elsewhere, and every padding row's index a valid record."""
    index = torch.tensor([3, 5, 8, 13, 21, 34, 55, 89, 144, 199, 7])
    for capacity in (16, 11, 4, 1):
        into_index = torch.full((capacity,), 9, dtype=torch.long)  # what an earlier step left
        into_weight = torch.full((capacity,), 0.5, dtype=torch.float64)
        weights = ones_then_zeros(capacity, torch.float64, torch.device("cpu"))
        for k, chunk in enumerate(padded_chunks(index, capacity, torch.float64)):
            load_chunk(index, k * capacity, into_index, into_weight, weights)
            assert torch.equal(into_weight, chunk.weight)
            sampled = chunk.weight == 1
            assert torch.equal(into_index[sampled], chunk.index[sampled])
            assert bool(((into_index >= 0) & (into_index < 200)).all())
    load_chunk(index[:0], 0, into_index, into_weight, weights)  # an empty batch: one chunk of weight 0
    assert float(into_weight.sum()) == 0.0


@pytest.mark.parametrize("capacity", [64, 40, 8])  # room to spare, the exact size, overflow into 5 chunks
def test_padded_chunked_clipped_sum_equals_the_eager_sum(capacity: int) -> None:
    (model, masks), data = ticket(), records()
    data.features[0] = float("nan")  # the padding row's record: non-finite, still adds exactly zero
    index = torch.arange(1, 41)
    layout = MaskLayout.of(model, masks, torch.float64)
    eager = clipped_gradient_sum(model, data.features[index], data.labels[index], 0.7, layout).grad_sums
    dense_layout = MaskLayout.of(model, masks, torch.float64, allow_sparse=False)
    total = {name: torch.zeros_like(v) for name, v in eager.items()}
    for chunk in padded_chunks(index, capacity, torch.float64):
        part = clipped_gradient_sum(model, data.features[chunk.index], data.labels[chunk.index], 0.7,
                                    dense_layout, row_clips=chunk.weight * 0.7).grad_sums
        for name in total:
            total[name] += part[name]
    for name in eager:
        assert torch.isfinite(total[name]).all()
        torch.testing.assert_close(total[name], eager[name], rtol=1e-12, atol=1e-12)


def test_epoch_sampled_at_once_is_poisson() -> None:
    n, q, steps = 500, 0.1, 200
    batches = poisson_batches_at_once(n, q, steps, torch.Generator().manual_seed(4))
    assert len(batches) == steps
    assert all(torch.equal(b, b.unique()) for b in batches)  # sorted, no record twice
    counts = torch.zeros(n)
    for b in batches:
        counts[b] += 1
    assert stats.binomtest(int(counts.sum()), n * steps, inclusion_threshold(q) / 2**62).pvalue > 1e-3
    assert stats.chisquare(counts.numpy()).pvalue > 1e-4
    sizes = torch.tensor([len(b) for b in batches], dtype=torch.float64)
    assert stats.kstest(sizes.numpy(), stats.binom(n, q).cdf).pvalue > 1e-4 or abs(sizes.mean() - n * q) < 3


def batches_for(steps: int, q: float = 0.15) -> list[torch.Tensor]:
    return poisson_batches_at_once(N, q, steps, torch.Generator().manual_seed(9))


def run_eager(batches: list[torch.Tensor], sigma: float, momentum: float,
              ema: Ema | None, noise_filter: str = "none") -> tuple[LeNet, Masks]:
    (model, masks), data = ticket(), records()
    filtered = make_noise_filter(noise_filter, dict(model.named_parameters()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=momentum)
    averager = make_averager(model, ema)
    generator = torch.Generator().manual_seed(5)
    layout = MaskLayout.of(model, masks, torch.float64)
    for index in batches:
        grads, _, _ = private_gradients(model, data.features[index], data.labels[index], clip=0.5,
                                        noise=GaussianNoise(sigma), expected_batch_size=N * 0.15,
                                        generator=generator, layout=layout)
        apply_gradients(model, grads if filtered is None else filtered.step(grads), optimizer)
        if averager is not None:
            update_average(averager, model, ema)
    return (model if averager is None else averager.module), masks  # type: ignore[return-value]


def run_static(batches: list[torch.Tensor], sigma: float, momentum: float, ema: Ema | None,
               capacity: int, device: str = "cpu", graphs: bool = False,
               noise_filter: str = "none") -> tuple[LeNet, Masks]:
    (model, masks), data = ticket(device=device), records(device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=momentum)
    averager = make_averager(model, ema)
    generator = torch.Generator(device=device).manual_seed(5)
    step = StaticShapeDpStep(model, masks, data, clip=0.5, noise=GaussianNoise(sigma), expected_batch_size=N * 0.15,
                             capacity=capacity, generator=generator, optimizer=optimizer, averager=averager,
                             ema=ema, graphs=graphs,
                             noise_filter=make_noise_filter(noise_filter, dict(model.named_parameters())))
    for index in batches:
        step.step(index.to(device))
    return (model if averager is None else averager.module), masks  # type: ignore[return-value]


@pytest.mark.parametrize(("sigma", "momentum", "ema", "capacity", "noise_filter"),
                         [(0.0, 0.0, None, 48, "none"), (1.1, 0.9, None, 48, "none"), (1.1, 0.5, Ema(0.9), 16, "none"),
                          (1.1, 0.5, Ema(0.9, warmup=True), 16, "none"), (1.1, 0.0, None, 16, "doppler"),
                          (1.1, 0.9, Ema(0.9), 48, "doppler")])
def test_static_step_trains_exactly_like_the_eager_step(sigma: float, momentum: float, ema: Ema | None,
                                                        capacity: int, noise_filter: str) -> None:
    """The noise filter too (in place in the static step's `.grad` buffers): the same weights, pruned ones at 0."""
    batches = batches_for(12)
    assert max(len(b) for b in batches) > 16  # the capacity-16 case overflows into chunks
    eager, _ = run_eager(batches, sigma, momentum, ema, noise_filter)
    static, masks = run_static(batches, sigma, momentum, ema, capacity, noise_filter=noise_filter)
    for (name, a), b in zip(eager.named_parameters(), static.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=name)  # same noise draws on the CPU
    assert_pruned_weights_are_zero(static, masks)
    assert_pruned_weights_are_zero(eager, masks)


def test_a_non_finite_record_left_in_the_padding_rows_adds_nothing() -> None:
    """`load_chunk` leaves padding rows pointing at records of earlier chunks: one whose features are NaN
    or infinite must add exactly nothing (weight 0, and the clipped sum zeroes non-finite rows)."""
    batches = batches_for(6)

    def trained(poison: bool) -> LeNet:
        (model, masks), data = ticket(), records()
        if poison:
            data.features[7] = float("nan")
            data.features[11] = float("inf")
        step = StaticShapeDpStep(model, masks, data, clip=0.5, noise=GaussianNoise(1.1), expected_batch_size=N * 0.15,
                                 capacity=48, generator=torch.Generator().manual_seed(5),
                                 optimizer=torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))
        for index in batches:
            keep = index[(index != 7) & (index != 11)]  # the poisoned records are never sampled...
            if poison:
                step.index[:] = torch.tensor([7, 11]).repeat(24)  # ...but fill every padding row
            step.step(keep)
        return model

    for (name, clean), poisoned in zip(trained(False).named_parameters(), trained(True).parameters()):
        assert bool(torch.isfinite(poisoned).all()), name
        torch.testing.assert_close(poisoned, clean, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("capacity", [48, 16])
def test_a_sampled_non_finite_record_is_dropped_as_the_eager_step_drops_it(capacity: int) -> None:
    """A sampled record whose features are NaN or infinite gets clip factor 0 in both modes: the static
    step (no host synchronisation: it zeroes non-finite values every step) gives the eager step's weights."""
    batches = batches_for(4)

    def poisoned() -> LabeledTensors:
        data = records()
        data.features[int(batches[0][0])] = float("nan")
        data.features[int(batches[1][1]), 3] = float("inf")
        return data

    (eager, masks), data = ticket(), poisoned()
    optimizer = torch.optim.SGD(eager.parameters(), lr=0.2)
    layout, generator = MaskLayout.of(eager, masks, torch.float64), torch.Generator().manual_seed(5)
    for index in batches:
        grads, _, _ = private_gradients(eager, data.features[index], data.labels[index], clip=0.5,
                                        noise=GaussianNoise(1.1), expected_batch_size=N * 0.15,
                                        generator=generator, layout=layout)
        apply_gradients(eager, grads, optimizer)
    (static, static_masks), data = ticket(), poisoned()
    step = StaticShapeDpStep(static, static_masks, data, clip=0.5, noise=GaussianNoise(1.1),
                             expected_batch_size=N * 0.15, capacity=capacity,
                             generator=torch.Generator().manual_seed(5),
                             optimizer=torch.optim.SGD(static.parameters(), lr=0.2))
    for index in batches:
        step.step(index)
    for (name, a), b in zip(eager.named_parameters(), static.parameters()):
        assert bool(torch.isfinite(b).all()), name
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=name)
    assert_pruned_weights_are_zero(static, masks)


@pytest.mark.parametrize("warmup", [False, True])
def test_ema_update_matches_the_definition(warmup: bool) -> None:
    """EMA_1 = θ_1, then EMA_t = d_t·EMA_{t-1} + (1 − d_t)·θ_t: d_t = 0.8, or with the warm-up TensorFlow's
    min(0.8, (1 + t)/(10 + t)) for the t-th update after the first (2/11, 3/12, … until it reaches 0.8)."""
    model, _ = ticket()
    ema = Ema(0.8, warmup)
    averager = make_averager(model, ema)
    iterates = []
    for k in range(30):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * (k + 1))
        iterates.append([p.detach().clone() for p in model.parameters()])
        update_average(averager, model, ema)  # type: ignore[arg-type]
    expected = iterates[0]
    for t, theta in enumerate(iterates[1:], start=1):
        d = min(0.8, (1 + t) / (10 + t)) if warmup else 0.8
        expected = [d * e + (1 - d) * x for e, x in zip(expected, theta)]
    for got, want in zip(averager.module.parameters(), expected):  # type: ignore[union-attr]
        torch.testing.assert_close(got, want)
    assert int(averager.n_averaged) == 30  # type: ignore[union-attr,arg-type]


def test_the_warm_up_forgets_a_far_away_start() -> None:
    """Why the warm-up exists: after T steps without it the first iterate keeps decay^(T−1) of the weight
    (0.18 for 0.999 over 1700 steps); with it, d_t ≤ (1 + t)/(10 + t) forgets it like a running mean."""
    count = torch.arange(1700)
    plain, warm = Ema(0.999).weight(count), Ema(0.999, warmup=True).weight(count)
    first_plain = torch.prod(1 - plain[1:]).item()
    first_warm = torch.prod(1 - warm[1:]).item()
    assert first_plain == pytest.approx(0.999 ** 1699) and first_plain > 0.18
    assert first_warm < 1e-5
    assert float(warm[0]) == float(plain[0]) == 1.0  # EMA_1 = θ_1 either way
    assert torch.all(warm >= plain) and float(warm[-1]) == pytest.approx(1 - 1700 / 1709)
    assert Ema(0.999, warmup=True).describe() == "ema(0.999, warm-up)" and Ema(0.9).describe() == "ema(0.9)"


@pytest.mark.gpu
@pytest.mark.parametrize(("ema", "noise_filter"), [(None, "none"), (Ema(0.9), "none"), (Ema(0.9, warmup=True), "none"),
                                                   (None, "doppler")])
def test_cuda_graph_step_equals_the_uncaptured_static_step_without_noise(ema: Ema | None, noise_filter: str) -> None:
    """With the noise filter, its state reset after the capture's warm-up like the optimiser's."""
    batches = batches_for(10)
    plain, _ = run_static(batches, 0.0, 0.9, ema, 16, device="cuda", noise_filter=noise_filter)
    graphed, masks = run_static(batches, 0.0, 0.9, ema, 16, device="cuda", graphs=True, noise_filter=noise_filter)
    for a, b in zip(plain.parameters(), graphed.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-11)
    assert_pruned_weights_are_zero(graphed, masks)


@pytest.mark.gpu
def test_cuda_graph_replays_draw_fresh_noise_on_surviving_weights_only() -> None:
    (model, masks), data = ticket(device="cuda"), records(device="cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    step = StaticShapeDpStep(model, masks, data, clip=0.5, noise=GaussianNoise(2.0), expected_batch_size=1.0,
                             capacity=8, generator=torch.Generator(device="cuda").manual_seed(3),
                             optimizer=optimizer, graphs=True)
    empty = torch.zeros(0, dtype=torch.long, device="cuda")
    before = [p.detach().clone() for p in model.parameters()]
    step.step(empty)  # an empty batch still adds noise: the update is pure noise
    first = [p.detach() - b for p, b in zip(model.parameters(), before)]
    step.step(empty)
    second = [p.detach() - b - f for p, b, f in zip(model.parameters(), before, first)]
    noise = torch.cat([f.flatten() for f in first])
    assert not torch.equal(torch.cat([s.flatten() for s in second]), noise)  # fresh draw per replay
    surviving = torch.cat([torch.ones_like(p).flatten() if m is None else m.flatten()
                           for p, m in zip(model.parameters(), _masks_in_parameter_order(model, masks))]).bool()
    assert bool((noise[~surviving] == 0).all())
    assert abs(float(noise[surviving].std()) - 2.0 * 0.5) < 0.15  # σC with lr 1 and L = 1


def _masks_in_parameter_order(model: LeNet, masks: Masks) -> list[torch.Tensor | None]:
    ordered: list[torch.Tensor | None] = []
    for mask_name, _ in model.layers_in_order():
        ordered += [masks[mask_name], None]
    return ordered


def _run_mode(data: DatasetSplits, mode: str, ema: float | None = None,
              physical_batch: int | None = None) -> tuple[TrainOutcome, LeNet, Masks]:
    settings = TrainSettings(epochs=3, batch_size=64, eps2=None, sigma=0.8, lr=0.3, momentum=0.5, ema=ema,
                             physical_batch=physical_batch)
    plan = plan_training(settings, len(data.train))
    model = LeNet(build_architecture(20, 4, (16, 8), None), torch.Generator().manual_seed(0))
    masks = apply_masks_(model, prune_layerwise(model.weights(), model.full_masks(),
                                                paper_prune_rates(model.mask_names())))
    outcome = run_private(model, data, plan, settings, seed=7, epsilon_after=lambda steps: steps / 1000,
                          progress=False, step_mode=mode,
                          noise_context=NoiseContext(model=model, masks=masks, clip=settings.clip,
                                                     private_dataset=data.name))
    return outcome, model, masks


def test_static_mode_runs_the_lightning_stage_with_the_same_accounting(tiny_splits: DatasetSplits) -> None:
    eager, _, _ = _run_mode(tiny_splits, "eager")
    static, model, masks = _run_mode(tiny_splits, "static", ema=0.9)
    assert [r["epsilon"] for r in static.history] == [r["epsilon"] for r in eager.history] == [0.008, 0.016, 0.024]
    assert static.steps == eager.steps == 24
    assert static.history[-1]["test_accuracy"] > 0.7  # it learned (blobs are easy)
    assert_pruned_weights_are_zero(model, masks)
    assert static.released is not model  # the EMA
    assert_pruned_weights_are_zero(static.released, masks)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_the_lightning_stage_in_physical_batches_trains_as_on_whole_batches(tiny_splits: DatasetSplits,
                                                                            mode: str) -> None:
    """`--physical-batch`: each Poisson batch in chunks of at most 10 rows (the static step's capacity, or the eager
    step's chunks), their sums added before the one draw: the same draws and ε, the same weights to float32's
    rounding (the order of the additions moves)."""
    whole, model, _ = _run_mode(tiny_splits, "eager")
    chunked, chunked_model, _ = _run_mode(tiny_splits, mode, physical_batch=10)
    assert [r["epsilon"] for r in chunked.history] == [r["epsilon"] for r in whole.history]
    for a, b in zip(model.parameters(), chunked_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_cuda_graphs_need_cuda(tiny_splits: DatasetSplits) -> None:
    with pytest.raises(DpltmUserError, match="CUDA"):
        _run_mode(tiny_splits, "graphs")


@pytest.mark.gpu
def test_cuda_graph_mode_trains_on_the_gpu(tiny_splits: DatasetSplits) -> None:
    cuda = DatasetSplits(name=tiny_splits.name, source_split="train", num_features=20, num_classes=4,
                         fingerprint=tiny_splits.fingerprint,
                         **{k: LabeledTensors(getattr(tiny_splits, k).features.cuda(),
                                              getattr(tiny_splits, k).labels.cuda()) for k in ("train", "val", "test")})
    outcome, model, masks = _run_mode(cuda, "graphs", ema=0.9)
    assert outcome.steps == 24 and outcome.history[-1]["test_accuracy"] > 0.7
    assert_pruned_weights_are_zero(model, masks)
    assert_pruned_weights_are_zero(outcome.released, masks)  # type: ignore[arg-type]


def test_blocks_of_indices_are_the_shuffled_batches_in_order(tiny_splits: DatasetSplits) -> None:
    shuffled = ShuffledBatches(tiny_splits.train, 48, 23, seed=3)
    blocks = list(BlocksOfIndices(shuffled, 5))
    assert [b.shape for b in blocks] == [(5, 48)] * 4 + [(3, 48)] and len(BlocksOfIndices(shuffled, 5)) == 5
    rows = torch.cat(blocks)
    for row, (x, y) in zip(rows, shuffled):
        assert torch.equal(tiny_splits.train.features[row], x) and torch.equal(tiny_splits.train.labels[row], y)


@pytest.mark.gpu
def test_graphed_generate_steps_equal_eager_steps(tiny_splits: DatasetSplits) -> None:
    train = LabeledTensors(tiny_splits.train.features.cuda(), tiny_splits.train.labels.cuda())
    trained = []
    for graphs in (False, True):
        model = LeNet(build_architecture(20, 4, (16, 8), None), torch.Generator().manual_seed(0)).cuda()
        masks = apply_masks_(model, prune_layerwise(model.weights(), model.full_masks(),
                                                    paper_prune_rates(model.mask_names())))
        result = train_classifier(model, train, masks=masks, steps=37, batch_size=48, lr=0.2, seed=3,
                                  log_every=10, cuda_graphs=graphs)
        trained.append((model, result.losses))
    (eager, eager_losses), (graphed, graphed_losses) = trained
    for a, b in zip(eager.parameters(), graphed.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert graphed_losses == pytest.approx(eager_losses, rel=1e-4)
    for model in (eager, graphed):  # the graphed step replays the re-zeroing too (PrunedWeights in the graph)
        assert_pruned_weights_are_zero(model, masks)


@pytest.mark.parametrize(("noise", "per_parameter"), [(GaussianNoise(1.5), 1.0), (DropoutNoise(1.5), 2.0)])
def test_the_flat_noise_draw_is_the_gaussian_mechanism_on_surviving_coordinates_only(noise: GaussianNoise,
                                                                                      per_parameter: float) -> None:
    """The static step's one flat draw (`_flat_update`): on an empty batch a step with lr = 1 moves each
    weight by −ĝ = −noise/L, which is N(0, (k·σC/L)²) on every surviving coordinate (k = 2 for DPD's
    N(0, 4C²σ²)), exactly 0 on every pruned one, and fresh at every step."""
    (model, masks), data = ticket(), records()
    clip, L = 0.5, 4.0
    step = StaticShapeDpStep(model, masks, data, clip=clip, noise=noise, expected_batch_size=L, capacity=8,
                             generator=torch.Generator().manual_seed(3),
                             optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    assert step.noise_std == pytest.approx(per_parameter * 1.5 * clip)
    surviving = torch.cat([torch.ones_like(p).flatten() if m is None else m.flatten()
                           for p, m in zip(model.parameters(), _masks_in_parameter_order(model, masks))]).bool()
    moves = []
    for _ in range(2):
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        step.step(torch.zeros(0, dtype=torch.long))
        moves.append(before - torch.cat([p.detach().flatten() for p in model.parameters()]))
    for move in moves:
        assert bool((move[~surviving] == 0).all())
        drawn = move[surviving] / (per_parameter * 1.5 * clip / L)
        assert stats.kstest(drawn.numpy(), "norm").pvalue > 1e-4
    assert not torch.equal(moves[0], moves[1])


def test_a_shaped_noise_goes_through_its_own_perturb_in_the_static_step() -> None:
    (model, masks), data = ticket(), records()
    shaped = ShapedNoise(1.0, {name: torch.full_like(p, 2.0) for name, p in model.named_parameters()})
    step = StaticShapeDpStep(model, masks, data, clip=0.5, noise=shaped, expected_batch_size=4.0, capacity=8,
                             generator=torch.Generator().manual_seed(3),
                             optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    assert step.noise_std is None


def test_a_gradient_written_between_steps_does_not_survive_a_step() -> None:
    """Every coordinate of ĝ is written afresh each step: whatever lands in a `.grad` between steps (a stray
    backward, a callback) is not applied again, and pruned weights stay exactly 0."""
    for sigma in (0.0, 1.0):
        (model, masks), data = ticket(), records()
        step = StaticShapeDpStep(model, masks, data, clip=0.5, noise=GaussianNoise(sigma), expected_batch_size=8.0,
                                 capacity=8, generator=torch.Generator().manual_seed(3),
                                 optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
        step.step(torch.arange(6))
        for parameter in model.parameters():
            parameter.grad.fill_(3.0)  # type: ignore[union-attr]
        before = [p.detach().clone() for p in model.parameters()]
        step.step(torch.zeros(0, dtype=torch.long))  # no records: ĝ is the noise alone
        assert_pruned_weights_are_zero(model, masks)
        for b, p, m in zip(before, model.parameters(), _masks_in_parameter_order(model, masks), strict=True):
            moved = p.detach() - b
            if sigma == 0.0:
                assert torch.equal(moved, torch.zeros_like(moved))
            assert not bool((moved.abs() > 1.4).any())  # no 0.5·3 from the stray gradient anywhere
            if m is not None:
                assert bool((p.grad[~m.bool()] == 0).all())  # type: ignore[index]


def test_an_unbounded_sum_on_a_pruned_coordinate_makes_no_nan() -> None:
    """The clipping norm covers surviving weights only, so a sum on a pruned coordinate is not bounded by it: in
    float16 an input fed only through pruned weights overflows it to inf. Pruned entries are set to 0, not
    multiplied by it (inf·0 = NaN would reach every weight): ĝ stays finite in both steps."""
    model = LeNet(build_architecture(12, 5, (10, 7), None, "relu"), torch.Generator().manual_seed(0))
    masks = model.full_masks()
    first = next(iter(masks))
    masks[first] = masks[first].clone()
    masks[first][:, 0] = False  # input feature 0 feeds no surviving weight
    masks = apply_masks_(model, masks)
    model = model.to(torch.float16)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(6)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(600, 12, generator=g) * 0.01
    x[:, 0] = 250.0
    data = LabeledTensors(x.half(), torch.randint(0, 5, (600,), generator=g))
    layout = MaskLayout.of(model, masks, torch.float16, allow_sparse=False)
    unmasked = clipped_gradient_sum(model, data.features, data.labels, 10.0, layout,
                                    row_clips=torch.full((600,), 10.0).half(),
                                    mask_sums=False)
    assert bool(torch.isinf(unmasked.grad_sums[first][:, 0]).any())  # the case: a pruned entry overflowed
    assert float(unmasked.norms.max()) < 10.0  # while every record's clipping norm is small
    eager = clipped_gradient_sum(model, data.features, data.labels, 10.0, layout)
    assert all(bool(torch.isfinite(v).all()) for v in eager.grad_sums.values())
    step = StaticShapeDpStep(model, masks, data, clip=10.0, noise=GaussianNoise(1.0), expected_batch_size=600.0,
                             capacity=600, generator=torch.Generator().manual_seed(5),
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step.step(torch.arange(600))
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert_pruned_weights_are_zero(model, masks)


def test_add_gaussian_for_one_sum_draws_as_it_always_did() -> None:
    """The one-tensor helper a plug-in of its own may call: N(0, std²·s²) on the surviving coordinates only,
    the draw of one `randn` as long as they are (the numbers it gave before `add_gaussian_all` existed)."""
    total, surviving = torch.zeros(3, 4, dtype=torch.float64), torch.tensor([0, 5, 11])
    scale = torch.full((3, 4), 2.0, dtype=torch.float64)
    got = add_gaussian(total.clone(), surviving, 0.5, torch.Generator().manual_seed(7), scale=scale)
    draw = torch.randn(3, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    want = torch.zeros(12, dtype=torch.float64)
    want[surviving] = 0.5 * 2.0 * draw
    torch.testing.assert_close(got.flatten(), want, rtol=1e-15, atol=0)
    dense = add_gaussian(total.clone(), None, 0.5, torch.Generator().manual_seed(7))
    torch.testing.assert_close(dense, 0.5 * torch.randn(3, 4, generator=torch.Generator().manual_seed(7),
                                                        dtype=torch.float64), rtol=1e-15, atol=0)
