"""The static DP step's fewer kernels (what a CUDA-graph replay launches) change nothing it computes: one-hot
targets give the loss's gradient without the loss, the sums are written into the step's flat buffers, and
the one-chunk piece stays within its kernel budget (counted here at PyTorch's dispatcher, on the CPU)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dpltm.data.types import LabeledTensors
from dpltm.dp.gaussian import GaussianNoise
from dpltm.dp.ghost import MaskLayout, clipped_gradient_sum
from dpltm.dp.graphed import StaticShapeDpStep
from dpltm.dp.padding import batch_capacity, load_chunk
from dpltm.masks import Masks, PrunedWeights, apply_masks_
from dpltm.networks.lenet import LeNet, build_architecture
from dpltm.pruning import paper_prune_rates, prune_layerwise
from tests.dp.test_cnn_ticket import cnn_ticket, images


def mlp_ticket(hidden: tuple[int, ...], features: int = 12, classes: int = 5, rounds: int = 2,
               dtype: torch.dtype = torch.float64) -> tuple[LeNet, Masks]:
    model = LeNet(build_architecture(features, classes, hidden, None), torch.Generator().manual_seed(0))
    masks = model.full_masks()
    for _ in range(rounds):
        masks = apply_masks_(model, prune_layerwise(model.weights(), masks, paper_prune_rates(model.mask_names())))
    return model.to(dtype), masks


def one_hot(y: torch.Tensor, classes: int) -> torch.Tensor:
    return F.one_hot(y, classes).to(torch.float64)


def _batch(n: int, features: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, features, generator=g, dtype=torch.float64), torch.randint(0, classes, (n,), generator=g)


@pytest.mark.parametrize("network", ["mlp", "one-layer", "lenet5"])
@pytest.mark.parametrize("static", [False, True])
def test_one_hot_targets_give_the_sums_and_norms_of_class_indices_without_the_loss(network: str,
                                                                                   static: bool) -> None:
    """softmax(z) − y is ∂(Σ CE)/∂z of the output layer: the norms and the clipped sums equal those of the
    loss's own gradient, for a deep, a one-layer and a convolutional network; a non-finite record (here
    sampled, bound C) is dropped either way, and padding rows (bound 0) add nothing."""
    if network == "lenet5":
        model, masks = cnn_ticket()
        x, y = images(9)
        classes = 10
    else:
        model, masks = mlp_ticket((10, 7) if network == "mlp" else ())
        x, y = _batch(9, 12, 5)
        classes = 5
    x[4, 1] = float("inf")
    layout = MaskLayout.of(model, masks, torch.float64, allow_sparse=False)
    row_clips = torch.tensor([0.6] * 7 + [0.0] * 2, dtype=torch.float64) if static else None
    by_index = clipped_gradient_sum(model, x, y, 0.6, layout, row_clips=row_clips)
    by_one_hot = clipped_gradient_sum(model, x, one_hot(y, classes), 0.6, layout, row_clips=row_clips)
    assert by_one_hot.loss_sum is None and by_index.loss_sum is not None
    assert list(by_one_hot.grad_sums) == list(by_index.grad_sums) == layout.all_parameter_names
    torch.testing.assert_close(by_one_hot.norms, by_index.norms, rtol=1e-12, atol=1e-12, equal_nan=True)
    for name, value in by_index.grad_sums.items():
        assert bool(torch.isfinite(by_one_hot.grad_sums[name]).all()), name
        torch.testing.assert_close(by_one_hot.grad_sums[name], value, rtol=1e-12, atol=1e-12, msg=name)


def _step(model: LeNet, masks: Masks, data: LabeledTensors, batch: float) -> StaticShapeDpStep:
    n = len(data)
    return StaticShapeDpStep(model, masks, data, clip=0.7, noise=GaussianNoise(1.1), expected_batch_size=batch,
                             capacity=batch_capacity(n, batch / n), generator=torch.Generator().manual_seed(1),
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1, foreach=True))


@pytest.mark.parametrize("network", ["mlp", "lenet5"])
def test_the_sums_are_written_into_the_steps_flat_buffer(network: str) -> None:
    """The chunk's clipped sums land in `flat_sums` (every parameter's sum a view of it, the fully connected
    biases side by side) with the values `clipped_gradient_sum` allocates when it has no buffers."""
    if network == "lenet5":
        model, masks = cnn_ticket()
        x, y = images(60)
    else:
        model, masks = mlp_ticket((10, 7))
        x, y = _batch(60, 12, 5)
    step = _step(model, masks, LabeledTensors(x, y), 20.0)
    index = torch.randperm(60, generator=torch.Generator().manual_seed(2))[:20]
    load_chunk(index, 0, step.index, step.row_clips, step._row_clips)
    step._clipped_sums()
    allocated = clipped_gradient_sum(model, x[step.index], y[step.index], 0.7, step.layout, row_clips=step.row_clips,
                                     mask_sums=False).grad_sums
    start, end = step.flat_sums.data_ptr(), step.flat_sums.data_ptr() + step.flat_sums.numel() * 8
    for name, value in allocated.items():
        written = step.sum_buffers.tensors[name]
        assert start <= written.data_ptr() < end, name  # a view of the flat buffer, not a copy of one
        torch.testing.assert_close(written, value, rtol=1e-12, atol=1e-12, msg=name)
    assert int(torch.count_nonzero(step.flat_sums)) == sum(int(torch.count_nonzero(v)) for v in allocated.values())


VIEWS = {"detach", "t", "view", "expand", "permute", "slice", "split", "split_with_sizes", "unsqueeze", "squeeze",
         "select", "alias", "as_strided", "transpose", "_unsafe_view", "lift_fresh", "_record_function_enter_new",
         "_record_function_exit"}


class ComputeOps(TorchDispatchMode):
    """The operators that run arithmetic or move data (views and bookkeeping left out): on a GPU each is one
    kernel or a few, and a step this small costs about its kernel count."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.__name__.split(".")[0] not in VIEWS:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


DP_STEP_OPS = 36
"""LeNet-300-100 ticket, one chunk: 45 before the loss's gradient was written directly (−3), the labels gathered
with the norm terms (−1), the sums written in place (−1), the padding rows' zero taken into the clip factor's
numerator and a non-finite record's NaN left to the clipped rows' zeroing (−2), the squared norms one batched row
dot product (−1), and the layers' norm terms written beside the gathered first layer's (−1). The non-private step
on the same count: 24."""


def test_the_one_chunk_step_stays_within_its_kernel_budget() -> None:
    model, masks = mlp_ticket((300, 100), features=784, classes=10, rounds=7, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    data = LabeledTensors(torch.rand(2000, 784, generator=g), torch.randint(0, 10, (2000,), generator=g))
    step = _step(model, masks, data, 400.0)
    load_chunk(torch.randperm(2000, generator=g)[:400], 0, step.index, step.row_clips, step._row_clips)
    step._one_chunk_step()
    with ComputeOps() as dp:
        step._one_chunk_step()
    counts = Counter(dp.ops)
    assert len(dp.ops) <= DP_STEP_OPS, counts.most_common()
    assert "aten.cat.out" not in counts and "aten._log_softmax.default" not in counts  # sums in place; no loss
    assert counts["aten.cat.default"] == 1  # the output gradients' join; the norm terms are written joined
    assert counts["aten.index_select.default"] == 2  # the records, and their norm terms with their labels

    plain, plain_masks = mlp_ticket((300, 100), features=784, classes=10, rounds=7, dtype=torch.float32)
    optimizer, keep = torch.optim.SGD(plain.parameters(), lr=0.1, foreach=True), PrunedWeights(plain, plain_masks)
    index = step.index[:400]

    def plain_step() -> None:  # what the non-private graph step runs (dpltm.training.plain.GraphedSgdStep)
        x, y = data.features.index_select(0, index), data.labels.index_select(0, index)
        F.cross_entropy(plain(x), y).backward()
        optimizer.step()
        keep()
        optimizer.zero_grad(set_to_none=True)

    plain_step()
    with ComputeOps() as non_private:
        plain_step()
    assert len(dp.ops) - len(non_private.ops) <= 12, (len(dp.ops), len(non_private.ops))
