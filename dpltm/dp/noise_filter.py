"""A low-pass filter over the released noisy gradients, before the optimiser: DOPPLER (Zhang, Bu, Hong &
Razaviyayn, NeurIPS 2024, "DOPPLER: Differentially Private Optimizers with Low-pass Filter for Privacy Noise
Reduction", arXiv 2408.13460, Algorithm 1).

The sequence of noisy mean gradients ĝ_1, ĝ_2, … is read as a signal: the true gradient changes slowly from step to
step (its power sits at low frequencies), the DP noise is white (flat across frequencies). A linear IIR low-pass
filter keeps the first and damps the second,

    m_t = −Σ_{τ=1..na} a_τ m_{t−τ} + Σ_{τ=0..nb} b_τ ĝ_{t−τ},      m_t = ĝ_t = 0 for t ≤ 0,

and its start-up bias (the zero history) is divided out by the same filter applied to the constant sequence 1:

    c_t = −Σ_{τ=1..na} a_τ c_{t−τ} + Σ_{τ=0..min(nb, t−1)} b_τ,    the optimiser then reads m̂_t = m_t / c_t.

The filter is built so that −Σa_τ + Σb_τ = 1 (unit gain at frequency 0: a constant gradient passes unchanged), and
then c_t → 1. `scipy.signal.lfilter(b, [1, *a], ĝ)` computes the same m_t (tests/dp/test_noise_filter.py checks it).

Why it costs no ε: every input is a released noisy mean ĝ_t, which the Gaussian mechanism already made DP (its
(q, σ, T) event is in the ledger), and the filter reads nothing else — no record, no clipped sum, no noise draw. A
function of a DP output is DP with the same (ε, δ) (post-processing: Dwork & Roth 2014, Prop. 2.1), so the ledger
gets no event and ε is the same with and without the filter, as for momentum (itself the filter a = (−β,), b = (1,)
without the correction) and the EMA of the iterates (dpltm.dp.averaging).

A pruned coordinate gets ĝ = 0 at every step (no noise there, dpltm.dp.step), so its history stays 0 and its m̂ is
exactly 0: the filter keeps a ticket's pruned weights at zero, like SGD.

The state (the last nb inputs and na outputs per parameter, and the last na values of c with the last nb indicators
of a real step) is kept in the gradients' own dtype and device, as torch keeps SGD's momentum buffer: ĝ itself is in
that dtype, so float64 history would not make the filtered step more exact than the gradient it filters, would
double the state of a float32 network, and does not exist on every device (MPS). All-zero state is a fresh filter,
and a step reads no value back to the host, so a step can be captured in a CUDA graph (dpltm.dp.graphed resets the
state after its warm-up like the optimiser's). `state_dict` / `load_state_dict` carry it across a save and resume,
so a resumed run filters on exactly as the uninterrupted run would have.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class FilterCoefficients:
    """A linear filter: a = (a_1 … a_na) on past outputs, b = (b_0 … b_nb) on the current and past inputs."""

    a: tuple[float, ...]
    b: tuple[float, ...]


NOISE_FILTERS: dict[str, FilterCoefficients | None] = {
    "none": None,
    # a first-order low-pass filter: its pole at 0.9 averages over ~10 steps like momentum 0.9, and its zero at
    # z = −1 (b_0 = b_1) removes the highest frequency (ĝ alternating in sign from step to step: pure noise) entirely;
    # unit gain at frequency 0 (0.9 + 0.05 + 0.05 = 1). DOPPLER's Algorithm 1 with a first-order filter of its
    # family (the paper's §4 and appendix tables list the first- and second-order choices; momentum SGD is the
    # a = (−0.9,), b = (0.1,) member).
    "doppler": FilterCoefficients(a=(-0.9,), b=(0.05, 0.05)),
}
"""The filters a run may name (`train.noise_filter`, `--noise-filter`, `make_private(noise_filter=…)`)."""


def filter_coefficients(name: str) -> FilterCoefficients | None:
    """The coefficients of a named filter (None: no filter); KeyError for an unknown name (settings check names)."""
    return NOISE_FILTERS[name]


class NoiseFilter:
    """The filter's state for one run's trainable parameters, and its step: ĝ_t in, m̂_t out.

    Built on the parameters (their shapes, dtypes and devices) so that its tensors exist before a step is captured in
    a CUDA graph; every step updates them in place."""

    def __init__(self, name: str, parameters: Mapping[str, Tensor]) -> None:
        coefficients = filter_coefficients(name)
        if coefficients is None:
            raise ValueError(f"noise filter {name!r} filters nothing: build no NoiseFilter")
        self.name, self.a, self.b = name, coefficients.a, coefficients.b
        first = next(iter(parameters.values()))
        self._inputs = {n: [torch.zeros_like(p, memory_format=torch.contiguous_format) for _ in self.b[1:]]
                        for n, p in parameters.items()}
        self._outputs = {n: [torch.zeros_like(p, memory_format=torch.contiguous_format) for _ in self.a]
                         for n, p in parameters.items()}
        # c_{t−1} … c_{t−na}, and for t−1 … t−nb whether that step was taken (1) or lies before the run (0)
        self._c = torch.zeros(len(self.a), dtype=first.dtype, device=first.device)
        self._taken = torch.zeros(len(self.b) - 1, dtype=first.dtype, device=first.device)

    @torch.no_grad()
    def step(self, grads: Mapping[str, Tensor], out: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
        """m̂_t for the released ĝ_t (`grads`, by parameter name; not modified), the state moved on by one step.
        `out`: write m̂_t into these tensors (a static step's `.grad` buffers, which may be `grads` themselves)
        instead of new ones."""
        if set(grads) != set(self._inputs):
            raise ValueError(f"the noise filter holds {sorted(self._inputs)}, the step gave {sorted(grads)}")
        a, b = self.a, self.b
        c = torch.full((), b[0], dtype=self._c.dtype, device=self._c.device)  # Σ b_τ over steps taken − Σ a_τ c_{t−τ}
        for tau, coefficient in enumerate(b[1:]):
            c = c + coefficient * self._taken[tau]
        for tau, coefficient in enumerate(a):
            c = c - coefficient * self._c[tau]
        result: dict[str, Tensor] = {}
        for name, g in grads.items():
            inputs, outputs = self._inputs[name], self._outputs[name]
            m = g * b[0]
            for coefficient, past in zip(b[1:], inputs, strict=True):
                m.add_(past, alpha=coefficient)
            for coefficient, past in zip(a, outputs, strict=True):
                m.add_(past, alpha=-coefficient)
            for later, earlier in zip(reversed(inputs[1:]), reversed(inputs[:-1]), strict=True):
                later.copy_(earlier)  # shift: ĝ_{t−τ} becomes ĝ_{t−τ−1}
            if inputs:
                inputs[0].copy_(g)
            for later, earlier in zip(reversed(outputs[1:]), reversed(outputs[:-1]), strict=True):
                later.copy_(earlier)
            if outputs:
                outputs[0].copy_(m)
            if out is None:
                result[name] = m.div_(c)
            else:
                torch.div(m, c, out=out[name])
                result[name] = out[name]
        if len(self._c):
            self._c.copy_(torch.cat([c.reshape(1), self._c[:-1]]))
        if len(self._taken):
            self._taken.copy_(torch.cat([torch.ones_like(self._taken[:1]), self._taken[:-1]]))
        return result

    def reset_tensors(self) -> list[Tensor]:
        """Every state tensor: zero is a fresh filter (a CUDA-graph capture zeroes them after its warm-up)."""
        return [*(t for ts in self._inputs.values() for t in ts), *(t for ts in self._outputs.values() for t in ts),
                self._c, self._taken]

    def state_dict(self) -> dict[str, Any]:
        """The filter's name and coefficients and its history, on the CPU: a resumed run continues from it."""
        return {"name": self.name, "a": list(self.a), "b": list(self.b),
                "inputs": {n: [t.detach().cpu().clone() for t in ts] for n, ts in self._inputs.items()},
                "outputs": {n: [t.detach().cpu().clone() for t in ts] for n, ts in self._outputs.items()},
                "c": self._c.detach().cpu().clone(), "taken": self._taken.detach().cpu().clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved state (copied into this filter's tensors, which keep their identity); a state of
        another filter or other parameters is refused (ValueError: the caller says which file)."""
        if (state.get("name") != self.name or list(state.get("a", ())) != list(self.a)
                or list(state.get("b", ())) != list(self.b)):
            raise ValueError(f"the saved noise filter is {state.get('name')!r}, this run's {self.name!r}")
        saved_in, saved_out = state["inputs"], state["outputs"]
        if set(saved_in) != set(self._inputs) or set(saved_out) != set(self._outputs):
            raise ValueError("the saved noise filter holds other parameters than this model's")
        pairs = [(mine, theirs) for name in self._inputs
                 for mine, theirs in [*zip(self._inputs[name], saved_in[name], strict=True),
                                      *zip(self._outputs[name], saved_out[name], strict=True)]]
        pairs += [(self._c, state["c"]), (self._taken, state["taken"])]
        if any(not isinstance(theirs, Tensor) or theirs.shape != mine.shape for mine, theirs in pairs):
            raise ValueError("the saved noise filter's history does not fit this model")
        with torch.no_grad():
            for mine, theirs in pairs:
                mine.copy_(theirs)


def make_noise_filter(name: str, parameters: Mapping[str, Tensor]) -> NoiseFilter | None:
    """The run's filter over its trainable `parameters` (None for `none`)."""
    return None if filter_coefficients(name) is None else NoiseFilter(name, parameters)
