"""Steps per second of the generate loop (Lightning) against a bare PyTorch loop.

Same masked model, same device-resident data, same batch size and batch order; the ratio is
Lightning / bare time per step (1.0 = no overhead). Target ≤ 1.2 eager. On CUDA two more rows:
a bare loop replaying the step from a CUDA graph, and `dpltm generate --cuda-graphs` (Lightning,
the same graph, a block of steps per Lightning step), both timed from before the graph's capture;
target ≤ 1.1 between them (issue 10).

    python benchmarks/bench_generate.py [--dataset mnist] [--steps 1000] [--device cpu|cuda] [--graphs-only]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dpltm.data import load_dataset
from dpltm.data.batches import ShuffledBatches
from dpltm.devices import resolve_device
from dpltm.masks import PrunedWeights, apply_masks_
from dpltm.networks.lenet import LeNet, build_architecture
from dpltm.pruning import paper_prune_rates, prune_layerwise
from dpltm.training.plain import GraphedSgdStep, train_classifier


def bare_loop(model: LeNet, keep_pruned: PrunedWeights, batches: ShuffledBatches, lr: float) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        keep_pruned()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--split", default="train")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=400)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--graphs-only", action="store_true",
                        help="on CUDA, time only the two CUDA-graph rows (a real round's 5000 steps eager take long)")
    args = parser.parse_args()
    device = resolve_device(args.device)
    data = load_dataset(args.dataset, split=args.split, device=device)
    arch = build_architecture(data.num_features, data.num_classes, (300, 100), None)
    model = LeNet(arch, torch.Generator().manual_seed(0)).to(device)
    # A ticket of the kind generate trains: one pruning round applied.
    masks = apply_masks_(model, prune_layerwise(model.weights(), model.full_masks(),
                                                paper_prune_rates(model.mask_names())))
    keep_pruned = PrunedWeights(model, masks)
    theta0 = {k: v.clone() for k, v in model.state_dict().items()}

    def time_bare() -> float:
        model.load_state_dict(theta0)
        batches = ShuffledBatches(data.train, args.batch_size, args.steps, seed=1)
        synchronize(device)
        start = time.perf_counter()
        bare_loop(model, keep_pruned, batches, 0.1)
        synchronize(device)
        return time.perf_counter() - start

    def time_lightning(cuda_graphs: bool = False) -> float:
        model.load_state_dict(theta0)
        synchronize(device)
        start = time.perf_counter()
        train_classifier(model, data.train, masks=masks, steps=args.steps, batch_size=args.batch_size,
                         lr=0.1, seed=1, cuda_graphs=cuda_graphs)
        synchronize(device)
        return time.perf_counter() - start

    def time_bare_graph() -> float:
        model.load_state_dict(theta0)
        batches = ShuffledBatches(data.train, args.batch_size, args.steps, seed=1)
        synchronize(device)
        start = time.perf_counter()  # the capture is timed, as it is in `dpltm generate --cuda-graphs`
        step = GraphedSgdStep(model, data.train, batches.batch_size, torch.optim.SGD(model.parameters(), lr=0.1),
                              keep_pruned)
        for index in batches.indices():
            step.step(index)
        synchronize(device)
        return time.perf_counter() - start

    rows: dict[str, Callable[[], float]] = {}
    if not (args.graphs_only and device.type == "cuda"):
        rows.update({"bare PyTorch": time_bare, "dpltm generate (L)": time_lightning})
    if device.type == "cuda":
        rows.update({"bare CUDA-graph loop": time_bare_graph, "dpltm generate graphs": lambda: time_lightning(True)})
    for timer in rows.values():
        timer()  # warm-up
    seconds = {name: min(timer() for _ in range(args.repeats)) for name, timer in rows.items()}
    print(f"device={device} dataset={args.dataset} batch={args.batch_size} steps={args.steps} "
          f"threads={torch.get_num_threads()}")
    print(f"{'loop':<24}{'steps/s':>10}{'ms/step':>10}")
    for name, value in seconds.items():
        print(f"{name:<24}{args.steps / value:>10.1f}{1e3 * value / args.steps:>10.3f}")
    if "bare PyTorch" in seconds:
        print(f"ratio eager (Lightning / bare time per step): "
              f"{seconds['dpltm generate (L)'] / seconds['bare PyTorch']:.3f}  (target <= 1.2)")
    if device.type == "cuda":
        print(f"ratio graphs (Lightning / bare graph loop): "
              f"{seconds['dpltm generate graphs'] / seconds['bare CUDA-graph loop']:.3f}  (target <= 1.1)")
        if "bare PyTorch" in seconds:
            speedup = seconds["bare PyTorch"] / seconds["dpltm generate graphs"]
            print(f"graphs vs eager bare loop: {speedup:.2f}x faster")


if __name__ == "__main__":
    main()
