"""Time of one DP-SGD step against the non-private step and against Opacus, in one run.

Same masked MLP (784-300-100-10, a ticket after `--rounds` pruning rounds), same batch (400 rows
gathered from a device-resident set of `--records` MNIST-shaped rows, as in training). Printed as
ratios to the non-private masked step:

* dpltm DP step: masked ghost norms (the first layer's share read from the per-record table
  `first_layer_input_terms`, built once per run: its one-time cost is printed) + clipped sum +
  noise on surviving weights (target ≤ 1.25× on 2 CPU threads);
* the engine's hook path on the same network as a plain `nn.Sequential` (what `make_private` and
  `DPCallback` run: the registry's Linear rule, no per-record table);
* Opacus 1.x default (per-sample gradients by hooks), and Opacus ghost clipping
  (`grad_sample_mode="ghost"`), both on the same masked network;
* on CUDA also both steps replayed from CUDA graphs (`--cuda-graphs`: the non-private
  `GraphedSgdStep`, the DP `StaticShapeDpStep` with the batch padded to its capacity). Targets
  (issue 10, H100): DP graph step ≤ 1.2× the non-private graph step, ≥ 4× ahead of Opacus ghost.

    python benchmarks/bench_dp_step.py [--rounds 7] [--batch-size 400] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpltm.data.types import LabeledTensors
from dpltm.devices import resolve_device
from dpltm.dp.engine import clipped_gradient_sum_of
from dpltm.dp.gaussian import GaussianNoise
from dpltm.dp.ghost import MaskLayout, first_layer_input_terms
from dpltm.dp.graphed import StaticShapeDpStep
from dpltm.dp.padding import batch_capacity
from dpltm.dp.step import apply_gradients, noisy_mean, private_gradients
from dpltm.masks import Masks, PrunedWeights, apply_masks_, density
from dpltm.networks.lenet import LeNet, build_architecture
from dpltm.pruning import paper_prune_rates, prune_layerwise
from dpltm.training.plain import GraphedSgdStep


def make_ticket(rounds: int, device: torch.device) -> tuple[LeNet, Masks]:
    model = LeNet(build_architecture(784, 10, (300, 100), None), torch.Generator().manual_seed(0))
    masks = model.full_masks()
    for _ in range(rounds):
        masks = apply_masks_(model, prune_layerwise(model.weights(), masks, paper_prune_rates(model.mask_names())))
    model.to(device)
    return model, {n: m.to(device) for n, m in masks.items()}


def opacus_model(ticket: LeNet) -> nn.Module:
    """The same network as an nn.Sequential of nn.Linear (pruned weights are zero already).

    Opacus cannot restrict clipping or noise to the mask; its cost is what matters here.
    """
    layers: list[nn.Module] = []
    for index, (_, layer) in enumerate(ticket.layers_in_order()):
        copy = nn.Linear(layer.in_features, layer.out_features).to(layer.weight.device)
        with torch.no_grad():
            copy.weight.copy_(layer.weight)
            copy.bias.copy_(layer.bias)
        layers.append(copy)
        if ticket.is_activation_after(index):
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def timed(step: Callable[[], None], device: torch.device, repeats: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def interleaved(steps: dict[str, Callable[[], None]], device: torch.device, rounds: int,
                per_round: int) -> dict[str, float]:
    """Median seconds per step over `rounds` rounds that time each step function in turn, so
    drifts in machine speed (shared VMs drift by ±15 %) hit every contender alike."""
    for step in steps.values():
        timed(step, device, 1, warmup=5)
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            samples[name].append(timed(step, device, per_round, warmup=0))
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="pruning rounds of the ticket (7: C ≈ 0.08)")
    parser.add_argument("--batch-size", type=int, default=400)
    parser.add_argument("--records", type=int, default=54000, help="training-set size (MNIST: 54000 after validation)")
    parser.add_argument("--repeats", type=int, default=30, help="interleaved rounds of 10 steps each")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-opacus", action="store_true")
    parser.add_argument("--kernels-out", type=Path, default=None,
                        help="with --device cuda: write each graph step's kernels, by name, to this file")
    args = parser.parse_args()
    if args.kernels_out is not None and (args.kernels_out.is_dir() or not args.kernels_out.parent.is_dir()):
        parser.error(f"--kernels-out {args.kernels_out}: a file in an existing folder was expected")
    device = resolve_device(args.device)
    g = torch.Generator(device=device).manual_seed(0)
    features = torch.rand(args.records, 784, device=device, generator=g)
    labels = torch.randint(0, 10, (args.records,), device=device, generator=g)
    index = torch.randperm(args.records, device=device, generator=g)[: args.batch_size].sort().values
    x, y = features[index], labels[index]  # for Opacus

    plain_model, plain_masks = make_ticket(args.rounds, device)
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.1)
    keep_pruned = PrunedWeights(plain_model, plain_masks)

    def plain_step() -> None:  # what ticket generation runs: the update, then the pruned weights re-zeroed
        xb, yb = features.index_select(0, index), labels.index_select(0, index)
        plain_opt.zero_grad(set_to_none=True)
        F.cross_entropy(plain_model(xb), yb).backward()
        plain_opt.step()
        keep_pruned()

    dp_model, dp_masks = make_ticket(args.rounds, device)
    dp_opt = torch.optim.SGD(dp_model.parameters(), lr=0.1)
    layout = MaskLayout.of(dp_model, dp_masks)
    noise = GaussianNoise(1.0)
    start = time.perf_counter()
    table = first_layer_input_terms(features, layout)
    table_seconds = time.perf_counter() - start

    def dp_step() -> None:
        xb, yb = features.index_select(0, index), labels.index_select(0, index)
        terms = None if table is None else table.index_select(0, index)
        grads, _, _ = private_gradients(dp_model, xb, yb, clip=1.0, noise=noise, expected_batch_size=args.batch_size,
                                        generator=g, layout=layout, input_terms=terms)
        apply_gradients(dp_model, grads, dp_opt)

    def dp_step_without_table() -> None:
        xb, yb = features.index_select(0, index), labels.index_select(0, index)
        grads, _, _ = private_gradients(dp_model, xb, yb, clip=1.0, noise=noise, expected_batch_size=args.batch_size,
                                        generator=g, layout=layout)
        apply_gradients(dp_model, grads, dp_opt)

    user_model = opacus_model(make_ticket(args.rounds, device)[0])  # the API's path: a plain nn.Sequential
    user_masks = {f"{i}.weight": dp_masks[name] for i, (name, _) in zip(range(0, 5, 2), dp_model.layers_in_order())}
    user_opt = torch.optim.SGD(user_model.parameters(), lr=0.1)
    user_surviving = {n: (m.flatten().nonzero().squeeze(1) if n in user_masks else None)
                      for n, m in [(n, user_masks.get(n)) for n, _ in user_model.named_parameters()]}

    def engine_step() -> None:
        xb, yb = features.index_select(0, index), labels.index_select(0, index)
        batch = clipped_gradient_sum_of(user_model, xb, yb, 1.0, user_masks)
        grads = noisy_mean(batch.grad_sums, noise=noise, surviving=user_surviving, clip=1.0,
                           expected_batch_size=args.batch_size, generator=g)
        for name, parameter in user_model.named_parameters():
            parameter.grad = grads[name]
        user_opt.step()

    contenders = {"non-private masked step": plain_step, "dpltm DP step": dp_step,
                  "dpltm DP step, no norm table": dp_step_without_table,
                  "dpltm engine, user nn.Sequential": engine_step}
    if device.type == "cuda":
        contenders.update(graph_steps(args.rounds, LabeledTensors(features, labels), index, args.batch_size, device))
    results = interleaved(contenders, device, rounds=args.repeats, per_round=10)
    if not args.no_opacus:
        results.update(opacus_steps(plain_model, x, y, args.batch_size, device, args.repeats))
    base = results["non-private masked step"]
    print(f"device={device} batch={args.batch_size} ticket density C={density(dp_masks):.3f} "
          f"threads={torch.get_num_threads()}")
    print(f"{'step':<34}{'ms/step':>10}{'× non-private':>16}")
    for name, seconds in results.items():
        print(f"{name:<34}{1e3 * seconds:>10.3f}{seconds / base:>16.2f}")
    if device.type == "cuda":
        graph_base = results["non-private step, CUDA graph"]
        print(f"DP graph step / non-private graph step: {results['dpltm DP step, CUDA graphs'] / graph_base:.2f} "
              f"(target <= 1.2)")
        if "Opacus ghost clipping" in results:
            print(f"Opacus ghost / dpltm DP graph step: "
                  f"{results['Opacus ghost clipping'] / results['dpltm DP step, CUDA graphs']:.1f}x (target >= 4)")
        tables = []
        for name in ("non-private step, CUDA graph", "dpltm DP step, CUDA graphs"):  # what a replay launches
            try:
                events = device_events_per_step(contenders[name])
            except RuntimeError as error:  # no CUPTI in this image: the timings above stand without it
                print(f"{name}: the profiler could not run ({error})")
                continue
            profiled = per_step(events, PROFILED_STEPS)
            tables.append(f"== {name}\n{kernel_table(events, PROFILED_STEPS)}")
            print(f"{name}: " + ("no device activity recorded (the profiler does not trace graph replays here)"
                                 if profiled is None else f"{profiled[0]:.1f} kernels and copies a step, "
                                                          f"{profiled[1]:.1f} µs of device time"))
        if args.kernels_out is not None and tables:
            args.kernels_out.write_text("\n".join(tables))
    print(f"one-time norm table ({args.records} records): {1e3 * table_seconds:.1f} ms "
          f"= {table_seconds / base:.0f} non-private steps "
          f"(a 50-epoch run at this batch: {50 * args.records // args.batch_size} steps)")
    print("target (issue 10): dpltm DP step <= 1.25x non-private on 2 CPU threads")


PROFILED_STEPS = 20


def device_events_per_step(step: Callable[[], None], steps: int = PROFILED_STEPS) -> list[Any]:
    """The profiler's events over `steps` steps (CUPTI traces the kernels inside a CUDA-graph replay)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as recorded:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return list(recorded.events())


def per_step(events: Iterable[Any], steps: int) -> tuple[float, float] | None:
    """(device events a step, their µs a step) of profiler events, the host's left out; None for no device event."""
    durations = [event.time_range.elapsed_us() for event in events
                 if event.device_type == torch.autograd.DeviceType.CUDA]
    return None if not durations else (len(durations) / steps, sum(durations) / steps)


def kernel_table(events: Iterable[Any], steps: int) -> str:
    """One line per device kernel name: launches a step and µs a step, the longest first (where a step's time goes)."""
    by_name: dict[str, list[float]] = {}
    for event in events:
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_name.setdefault(event.name, []).append(event.time_range.elapsed_us())
    rows = sorted(by_name.items(), key=lambda item: -sum(item[1]))
    return "\n".join(f"{len(times) / steps:6.1f} {sum(times) / steps:9.2f} us  {name[:160]}" for name, times in rows)


def graph_steps(rounds: int, data: LabeledTensors, index: torch.Tensor, batch_size: int,
                device: torch.device) -> dict[str, Callable[[], None]]:
    """Both steps replayed from CUDA graphs, on the same ticket, data and batch."""
    plain_model, plain_masks = make_ticket(rounds, device)
    plain = GraphedSgdStep(plain_model, data, batch_size, torch.optim.SGD(plain_model.parameters(), lr=0.1),
                           PrunedWeights(plain_model, plain_masks))
    dp_model, dp_masks = make_ticket(rounds, device)
    n = len(data)
    dp = StaticShapeDpStep(dp_model, dp_masks, data, clip=1.0, noise=GaussianNoise(1.0), expected_batch_size=batch_size,
                           capacity=batch_capacity(n, batch_size / n),
                           generator=torch.Generator(device=device).manual_seed(1),
                           optimizer=torch.optim.SGD(dp_model.parameters(), lr=0.1), graphs=True)

    def plain_step() -> None:
        plain.step(index)

    def dp_step() -> None:
        dp.step(index)

    return {"non-private step, CUDA graph": plain_step, "dpltm DP step, CUDA graphs": dp_step}


def opacus_steps(ticket: LeNet, x: torch.Tensor, y: torch.Tensor, batch_size: int,
                 device: torch.device, repeats: int) -> dict[str, float]:
    from opacus import PrivacyEngine

    out: dict[str, float] = {}
    data = torch.utils.data.TensorDataset(x.cpu(), y.cpu())
    for mode, label in (("hooks", "Opacus (per-sample, hooks)"), ("ghost", "Opacus ghost clipping")):
        model = opacus_model(ticket)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = torch.utils.data.DataLoader(data, batch_size=batch_size)
        criterion = nn.CrossEntropyLoss()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = PrivacyEngine(accountant="rdp")
            made = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                       noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False,
                                       grad_sample_mode=mode, **({"criterion": criterion} if mode == "ghost" else {}))
        if mode == "ghost":
            private_model, private_opt, dp_criterion, _ = made

            def step(m=private_model, o=private_opt, c=dp_criterion) -> None:  # type: ignore[no-untyped-def]
                o.zero_grad(set_to_none=True)
                c(m(x), y).backward()
                o.step()
        else:
            private_model, private_opt, _ = made

            def step(m=private_model, o=private_opt) -> None:  # type: ignore[no-untyped-def]
                o.zero_grad(set_to_none=True)
                F.cross_entropy(m(x), y).backward()
                o.step()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out[label] = timed(step, device, 5 if mode == "hooks" else 10 * repeats)
    return out


if __name__ == "__main__":
    main()
