"""A truer proxy for public-weight starts, tried before it is built: tickets made on some of the public classes,
simulated under the planned DP noise on the others, relabelled onto the first ones' output units (issue 21).

The noise-aware choice simulates each candidate on the public data its weights were trained on, so a public start
begins at its own task's solution and the proxy mostly measures how much of it survives the noise; sparse tickets
erode less and win by 3–10 points, while privately (another task, MNIST or Fashion-MNIST, to be learnt from that
start) they do not (docs/results.md). Here IMP runs on the public records of classes A only (same settings as the
grid's tickets), and every candidate (round × its public-trained weights, θ0's output layer) is trained under the
planned noise (epoch-matched, as the choice does) on the records of the other classes B, which its weights have
never seen, relabelled onto A's output units: the situation of the private run (KMNIST's output units reused for
MNIST's digits). Public data only; nothing private is read.

    python benchmarks/held_out_class_proxy.py --classes 0 1 2 3 4 --eps 1 0.2 --seeds 0 1 2 \\
        --known mnist:1=0.9351,0.9354,0.9316,0.9340,0.9332 ...

`--known DATASET:EPS=a,b,…` are private test accuracies per candidate measured elsewhere (docs/results.md,
`ticket_choice.py --every-candidate`): the script prints Spearman's ρ between them and this proxy, and the regret
of its pick. They are reported against, never used to choose.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ticket_choice import recipe_settings, spearman  # noqa: E402

from dpltm.config import ModelSettings  # noqa: E402
from dpltm.data import load_dataset  # noqa: E402
from dpltm.data.types import DatasetSplits, LabeledTensors  # noqa: E402
from dpltm.selection.noise_aware import PlannedRun, among_rounds, noise_aware_choice  # noqa: E402
from dpltm.settings import DataSettings, GenerateConfig, GenerateSettings
from dpltm.tickets.imp import generate_tickets  # noqa: E402
from dpltm.training.plan import plan_training  # noqa: E402


def of_classes(part: LabeledTensors, classes: list[int], relabel_to: list[int] | None = None) -> LabeledTensors:
    """The records whose label is in `classes`; with `relabel_to`, class classes[i] is renamed relabel_to[i]."""
    chosen = torch.isin(part.labels, torch.tensor(classes, device=part.labels.device))
    labels = part.labels[chosen]
    if relabel_to is not None:
        table = torch.arange(int(part.labels.max()) + 1, device=labels.device)
        table[torch.tensor(classes, device=labels.device)] = torch.tensor(relabel_to, device=labels.device)
        labels = table[labels]
    return LabeledTensors(part.features[chosen], labels)


def class_split(data: DatasetSplits, classes: set[int]) -> tuple[DatasetSplits, DatasetSplits]:
    """(classes A, the other classes B), each a DatasetSplits of its own fingerprint. B's classes take A's label
    ids in order (the smallest B class becomes the smallest A class, …), so the proxy reuses the output units IMP
    trained, as KMNIST's output units are reused for MNIST's digits; an output unit IMP never trained would be
    pruned as noise and make every sparse ticket fail for a reason the private run does not have."""
    seen = sorted(classes)
    unseen = [c for c in range(data.num_classes) if c not in classes]
    if len(unseen) > len(seen):
        raise ValueError(f"classes B ({len(unseen)}) need as many label ids among classes A ({len(seen)})")
    halves = []
    for chosen, relabel, name in ((seen, None, ",".join(map(str, seen))),
                                  (unseen, seen[:len(unseen)], "not " + ",".join(map(str, seen)))):
        halves.append(dataclasses.replace(
            data, train=of_classes(data.train, chosen, relabel), val=of_classes(data.val, chosen, relabel),
            test=of_classes(data.test, chosen, relabel), fingerprint=f"{data.fingerprint}:classes {name}"))
    return halves[0], halves[1]


def parse_known(items: list[str]) -> dict[tuple[str, float], list[float]]:
    known = {}
    for item in items:
        head, values = item.split("=")
        dataset, eps = head.split(":")
        known[(dataset, float(eps))] = [float(v) for v in values.split(",")]
    return known


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--public", default="kmnist")
    parser.add_argument("--public-split", default="test")
    parser.add_argument("--classes", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="classes A the tickets see")
    parser.add_argument("--eps", type=float, nargs="+", default=[1.0, 0.2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="proxy seeds (the planned noise's draw)")
    parser.add_argument("--private-size", type=int, default=54000, help="N of the planned private run")
    parser.add_argument("--recipe", default="tuned")
    parser.add_argument("--final-iterate", action="store_true", help="release the last iterate (the recipe's EMA off)")
    parser.add_argument("--rounds", type=int, nargs="+", default=[0, 2, 4, 6, 8])
    parser.add_argument("--tickets", type=Path, default=Path("runs/held-out-class-proxy/tickets-A.pt"))
    parser.add_argument("--known", nargs="*", default=[], help="DATASET:EPS=a,b,… private accuracies per candidate")
    parser.add_argument("--data-dir", type=Path, default=None)
    args = parser.parse_args()

    data = load_dataset(args.public, split=args.public_split, data_dir=args.data_dir, seed=0)
    seen, unseen = class_split(data, set(args.classes))
    print(f"{args.public} ({args.public_split}): classes {sorted(args.classes)} for IMP ({len(seen.train)} train / "
          f"{len(seen.val)} val), the others for the proxy ({len(unseen.train)} train / {len(unseen.val)} val)",
          flush=True)
    cfg = GenerateConfig(data=DataSettings(dataset=args.public, split=args.public_split),
                         model=ModelSettings(activation="tanh"),
                         generate=GenerateSettings(rounds=max(args.rounds), iterations=5000, batch_size=400, lr=0.1),
                         seed=0)
    args.tickets.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    tickets = among_rounds(generate_tickets(cfg, seen, args.tickets, progress=False), args.rounds)
    print(f"tickets on classes A: {time.perf_counter() - started:.0f} s; densities "
          f"{[round(t.density, 3) for t in tickets.tickets]}; public val accuracy on A "
          f"{[round(t.val_accuracy, 3) for t in tickets.tickets]}", flush=True)
    known = parse_known(args.known)
    # The choice refuses data other than the tickets' own (its guard against a private proxy); classes B are the
    # same public split's other records, public too, and the point here is that the tickets never saw them.
    tickets = dataclasses.replace(tickets, data={**tickets.data, "fingerprint": unseen.fingerprint})
    for eps in args.eps:
        settings, model = recipe_settings(args.recipe, eps, None)
        settings = dataclasses.replace(settings, rewind="public", output_layer="reinit")
        if args.final_iterate:
            settings = dataclasses.replace(settings, ema=None, ema_warmup=False)
        plan = plan_training(settings, args.private_size)
        planned = PlannedRun.of(settings, plan, model.activation, args.private_size)
        scores: list[list[float]] = []
        picks = []
        for seed in args.seeds:
            started = time.perf_counter()
            choice = noise_aware_choice(tickets, unseen, planned, seed=seed)
            scores.append([c.public_val_accuracy for c in choice.candidates])
            picks.append(choice.index)
            rows = ", ".join(f"C={c.density:.3f}:{c.public_val_accuracy:.3f} "
                             f"({c.gain_over_dense:+.3f}±{2 * c.gain_standard_error:.3f})" for c in choice.candidates)
            print(f"# ε={eps:g} seed {seed}: {rows}; pick C={choice.candidates[choice.index].density:.3f} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
        mean = [statistics.mean(column) for column in zip(*scores)]
        print(f"ε={eps:g}: held-out-class proxy, mean over {len(args.seeds)} seed(s): "
              + " / ".join(f"{m:.3f}" for m in mean)
              + f"; picks {[round(tickets.tickets[i].density, 3) for i in picks]}", flush=True)
        for (dataset, at), private in sorted(known.items()):
            if at != eps or len(private) != len(mean):
                continue
            hindsight = max(private)
            regrets = [hindsight - private[i] for i in picks]
            print(f"  against {dataset} private (ε={eps:g}): Spearman ρ = {spearman(mean, private):+.2f}; regret of "
                  f"the picks {' '.join(f'{r:+.4f}' for r in regrets)}", flush=True)


if __name__ == "__main__":
    main()
