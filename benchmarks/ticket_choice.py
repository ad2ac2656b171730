"""Which public ticket to train privately: the paper's score (`--best`) vs the noise-aware choice, and
how well the noise-aware proxy ranks the tickets against what private training gives them.

    python benchmarks/ticket_choice.py --tickets checkpoints/kmnist-test-tickets.pt \\
        --dataset mnist --eps 1 0.2 --seeds 0 1
    python benchmarks/ticket_choice.py --tickets T --recipe scatter --every-candidate --dataset fashion-mnist
    python benchmarks/ticket_choice.py --tickets T --recipe tuned --rewind public --final-iterate \
        --rounds 0 2 4 6 8 --every-candidate --dataset fashion-mnist     # public-weight starts

For each ε: σ is calibrated for the private run (the paper's recipe, or `--recipe`'s), every public
ticket is trained under that planned noise on the tickets' own public data (noise-aware choice), and
then the noise-aware winner, the paper's `--best` winner and the dense network are trained with DP on
the private data, same recipe and seeds. With `--every-candidate` every ticket is trained privately
instead, and a ranking report follows: per ticket its public proxy accuracy and its private test
accuracy (mean over seeds), Spearman's ρ between the two, and the regret of each pick (the best
ticket's private accuracy, in hindsight, minus the pick's). Prints one table row per (ε, method or
ticket, seed) with the test accuracy, and the wall time of each part. Nothing here is tuned on the
private test split: the choice sees public data only; the test accuracies are reported, never used.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from dpltm.checkpoint import load_ticket_set
from dpltm.config import recipe_tree
from dpltm.data import load_dataset
from dpltm.devices import resolve_device
from dpltm.errors import DpltmUserError
from dpltm.privacy.display import format_sigma
from dpltm.selection.noise_aware import NoiseAwareChoice, PlannedRun, among_rounds, noise_aware_choice
from dpltm.selection.winner import choose, make_winner, noise_aware_selection
from dpltm.settings import OUTPUT_LAYERS, TICKET_STARTS, DataSettings, ModelSettings, TrainConfig, TrainSettings
from dpltm.tickets.data import reload_ticket_data
from dpltm.training.pipeline import train
from dpltm.training.plan import plan_training


def recipe_settings(recipe: str | None, eps: float, epochs: int | None) -> tuple[TrainSettings, ModelSettings]:
    """The recipe's train and model sections (None: the paper's defaults) at this ε."""
    tree = recipe_tree(recipe) if recipe else {}
    train_fields = {k: v for k, v in tree.get("train", {}).items() if k in {f.name for f in
                                                                             dataclasses.fields(TrainSettings)}}
    model_fields = {k: tuple(v) if isinstance(v, list) else v for k, v in tree.get("model", {}).items()}
    settings = TrainSettings(**{**train_fields, "eps2": eps, **({"epochs": epochs} if epochs else {})})
    return settings, ModelSettings(**model_fields)


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def ranking_report(eps: float, choice: NoiseAwareChoice, private: dict[int, list[float]], best_score: int) -> None:
    """How the proxy's order compares with the private outcome (reported, never used to choose)."""
    means = [statistics.mean(private[k]) for k in range(len(choice.candidates))]
    proxy = [c.public_val_accuracy for c in choice.candidates]
    hindsight = max(means)
    print(f"# ranking at ε={eps:g}: Spearman ρ(proxy, private) = {spearman(proxy, means):+.2f}; "
          f"regret (best private − pick): noise-aware {hindsight - means[choice.index]:+.4f}, "
          f"argmax of the proxy {hindsight - means[max(range(len(proxy)), key=proxy.__getitem__)]:+.4f}, "
          f"best-score {hindsight - means[best_score]:+.4f}, dense {hindsight - means[0]:+.4f}", flush=True)
    for k, c in enumerate(choice.candidates):
        print(f"#   round {c.round} C={c.density:.3f}: proxy {c.public_val_accuracy:.4f} "
              f"({c.gain_over_dense:+.4f} ± {2 * c.gain_standard_error:.4f} vs dense), private {means[k]:.4f}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tickets", type=Path, required=True)
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--eps", type=float, nargs="+", default=[1.0, 0.2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--epochs", type=int, default=None, help="default: the recipe's (the paper's: 50)")
    parser.add_argument("--recipe", default=None, help="a recipe of configs/recipes (tuned, scatter)")
    parser.add_argument("--every-candidate", action="store_true",
                        help="train every ticket privately and report the proxy's ranking against it")
    parser.add_argument("--score-on-train", action="store_true",
                        help="score the proxy on the public records it trained on, not the public validation ones")
    parser.add_argument("--proxy-only", action="store_true", help="print the proxy's accuracies; train nothing")
    parser.add_argument("--rewind", choices=TICKET_STARTS, default=None,
                        help="where each ticket starts (train --rewind); default: the recipe's")
    parser.add_argument("--output-layer", choices=OUTPUT_LAYERS, default=None,
                        help="with --rewind public: θ0's output layer or the public one; default: the recipe's")
    parser.add_argument("--final-iterate", action="store_true", help="release the last iterate (the recipe's EMA off)")
    parser.add_argument("--rounds", type=int, nargs="+", default=None,
                        help="only these IMP rounds as candidates (the dense round 0 always among them)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--data-dir", type=Path, default=None)
    args = parser.parse_args()
    try:  # a missing or foreign file, a bad device: one line, as the CLI says it
        device = resolve_device(args.device)
        tickets = load_ticket_set(args.tickets)
    except DpltmUserError as error:
        parser.error(str(error))
    if args.rounds is not None:  # as the grid's `noise_aware: {rounds: …}`
        tickets = among_rounds(tickets, args.rounds)
    public = reload_ticket_data(tickets, args.data_dir).to(device)
    if args.score_on_train:  # the generalisation gap of the small public set left out of the proxy's score
        public = dataclasses.replace(public, val=public.train)
    print(f"tickets {args.tickets}: densities {[round(t.density, 3) for t in tickets.tickets]}", flush=True)
    print("eps | method | seed | C | test acc | seconds", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        for eps in args.eps:
            private: dict[int, list[float]] = {}
            choice: NoiseAwareChoice | None = None
            for seed in args.seeds:
                data = load_dataset(args.dataset, data_dir=args.data_dir, seed=seed, device=device)
                settings, model = recipe_settings(args.recipe, eps, args.epochs)
                settings = dataclasses.replace(settings, **{k: v for k, v in (("rewind", args.rewind),
                                                                              ("output_layer", args.output_layer))
                                                            if v is not None})
                if args.final_iterate:
                    settings = dataclasses.replace(settings, ema=None, ema_warmup=False)
                plan = plan_training(settings, len(data.train))
                planned = PlannedRun.of(settings, plan, model.activation, len(data.train))
                started = time.perf_counter()
                if choice is None or not args.every_candidate:  # every candidate: one proxy ranking per ε
                    choice = noise_aware_choice(tickets, public, planned, seed=seed)
                choice_seconds = time.perf_counter() - started
                print(f"# ε={eps:g} σ={format_sigma(plan.noise_multiplier)}: public accuracy under the planned noise "
                      + ", ".join(f"C={c.density:.3f}:{c.public_val_accuracy:.3f}" for c in choice.candidates)
                      + f" (noise-aware pick: C={choice.candidates[choice.index].density:.3f}; {choice_seconds:.0f} s)",
                      flush=True)
                if args.proxy_only:
                    continue
                best_score = choose(tickets, eps1=None, nu=50.0, seed=None)
                winners: dict[str, Any]
                if args.every_candidate:
                    winners = {f"round {c.round}": make_winner(
                        tickets, args.tickets, noise_aware_selection(dataclasses.replace(choice, index=k)), eps1=None,
                        nu=50.0, seeded=True, noise_aware=dataclasses.replace(choice, index=k))
                        for k, c in enumerate(choice.candidates)}
                else:
                    winners = {
                        "noise-aware": make_winner(tickets, args.tickets, noise_aware_selection(choice), eps1=None,
                                                   nu=50.0, seeded=True, noise_aware=choice),
                        "best-score": make_winner(tickets, args.tickets, best_score, eps1=None, nu=50.0, seeded=True),
                        "dense": None,
                    }
                for k, (method, winner) in enumerate(winners.items()):
                    cfg = TrainConfig(data=DataSettings(dataset=args.dataset), train=settings, model=model, seed=seed)
                    started = time.perf_counter()
                    report = train(cfg, data, Path(folder) / f"{k}-{eps}-{seed}.pt", ticket=winner,
                                   ticket_path=args.tickets, private=True, progress=False,
                                   ticket_data=None if winner is None else public).to_json()
                    private.setdefault(k, []).append(float(report["test_accuracy"]))
                    print(f"{eps:g} | {method} | {seed} | {report['density']:.3f} | {report['test_accuracy']:.4f} | "
                          f"{time.perf_counter() - started:.0f}", flush=True)
            if args.every_candidate and choice is not None and private:
                ranking_report(eps, choice, private, best_score.index)


if __name__ == "__main__":
    main()
