"""Private tickets: a lottery ticket made on the private data itself, with privacy.

For a user who has no public data to take tickets from. The paper's same-data mode prunes by
the magnitudes of non-privately trained weights, so the mask leaks (docs/privacy.md §1). Here every
look at the private data is DP-SGD (the same Poisson sampling, masked clipping and noise plug-in
as training):

1. warm-up: DP-SGD of the dense network for `warmup_epochs` epochs;
2. mask: the smallest-magnitude DP weights are pruned layer by layer (post-processing of a DP
   output; the paper's per-layer ratios, 30 % per round for hidden layers, 20 % for the output);
3. optionally more rounds (DP-IMP): train the masked network again, prune again, until the
   target density is reached after `rounds` rounds;
4. the ticket starts training from the masked warm-up weights (`rewind: warmup`) or from θ0.

Every round is a `SelfComposed(PoissonSampled(q, Gaussian(σ)), T_a)` event on the private data,
recorded in the ticket and composed with training in one accountant computation, and one σ for
every phase is calibrated before any record is read so that the whole run meets the user's ε
(`calibration.calibrate_phases`). TP-TopK (2026) is the nearest prior work (DP warm-up, then a
top-k mask); this is its plain-magnitude form, with the paper's layer-wise pruning.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from dp_accounting import ComposedDpEvent  # type: ignore[import-untyped]

from dpltm import __version__
from dpltm.artefacts import Winner
from dpltm.artefacts.winner import PRIVATE_METHOD
from dpltm.checkpoint import save_atomic
from dpltm.config import to_dict
from dpltm.data.types import DatasetSplits
from dpltm.dp.mechanism import NoiseContext
from dpltm.dp.noise import check_noise_for_network, noise_plugin
from dpltm.errors import DpltmUserError
from dpltm.feature_cache import network_inputs
from dpltm.masks import Masks, apply_masks_, density, full_masks, layer_densities, prunable_weights
from dpltm.networks.lenet import Architecture, build_architecture, build_network
from dpltm.options import Overrides
from dpltm.privacy.accounting import epsilon
from dpltm.privacy.calibration import calibrate_phases
from dpltm.privacy.events import DpEvent, dpsgd_event, event_to_json
from dpltm.privacy.ledger import training_record
from dpltm.pruning.magnitude import paper_prune_rates, prune_input_features, prune_layerwise
from dpltm.settings import PrivateTicketSettings, TrainConfig
from dpltm.training.plan import EpochRecord, TrainPlan, learning_rate
from dpltm.training.private import mechanism_seed, run_private

SELECTION_METHOD = PRIVATE_METHOD
"""`selection.method` of a private ticket: no choice among tickets was made, and none was needed."""


def layer_keep_fractions(arch: Architecture, target_density: float) -> dict[str, float]:
    """Per-layer fraction of weights to keep so the whole network keeps `target_density`.

    The paper's layer ratios continued to a real number of rounds r: hidden layers keep 0.7^r,
    the output layer 0.8^r (IMP's 30 % / 20 % per round), with r solved by bisection so that
    Σ n_l·keep_l / Σ n_l = target. Pure: depends on the architecture only.
    """
    if not 0.0 < target_density < 1.0:
        raise DpltmUserError(f"--density must lie in (0, 1), got {target_density:g}")
    shapes = {f"{name}.weight": shape for name, shape in arch.layer_shapes().items()}
    rates = paper_prune_rates(list(shapes))
    sizes = {name: math.prod(shape) for name, shape in shapes.items()}  # a convolution's (out, in, k, k) too
    total = sum(sizes.values())

    def kept(r: float) -> float:
        return sum(sizes[n] * (1.0 - rates[n]) ** r for n in sizes) / total

    lo, hi = 0.0, 1.0
    while kept(hi) > target_density:
        hi *= 2.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if kept(mid) > target_density else (lo, mid)
    keep = {n: (1.0 - rates[n]) ** hi for n in sizes}
    for name, fraction in keep.items():
        if fraction * sizes[name] < 1.0:  # C = 0 in that layer: the network would compute a constant
            raise DpltmUserError(f"--density {target_density:g} is too small for this network: layer {name} "
                                 f"({sizes[name]} weights) would keep no weight")
    return keep


def check_private_prune(arch: Architecture, settings: PrivateTicketSettings) -> None:
    """The mask a private ticket's settings ask for can be made on this network (checked before any record is
    read): per-layer keep fractions that leave every layer a weight, or for `prune: inputs` a linear first layer."""
    if settings.prune == "weights":
        layer_keep_fractions(arch, settings.density)
        return
    name, shape = next(iter(arch.layer_shapes().items()))
    if len(shape) != 2:
        raise DpltmUserError(f"--prune inputs keeps whole input features of a linear first layer; this network's "
                             f"first layer ({name}) is a convolution: use --prune weights")


def private_masks(weights: dict[str, torch.Tensor], masks: Masks, settings: PrivateTicketSettings,
                  rates: dict[str, float]) -> Masks:
    """One warm-up round's new masks from the DP weights: the smallest weights of each layer at `rates`, or (`prune:
    inputs`) the first layer's weakest input features, so that `rounds` rounds keep `density` of them."""
    if settings.prune == "weights":
        return prune_layerwise(weights, masks, rates)
    first = next(iter(weights))
    keep = settings.density ** (1.0 / settings.rounds)
    return {**masks, first: prune_input_features(weights[first], masks[first], keep)}


def round_prune_rates(arch: Architecture, target_density: float, rounds: int) -> dict[str, float]:
    """Per-round prune rates that reach `layer_keep_fractions` after `rounds` equal rounds."""
    return {n: 1.0 - keep ** (1.0 / rounds) for n, keep in layer_keep_fractions(arch, target_density).items()}


@dataclass(frozen=True)
class PrivateTicketPlan:
    """The whole private-ticket run, fixed before any private record is read."""

    sample_rate: float
    expected_batch_size: int
    dataset_size: int
    steps_per_epoch: int
    warmup_steps: int
    """Steps of each warm-up round."""
    rounds: int
    training_steps: int
    """Steps of the ticket's planned DP training (the `train:` recipe's epochs)."""
    noise_multiplier: float
    """One effective σ for every phase."""
    noise_parameter: float
    epsilon: float
    delta: float

    def warmup_events(self, completed_rounds: int | None = None) -> list[DpEvent]:
        n = self.rounds if completed_rounds is None else completed_rounds
        return [dpsgd_event(self.sample_rate, self.noise_multiplier, self.warmup_steps) for _ in range(n)]


def plan_private_ticket(cfg: TrainConfig, dataset_size: int) -> PrivateTicketPlan:
    """q = L/N, and the σ shared by the warm-up rounds and the planned training that makes the
    composition of all of them meet `train.eps2` (here: the whole run's ε) at δ."""
    s, p = cfg.train, cfg.private_ticket
    if s.sigma is not None:
        raise DpltmUserError("--private calibrates σ for the whole run: give --eps, not --sigma")
    if s.eps2 is None:
        raise DpltmUserError("--private needs --eps (the whole run's budget)")
    if noise_plugin(s.noise).needs_public_data:
        raise DpltmUserError(f"--private does not support --noise {s.noise} (it needs public data)")
    if s.patience is not None or s.max_eps is not None:
        # an early stop would choose the warm-up's end from private validation data without privacy
        raise DpltmUserError("--private plans every phase before it starts: drop train.patience / train.max_eps")
    if s.batch_size >= dataset_size:
        raise DpltmUserError(f"--batch-size {s.batch_size} must be smaller than the training set "
                             f"({dataset_size} records)")
    q = s.batch_size / dataset_size
    per_epoch = math.ceil(dataset_size / s.batch_size)
    warmup_steps, training_steps = per_epoch * p.warmup_epochs, per_epoch * s.epochs
    phases = [(q, warmup_steps)] * p.rounds + [(q, training_steps)]
    sigma = calibrate_phases(phases, s.eps2, s.delta, s.accountant, s.neighboring)
    return PrivateTicketPlan(q, s.batch_size, dataset_size, per_epoch, warmup_steps, p.rounds, training_steps,
                             sigma, noise_plugin(s.noise).parameter_for(sigma), s.eps2, s.delta)


def make_private_ticket(cfg: TrainConfig, data: DatasetSplits, out: Path, *, progress: bool = True,
                        noise_seed: int | None = None,
                        on_round: Callable[[EpochRecord], None] | None = None) -> Winner:
    """Run the DP warm-up round(s) on `data.train`, prune by magnitude, and write the ticket file
    (kind "ticket": it goes to `dpltm train --ticket` directly, no selection)."""
    p = cfg.private_ticket
    plan = plan_private_ticket(cfg, len(data.train))
    s = replace(cfg.train, lr=learning_rate(cfg.train, plan.noise_multiplier))  # lr_sigma: lr follows σ
    arch = ticket_architecture(cfg, data)
    model = build_network(arch, torch.Generator().manual_seed(cfg.seed)).to(data.train.labels.device)
    # a fixed front end's features (private: cached locally); with --augmult K each training record's K views, which
    # the warm-up's DP steps average before clipping as the final training does
    data = network_inputs(model, data, progress=progress, views=s.augmult)
    theta0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    check_private_prune(arch, p)
    rates = round_prune_rates(arch, p.density, p.rounds) if p.prune == "weights" else {}
    seed, randomness = mechanism_seed(noise_seed)
    rounds: list[EpochRecord] = []
    masks: Masks = apply_masks_(model, full_masks(model))
    for r in range(p.rounds):
        spent = plan.warmup_events(r)

        def epsilon_after(steps: int, spent: list[DpEvent] = spent) -> float:
            return epsilon(ComposedDpEvent([*spent, dpsgd_event(plan.sample_rate, plan.noise_multiplier, steps)]),
                           plan.delta, s.accountant, s.neighboring)

        round_plan = TrainPlan(plan.dataset_size, plan.expected_batch_size, plan.sample_rate, plan.steps_per_epoch,
                               p.warmup_epochs, plan.noise_multiplier, plan.noise_parameter, True, s.lr)
        context = NoiseContext(model=model, masks=masks, clip=s.clip, private_dataset=data.name)
        outcome = run_private(model, data, round_plan, s, seed=phase_seed(seed, f"warm-up {r}"),
                              epsilon_after=epsilon_after,
                              progress=progress, noise_context=context,
                              progress_label=f"DP warm-up round {r + 1}/{p.rounds}")
        released = outcome.released if outcome.released is not None else model
        weights = {n: w.detach() for n, w in prunable_weights(released).items()}
        masks = private_masks(weights, masks, p, rates)
        record = {"round": r + 1, "steps": plan.warmup_steps, "density": density(masks),
                  "val_accuracy": outcome.history[-1]["val_accuracy"],
                  "epsilon_so_far": outcome.history[-1]["epsilon"]}
        rounds.append(record)
        if on_round is not None:
            on_round(record)
        with torch.no_grad():  # the next round (and the ticket) starts here
            if p.rewind == "init":
                model.load_state_dict(theta0)
            else:
                model.load_state_dict(released.state_dict())
            masks = apply_masks_(model, masks)
    start = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    warmup = [training_record(plan.sample_rate, plan.noise_multiplier, plan.warmup_steps, s.clip,
                              plan.expected_batch_size, plan.dataset_size) for _ in range(p.rounds)]
    cpu_masks = {k: v.cpu() for k, v in masks.items()}
    payload = {
        "dpltm_version": __version__,
        "architecture": arch.to_dict(),
        "theta0": start,
        "masks": cpu_masks,
        "density": density(cpu_masks),
        "layer_density": layer_densities(cpu_masks),
        "round": p.rounds,
        "val_accuracy": rounds[-1]["val_accuracy"],
        "source": {"tickets": None, "data": data.summary(), "config": to_dict(replace(cfg, train=s))},
        # ε spent and the statement are computed from `private_ticket.dp_event` (Winner.privacy_view)
        "privacy": {"phase1": "private"},
        "selection": {"method": SELECTION_METHOD, "eps1": None, "draws": 0, "eps1_total": None,
                      "noise_aware": None},
        "private_ticket": {
            "warmup": warmup,
            "rounds": rounds,
            "rewind": p.rewind,
            "target_density": p.density,
            "noise": s.noise,
            "noise_multiplier": plan.noise_multiplier,
            "planned_training_steps": plan.training_steps,
            "epsilon_total": plan.epsilon,
            "delta": plan.delta,
            "accountant": s.accountant,
            "neighboring": s.neighboring,
            "dp_event": event_to_json(ComposedDpEvent(plan.warmup_events())),
            "randomness": randomness,
        },
    }
    ticket = Winner.from_payload(payload)
    save_atomic(ticket.to_dict(), out, "ticket")
    return ticket


def ticket_architecture(cfg: TrainConfig, data: DatasetSplits) -> Architecture:
    """The private ticket's network: `model.arch` (the MLP, LeNet-5, or a network of the registry) for this data.
    A network other than the MLP trains with Gaussian-type noise (the dpd and shaped geometries shape the
    MLP's layers), checked before any record is used."""
    arch = build_architecture(data.num_features, data.num_classes, cfg.model.hidden, cfg.model.project_to,
                              cfg.model.activation, cfg.model.arch or "mlp")
    check_noise_for_network(cfg.train.noise, arch.is_mlp, f"a private ticket of --arch {cfg.model.arch}")
    return arch


def phase_seed(seed: int, phase: str) -> int:
    """A 63-bit seed for one phase, derived from the run's seed by SHA-256, so that phases given one
    user seed (the warm-up rounds here, training later with the same --noise-seed) never share
    Poisson batches or noise draws: the composition assumes independent randomness."""
    digest = hashlib.sha256(f"{seed}:{phase}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def private_ticket_plan(ticket: Winner) -> Overrides:
    """The training settings a private ticket was planned with: its data settings and seed (so the data it
    trains on matches the ticket's record: dpltm.data.release), its recipe and model, and the whole run's ε as
    the training target (`train.eps2` with a private ticket means the whole run's ε)."""
    record = ticket.private_ticket
    config = ticket.source.get("config")
    if record is None or not isinstance(config, dict):
        raise DpltmUserError("the private ticket lacks its plan (a damaged or foreign ticket file)")
    planned = Overrides.from_tree({"data": config.get("data", {}), "train": config.get("train", {})})
    dropped = {"data.dataset", "train.sigma", "train.max_eps", "train.patience"}
    plan = Overrides({k: v for k, v in planned.values.items() if k not in dropped}).updated(
        {"eps2": record.epsilon_total}, "train")
    if config.get("model", {}).get("activation") is not None:
        plan = plan.updated({"activation": config["model"]["activation"]}, "model")
    return plan if config.get("seed") is None else plan.updated({"seed": config["seed"]})
