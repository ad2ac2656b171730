"""The DP step benchmark's kernel count per step: device events only, averaged over the profiled steps."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from bench_dp_step import per_step


def _event(device: torch.autograd.DeviceType, microseconds: float) -> SimpleNamespace:
    return SimpleNamespace(device_type=device, time_range=SimpleNamespace(elapsed_us=lambda: microseconds))


def test_per_step_counts_device_events_and_their_time_not_the_hosts() -> None:
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [_event(cuda, 3.0), _event(cpu, 100.0), _event(cuda, 5.0), _event(cuda, 4.0), _event(cpu, 7.0)]
    assert per_step(events, 2) == (1.5, 6.0)
    assert per_step([_event(cpu, 1.0)], 2) is None  # nothing traced on the device: said, not a zero
