"""What `DPCallback` costs a Lightning user a step, side by side in one run: a Lightning fit without DP, the
same fit with `DPCallback`, and `make_private`'s own step, on one model, batch and device.

The callback's step is the engine's (per-record norms, clipping, one noise draw) plus its checks: it wraps the
optimiser's closure, reads each parameter's and buffer's (version, norm) marks at the batch start and after the
closure (`torch._foreach_norm`, one host sync each), and checks each `.grad` is the noisy one it wrote. On a GPU
those syncs are the part a CPU timing cannot show. Each variant fits fresh weights (`--fits` times, in turn, so a
drift in the machine's speed falls on all alike) through the same Poisson loader of CPU tensors; a step is timed
from one batch end to the next (after `torch.cuda.synchronize` on CUDA), the first `--warmup` steps of a fit
dropped (the callback's first step runs its independence probe). Reported: the median ms a step of each.

    python benchmarks/bench_callback.py [--device cuda] [--batch-size 256] [--steps 60] [--fits 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

import dpltm
from dpltm.lightning import poisson_loader


def network(width: int) -> nn.Module:
    """An MLP on 784 inputs (0.67 M parameters at width 512): big enough that the step, not Python, is timed."""
    return nn.Sequential(nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


class Classifier(L.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = network(width)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class StepTimer(L.Callback):
    """The wall time between consecutive batch ends, the device's queue drained at each."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())


def lightning_fit(args: argparse.Namespace, data: tuple[torch.Tensor, torch.Tensor], private: bool, seed: int
                  ) -> list[float]:
    torch.manual_seed(seed)
    timer = StepTimer(args.device)
    callbacks: list[L.Callback] = [timer]
    if private:
        callbacks.insert(0, dpltm.DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5))
    # one epoch of the Poisson loader is len(records) / L steps: the callback plans σ for whole epochs
    trainer = L.Trainer(max_epochs=1, callbacks=callbacks, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="gpu" if args.device == "cuda" else "cpu", devices=1)
    loader = poisson_loader(torch.utils.data.TensorDataset(*data), batch_size=args.batch_size, seed=seed)
    trainer.fit(Classifier(args.width), loader)
    return [b - a for a, b in zip(timer.ends[args.warmup:], timer.ends[args.warmup + 1:])]


def api_fit(args: argparse.Namespace, data: tuple[torch.Tensor, torch.Tensor], seed: int) -> list[float]:
    torch.manual_seed(seed)
    model = network(args.width).to(args.device)
    x, y = (t.to(args.device) for t in data)
    private = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), (x, y),
                                 noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5,
                                 batch_size=args.batch_size, epochs=1000)
    ends = []
    for _ in range(args.warmup + args.steps + 1):  # as a Lightning fit's epoch: `steps` intervals timed
        private.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        ends.append(time.perf_counter())
    return [b - a for a, b in zip(ends[args.warmup:], ends[args.warmup + 1:])]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch-size", type=int, default=256, help="the expected Poisson batch L")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=60, help="timed steps a fit")
    parser.add_argument("--warmup", type=int, default=5, help="steps a fit dropped before timing")
    parser.add_argument("--fits", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads on the CPU")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    records = args.batch_size * (args.warmup + args.steps + 1)  # one epoch: the steps timed, warm-up and one
    data = (torch.rand(records, 784, generator=g), torch.randint(0, 10, (records,), generator=g))
    times: dict[str, list[float]] = {"Lightning, no DP": [], "Lightning + DPCallback": [], "make_private step": []}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's advice on workers and the loader: not what is timed
            for fit in range(args.fits):
                times["Lightning, no DP"] += lightning_fit(args, data, private=False, seed=fit)
                times["Lightning + DPCallback"] += lightning_fit(args, data, private=True, seed=fit)
                times["make_private step"] += api_fit(args, data, seed=fit)
    finally:
        torch.set_num_threads(threads)
    median = {name: statistics.median(t) * 1000 for name, t in times.items()}
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {args.threads} threads"
    print(f"{device}; MLP 784-{args.width}-{args.width}-10, expected batch {args.batch_size}, "
          f"{args.fits} fits x {args.steps} timed steps each (median ms a step)")
    base = median["Lightning, no DP"]
    for name, ms in median.items():
        print(f"  {name:<24} {ms:8.3f} ms   {ms / base:5.2f}x the fit without DP")
    print(f"  DPCallback / make_private step: {median['Lightning + DPCallback'] / median['make_private step']:.2f}x")


if __name__ == "__main__":
    main()
