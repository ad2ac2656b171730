"""The 2-D wavelet scattering transform (Mallat 2012; Bruna & Mallat 2013) at J = 2, batched over filters.

The same transform as kymatio 0.3's `Scattering2D(J=2, L=8, max_order=2)` — kymatio's own Morlet filter bank
(`kymatio.scattering2d.filter_bank`), its reflection padding, its Fourier-domain subsampling and its
output order (order 0, then the 16 first-order maps by (j, θ), then the 64 second-order maps by (n1, n2)) —
computed differently: each step runs on every filter at once with native complex tensors, and the
Fourier periodisation is a sum of contiguous blocks. kymatio loops in Python over the filters and spends
about two thirds of its time outside the FFTs (a strided mean for each subsampling, a zero-filled copy
for each real FFT, element-wise products on real views); this version gives the same features to
float32 rounding (tests/networks/test_scattering.py compares the two) in about a third of the time on
2 CPU cores (benchmarks/bench_scattering.py).

Subsampling by k in space is periodising the spectrum: the k×k blocks of an M×N spectrum averaged give
the spectrum of every k-th sample (kymatio's `subsample_fourier`).
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

SCALES = 2
"""J, the number of scales (maps are side / 2^J on a side). Only J = 2 is implemented (what the ScatterNet
front end uses): one scale of first-order wavelets at full resolution, one at half, and second-order paths
from the first to the second."""


def filter_bank_module() -> Any:
    """kymatio's 2-D filter bank module, imported from its own file (kymatio's top-level package imports
    its 3-D filters, which need `scipy.special.sph_harm`, gone from SciPy ≥ 1.15)."""
    return importlib.import_module("kymatio.scattering2d.filter_bank")


ROWS_AT_ONCE = 256
"""Images per pass: a pass holds (rows, L, P, P) complex spectra (21 MiB at 256 for 28×28 images), small
enough to stay in cache between the element-wise steps and the FFTs."""


def padded_side(side: int) -> int:
    """kymatio's `compute_padding` for J = 2: the image is reflected out to this side before the FFTs."""
    step = 2**SCALES
    return ((side + step) // step + 1) * step


class Scattering2D:
    """Images (B, side, side) → scattering maps (B, 1 + 2L + L², side/4, side/4), float32 or float64.

    Filters are built once per (device, dtype); nothing here is a parameter or a buffer."""

    def __init__(self, side: int, angles: int = 8, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self.side, self.angles = side, angles
        self.padded = padded_side(side)
        self.pad = ((self.padded - side) // 2, (self.padded - side + 1) // 2)
        if max(self.pad) >= side:
            raise ValueError(f"images of side {side} are too small for J = {SCALES} scattering (need at least 8)")
        bank = filter_bank_module().filter_bank(self.padded, self.padded, SCALES, angles)

        def spectrum(values: np.ndarray) -> Tensor:
            """A real Fourier filter (kymatio drops the zero imaginary part), each value twice: the layout of
            `torch.view_as_real` of the spectra it multiplies, so the product is one contiguous pass."""
            real = torch.as_tensor(np.asarray(values), dtype=dtype)
            return torch.stack([real, real], dim=-1).to(device=device)

        psi = [spectrum(f["levels"][0]) for f in bank["psi"]]
        self.psi_fine = torch.stack(psi[:angles])  # j = 0: (L, P, P)
        self.psi_coarse = torch.stack(psi[angles:])  # j = 1: (L, P, P)
        self.phi = [spectrum(level) for level in bank["phi"]["levels"]]  # (P, P), (P/2, P/2)
        self.dtype = dtype

    def __call__(self, images: Tensor, rows_at_once: int = ROWS_AT_ONCE) -> Tensor:
        return torch.cat([self._transform(images[start:start + rows_at_once])
                          for start in range(0, images.shape[0], rows_at_once)])

    def _transform(self, images: Tensor) -> Tensor:
        x = images.to(self.dtype).unsqueeze(1)
        x = F.pad(x, (self.pad[0], self.pad[1], self.pad[0], self.pad[1]), mode="reflect").squeeze(1)
        u0 = _fft2_of_real(x)  # (B, P, P)
        outputs = [_low_pass(u0, self.phi[0], 4)]  # order 0
        # order 1, j1 = 0: full resolution; its modulus' spectrum feeds order 2
        u1_fine = _modulus_spectrum(_times(u0.unsqueeze(1), self.psi_fine))  # (B, L, P, P)
        outputs.append(_low_pass(u1_fine, self.phi[0], 4))
        # order 1, j1 = 1: half resolution
        u1_coarse = _modulus_spectrum(_periodise(_times(u0.unsqueeze(1), self.psi_coarse), 2))
        outputs.append(_low_pass(u1_coarse, self.phi[1], 2))
        # order 2: (j1, j2) = (0, 1), for each first-order angle every second-order angle, in kymatio's order
        for n1 in range(self.angles):
            u2 = _modulus_spectrum(_periodise(_times(u1_fine[:, n1 : n1 + 1], self.psi_coarse), 2))
            outputs.append(_low_pass(u2, self.phi[1], 2))
        return torch.cat([o.reshape(o.shape[0], -1, *o.shape[-2:]) for o in outputs], dim=1)


def _times(spectra: Tensor, filters: Tensor) -> Tensor:
    """Complex spectra times real filters stored as (…, 2) pairs (`Scattering2D.spectrum`): two real products
    per value, in one contiguous pass (a broadcast over the pair is ten times slower on the CPU)."""
    return torch.view_as_complex(torch.view_as_real(spectra) * filters)


def _fft2_of_real(values: Tensor) -> Tensor:
    """fft2 of a real tensor, made complex first: torch's real-input fft2 path is about 3.5 times slower
    than the complex one on the CPU (torch 2.x, measured at (64, 8, 36, 36))."""
    return torch.fft.fft2(values.to(torch.complex128 if values.dtype == torch.float64 else torch.complex64))


def _modulus_spectrum(spectra: Tensor) -> Tensor:
    """The spectrum of |F⁻¹(spectra)|: the wavelet modulus, back in Fourier. The modulus as
    sqrt(re² + im²) on the real view (half the time of complex `abs`, which guards against overflow that
    these bounded values cannot reach)."""
    pairs = torch.view_as_real(torch.fft.ifft2(spectra))
    re, im = pairs[..., 0], pairs[..., 1]
    return _fft2_of_real(torch.sqrt(re * re + im * im))


def _periodise(spectra: Tensor, k: int) -> Tensor:
    """The spectrum of every k-th sample: the mean of the k×k blocks of each (…, M, N) spectrum."""
    m, n = spectra.shape[-2] // k, spectra.shape[-1] // k
    if k == 2:
        rows = spectra[..., :m, :] + spectra[..., m:, :]
        return (rows[..., :n] + rows[..., n:]).mul_(0.25)
    blocks = spectra.reshape(*spectra.shape[:-2], k, m, k, n)
    return blocks.sum(dim=(-4, -2)).mul_(1.0 / (k * k))


def _low_pass(spectra: Tensor, phi: Tensor, k: int) -> Tensor:
    """Average with φ, subsample by k, back to space, and crop kymatio's one-sample border."""
    low = torch.fft.ifft2(_periodise(_times(spectra, phi), k)).real
    return low[..., 1:-1, 1:-1]
