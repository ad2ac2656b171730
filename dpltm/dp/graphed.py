"""Launch-free DP-SGD steps: the step in static shapes, replayed from CUDA graphs on a GPU.

A LeNet-sized DP step is microseconds of arithmetic and a millisecond of kernel launches and
Python. Here one step is split into two pieces of fixed shape:

* `accumulate`: gather one padded chunk of `capacity` records (dpltm.dp.padding.load_chunk) and their
  first-layer norm terms (`first_layer_input_terms`, computed once), forward,
  output gradients, masked per-sample norms, clip factors C_i / max(‖g_i‖, C) (C_i: C for a sampled row, 0 for
  padding), and add the chunk's clipped sum to an accumulator;
* `update`: add the noise once (under DDP: rank 0, then the all-reduce), scale by 1/L,
  the noise filter if any (in place), optimiser step, EMA, clear the accumulator. Plain Gaussian noise on one
  device takes `_flat_update`:
  every ĝ and every clipped sum is a view of a flat buffer (the sums written there in place), so the draw
  and the masks cost four kernels whatever the depth. The labels are gathered as one-hot rows beside the
  norm terms (one row copy, `record_rows`; the other layers' weight shares are added into the same rows), and the
  output layer's gradient is softmax(z) − y, written without the loss.
  On PyTorch's dispatcher the one-chunk piece of a LeNet-300-100 ticket runs 36 operators against the
  non-private step's 24 (tests/dp/test_static_step_kernels.py): their launches, not the arithmetic, are
  what a GPU step of this size spends.

A step is ⌈|B|/K⌉ accumulates and one update: the eager step's mechanism exactly (padding adds
zero; every sampled record is processed once; one noise draw). A batch that fits one chunk (all but
~3e-5 of steps) runs a third piece, `one_chunk_step`: the chunk's clipped sum straight into the update,
no accumulator to add to and clear. On CUDA (`graphs=True`) the pieces are
captured once in CUDA graphs and each step replays them, with no host synchronisation: the batch
sizes come from sampling a whole epoch ahead (`PoissonBatches(..., epoch_at_once=True)`). On the
CPU the same three pieces run eagerly, which is what the tests compare with the eager step.

Dense products only (`MaskLayout.of(..., allow_sparse=False)`): sparse kernels are not capturable,
and on a GPU these layers are small. Noise plug-ins must draw from the generator they are given
without reading values back to the host (Gaussian, DPD and shaped noise do).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.optim.swa_utils import AveragedModel

from dpltm.data.types import LabeledTensors
from dpltm.dp.averaging import Ema, update_average
from dpltm.dp.cuda_graphs import capture
from dpltm.dp.ghost import (
    INPUT_TERMS_MAX_BYTES,
    MaskLayout,
    SumBuffers,
    clipped_gradient_sum,
    first_layer_input_terms,
)
from dpltm.dp.mechanism import NoiseMechanism, ScaledGaussianNoise
from dpltm.dp.noise_filter import NoiseFilter
from dpltm.dp.padding import load_chunk, ones_then_zeros
from dpltm.dp.step import noisy_mean
from dpltm.masks import Masks
from dpltm.networks.lenet import LeNet


class StaticShapeDpStep:
    """One DP-SGD step as fixed-shape pieces; `step(index)` runs one Poisson batch."""

    def __init__(self, model: LeNet, masks: Masks, train: LabeledTensors, *, clip: float, noise: NoiseMechanism,
                 expected_batch_size: float, capacity: int, generator: torch.Generator,
                 optimizer: torch.optim.Optimizer, averager: AveragedModel | None = None,
                 ema: Ema | None = None,
                 reduce: Callable[[dict[str, Tensor]], dict[str, Tensor]] | None = None,
                 add_noise: bool = True, graphs: bool = False, noise_filter: NoiseFilter | None = None) -> None:
        if not math.isfinite(clip):
            raise ValueError("the static step clips to a finite bound C")
        self.model, self.train, self._clip, self.noise = model, train, clip, noise
        self.expected_batch_size = expected_batch_size
        self.capacity, self.generator, self.optimizer = capacity, generator, optimizer
        self.averager, self.ema, self.reduce, self.add_noise = averager, ema, reduce, add_noise
        self.noise_filter = noise_filter  # filters ĝ in place in the `.grad` buffers, before the optimiser reads them
        device, dtype = train.labels.device, train.features.dtype
        self.layout = MaskLayout.of(model, masks, dtype, noise.coordinate_scales(), allow_sparse=False)
        self.record_rows, self.terms_width, self.terms_joined = record_rows(model, train, self.layout)
        self.index = torch.zeros(capacity, dtype=torch.long, device=device)
        # each row's clipping bound: C for a sampled record, 0 for a padding row (`clip_factors`' numerator), each
        # chunk's one slice of C·`ones_then_zeros`
        self.row_clips = torch.zeros(capacity, dtype=dtype, device=device)
        self._row_clips = ones_then_zeros(capacity, dtype, device).mul_(clip)
        self.finite_records = bool(torch.isfinite(train.features).all())  # once per run: one sync
        parameters = dict(model.named_parameters())
        names = self.layout.all_parameter_names  # the eager step's order (convolutions first): the noise's order
        # ĝ = (unmasked clipped sum + noise on surviving coordinates) ⊙ M / L: the mask costs no pass of its own
        self.out_scales: dict[str, Tensor | float] = {name: 1.0 / expected_batch_size for name in names}
        for (weight_name, _), mask in zip(self.layout.parameter_names, self.layout.weight_masks, strict=True):
            if mask is not None:
                self.out_scales[weight_name] = mask / expected_batch_size
        # every ĝ, every clipped sum and the accumulator are views of flat buffers laid out as the convolutions,
        # then the fully connected weights, then their biases side by side (one sum writes all of those): the
        # noise is one draw scattered into ĝ's buffer (`_flat_update`), and the sums are written in place
        fc_biases = [bias for _, bias in self.layout.parameter_names]
        flat_order = [*(name for pair in self.layout.conv_parameter_names for name in pair),
                      *(weight for weight, _ in self.layout.parameter_names), *fc_biases]
        sizes = {name: parameters[name].numel() for name in names}
        offsets = dict(zip(flat_order, itertools.accumulate((sizes[name] for name in flat_order), initial=0)))
        total = sum(sizes.values())

        def views(flat: Tensor) -> dict[str, Tensor]:
            return {name: flat[offsets[name]: offsets[name] + sizes[name]].view_as(parameters[name]) for name in names}

        self.flat_grad = torch.zeros(total, dtype=dtype, device=device)
        self.grads = views(self.flat_grad)
        for name, parameter in parameters.items():
            parameter.grad = self.grads[name]  # static: the optimiser reads these, the update writes them
        self.flat_sums = torch.zeros_like(self.flat_grad)  # one chunk's clipped sums, written there
        bias_start = offsets[fc_biases[0]]
        self.sum_buffers = SumBuffers(views(self.flat_sums),
                                      self.flat_sums[bias_start: bias_start + sum(sizes[b] for b in fc_biases)])
        self.flat_total = torch.zeros_like(self.flat_grad)  # a batch of several chunks: their sums added up
        self.total_views = views(self.flat_total)
        self.noise_std = flat_gaussian_std(noise, clip) if reduce is None else None
        # the draw's i-th number goes where the eager step puts it: surviving coordinates in the eager order
        kept = [torch.arange(sizes[name], device=device) if self.layout.surviving[name] is None
                else self.layout.surviving[name] for name in names]
        self.surviving_flat = torch.cat([k + offsets[name] for k, name in zip(kept, names, strict=True)])
        self.draws = torch.zeros(self.surviving_flat.numel(), dtype=dtype, device=device)
        self.any_pruned = self.surviving_flat.numel() != self.flat_grad.numel()
        # every coordinate survives and the flat order is the eager one (one fully connected layer): the draw goes
        # straight into the buffer; else it is scattered, so each number lands where the eager step puts it
        self.draw_straight = not self.any_pruned and flat_order == names
        self.flat_noise = torch.zeros_like(self.flat_grad)  # private: its pruned entries are never written
        self.flat_pruned = torch.ones_like(self.flat_grad, dtype=torch.bool)
        self.flat_pruned[self.surviving_flat] = False
        self.graphs: tuple[torch.cuda.CUDAGraph, ...] | None = None
        if graphs:
            if device.type != "cuda":
                raise ValueError("CUDA graphs need the data on a CUDA device")
            self._capture()

    @property
    def clip(self) -> float:
        """C, fixed when the step is built: each row's bound in `row_clips` (the clip factor's numerator) is C
        too, so a C changed afterwards would put factors above 1 (read-only)."""
        return self._clip

    def step(self, index: Tensor) -> None:
        """One step on the Poisson batch `index` (record indices; its size is known on the host)."""
        if index.numel() <= self.capacity:  # all but ~3e-5 of steps: one chunk, and one replay for the step
            load_chunk(index, 0, self.index, self.row_clips, self._row_clips)
            self._run(2)
            return
        for start in range(0, index.numel(), self.capacity):
            load_chunk(index, start, self.index, self.row_clips, self._row_clips)
            self._run(0)
        self._run(1)

    def _run(self, piece: int) -> None:
        if self.graphs is not None:
            self.graphs[piece].replay()
        else:
            (self._accumulate, self._update, self._one_chunk_step)[piece]()

    def _clipped_sums(self) -> None:
        """The chunk's clipped sums, written into `flat_sums` (unmasked: ĝ is masked as it is written)."""
        x = self.train.features.index_select(0, self.index)
        rows = self.record_rows.index_select(0, self.index)
        terms, one_hot = (rows[:, : self.terms_width] if self.terms_width else None), rows[:, self.terms_width:]
        clipped_gradient_sum(self.model, x, one_hot, self._clip, self.layout, row_clips=self.row_clips,
                             input_terms=None if self.terms_joined else terms,
                             joined_terms=terms if self.terms_joined else None, mask_sums=False,
                             finite_records=self.finite_records, out=self.sum_buffers)

    def _accumulate(self) -> None:
        self._clipped_sums()
        self.flat_total.add_(self.flat_sums)

    def _update(self) -> None:
        self._apply(self.flat_total, self.total_views)
        self.flat_total.zero_()

    def _one_chunk_step(self) -> None:
        """A batch that fits one chunk: its clipped sum goes straight to the update (no accumulator to add
        to and clear: the same mechanism and the same noise draws as `_accumulate` then `_update`)."""
        self._clipped_sums()
        self._apply(self.flat_sums, self.sum_buffers.tensors)

    @torch.no_grad()
    def _apply(self, flat_sums: Tensor, sums: dict[str, Tensor]) -> None:
        """ĝ from the clipped sums (`sums`: views of `flat_sums`), then the optimiser's step."""
        if self.noise_std is not None:
            self._flat_update(flat_sums)
        else:
            noisy_mean(dict(sums), noise=self.noise, surviving=self.layout.surviving, clip=self._clip,
                       expected_batch_size=self.expected_batch_size, generator=self.generator, reduce=self.reduce,
                       add_noise=self.add_noise, out=self.grads, out_scales=self.out_scales)
        if self.noise_filter is not None:  # m̂ from the released ĝ alone (post-processing)
            self.noise_filter.step(self.grads, out=self.grads)
        self.optimizer.step()
        if self.averager is not None and self.ema is not None:
            update_average(self.averager, self.model, self.ema)

    def _flat_update(self, flat_sums: Tensor) -> None:
        """`noisy_mean` for plain Gaussian noise on one device, in four kernels whatever the layer count
        (three for a dense network, two for a dense single layer): ĝ = (S + σC·z)/L ⊙ M with z the eager step's one
        draw over the surviving coordinates (`dpltm.dp.mechanism.add_gaussian_all`: the same numbers on the same
        generator, each where the eager step puts it), drawn as
        N(0, (σC/L)²) and scattered into a private noise buffer whose pruned entries stay 0; the sums are one flat
        buffer already; then every coordinate of ĝ written afresh: noise + S/L, and the pruned ones set to 0
        by `masked_fill_` (an unmasked sum there is not bounded by the clipping, and inf·0 would be NaN). Nothing
        written into a `.grad` between steps survives a step."""
        if self.noise_std and self.add_noise:
            std = self.noise_std / self.expected_batch_size
            if self.draw_straight:
                self.flat_noise.normal_(0.0, std, generator=self.generator)
            else:
                self.draws.normal_(0.0, std, generator=self.generator)
                self.flat_noise.index_copy_(0, self.surviving_flat, self.draws)
        torch.add(self.flat_noise, flat_sums, alpha=1.0 / self.expected_batch_size, out=self.flat_grad)
        if self.any_pruned:
            self.flat_grad.masked_fill_(self.flat_pruned, 0.0)

    def _capture(self) -> None:
        averaged = [self.averager] if self.averager is not None else []
        counters = [self.averager.n_averaged] if self.averager is not None else []
        accumulate, update, one_chunk = capture(
            [self._accumulate, self._update, self._one_chunk_step], modules=[self.model, *averaged],
            optimizer=self.optimizer, generators=[self.generator],
            reset=[self.flat_total, *counters,  # type: ignore[list-item]
                   *(self.noise_filter.reset_tensors() if self.noise_filter is not None else [])])
        self.graphs = (accumulate, update, one_chunk)


def record_rows(model: LeNet, train: LabeledTensors, layout: MaskLayout) -> tuple[Tensor, int, bool]:
    """Per record, what a static step gathers in one row copy: its norm terms, then its one-hot label (the loss's
    gradient is then written directly, `clipped_gradient_sum`). Returns the table, the terms' width and whether
    the terms are joined.

    Joined: every fully connected layer's columns side by side, the first layer's holding the record's
    `first_layer_input_terms` at full width and the others their layer's bias shares b_j, to which each step adds
    the weight shares in place (`clipped_gradient_sum(joined_terms=...)`): the layers' terms are then joined
    without a copy, and a later masked layer's terms cost one accumulating product. Where that table would pass
    `INPUT_TERMS_MAX_BYTES`, only the first layer's terms as computed (not joined); where those are skipped too
    (or the network has convolutions), the labels alone."""
    dtype = train.features.dtype
    classes = model.layers_in_order()[-1][1].out_features
    one_hot = F.one_hot(train.labels, classes).to(dtype)
    input_terms = first_layer_input_terms(train.features, layout)
    if input_terms is None:
        return one_hot, 0, False
    widths = [layer.out_features for _, layer in model.layers_in_order()]
    joined_width = sum(widths)
    if len(train) * (joined_width + classes) * train.features.element_size() > INPUT_TERMS_MAX_BYTES:
        return torch.cat([input_terms, one_hot], dim=1), input_terms.shape[1], False
    first = input_terms.expand(-1, widths[0])  # a dense unscaled first layer's one column, widened
    biases = [bias.expand(len(train), -1) for bias in layout.bias_terms[1:]]
    return torch.cat([first, *biases, one_hot], dim=1), joined_width, True


def flat_gaussian_std(noise: NoiseMechanism, clip: float) -> float | None:
    """The standard deviation of a plug-in that adds unshaped Gaussian noise through the shared body (Gaussian,
    DPD), which the static step draws flat (`StaticShapeDpStep._flat_update`); None for any other plug-in,
    which goes through its own `perturb` (`noisy_mean`)."""
    if (isinstance(noise, ScaledGaussianNoise) and type(noise).perturb is ScaledGaussianNoise.perturb
            and noise.coordinate_scales() is None):
        return noise.noise_std(clip)
    return None
