"""Phase 1: lottery tickets by iterative magnitude pruning with rewinding.

Frankle & Carbin (2019); DPLTM paper Alg. 1 phase 1. Round k trains the network with mask
m_k from θ0 for I iterations, records its validation accuracy A_k, density C_k and the trained
weights, prunes the smallest surviving weights of each layer to get m_{k+1}, and rewinds to θ0.
Round 0 is the dense network. With late rewinding (`generate --rewind-step K`, Frankle et al. 2020,
"Linear mode connectivity and the lottery ticket hypothesis", §5) the rounds after the first rewind
instead to θ_K, the dense network's weights after K steps of round 0, and train the remaining I − K
steps; the ticket set keeps θ_K (`rewind_point`), where `dpltm train --rewind K` starts. The trained
weights (zero where m_k prunes) are what `dpltm train --rewind public` starts from: on public data they
are public, and they carry the round's training instead of throwing it away.

This phase sees its data without any privacy. The ticket file says so: tickets generated on
the data later trained with DP make that training not end-to-end DP (docs/privacy.md §1).
Accuracy is measured on the validation hold-out only: a test accuracy on the ticket data
(possibly the private pool) would be one more non-private release in every ticket and winner
file, and no stage needs it.

The ticket file is rewritten atomically after every round, so an interrupted run resumes at
the first unfinished round and, with the same seed, produces the same tickets.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dpltm import __version__
from dpltm.artefacts import TicketSet
from dpltm.checkpoint import load_ticket_set, save_atomic
from dpltm.config import config_hash, to_dict
from dpltm.data.types import DatasetSplits
from dpltm.errors import DpltmUserError
from dpltm.feature_cache import network_inputs
from dpltm.masks import (
    Masks,
    apply_masks_,
    density,
    layer_densities,
    prunable_weights,
    rewind,
    ticket_masks,
    trained_weights,
)
from dpltm.networks.lenet import Architecture, build_architecture, build_network
from dpltm.pruning import paper_prune_rates, prune_layerwise, random_masks_like
from dpltm.settings import GenerateConfig


def round_seed(seed: int, round_index: int, stream: int = 0) -> int:
    """Independent, reproducible seed per (run seed, round, purpose)."""
    return (seed * 1_000_003 + round_index * 7919 + stream * 104_729) % (2**63 - 1)


def resolve_prune_rates(arch: Architecture, rates: tuple[float, ...] | None) -> dict[str, float]:
    names = [f"{n}.weight" for n in arch.layer_names()]
    if rates is None:
        return paper_prune_rates(names)
    if len(rates) == 1:
        return dict.fromkeys(names, rates[0])
    if len(rates) != len(names):
        raise DpltmUserError(
            f"--prune-rates needs one rate or one per layer ({len(names)}: "
            f"{', '.join(arch.layer_names())}), got {len(rates)}"
        )
    return dict(zip(names, rates))


@dataclass
class GenerationState:
    """What the ticket file holds while generation runs (and after)."""

    payload: dict[str, Any]

    @property
    def tickets(self) -> list[dict[str, Any]]:
        return self.payload["tickets"]  # type: ignore[no-any-return]


def _new_payload(cfg: GenerateConfig, data: DatasetSplits, arch: Architecture,
                 theta0: dict[str, torch.Tensor], rates: dict[str, float]) -> dict[str, Any]:
    return {
        "dpltm_version": __version__,
        "config": to_dict(cfg),
        "config_hash": config_hash(cfg),
        "architecture": arch.to_dict(),
        "prune_rates": rates,
        "seed": cfg.seed,
        "data": data.ticket_set_summary(),
        "theta0": theta0,
        "privacy": {
            "phase1": "non-private",
            "dp_event": {"type": "NonPrivateDpEvent"},  # where it ran is `data`; TicketSet.privacy_view
        },
        "tickets": [],
        "rewind_point": None,
        "next_masks": None,
        "complete": False,
        "stop_reason": None,
        "wall_seconds": 0.0,
    }


def _resume_or_start(cfg: GenerateConfig, data: DatasetSplits, out: Path, overwrite: bool,
                     arch: Architecture, theta0: dict[str, torch.Tensor],
                     rates: dict[str, float]) -> GenerationState:
    if out.exists() and not overwrite:
        return GenerationState(resumable_body(cfg, data, out))
    return GenerationState(_new_payload(cfg, data, arch, theta0, rates))


def resumable_body(cfg: GenerateConfig, data: DatasetSplits, out: Path) -> dict[str, Any]:
    """The ticket set in `out`, if a run with `cfg` on `data` may continue it (else a one-line refusal): what the
    stage checks before it says it is continuing."""
    try:
        body: dict[str, Any] = load_ticket_set(out).to_dict()
    except DpltmUserError as error:  # the output exists but cannot be continued: say it is the output, and the way on
        raise DpltmUserError(f"--out {out} exists and is no ticket file this command can continue ({error}): pass "
                             "--overwrite to replace it, or --out to write elsewhere") from None
    if body.get("config_hash") != config_hash(cfg) or body["data"]["fingerprint"] != data.fingerprint:
        raise DpltmUserError(f"{out} holds tickets from other settings or data; pass --overwrite to replace it or "
                             "--out to write elsewhere")
    return body


def generate_tickets(cfg: GenerateConfig, data: DatasetSplits, out: Path, *,
                     overwrite: bool = False, progress: bool = True,
                     on_round: Callable[[dict[str, Any]], None] | None = None,
                     stop_after: int | None = None, cuda_graphs: bool = False) -> dict[str, Any]:
    """Run IMP, writing `out` after each round; returns the final ticket-file payload.

    `stop_after` ends the run after that many *new* rounds (used to test resuming). `cuda_graphs`
    replays each SGD step from a CUDA graph (same batches, same updates; CUDA only).
    """
    device = data.train.labels.device
    arch = build_architecture(data.num_features, data.num_classes, cfg.model.hidden,
                              cfg.model.project_to, cfg.model.activation, cfg.model.arch)
    rates = resolve_prune_rates(arch, cfg.generate.prune_rates)
    init_gen = torch.Generator(device="cpu").manual_seed(round_seed(cfg.seed, 0, stream=1))
    model = build_network(arch, init_gen)
    theta0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = _resume_or_start(cfg, data, out, overwrite, arch, theta0, rates)
    payload = state.payload
    if payload["complete"]:
        return payload
    theta0 = payload["theta0"]
    model.to(device)
    data = network_inputs(model, data, progress=progress)  # a fixed front end's cached features
    g = cfg.generate
    started = time.perf_counter()
    wall_before = float(payload.get("wall_seconds", 0.0))
    new_rounds = 0
    for k in range(len(state.tickets), g.rounds + 1):
        masks = ticket_masks({"masks": payload["next_masks"]}) if payload["next_masks"] else {
            n: torch.ones(s, dtype=torch.bool) for n, s in _weight_shapes(arch).items()
        }
        if k > 0 and density(masks) < g.min_density:
            payload["stop_reason"] = f"density {density(masks):.4f} below --min-density {g.min_density}"
            break
        record, snapshot = _run_round(model, rewind_weights(payload), masks, data, cfg, k, progress, cuda_graphs)
        if snapshot is not None:  # round 0 of late rewinding: θ_K, where every later round starts
            payload["rewind_point"] = {"step": g.rewind_step, "weights": snapshot}
        if g.controls and k > 0:
            record["controls"] = _run_controls(arch, rewind_weights(payload), masks, data, cfg, k, device,
                                               cuda_graphs, progress)
        new_masks = prune_layerwise(prunable_weights(model), masks, rates)
        record["next_density"] = density(new_masks)
        state.tickets.append(record)
        payload["next_masks"] = {n: m.cpu() for n, m in new_masks.items()}
        payload["wall_seconds"] = wall_before + time.perf_counter() - started
        save_atomic(TicketSet.from_payload(payload).to_dict(), out, "tickets")
        new_rounds += 1
        if on_round is not None:
            on_round(record)
        if stop_after is not None and new_rounds >= stop_after and k < g.rounds:
            return payload
    payload["complete"] = True
    payload["stop_reason"] = payload["stop_reason"] or f"finished {g.rounds} pruning rounds"
    payload["wall_seconds"] = wall_before + time.perf_counter() - started
    save_atomic(TicketSet.from_payload(payload).to_dict(), out, "tickets")
    return payload


def rewind_weights(payload: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Where a round starts: θ_K once round 0 has kept it (late rewinding), else θ0."""
    point = payload.get("rewind_point")
    return payload["theta0"] if point is None else point["weights"]  # type: ignore[no-any-return]


def round_steps(g: Any, k: int) -> int:
    """SGD steps of round k: I for round 0, which starts at θ0; the I − K that remain after θ_K for a later
    round of late rewinding (Frankle et al. 2020 train the rewound network for the rest of training)."""
    return g.iterations if k == 0 else g.iterations - g.rewind_step


def _weight_shapes(arch: Architecture) -> dict[str, tuple[int, int]]:
    return {f"{n}.weight": s for n, s in arch.layer_shapes().items()}


def _run_round(model: torch.nn.Module, start: dict[str, torch.Tensor], masks: Masks,
               data: DatasetSplits, cfg: GenerateConfig, k: int, progress: bool,
               cuda_graphs: bool = False) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
    """One round from `start` (θ0, or θ_K after round 0 of late rewinding): its ticket record, and for round 0
    of late rewinding the weights after K steps (else None)."""
    from dpltm.training.plain import accuracy, train_classifier  # Lightning: only where tickets are made

    g = cfg.generate
    installed = rewind(model, start, masks)
    label = f"round {k}/{g.rounds} C={density(masks):.3f}"
    result = train_classifier(
        model, data.train, masks=installed, steps=round_steps(g, k), batch_size=g.batch_size, lr=g.lr,
        seed=round_seed(cfg.seed, k), log_every=g.log_every,
        progress_label=label if progress else None, cuda_graphs=cuda_graphs,
        snapshot_at=g.rewind_step if k == 0 and g.rewind_step else None,
    )
    return {
        "round": k,
        "masks": {n: m.cpu() for n, m in masks.items()},
        "density": density(masks),
        "layer_density": layer_densities(masks),
        "val_accuracy": accuracy(model, data.val),
        "loss_curve": result.losses,
        "loss_every": g.log_every,
        "trained": trained_weights(model),
    }, result.snapshot


def _run_controls(arch: Architecture, theta0: dict[str, torch.Tensor], masks: Masks,
                  data: DatasetSplits, cfg: GenerateConfig, k: int,
                  device: torch.device, cuda_graphs: bool = False, progress: bool = False) -> dict[str, Any]:
    """The lottery-ticket controls: same mask, fresh init; and a random mask of equal density at the rounds'
    start (`theta0`: θ0, or θ_K with late rewinding), each trained as long as the round (with late rewinding the
    I − K steps after θ_K: the fresh init then has K steps fewer than the ticket's whole path from θ0, a control
    that leans towards the ticket)."""
    from dpltm.training.plain import accuracy, train_classifier

    g = cfg.generate
    out: dict[str, Any] = {}
    reinit = build_network(arch, torch.Generator().manual_seed(round_seed(cfg.seed, k, stream=2))).to(device)
    reinit_masks = apply_masks_(reinit, masks)
    random_mask = random_masks_like(masks, torch.Generator().manual_seed(round_seed(cfg.seed, k, stream=3)))
    rand = build_network(arch).to(device)
    rand_masks = rewind(rand, theta0, random_mask)
    for name, net, net_masks in (("reinit", reinit, reinit_masks), ("random_mask", rand, rand_masks)):
        train_classifier(net, data.train, masks=net_masks, steps=round_steps(g, k), batch_size=g.batch_size, lr=g.lr,
                         seed=round_seed(cfg.seed, k), log_every=g.log_every, cuda_graphs=cuda_graphs,
                         progress_label=f"round {k}/{g.rounds} control {name}" if progress else None)
        out[name] = {"val_accuracy": accuracy(net, data.val)}
    return out
