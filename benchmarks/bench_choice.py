"""The noise-aware choice with and without successive halving, side by side in one run (issue 21, item 3).

A LeNet-300-100 ticket set of `--rounds` IMP rounds (the dense network and its tickets, as `dpltm run`
chooses among) over KMNIST-shaped synthetic records (7208 training, 830 validation, 784 features, 10
classes: the public split the grid uses), then the choice under the planned run of the tuned recipe
at ε = 1 on N = 54000 (the TAN proxy: L' = 214, σ' scaled to keep σ/L), cut to `--steps` steps.
Wall time of each mode, timed in turn within every repeat, and its ratio to the full choice: the
halving modes should cost about (their candidate-steps) / (K·T), e.g. 3/5 for 5 candidates and 2 rungs.
Accuracy is not measured here (synthetic data); docs/results.md has the choice on the real tickets.

    python benchmarks/bench_choice.py [--steps 300] [--rounds 4] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dpltm.data.types import DatasetSplits, LabeledTensors
from dpltm.selection.noise_aware import PlannedRun, noise_aware_choice, rung_steps
from dpltm.settings import DataSettings, GenerateConfig, GenerateSettings, ModelSettings
from dpltm.tickets.imp import generate_tickets


def records(n: int, seed: int) -> LabeledTensors:
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(10, 784, generator=torch.Generator().manual_seed(99))
    labels = torch.randint(0, 10, (n,), generator=g)
    return LabeledTensors((centres[labels] + 2.0 * torch.randn(n, 784, generator=g)).float(), labels)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=4, help="IMP rounds: rounds + 1 candidates")
    parser.add_argument("--halving", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    public = DatasetSplits(name="kmnist-shaped", source_split="test", train=records(7208, 0), val=records(830, 1),
                           test=records(10, 2), num_features=784, num_classes=10, fingerprint="synthetic")
    cfg = GenerateConfig(data=DataSettings(dataset="kmnist"), model=ModelSettings(activation="tanh"),
                         generate=GenerateSettings(rounds=args.rounds, iterations=20, batch_size=64))
    with tempfile.TemporaryDirectory() as folder:
        tickets = generate_tickets(cfg, public, Path(folder) / "t.pt", progress=False)
    plan = PlannedRun(noise_multiplier=4.65, expected_batch_size=1600, steps=args.steps, clip=1.0, lr=1.29,
                      activation="tanh", ema=0.999, ema_warmup=True, private_size=54000)
    k = len(tickets.tickets)
    modes = {0: "every candidate all T steps", **{h: f"halving, {h} rung(s) at steps {rung_steps(args.steps, h)}"
                                                  for h in args.halving}}
    times: dict[int, list[float]] = {h: [] for h in modes}
    for repeat in range(args.repeats):
        for halving in modes:
            start = time.perf_counter()
            choice = noise_aware_choice(tickets, public, plan, seed=repeat, halving=halving)
            times[halving].append(time.perf_counter() - start)
            if repeat == 0:
                work = sum(c.steps for c in choice.candidates) / (k * args.steps)
                modes[halving] += f"; candidate-steps {work:.2f} of the full choice's"
    full = statistics.median(times[0])
    print(f"{k} candidates, T = {args.steps} steps, L' = {plan.on_public(7208)[0]}, {args.threads} thread(s), "
          f"median of {args.repeats}")
    for halving, label in modes.items():
        median = statistics.median(times[halving])
        print(f"  halving {halving}: {median:6.2f} s  ({median / full:.2f}× the full choice)  {label}")


if __name__ == "__main__":
    main()
