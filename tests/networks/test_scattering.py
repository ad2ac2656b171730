"""dpltm's batched scattering transform gives kymatio's maps: same filters, same padding, same order,
to float32 rounding; chunking, dtype and device do not change them; a missing kymatio is one line."""

from __future__ import annotations

import sys

import pytest
import torch

from dpltm.errors import DpltmUserError
from dpltm.networks.scatter import ScatterFront, scattering_class, scattering_for
from dpltm.networks.scattering import Scattering2D, padded_side


def _images(n: int, side: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, side, side, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("side", [8, 28, 32])
def test_the_maps_are_kymatios(side: int) -> None:
    x = _images(6, side)
    x[0] = 0.0  # a blank image (MNIST's corners) and a constant one
    x[1] = 1.0
    reference = scattering_class()(J=2, shape=(side, side), L=8)(x)
    ours = Scattering2D(side)(x)
    assert ours.shape == reference.shape == (6, 81, side // 4, side // 4)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    double = Scattering2D(side, dtype=torch.float64)(x.double())
    assert double.dtype == torch.float64
    torch.testing.assert_close(double.float(), reference, rtol=1e-5, atol=1e-6)


def test_the_maps_are_the_same_whatever_the_rows_at_once() -> None:
    x = _images(11, 28, seed=3)
    scattering = Scattering2D(28)
    torch.testing.assert_close(scattering(x, rows_at_once=3), scattering(x), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(scattering(x[4:5])[0], scattering(x)[4], rtol=1e-6, atol=1e-7)


def test_the_padding_is_kymatios() -> None:
    from kymatio.scattering2d.utils import compute_padding

    for side in (8, 12, 28, 32, 64):
        assert padded_side(side) == compute_padding(side, side, 2)[0]
    with pytest.raises(ValueError, match="too small"):
        Scattering2D(4)


def test_the_front_end_uses_it_and_its_cache_key_says_so() -> None:
    front = ScatterFront(784)
    x = _images(3, 28).reshape(3, 784)
    assert isinstance(scattering_for(28, torch.device("cpu")), Scattering2D)
    assert "dpltm.networks.scattering" in front.settings()["implementation"]
    maps = scattering_class()(J=2, shape=(28, 28), L=8)(x.reshape(3, 28, 28))
    expected = torch.nn.functional.group_norm(maps, 27, eps=1e-5).flatten(1)
    torch.testing.assert_close(front(x), expected, rtol=1e-4, atol=1e-5)


def test_a_missing_filter_bank_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kymatio.scattering2d.filter_bank", None)
    with pytest.raises(DpltmUserError, match="needs kymatio"):
        scattering_for(28, torch.device("cpu"))


@pytest.mark.gpu
def test_the_maps_on_a_gpu_are_the_cpus() -> None:
    x = _images(40, 28)
    torch.testing.assert_close(Scattering2D(28, device="cuda")(x.cuda()).cpu(), Scattering2D(28)(x),
                               rtol=1e-4, atol=1e-5)
