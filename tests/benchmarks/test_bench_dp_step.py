"""The DP step benchmark's kernel count per step: device events only, averaged over the profiled steps."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from bench_dp_step import kernel_table, per_step


def _event(device: torch.autograd.DeviceType, microseconds: float) -> SimpleNamespace:
    return SimpleNamespace(device_type=device, time_range=SimpleNamespace(elapsed_us=lambda: microseconds))


def test_per_step_counts_device_events_and_their_time_not_the_hosts() -> None:
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [_event(cuda, 3.0), _event(cpu, 100.0), _event(cuda, 5.0), _event(cuda, 4.0), _event(cpu, 7.0)]
    assert per_step(events, 2) == (1.5, 6.0)
    assert per_step([_event(cpu, 1.0)], 2) is None  # nothing traced on the device: said, not a zero


def test_kernel_table_groups_device_kernels_by_name_longest_first() -> None:
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def named(name: str, device: torch.autograd.DeviceType, microseconds: float) -> SimpleNamespace:
        event = _event(device, microseconds)
        event.name = name
        return event

    events = [named("gemm", cuda, 4.0), named("add", cuda, 1.0), named("gemm", cuda, 6.0), named("host", cpu, 99.0)]
    lines = kernel_table(events, 2).splitlines()
    assert [line.split()[-1] for line in lines] == ["gemm", "add"]  # the host's op left out, the longest first
    assert lines[0].split()[:2] == ["1.0", "5.00"]  # 2 launches over 2 steps, 10 µs over 2 steps
