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
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dpltm import __version__
from dpltm.artefacts import Phase1Record, RewindPoint, TicketRecord, TicketSet
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
from dpltm.settings import GenerateConfig, GenerateSettings


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


def _new_set(cfg: GenerateConfig, data: DatasetSplits, arch: Architecture, theta0: dict[str, torch.Tensor],
             rates: dict[str, float]) -> TicketSet:
    return TicketSet(architecture=arch.to_dict(), theta0=theta0, tickets=(), data=data.ticket_set_summary(),
                     config=to_dict(cfg),
                     privacy=Phase1Record("non-private",  # where it ran is `data`; TicketSet.privacy_view
                                          {"type": "NonPrivateDpEvent"}),
                     seed=cfg.seed, complete=False, dpltm_version=__version__, config_hash=config_hash(cfg),
                     prune_rates=rates, wall_seconds=0.0)


def resumable_set(cfg: GenerateConfig, data: DatasetSplits, out: Path) -> TicketSet:
    """The ticket set in `out`, if a run with `cfg` on `data` may continue it (else a one-line refusal): what the
    stage checks before it says it is continuing."""
    try:
        tickets = load_ticket_set(out)
    except DpltmUserError as error:  # the output exists but cannot be continued: say it is the output, and the way on
        raise DpltmUserError(f"--out {out} exists and is no ticket file this command can continue ({error}): pass "
                             "--overwrite to replace it, or --out to write elsewhere") from None
    if tickets.config_hash != config_hash(cfg) or tickets.fingerprint != data.fingerprint:
        raise DpltmUserError(f"{out} holds tickets from other settings or data; pass --overwrite to replace it or "
                             "--out to write elsewhere")
    return tickets


def _saved(ticket_set: TicketSet, out: Path, **changes: Any) -> TicketSet:
    """`ticket_set` with `changes`, checked as a reader would check the file (a writer cannot save what a reader
    would refuse), and written to `out`."""
    checked = TicketSet.from_payload(replace(ticket_set, **changes).to_dict())
    save_atomic(checked.to_dict(), out, "tickets")
    return checked


def generate_tickets(cfg: GenerateConfig, data: DatasetSplits, out: Path, *,
                     overwrite: bool = False, progress: bool = True,
                     on_round: Callable[[TicketRecord], None] | None = None,
                     stop_after: int | None = None, cuda_graphs: bool = False) -> TicketSet:
    """Run IMP, writing `out` after each round; returns the ticket set as written.

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
    tickets = (resumable_set(cfg, data, out) if out.exists() and not overwrite
               else _new_set(cfg, data, arch, theta0, rates))
    if tickets.complete:
        return tickets
    model.to(device)
    data = network_inputs(model, data, progress=progress)  # a fixed front end's cached features
    g = cfg.generate
    started = time.perf_counter()
    wall_before = float(tickets.wall_seconds or 0.0)
    stop_reason, new_rounds = tickets.stop_reason, 0
    for k in range(len(tickets.tickets), g.rounds + 1):
        masks = ticket_masks(tickets.next_masks) if tickets.next_masks else {
            n: torch.ones(s, dtype=torch.bool) for n, s in _weight_shapes(arch).items()
        }
        if k > 0 and density(masks) < g.min_density:
            stop_reason = f"density {density(masks):.4f} below --min-density {g.min_density}"
            break
        record, snapshot = _run_round(model, tickets.rewind_weights, masks, data, cfg, k, progress, cuda_graphs)
        if snapshot is not None:  # round 0 of late rewinding: θ_K, where every later round starts
            tickets = replace(tickets, rewind_point=RewindPoint(g.rewind_step, snapshot))
        controls = (_run_controls(arch, tickets.rewind_weights, masks, data, cfg, k, device, cuda_graphs, progress)
                    if g.controls and k > 0 else None)
        new_masks = prune_layerwise(prunable_weights(model), masks, rates)
        record = replace(record, next_density=density(new_masks), controls=controls)
        tickets = _saved(tickets, out, tickets=(*tickets.tickets, record),
                         next_masks={n: m.cpu() for n, m in new_masks.items()},
                         wall_seconds=wall_before + time.perf_counter() - started)
        new_rounds += 1
        if on_round is not None:
            on_round(record)
        if stop_after is not None and new_rounds >= stop_after and k < g.rounds:
            return tickets
    return _saved(tickets, out, complete=True, stop_reason=stop_reason or f"finished {g.rounds} pruning rounds",
                  wall_seconds=wall_before + time.perf_counter() - started)


def round_steps(g: GenerateSettings, k: int) -> int:
    """SGD steps of round k: I for round 0, which starts at θ0; the I − K that remain after θ_K for a later
    round of late rewinding (Frankle et al. 2020 train the rewound network for the rest of training)."""
    return g.iterations if k == 0 else g.iterations - g.rewind_step


def _weight_shapes(arch: Architecture) -> dict[str, tuple[int, int]]:
    return {f"{n}.weight": s for n, s in arch.layer_shapes().items()}


def _run_round(model: torch.nn.Module, start: dict[str, torch.Tensor], masks: Masks,
               data: DatasetSplits, cfg: GenerateConfig, k: int, progress: bool,
               cuda_graphs: bool = False) -> tuple[TicketRecord, dict[str, torch.Tensor] | None]:
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
    return TicketRecord(round=k, masks={n: m.cpu() for n, m in masks.items()}, density=density(masks),
                        layer_density=layer_densities(masks), val_accuracy=accuracy(model, data.val),
                        loss_curve=tuple(result.losses), loss_every=g.log_every,
                        trained=trained_weights(model)), result.snapshot


def _run_controls(arch: Architecture, theta0: dict[str, torch.Tensor], masks: Masks,
                  data: DatasetSplits, cfg: GenerateConfig, k: int,
                  device: torch.device, cuda_graphs: bool = False,
                  progress: bool = False) -> dict[str, dict[str, float]]:
    """The lottery-ticket controls: same mask, fresh init; and a random mask of equal density at the rounds'
    start (`theta0`: θ0, or θ_K with late rewinding), each trained as long as the round (with late rewinding the
    I − K steps after θ_K: the fresh init then has K steps fewer than the ticket's whole path from θ0, a control
    that leans towards the ticket)."""
    from dpltm.training.plain import accuracy, train_classifier

    g = cfg.generate
    out: dict[str, dict[str, float]] = {}
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
