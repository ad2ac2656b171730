"""Masked against dense DP-SGD on a ScatterNet linear head, side by side in one run (issue 25, item 5).

The head of `--arch scatter-linear`: one linear layer over 81·7·7 = 3969 scattering features, 10
classes, at the expected batch of the scatter recipe (L = 4096, Poisson-sampled from `--records`
feature rows resident on the device). Timed, ms per step:

* the CLI's DP step on the network (`dp.step.private_gradients` with `step_layout`: the fused step), dense and
  with a ticket mask at `--density` and with a mask that keeps everything;
* the API's `PrivateTraining.step` (`make_private`: its own Poisson draw, the optimiser, re-masking),
  dense and with the same masks.

Timed in turn within every repeat (`interleaved`). A masked step should cost no more than the dense
one: a mask that keeps everything takes the plain ghost norm, and a real mask's norm is a row gather
from a per-record table made once per run (dpltm.dp.engine.record_norm_tables: the head is fed the
records' features themselves).

    python benchmarks/bench_masked_head.py [--batch-size 4096] [--density 0.3] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch

from dpltm.api import make_private
from dpltm.dp.gaussian import GaussianNoise
from dpltm.dp.sampling import BatchGather
from dpltm.dp.step import apply_gradients, private_gradients, record_terms, step_layout, terms_of_batch
from dpltm.masks import apply_masks_, full_masks
from dpltm.networks.lenet import build_architecture, build_network
from dpltm.networks.scatter import CHANNELS


def interleaved(steps: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median ms per step of each, timed in turn within every repeat (so a drift in the machine's speed
    or memory state falls on all of them alike), after 3 warm-up steps each."""
    for step in steps.values():
        for _ in range(3):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1000 for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--density", type=float, default=0.3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    g = torch.Generator().manual_seed(0)
    features = torch.randn(args.records, CHANNELS * 49, generator=g)
    labels = torch.randint(0, 10, (args.records,), generator=g)
    arch = build_architecture(784, 10, (), None, "tanh", "scatter-linear")
    dense = full_masks(build_network(arch))
    ticket = {n: torch.rand(m.shape, generator=g) < args.density for n, m in dense.items()}
    q = args.batch_size / args.records

    def cli_step(masks: dict[str, torch.Tensor] | None) -> Callable[[], None]:
        model = build_network(arch, torch.Generator().manual_seed(1))
        installed = apply_masks_(model, masks if masks is not None else full_masks(model))
        layout = step_layout(model, installed)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        noise, sampler = GaussianNoise(5.0), torch.Generator().manual_seed(2)
        terms = record_terms(model, layout, features)  # once per run, as dpltm train does
        gather = BatchGather()  # the batch's rows into a kept buffer, as dpltm train does

        def step() -> None:
            index = (torch.rand(args.records, generator=sampler, dtype=torch.float64) < q).nonzero().squeeze(1)
            grads, _, _ = private_gradients(model, gather(features, index), labels.index_select(0, index),
                                            clip=1.0, noise=noise, expected_batch_size=args.batch_size,
                                            generator=sampler, layout=layout, input_terms=terms_of_batch(terms, index))
            apply_gradients(model, grads, optimizer)
        return step

    def api_step(masks: dict[str, torch.Tensor] | None) -> Callable[[], None]:
        model = build_network(arch, torch.Generator().manual_seed(1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        private = make_private(model, optimizer, (features, labels), noise_multiplier=5.0, epochs=50,
                               batch_size=args.batch_size, masks=masks, masks_from=None if masks is None else "public",
                               noise_seed=3)
        return private.step

    rows = []
    for label, make in (("CLI DP step", cli_step), ("API make_private step", api_step)):
        networks = {"dense": None, f"ticket C={args.density:g}": ticket, "mask keeping all": dense}
        steps = {name: make(masks) for name, masks in networks.items()}
        times = interleaved(steps, args.repeats)
        for name, ms in times.items():
            rows.append((label, name, ms, ms / times["dense"]))
    print(f"linear head {CHANNELS * 49}×10, L = {args.batch_size}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}")
    print(f"{'path':<24}{'network':<20}{'ms/step':>10}{'× dense':>10}")
    for label, name, ms, ratio in rows:
        print(f"{label:<24}{name:<20}{ms:>10.2f}{ratio:>10.2f}")


if __name__ == "__main__":
    main()
