"""Reproduction of the paper's grid: every (dataset, method, ε, seed) run, resumably.

Methods:
* `dpltm-same` — the paper's mode: tickets generated (non-privately) on the private training
  data, selected with the exponential mechanism (ε1 = selection_fraction·ε), trained with
  ε2 = ε − ε1. NOT end-to-end DP (docs/privacy.md §1); reported ε covers phases 2–3 only.
* `dpltm-public` — the sound mode (paper §4.5): tickets from a public dataset (projection
  layer when input sizes differ), best score picked without touching private data, all of ε to
  training. End-to-end (ε, δ)-DP.
* `dpltm-noise-aware` — the sound mode with the noise-aware choice (issue 9): every candidate
  public ticket (the dense network included; `noise_aware.rounds` picks which) is trained under
  the private run's planned noise on the public data, and the best on public validation data is
  trained privately. Spends no ε on the choice; end-to-end (ε, δ)-DP. The choice depends only on
  public data and the plan (σ, L, T, recipe), so it is made once and cached (`choices.json`).
* `dpltm-private` — private tickets (`generate --private`): DP warm-up of `private_ticket.warmup_epochs`
  epochs on the private data, magnitude mask, then `train.epochs − warmup_epochs` epochs of DP
  training of the ticket, one σ for both, composed by PLD to ε. End-to-end (ε, δ)-DP.
* `dpsgd` — dense DP-SGD with the same settings, from θ0 (a profile's `train.rewind` does not apply: it
  has no ticket). `nonprivate` — dense, no noise.
* `dpsgd-public` — dense DP-SGD from the public-trained weights (fine-tuning): the public ticket set's
  dense round 0 trained with `rewind: public` (its output layer as `train.output_layer` says), so the
  baseline gets the same public data as the tickets. End-to-end (ε, δ)-DP (public data adds nothing).
* `dpsgd-rewind` — dense DP-SGD from θ_K, the dense network's weights K steps into public training (a profile
  with `generate.rewind_step: K`, late rewinding): the baseline that starts where `rewind: K` tickets start.
* `random-ticket` (at `random_ticket_eps`) — a same-data ticket drawn uniformly (Table 2).
* `random-mask` (at `random_mask_eps`) — the noise-aware winner's mask replaced by a random one of the same
  per-layer density, drawn from the run seed alone (independent of any data), trained by the same recipe from
  the winner's start under the random mask (θ0, the dense public weights with `rewind: public`, or θ_K with
  `rewind: K`): is it the ticket or just the sparsity? End-to-end (ε, δ)-DP.

Each run appends one row to `results.csv` (a run already there is skipped, so an interrupted
reproduction resumes) and its per-epoch history to `curves.csv`.

Randomness of the mechanisms: every run draws its DP-SGD noise / Poisson-sampling seed and its
exponential-mechanism coins afresh from the OS CSPRNG (never stored; the row says "csprng").
Seeds derived from the run seed would make every ε at one seed reuse the same normal draws,
so the released models would not be independently private. The run seed still fixes the data
split, the random-ticket control and the model initialisation.
"""

from __future__ import annotations

import csv
import dataclasses
import fcntl
import hashlib
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpltm.checkpoint import load_checkpoint, load_ticket_set, load_trained_model, load_winner
from dpltm.config import config_hash, read_yaml
from dpltm.data import load_dataset
from dpltm.data.types import DatasetSplits
from dpltm.errors import DpltmUserError
from dpltm.outputs import write_text_atomic
from dpltm.privacy.display import format_sigma
from dpltm.selection.noise_aware import among_rounds
from dpltm.selection.winner import Selection, choose, make_winner
from dpltm.settings import DataSettings, GenerateConfig, GenerateSettings, ModelSettings, TrainConfig, TrainSettings
from dpltm.tickets.data import data_to_check
from dpltm.tickets.imp import generate_tickets
from dpltm.training.pipeline import train

RESULT_FIELDS = ["dataset", "method", "epsilon_target", "seed", "test_accuracy", "val_accuracy", "epsilon",
                 "end_to_end_dp", "composition", "accountant", "noise_multiplier", "density", "ticket_round",
                 "epochs_run", "seconds", "prep_seconds", "noise_seed", "selection_seed"]
METHODS = ("dpltm-same", "dpltm-public", "dpltm-noise-aware", "dpltm-private", "dpsgd", "dpsgd-public", "dpsgd-rewind",
           "nonprivate", "random-ticket", "random-mask")
"""Every method a grid can run (see the module docstring)."""
FRESH_SEED = "csprng"
"""Value of the `noise_seed`/`selection_seed` columns: a fresh OS-CSPRNG seed, not stored."""


@dataclass(frozen=True)
class Run:
    dataset: str
    split: str
    method: str
    epsilon: float
    seed: int

    @property
    def key(self) -> tuple[str, str, str, int]:
        return (self.dataset, self.method, f"{self.epsilon:g}", self.seed)


class Experiment:
    def __init__(self, spec: dict[str, Any], out_dir: Path, data_dir: Path | None, device: torch.device) -> None:
        self.spec = spec
        self.out_dir = out_dir
        self.data_dir = data_dir
        self.device = device
        self.ticket_dir = out_dir / "tickets"
        self.model_dir = out_dir / "models"
        self.ticket_dir.mkdir(parents=True, exist_ok=True)
        self.model_dir.mkdir(parents=True, exist_ok=True)
        self._data: dict[tuple[str, str, int], DatasetSplits] = {}

    @classmethod
    def from_file(cls, path: Path, out_dir: Path | None, data_dir: Path | None, device: torch.device) -> Experiment:
        spec = read_yaml(path)
        return cls(spec, out_dir or Path("runs") / spec["name"], data_dir, device)

    # ---- the grid ------------------------------------------------------------------------
    def available_datasets(self) -> list[dict[str, Any]]:
        out = []
        for entry in self.spec["datasets"]:
            try:
                self.data(entry["name"], entry["split"], 0)
            except DpltmUserError as exc:
                if entry.get("optional"):
                    print(f"skipping {entry['name']}: {exc}", flush=True)
                    continue
                raise
            out.append(entry)
        return out

    def runs(self) -> Iterator[Run]:
        """Seed by seed, so a cut-short reproduction still covers every dataset once."""
        entries = self.available_datasets()
        method_seeds = self.spec.get("method_seeds", {})  # e.g. {dpltm-same: [0]}: fewer seeds for a method
        method_datasets = self.spec.get("method_datasets", {})  # and fewer datasets
        for seed in self.spec["seeds"]:
            for entry in entries:
                for method in self.spec["methods"]:
                    if method in method_seeds and seed not in method_seeds[method]:
                        continue
                    if method in method_datasets and entry["name"] not in method_datasets[method]:
                        continue
                    epsilons = [math.inf] if method == "nonprivate" else self.spec["epsilons"]
                    for eps in epsilons:
                        yield Run(entry["name"], entry["split"], method, eps, seed)
                if "random_ticket_eps" in self.spec:
                    yield Run(entry["name"], entry["split"], "random-ticket", self.spec["random_ticket_eps"], seed)
                if "random_mask_eps" in self.spec:
                    yield Run(entry["name"], entry["split"], "random-mask", self.spec["random_mask_eps"], seed)

    # ---- pieces --------------------------------------------------------------------------
    def data(self, name: str, split: str, seed: int) -> DatasetSplits:
        key = (name, split, seed)
        if key not in self._data:
            self._data[key] = load_dataset(name, split=split, data_dir=self.data_dir, seed=seed, device=self.device)
        return self._data[key]

    def tickets(self, name: str, split: str, project_to: int | None) -> Path:
        """Ticket set (generated once, seed 0, resumable) for a dataset, optionally with a projection."""
        g = self.spec["generate"]
        suffix = f"-proj{project_to}" if project_to else ""
        path = self.ticket_dir / f"{name}-{split}{suffix}.pt"
        network = {k: v for k, v in self.spec.get("model", {}).items() if k in ("arch", "hidden")}  # e.g. lenet5
        if "activation" in g:  # IMP in the training's activation, so that public weights mean the same there
            network["activation"] = g["activation"]
        cfg = GenerateConfig(data=DataSettings(dataset=name, split=split),
                             model=ModelSettings(project_to=project_to, **network),
                             generate=GenerateSettings(rounds=g["rounds"], iterations=g["iterations"],
                                                       batch_size=g["batch_size"], lr=g["lr"],
                                                       rewind_step=int(g.get("rewind_step", 0))), seed=0)
        # Workers (--shard) may need the same ticket set at once: the first generates it, the others
        # wait on this lock and then find it complete.
        with open(self.ticket_dir / f".{path.name}.generating", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            stale = False
            if path.exists():
                body = load_checkpoint(path, "tickets")
                if body["config_hash"] == config_hash(cfg) and body["complete"]:
                    return path
                stale = body["config_hash"] != config_hash(cfg)  # other settings: regenerate
            print(f"generating tickets: {name} ({split}){suffix}", flush=True)
            generate_tickets(cfg, self.data(name, split, 0), path, progress=False, overwrite=stale)
        return path

    def winner(self, tickets: Path, run: Run, how: str, dense_only: bool = False) -> Path:
        ticket_set = load_ticket_set(tickets)
        if dense_only:  # the dense network IMP trained on the public data (round 0): fine-tuning's start
            ticket_set = among_rounds(ticket_set, ())
        nu = float(self.spec["nu"])
        eps1 = None
        if how == "exponential":
            eps1 = self.spec["selection_fraction"] * run.epsilon
            selection = choose(ticket_set, eps1=eps1, nu=nu, seed=None)  # fresh CSPRNG coins
        elif how == "best":
            selection = choose(ticket_set, eps1=None, nu=nu, seed=None)
        else:  # uniformly random ticket (Table 2's control)
            rng = np.random.default_rng(run.seed)
            k = len(ticket_set.tickets)
            base = choose(ticket_set, eps1=None, nu=nu, seed=None)
            selection = Selection(int(rng.integers(k)), base.scores, np.full(k, 1 / k), base.sensitivity, True,
                                  math.nan)
        winner = make_winner(ticket_set, tickets, selection, eps1=eps1, nu=nu, seeded=how != "exponential")
        if how == "random":
            winner = dataclasses.replace(winner, selection={**winner.selection, "method": "random"})
        path = self.model_dir / f"winner-{run.dataset}-{run.method}-{run.epsilon:g}-{run.seed}.pt"
        from dpltm.checkpoint import save_atomic

        save_atomic(winner.to_dict(), path, "ticket")
        return path

    def random_mask(self, winner_path: Path, run: Run, public_tickets: Path | None = None) -> Path:
        """The winner with its mask replaced by a random mask of the same per-layer density, drawn from the
        run seed only (no data). Its own public weights are dropped (they belong to the real mask): it starts
        at θ0, or, given `public_tickets` (a run with `rewind: public`), at the dense public network's
        weights (round 0's) under the random mask — the ticket's start without the ticket's mask; and where the
        set was made with late rewinding, its θ_K under the random mask (`rewind: K`'s start)."""
        from dpltm.checkpoint import save_atomic
        from dpltm.pruning import random_masks_like

        body = load_checkpoint(winner_path, "ticket")
        masks = random_masks_like(body["masks"], torch.Generator().manual_seed(1_000_003 + run.seed))
        body = {k: v for k, v in body.items() if k not in ("format", "kind", "format_version", "environment",
                                                           "public_weights", "rewind_point")}
        body["masks"] = masks
        if public_tickets is not None:
            from dpltm.masks import masked_weights

            ticket_set = load_ticket_set(public_tickets)
            dense = ticket_set.tickets[0]  # round 0
            body["public_weights"] = masked_weights(dense.trained or {}, masks)
            point = ticket_set.rewind_point
            if point is not None:
                body["rewind_point"] = {"step": point.step, "weights": masked_weights(point.weights, masks)}
        body["selection"] = {**body["selection"], "method": "random"}
        path = self.model_dir / f"random-mask-{run.dataset}-{run.epsilon:g}-{run.seed}.pt"
        save_atomic(body, path, "ticket")
        return path

    def model_settings(self, dataset: str | None = None) -> ModelSettings:
        """The recipe's network options (e.g. `model: {activation: tanh}`) for every method alike,
        with a dataset's own (`dataset_model`) where the profile gives one."""
        options = {**self.spec.get("model", {}), **self.spec.get("dataset_model", {}).get(dataset, {})}
        return ModelSettings(**options)

    def noise_aware_winner(self, tickets: Path, run: Run, settings: TrainSettings,
                           n_private: int) -> tuple[Path, TrainSettings]:
        """The noise-aware choice among the public tickets, made once per planned run and cached, and the
        training settings that run its winner (the plan's, or the variant it chose with `noise_aware.search`)."""
        from dpltm.selection.noise_aware import PlannedRun, Variant, check_search, noise_aware_choice
        from dpltm.selection.winner import noise_aware_selection
        from dpltm.training.plan import plan_training

        ticket_set = load_ticket_set(tickets)
        rounds = self.spec.get("noise_aware", {}).get("rounds")
        if rounds is not None:  # a subset of candidates (the dense round 0 always among them)
            ticket_set = among_rounds(ticket_set, rounds)
        # The per-record split makes N differ by a few dozen records between seeds (and MNIST vs
        # Fashion-MNIST), which moves σ by about 0.1 %: the grid plans the choice for N rounded to
        # two significant digits, so runs that differ only by that share one choice (the CLI plans
        # with the exact N).
        nominal = int(float(f"{n_private:.2g}"))
        plan = plan_training(settings, nominal)
        planned = PlannedRun.of(settings, plan, self.model_settings(run.dataset).activation, nominal)
        halving = int(self.spec.get("noise_aware", {}).get("halving", 0))
        search = check_search(self.spec.get("noise_aware", {}).get("search", ()))
        key = json.dumps({"tickets": tickets.name, "rounds": [t.round for t in ticket_set.tickets],
                          "plan": dataclasses.asdict(planned), **({"halving": halving} if halving else {}),
                          **({"search": list(search)} if search else {})},
                         sort_keys=True)
        cache = self.out_dir / "choices" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
        if not cache.exists():
            public = self.data(ticket_set.dataset, ticket_set.split, int(ticket_set.config.get("seed", 0)))
            print(f"noise-aware choice for σ={format_sigma(plan.noise_multiplier)}, T={plan.steps} on "
                  f"{tickets.name}", flush=True)
            started = time.perf_counter()
            choice = noise_aware_choice(ticket_set, public, planned, seed=None, halving=halving, search=search)
            cache.parent.mkdir(exist_ok=True)
            write_text_atomic(json.dumps({**choice.to_json(), "key": json.loads(key),
                                          "seconds": round(time.perf_counter() - started, 1)}, indent=1), cache)
        from dpltm.selection.noise_aware import Candidate, NoiseAwareChoice, PublicData

        stored = json.loads(cache.read_text())
        chosen = stored.get("chosen")
        variant = None if chosen is None else Variant(**{**chosen, "freeze": tuple(chosen["freeze"])})
        choice = NoiseAwareChoice(stored["index"], [Candidate(**c) for c in stored["candidates"]], planned,
                                  PublicData(**stored["public_data"]), tuple(stored.get("halving_rungs", ())),
                                  tuple(stored.get("searched", ())), variant)
        winner = make_winner(ticket_set, tickets, noise_aware_selection(choice), eps1=None,
                             nu=float(self.spec["nu"]), seeded=True, noise_aware=choice)
        path = self.model_dir / f"winner-{run.dataset}-{run.method}-{run.epsilon:g}-{run.seed}.pt"
        from dpltm.checkpoint import save_atomic

        save_atomic(winner.to_dict(), path, "ticket")
        if variant is not None:
            settings = dataclasses.replace(settings, rewind=variant.start, freeze=variant.freeze, ema=variant.ema,
                                           ema_warmup=variant.ema_warmup, output_layer=variant.output_layer)
        return path, settings

    def private_ticket(self, run: Run, data: DatasetSplits, settings: TrainSettings) -> tuple[Path, TrainSettings]:
        """A private ticket on the run's own data; the ticket's training gets the epochs the warm-up left."""
        from dpltm.settings import PrivateTicketSettings
        from dpltm.tickets.private import make_private_ticket

        p = PrivateTicketSettings(**self.spec.get("private_ticket", {}))
        if p.warmup_epochs * p.rounds >= settings.epochs:
            raise DpltmUserError(f"private_ticket warm-up ({p.rounds}×{p.warmup_epochs} epochs) leaves no epochs "
                                 f"of the recipe's {settings.epochs} for training")
        training = dataclasses.replace(settings, epochs=settings.epochs - p.warmup_epochs * p.rounds)
        cfg = TrainConfig(data=DataSettings(dataset=run.dataset, split=run.split), train=training,
                          model=self.model_settings(run.dataset), private_ticket=p, seed=run.seed)
        path = self.model_dir / f"private-ticket-{run.dataset}-{run.epsilon:g}-{run.seed}.pt"
        make_private_ticket(cfg, data, path, progress=False, noise_seed=None)
        return path, training

    def public_tickets(self, run: Run, data: DatasetSplits) -> Path:
        """The public ticket set for a run's dataset (projected when the input sizes differ)."""
        public = self.spec["public"].get(run.dataset, self.spec["public"]["default"])
        pub_data = self.data(public["name"], public["split"], 0)
        project = data.num_features if pub_data.num_features != data.num_features else None
        return self.tickets(public["name"], public["split"], project)

    def train_settings(self, n_train: int, dataset: str | None = None, **overrides: Any) -> TrainSettings:
        """The recipe for a run; `lr_by_eps` (public-data choices per ε) sets its learning rate."""
        t = dict(self.spec["train"])
        by_eps = {float(k): float(v) for k, v in self.spec.get("lr_by_eps", {}).items()}
        target = overrides.get("eps2")
        if target is not None and float(target) in by_eps:
            t["lr"] = by_eps[float(target)]
        if n_train < 5000:  # sets under 5000 records: a smaller expected batch (and its own lr, if given)
            t["batch_size"] = self.spec.get("small_dataset_batch", t["batch_size"])
            t.update(self.spec.get("small_dataset", {}))
        if dataset is not None:  # per-dataset recipe (e.g. a batch that suits a smaller set)
            t.update(self.spec.get("dataset_train", {}).get(dataset, {}))
        t.update(overrides)
        if t.get("ema_warmup") and t.get("ema") is None:  # as dpltm.config.resolve_train_config refuses it
            raise DpltmUserError(f"profile {self.spec['name']}: train.ema_warmup needs a decay, train.ema"
                                 + (f" (for {dataset})" if dataset else ""))
        return TrainSettings(**t)

    # ---- one run -------------------------------------------------------------------------
    def execute_preparation(self, run: Run) -> None:
        """Only the public-data part of a run (its noise-aware choice, cached)."""
        self.prepare_run(run, self.data(run.dataset, run.split, run.seed))

    def prepare_run(self, run: Run, data: DatasetSplits) -> tuple[Path | None, TrainSettings, bool]:
        """The run's ticket (generated, chosen or made privately) and training settings."""
        n = len(data.train)
        ticket_path: Path | None = None
        private = True
        frac = self.spec["selection_fraction"]
        if run.method == "nonprivate":
            settings = self.train_settings(n, run.dataset, eps2=None, sigma=None)
            private = False
        elif run.method == "dpsgd":
            settings = self.train_settings(n, run.dataset, eps2=run.epsilon, rewind="init", freeze=())
        elif run.method == "dpsgd-public":
            ticket_path = self.winner(self.public_tickets(run, data), run, "best", dense_only=True)
            settings = self.train_settings(n, run.dataset, eps2=run.epsilon, rewind="public")
        elif run.method == "dpsgd-rewind":
            step = int(self.spec["generate"].get("rewind_step", 0))
            if not step:
                raise DpltmUserError("dpsgd-rewind starts from θ_K: give the profile generate.rewind_step K ≥ 1")
            ticket_path = self.winner(self.public_tickets(run, data), run, "best", dense_only=True)
            settings = self.train_settings(n, run.dataset, eps2=run.epsilon, rewind=str(step))
        elif run.method in ("dpltm-same", "random-ticket"):
            tickets = self.tickets(run.dataset, run.split, None)
            ticket_path = self.winner(tickets, run, "exponential" if run.method == "dpltm-same" else "random")
            eps2 = run.epsilon * (1 - frac)
            settings = dataclasses.replace(self.train_settings(n, run.dataset, eps2=run.epsilon), eps2=eps2)
        elif run.method in ("dpltm-public", "dpltm-noise-aware", "random-mask"):
            tickets = self.public_tickets(run, data)
            settings = self.train_settings(n, run.dataset, eps2=run.epsilon)
            if run.method == "dpltm-public":
                ticket_path = self.winner(tickets, run, "best")
            else:
                ticket_path, settings = self.noise_aware_winner(tickets, run, settings, n)
            if run.method == "random-mask":
                ticket_path = self.random_mask(ticket_path, run, tickets if settings.rewind != "init" else None)
        elif run.method == "dpltm-private":
            recipe = self.train_settings(n, run.dataset, eps2=run.epsilon)
            ticket_path, settings = self.private_ticket(run, data, recipe)
        else:
            raise DpltmUserError(f"unknown method {run.method}")
        return ticket_path, settings, private

    def execute(self, run: Run) -> dict[str, Any]:
        data = self.data(run.dataset, run.split, run.seed)
        prepared = time.perf_counter()
        ticket_path, settings, private = self.prepare_run(run, data)
        assert_public = False
        cfg = TrainConfig(data=DataSettings(dataset=run.dataset, split=run.split), train=settings,
                          model=self.model_settings(run.dataset), seed=run.seed)
        out = self.model_dir / f"{run.dataset}-{run.method}-{run.epsilon:g}-{run.seed}.pt"
        ticket = load_winner(ticket_path) if ticket_path else None
        started = time.perf_counter()
        prep_seconds = started - prepared  # tickets, choice or DP warm-up (cached parts: only the first run)
        # noise_seed=None: a fresh OS-CSPRNG seed per run, never stored (module docstring)
        ticket_data, unchecked = data_to_check(ticket, run.dataset, assert_public, self.data_dir)
        report = train(cfg, data, out, ticket=ticket, ticket_path=ticket_path, private=private,
                       assert_public=assert_public, progress=False, noise_seed=None, ticket_data=ticket_data,
                       ticket_data_unchecked=unchecked).to_json()
        report["seconds"] = time.perf_counter() - started
        history = list(load_trained_model(out).history)
        ticket_round = ticket.round if ticket else None
        row = {
            "dataset": run.dataset, "method": run.method, "epsilon_target": f"{run.epsilon:g}", "seed": run.seed,
            "test_accuracy": report["test_accuracy"], "val_accuracy": report["val_accuracy"],
            "epsilon": report["epsilon_dp_part"], "end_to_end_dp": report["end_to_end_dp"],
            "composition": report["composition"], "accountant": report["accountant"],
            "noise_multiplier": report["noise_multiplier"], "density": report["density"],
            "ticket_round": ticket_round, "epochs_run": report["epochs_run"], "seconds": round(report["seconds"], 2),
            "prep_seconds": round(prep_seconds, 2),
            "noise_seed": FRESH_SEED if private else "",
            "selection_seed": FRESH_SEED if run.method == "dpltm-same" else "",
        }
        return {"row": row, "history": history}


def completed_keys(results: Path) -> set[tuple[str, str, str, int]]:
    if not results.exists():
        return set()
    with results.open() as handle:
        return {(r["dataset"], r["method"], r["epsilon_target"], int(r["seed"])) for r in csv.DictReader(handle)}


def append_row(path: Path, fields: list[str], row: dict[str, Any]) -> None:
    """Append `row`; a file written with other columns (an older version) is refused, not mangled."""
    new = not path.exists()
    if not new:
        with path.open(newline="") as handle:
            header = next(csv.reader(handle), [])
        if header != fields:
            raise DpltmUserError(f"{path} has columns {header}, expected {fields}: it was written by "
                                 "another version; move it away (or delete it) and run again")
    with path.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        if new:
            writer.writeheader()
        writer.writerow(row)
        handle.flush()


def run_grid(exp: Experiment, shard: tuple[int, int] = (0, 1)) -> None:
    results = exp.out_dir / f"results-{shard[0]}of{shard[1]}.csv"
    curves = exp.out_dir / f"curves-{shard[0]}of{shard[1]}.csv"
    done = set().union(*(completed_keys(p) for p in exp.out_dir.glob("results-*.csv")))
    runs = list(exp.runs())
    mine = [r for i, r in enumerate(runs) if i % shard[1] == shard[0]]
    for run in mine:
        if run.key in done:
            continue
        print(f"run {run.dataset} {run.method} ε={run.epsilon:g} seed={run.seed}", flush=True)
        outcome = exp.execute(run)
        for record in outcome["history"]:
            append_row(curves, ["dataset", "method", "epsilon_target", "seed", "epoch", "test_accuracy",
                                "val_accuracy", "epsilon"],
                       {"dataset": run.dataset, "method": run.method, "epsilon_target": f"{run.epsilon:g}",
                        "seed": run.seed, "epoch": record.epoch, "test_accuracy": record.test_accuracy,
                        "val_accuracy": record.val_accuracy, "epsilon": record.epsilon})
        append_row(results, RESULT_FIELDS, outcome["row"])  # last: a run counts as done only when whole
        print(json.dumps(outcome["row"]), flush=True)
