"""benchmarks/private_norm_oracle.py: its `gn` rows are the shipped front end's features, its `datanorm` rows
standardise each scattering map by the statistics of the reference records (and only those)."""

from __future__ import annotations

import torch
from private_norm_oracle import group_normalised, map_standardised, raw_maps

from dpltm.networks.scatter import ScatterFront


def test_gn_rows_are_what_the_front_end_ships() -> None:
    records = torch.rand(6, 28 * 28, generator=torch.Generator().manual_seed(0))
    front = ScatterFront(28 * 28)
    assert torch.allclose(group_normalised(raw_maps(front, records)), front(records), atol=1e-6)


def test_datanorm_uses_the_reference_statistics_per_map() -> None:
    g = torch.Generator().manual_seed(1)
    reference = torch.randn(50, 81, 7, 7, generator=g) * torch.linspace(0.1, 5, 81).view(1, 81, 1, 1) + 3
    out = map_standardised(reference, reference).view(50, 81, 49)
    assert out.mean((0, 2)).abs().max() < 1e-4
    assert out.std((0, 2)).sub(1).abs().max() < 1e-3
    other = torch.randn(4, 81, 7, 7, generator=g)
    expected = (other - reference.mean((0, 2, 3), keepdim=True)) / (reference.std((0, 2, 3), keepdim=True) + 1e-5)
    assert torch.allclose(map_standardised(other, reference), expected.flatten(1))
    assert not torch.allclose(map_standardised(other, other), expected.flatten(1))  # the reference decides
