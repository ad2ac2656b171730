"""Which public ticket to train privately: the paper's score (`--best`) vs the noise-aware choice.

    python benchmarks/ticket_choice.py --tickets checkpoints/kmnist-test-tickets.pt \\
        --dataset mnist --eps 1 0.2 --seeds 0 1

For each ε: σ is calibrated for the private run (MNIST, the paper's recipe), every public ticket
is trained under that planned noise on the tickets' own public data (noise-aware choice), and
then the noise-aware winner, the paper's `--best` winner and the dense network are trained with
DP on the private data, same recipe and seeds. Prints one table row per (ε, method, seed) with
the test accuracy, and the wall time of each part. Nothing here is tuned on the private test split:
the choice sees public data only; the test accuracies are reported, never used.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from dpltm.allocator import keep_freed_blocks
from dpltm.checkpoint import load_checkpoint
from dpltm.config import DataSettings, TrainConfig, TrainSettings
from dpltm.data import load_dataset
from dpltm.devices import resolve_device
from dpltm.selection.noise_aware import PlannedRun, noise_aware_choice
from dpltm.selection.winner import choose, noise_aware_selection, winner_payload
from dpltm.training.pipeline import reload_ticket_data, train
from dpltm.training.private import plan_training


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tickets", type=Path, required=True)
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--eps", type=float, nargs="+", default=[1.0, 0.2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--data-dir", type=Path, default=None)
    args = parser.parse_args()
    keep_freed_blocks()  # as the dpltm CLI does (dpltm.allocator)
    device = resolve_device(args.device)
    payload = load_checkpoint(args.tickets, "tickets")
    public = reload_ticket_data(payload, args.data_dir).to(device)
    print(f"tickets {args.tickets}: densities {[round(t['density'], 3) for t in payload['tickets']]}", flush=True)
    print("eps | method | seed | C | test acc | seconds", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        for seed in args.seeds:
            data = load_dataset(args.dataset, data_dir=args.data_dir, seed=seed, device=device)
            for eps in args.eps:
                settings = TrainSettings(eps2=eps, epochs=args.epochs)
                plan = plan_training(settings, len(data.train))
                planned = PlannedRun(plan.noise_multiplier, plan.expected_batch_size, plan.steps, settings.clip,
                                     plan.lr, settings.optimizer, private_size=len(data.train))
                started = time.perf_counter()
                choice = noise_aware_choice(payload, public, planned, seed=seed)
                choice_seconds = time.perf_counter() - started
                print(f"# ε={eps:g} σ={plan.noise_multiplier:.3f}: public accuracy under the planned noise "
                      + ", ".join(f"C={c.density:.3f}:{c.public_val_accuracy:.3f}" for c in choice.candidates)
                      + f" ({choice_seconds:.0f} s)", flush=True)
                winners = {
                    "noise-aware": winner_payload(payload, args.tickets, noise_aware_selection(choice), eps1=None,
                                                  nu=50.0, seeded=True, noise_aware=choice),
                    "best-score": winner_payload(payload, args.tickets, choose(payload, eps1=None, nu=50.0, seed=None),
                                                 eps1=None, nu=50.0, seeded=True),
                    "dense": None,
                }
                for method, winner in winners.items():
                    cfg = TrainConfig(data=DataSettings(dataset=args.dataset), train=settings, seed=seed)
                    started = time.perf_counter()
                    report = train(cfg, data, Path(folder) / f"{method}-{eps}-{seed}.pt", ticket=winner,
                                   ticket_path=args.tickets, private=True, progress=False)
                    print(f"{eps:g} | {method} | {seed} | {report['density']:.3f} | {report['test_accuracy']:.4f} | "
                          f"{time.perf_counter() - started:.0f}", flush=True)


if __name__ == "__main__":
    main()
