"""Poisson sampling: the realised inclusion probability never exceeds q (docs/privacy.md §7)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dpltm.dp.sampling import RANDOM_BITS, PoissonBatches, inclusion_threshold, poisson_sample

AWKWARD = [
    1.0,
    1.0 - 2**-53,  # the largest double below 1
    0.5,
    0.1,
    1 / 3,
    400 / 60000,  # the paper's q
    64 / 1437,
    float(np.nextafter(0.1, 1.0)),
    float(np.float32(0.1)),  # on the float32 grid
    float(np.nextafter(np.float32(0.1), np.float32(1.0))) - 2**-60,  # just below a float32 point
    2**-24 + 2**-60,
    2**-25,
    2**-62,
    2**-62 + 2**-100,
    3 * 2**-64,
    2**-63,
    5e-324,  # the smallest subnormal
    2.2250738585072014e-308,  # the smallest normal
]


def _realised(sample_rate: float) -> Fraction:
    return Fraction(inclusion_threshold(sample_rate), 2**RANDOM_BITS)


@settings(max_examples=300, deadline=None)
@given(q=st.floats(min_value=0.0, max_value=1.0, exclude_min=True, allow_subnormal=True))
@example(q=AWKWARD[0])
def test_realised_rate_never_exceeds_q(q: float) -> None:
    threshold = inclusion_threshold(q)
    assert isinstance(threshold, int) and 0 <= threshold <= 2**RANDOM_BITS
    realised = _realised(q)
    assert realised <= Fraction(q)  # exact rational comparison: never above q
    assert Fraction(q) - realised < Fraction(1, 2**RANDOM_BITS)  # and below it by < 2^-62


@pytest.mark.parametrize("q", AWKWARD)
def test_realised_rate_on_awkward_rates(q: float) -> None:
    assert _realised(q) <= Fraction(q) < _realised(q) + Fraction(1, 2**RANDOM_BITS)


def test_rate_off_the_float32_grid_is_not_rounded_up() -> None:
    """float32 uniforms (a 2^-24 grid on CPU) include a record at q = 2^-60 with rate 2^-24.

    2^26 draws then expect 4 inclusions; the integer rule expects 2^-34, i.e. none.
    """
    generator = torch.Generator().manual_seed(1)
    included = sum(poisson_sample(2**23, 2**-60, generator).numel() for _ in range(8))
    assert included == 0


def test_every_record_at_rate_one_and_sorted_unique() -> None:
    generator = torch.Generator().manual_seed(0)
    assert torch.equal(poisson_sample(1000, 1.0, generator), torch.arange(1000))
    indices = poisson_sample(10_000, 0.5, generator)
    assert torch.equal(indices, indices.unique())
    assert poisson_sample(0, 0.5, generator).shape == (0,)


@pytest.mark.parametrize("q", [1 / 3, 0.02, 400 / 60000])
def test_empirical_frequencies_match_q(q: float) -> None:
    n, steps = 2000, 500
    counts = torch.zeros(n, dtype=torch.int64)
    for batch in PoissonBatches(n, q, steps=steps, seed=7):
        counts[batch] += 1
    # All draws together: within 5 sd of n·steps·q.
    total, trials = int(counts.sum()), n * steps
    assert abs(total - trials * q) < 5 * math.sqrt(trials * q * (1 - q))
    # Each record alone: Binomial(steps, q); a chi-square over records (dispersion test).
    expected, variance = steps * q, steps * q * (1 - q)
    dispersion = float(((counts.double() - expected) ** 2).sum()) / variance
    assert abs(dispersion - n) < 6 * math.sqrt(2 * n)


def test_bad_rate_is_refused() -> None:
    from dpltm.errors import DpltmUserError

    for q in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(DpltmUserError, match="sampling rate"):
            poisson_sample(10, q, torch.Generator())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_generator_same_rule() -> None:
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(3)
    included = sum(poisson_sample(2**24, 2**-60, generator, "cpu").numel() for _ in range(4))
    assert included == 0
    n, steps, q = 4000, 400, 0.05
    counts = torch.zeros(n, dtype=torch.int64, device=device)
    for batch in PoissonBatches(n, q, steps=steps, seed=5, device=device):
        assert batch.device.type == "cuda"
        counts[batch] += 1
    total, trials = int(counts.sum()), n * steps
    assert abs(total - trials * q) < 5 * math.sqrt(trials * q * (1 - q))


def test_batch_gather_gives_the_rows_and_keeps_its_buffer() -> None:
    """BatchGather: exactly `index_select`'s rows, written into one buffer reused across calls (grown when a
    batch is larger, remade for other rows' shape or dtype)."""
    from dpltm.dp.sampling import BatchGather

    rows = torch.randn(50, 3, 4)
    gather = BatchGather()
    first = gather(rows, torch.tensor([4, 1, 9]))
    assert torch.equal(first, rows.index_select(0, torch.tensor([4, 1, 9]))) and first.is_contiguous()
    pointer = first.data_ptr()
    second = gather(rows, torch.tensor([0, 2]))
    assert torch.equal(second, rows[[0, 2]]) and second.data_ptr() == pointer  # the same buffer
    assert gather(rows, torch.tensor([], dtype=torch.long)).shape == (0, 3, 4)
    larger = gather(rows, torch.arange(20))
    assert torch.equal(larger, rows[:20])
    other = gather(rows.double(), torch.tensor([3]))
    assert other.dtype == torch.float64 and torch.equal(other, rows.double()[[3]])
