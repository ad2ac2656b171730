"""Your own model and data under dpltm: a ticket mask made on public data, then masked DP-SGD at a target ε.

    python examples/own_model.py [--eps 1.0] [--epochs 5]

Prints one JSON line: {"epsilon": …, "test_accuracy": …, "density": …, …}. Runs in seconds on a
CPU: the data are small synthetic clusters standing in for your tensors (any (features, labels)
tensors or a torch Dataset work the same way).
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

import dpltm


def clusters(n: int, seed: int, d: int = 20, classes: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """n records of `classes` Gaussian clusters in d dimensions (fixed centres)."""
    g = torch.Generator().manual_seed(seed)
    centres = 0.45 * torch.randn(classes, d, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, classes, (n,), generator=g)
    return centres[labels] + torch.randn(n, d, generator=g), labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eps", type=float, default=1.0)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    public, private, test = clusters(2000, 1), clusters(4000, 2), clusters(1000, 3)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 4))
    # 1. tickets by iterative magnitude pruning on PUBLIC data (not private: it sees that data directly)
    tickets = dpltm.generate_tickets(model, public, val=clusters(500, 4), rounds=3, iterations=200, batch_size=64)
    ticket = dpltm.select_ticket(tickets, rule="best", nu=0.5)  # public tickets: the best score, no ε spent
    model.load_state_dict(ticket.rewind_weights)  # rewind (to θ0: no late rewinding); make_private applies the mask

    # 2. masked DP-SGD on the PRIVATE data, σ calibrated to the target ε
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    private = dpltm.make_private(model, optimizer, private, target_epsilon=args.eps, delta=1e-5, epochs=args.epochs,
                                 batch_size=200, max_grad_norm=1.0, masks=ticket.masks,
                                 masks_from="public clusters (seed 1)")
    private.fit()
    print(json.dumps({"epsilon": private.epsilon, "delta": 1e-5, "test_accuracy": private.evaluate(test),
                      "density": ticket.density, "ticket_round": ticket.round,
                      "noise_multiplier": private.plan.noise_multiplier, "steps": private.steps_done}))


if __name__ == "__main__":
    main()
