"""A sparse CNN ticket (LeNet-5) beside the MLP ticket (LeNet-300-100), through the Python API.

Both: tickets by iterative magnitude pruning on public data (KMNIST, test split), the tickets of
rounds `--train-rounds` (the same schedule: 30 % of each layer's survivors per round, 20 % for the
output; round 0 is the dense network: dense DP-SGD under the same recipe), then masked DP-SGD on
MNIST with one recipe (tanh, expected batch `--batch-size`, SGD with momentum 0.9,
lr = `--lr-sigma` / σ, clip 1, `--epochs` epochs) at each ε, with the same seeds. Prints one row
per (architecture, ticket, ε, seed) and the mean per cell.

    python benchmarks/cnn_ticket.py --eps 1 0.2 --seeds 0 1 --train-rounds 0 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

import dpltm
from dpltm.data import load_dataset


class LeNet5(nn.Sequential):
    """LeNet-5 for 28×28 inputs (LeCun et al. 1998, as in Opacus's MNIST example: no padding)."""

    def __init__(self) -> None:
        super().__init__(
            nn.Unflatten(1, (1, 28, 28)),
            nn.Conv2d(1, 6, 5), nn.Tanh(), nn.AvgPool2d(2),
            nn.Conv2d(6, 16, 5), nn.Tanh(), nn.AvgPool2d(2),
            nn.Flatten(), nn.Linear(16 * 4 * 4, 120), nn.Tanh(), nn.Linear(120, 84), nn.Tanh(), nn.Linear(84, 10))


def lenet_300_100() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 300), nn.Tanh(), nn.Linear(300, 100), nn.Tanh(), nn.Linear(100, 10))


ARCHITECTURES = {"lenet5 (CNN)": LeNet5, "lenet-300-100 (MLP)": lenet_300_100}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eps", type=float, nargs="+", default=[1.0, 0.2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--train-rounds", type=int, nargs="+", default=[0, 4],
                        help="the tickets trained (round k keeps ≈ 0.7^k; 0: the dense network)")
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=1600)
    parser.add_argument("--lr-sigma", type=float, default=6.0)
    args = parser.parse_args()
    public = load_dataset("kmnist", split="test", device="cpu")
    private = load_dataset("mnist", split="train", device="cpu")
    public_train = (public.train.features, public.train.labels)
    rows = []
    for arch, build in ARCHITECTURES.items():
        torch.manual_seed(0)
        model = build()
        start = time.perf_counter()
        tickets = dpltm.generate_tickets(model, public_train, val=(public.val.features, public.val.labels),
                                         rounds=args.rounds, iterations=args.iterations, batch_size=400, lr=0.1)
        ticket_seconds = time.perf_counter() - start
        for ticket, eps, seed in ((tickets[k], e, s) for k in args.train_rounds for e in args.eps for s in args.seeds):
            model.load_state_dict(ticket.rewind_weights)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            trainer = dpltm.make_private(model, optimizer, (private.train.features, private.train.labels),
                                         target_epsilon=eps, epochs=args.epochs, batch_size=args.batch_size,
                                         masks=ticket.masks if ticket.round else None,  # round 0: dense
                                         masks_from="KMNIST test split (public)" if ticket.round else None,
                                         noise_seed=seed, dataset_name="mnist")
            for group in optimizer.param_groups:  # the tuned recipe's rule: lr = lr_sigma / σ
                group["lr"] = args.lr_sigma / trainer.plan.noise_multiplier
            torch.manual_seed(seed)
            start = time.perf_counter()
            trainer.fit()
            row = {"arch": arch, "round": ticket.round, "eps": eps, "seed": seed,
                   "density": round(ticket.density, 4),
                   "epsilon": trainer.epsilon, "sigma": trainer.plan.noise_multiplier,
                   "test_accuracy": trainer.evaluate((private.test.features, private.test.labels)),
                   "train_seconds": round(time.perf_counter() - start, 1),
                   "ticket_seconds": round(ticket_seconds, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"{'architecture':<22}{'ε':>6}{'C':>8}{'test accuracy (mean over seeds)':>34}")
    for arch in ARCHITECTURES:
        for k in args.train_rounds:
            for eps in args.eps:
                cell = [r for r in rows if r["arch"] == arch and r["eps"] == eps and r["round"] == k]
                accuracy = statistics.mean(r["test_accuracy"] for r in cell)
                print(f"{arch:<22}{eps:>6g}{cell[0]['density']:>8.3f}{accuracy:>34.4f}")


if __name__ == "__main__":
    main()
