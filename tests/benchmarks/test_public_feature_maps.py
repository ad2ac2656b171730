"""The public feature maps of benchmarks/public_feature_maps.py: fitted on public rows only, norm-preserving."""

from __future__ import annotations

import pytest
import torch
from public_feature_maps import PublicMap

from dpltm.errors import DpltmUserError


def public_rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(200, 81 * 49, generator=g) * (torch.rand(81 * 49, generator=g) * 3 + 0.1) + 1


def test_maps_keep_the_mean_record_norm_and_do_what_they_say() -> None:
    x = public_rows()
    assert torch.equal(PublicMap(x, "none")(x), x)
    for kind in ("std-feature", "std-channel", "pca64", "std-pca64"):
        mapped = PublicMap(x, kind)(x)
        assert mapped.norm(dim=1).mean() == pytest.approx(float(x.norm(dim=1).mean()), rel=1e-4)
    standardised = PublicMap(x, "std-feature")(x).double()
    assert standardised.mean(0).abs().max() < 1e-4  # centred on the public mean
    spread = standardised.std(0)
    assert float(spread.max() / spread.min()) == pytest.approx(1.0, abs=1e-4)  # one scale for every feature
    assert PublicMap(x, "pca64")(x).shape == (200, 64)


def test_unknown_maps_and_sizes_are_refused() -> None:
    with pytest.raises(DpltmUserError, match="unknown map"):
        PublicMap(public_rows(), "whiten")
    with pytest.raises(DpltmUserError, match="k must lie in"):
        PublicMap(public_rows(), "pca0")
