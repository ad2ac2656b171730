"""IMP with late rewinding (`generate --rewind-step K`, Frankle et al. 2020): round 0 keeps θ_K, its weights after
K steps; every later round starts from θ_K under its mask and trains the remaining I − K steps; the set stores θ_K
(and resumes with it); the noise-aware choice searches θ_K as a start of its own."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dpltm.artefacts import TicketRecord, TicketSet
from dpltm.checkpoint import load_ticket_set, save_atomic
from dpltm.data.types import DatasetSplits, LabeledTensors
from dpltm.errors import DpltmUserError
from dpltm.masks import PrunedWeights, apply_masks_, rewind, ticket_masks
from dpltm.networks.lenet import Architecture, LeNet, build_architecture, build_network
from dpltm.options import Overrides
from dpltm.pruning import paper_prune_rates, prune_layerwise
from dpltm.selection.noise_aware import PlannedRun, noise_aware_choice, searched_trainings
from dpltm.selection.winner import chosen_training
from dpltm.settings import DataSettings, GenerateConfig, GenerateSettings, ModelSettings
from dpltm.tickets.imp import generate_tickets, round_seed
from dpltm.training.plain import GraphedSgdStep, train_classifier

K = 7


def late_config(step: int = K, **generate: object) -> GenerateConfig:
    settings = {"rounds": 2, "iterations": 30, "batch_size": 64, "lr": 0.2, "log_every": 5, "rewind_step": step}
    settings.update(generate)
    return GenerateConfig(data=DataSettings(dataset="blobs"), model=ModelSettings(hidden=(16, 8)),
                          generate=GenerateSettings(**settings), seed=3)  # type: ignore[arg-type]


@pytest.fixture
def late(tiny_splits: DatasetSplits, tmp_path: Path) -> TicketSet:
    return generate_tickets(late_config(), tiny_splits, tmp_path / "late.pt", progress=False)


def _replayed(tickets: TicketSet, start: dict[str, torch.Tensor], ticket: TicketRecord, steps: int,
              splits: DatasetSplits) -> dict[str, torch.Tensor]:
    """The round trained again by hand: from `start` under the ticket's mask, `steps` steps of its own seed."""
    cfg = late_config()
    model = build_network(Architecture.from_dict(tickets.architecture))
    masks = rewind(model, start, ticket_masks(ticket.masks))
    train_classifier(model, splits.train, masks=masks, steps=steps, batch_size=cfg.generate.batch_size,
                     lr=cfg.generate.lr, seed=round_seed(cfg.seed, ticket.round))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_round_zero_keeps_its_iterate_k_and_later_rounds_start_there(late: TicketSet,
                                                                     tiny_splits: DatasetSplits) -> None:
    point = late.rewind_point
    assert point is not None and late.rewind_step == K and set(point.weights) == set(late.theta0)
    assert late.rewind_weights is point.weights
    dense, first = late.tickets[0], late.tickets[1]
    # θ_K is round 0's own iterate: K steps from θ0 on round 0's batches
    by_hand = _replayed(late, late.theta0, dense, K, tiny_splits)
    for key, value in point.weights.items():
        torch.testing.assert_close(value, by_hand[key], rtol=1e-5, atol=1e-6)
    assert not torch.equal(point.weights["hidden.0.weight"], late.theta0["hidden.0.weight"])
    # round 1 starts from θ_K under its mask and trains I − K steps (not from θ0, not I steps)
    again = _replayed(late, point.weights, first, 30 - K, tiny_splits)
    for key, value in (first.trained or {}).items():
        torch.testing.assert_close(value, again[key], rtol=1e-5, atol=1e-6)
    assert len(first.loss_curve) == len(range(0, 30 - K, 5)) and len(dense.loss_curve) == 6


def test_the_set_stores_the_point_and_resumes_with_it(late: TicketSet, tiny_splits: DatasetSplits,
                                                      tmp_path: Path) -> None:
    stored = load_ticket_set(tmp_path / "late.pt")
    assert stored.rewind_point is not None and stored.rewind_point.step == K
    part = tmp_path / "part.pt"
    generate_tickets(late_config(), tiny_splits, part, progress=False, stop_after=1)
    resumed = generate_tickets(late_config(), tiny_splits, part, progress=False)
    for a, b in zip(late.tickets, resumed.tickets, strict=True):
        for name in a.masks:
            assert torch.equal(a.masks[name], b.masks[name])
        assert a.trained is not None and b.trained is not None
        torch.testing.assert_close(a.trained["hidden.0.weight"], b.trained["hidden.0.weight"])
    plain = generate_tickets(late_config(step=0), tiny_splits, tmp_path / "plain.pt", progress=False)
    assert plain.rewind_point is None and plain.rewind_step == 0 and plain.rewind_weights is plain.theta0
    assert load_ticket_set(tmp_path / "plain.pt").rewind_point is None
    assert plain.config_hash != late.config_hash  # a resumed run never mixes the two


def test_a_point_that_disagrees_with_its_settings_is_refused(late: TicketSet, tmp_path: Path) -> None:
    body = load_ticket_set(tmp_path / "late.pt").to_dict()
    body["rewind_point"] = {**body["rewind_point"], "step": K + 1}
    save_atomic(body, tmp_path / "bad.pt", "tickets")
    with pytest.raises(DpltmUserError, match="'rewind_point' holds step 8, its config rewinds to step 7"):
        load_ticket_set(tmp_path / "bad.pt")
    body["rewind_point"] = {"step": K, "weights": {"hidden.0.weight": torch.zeros(2)}}
    save_atomic(body, tmp_path / "bad.pt", "tickets")
    with pytest.raises(DpltmUserError, match="rewind_point.weights"):
        load_ticket_set(tmp_path / "bad.pt")


@pytest.mark.parametrize("step", [-1, 30, 31])
def test_a_step_outside_the_round_is_refused(step: int) -> None:
    with pytest.raises(DpltmUserError, match=r"--rewind-step must lie in \[0, --iterations\)"):
        late_config(step=step)


def test_the_choice_searches_theta_k_as_a_start(late: TicketSet, tiny_splits: DatasetSplits) -> None:
    plan = PlannedRun(noise_multiplier=1.0, expected_batch_size=64, steps=3, clip=1.0, lr=0.3)
    assert searched_trainings(plan, ("start",), "hidden.0", K) == [("init", ()), (str(K), ()), ("public", ())]
    assert searched_trainings(replace(plan, start=str(K)), ("start",), "hidden.0", K) == [
        (str(K), ()), ("init", ()), ("public", ())]
    choice = noise_aware_choice(late, tiny_splits, plan, seed=0, search=("start",))
    assert [(c.round, c.start) for c in choice.candidates] == [
        (t.round, s) for t in late.tickets for s in ("init", str(K), "public")]
    selection = {"noise_aware": {**choice.to_json(), "chosen": {
        "start": str(K), "freeze": [], "ema": None, "ema_warmup": False, "output_layer": "reinit"}}}
    assert chosen_training(selection) == Overrides({"train.rewind": str(K), "train.output_layer": "reinit"})
    for written in (f"0{K}", K, "0"):  # a start as no writer stores it: the record is damaged
        selection["noise_aware"]["chosen"]["start"] = written
        with pytest.raises(DpltmUserError, match="damaged"):
            chosen_training(selection)
    planned_k = noise_aware_choice(late, tiny_splits, replace(plan, start=str(K)), seed=0)
    assert {c.start for c in planned_k.candidates} == {str(K)}


def test_a_start_k_the_set_does_not_hold_is_refused(tiny_splits: DatasetSplits, tmp_path: Path) -> None:
    plain = generate_tickets(late_config(step=0), tiny_splits, tmp_path / "plain.pt", progress=False)
    plan = PlannedRun(noise_multiplier=1.0, expected_batch_size=64, steps=2, clip=1.0, lr=0.3, start="5")
    with pytest.raises(DpltmUserError, match="holds no iterate of public training"):
        noise_aware_choice(plain, tiny_splits, plan, seed=0)


def test_the_api_rewinds_a_users_model_to_its_iterate_k() -> None:
    """`dpltm.generate_tickets(..., rewind_step=K)`: every ticket rewinds to θ_K, the model after K of the first
    round's SGD steps (replayed by hand on the same batches), held apart from its θ0 (untouched by any record),
    and the model is left at its θ0."""
    import torch.nn.functional as F

    import dpltm
    from tests.apidata import blobs, mlp

    model, data = mlp(), blobs(200, 0)
    theta0 = {k: v.clone() for k, v in model.state_dict().items()}
    tickets = dpltm.generate_tickets(model, data, rounds=2, iterations=12, batch_size=32, lr=0.2, seed=5,
                                     rewind_step=4)
    by_hand = mlp()
    by_hand.load_state_dict(theta0)
    generator, optimizer = torch.Generator().manual_seed(5), torch.optim.SGD(by_hand.parameters(), lr=0.2)
    for _ in range(4):
        index = torch.randint(0, 200, (32,), generator=generator)
        optimizer.zero_grad()
        F.cross_entropy(by_hand(data[0][index]), data[1][index]).backward()
        optimizer.step()
    for ticket in tickets:
        assert ticket.rewind_step == 4 and ticket.theta_k is not None and ticket.rewind_weights is ticket.theta_k
        for key, value in by_hand.state_dict().items():
            torch.testing.assert_close(ticket.theta_k[key], value)
            assert torch.equal(ticket.theta0[key], theta0[key]), key  # θ0 itself, not the trained θ_K
    assert all(torch.equal(v, theta0[k]) for k, v in model.state_dict().items())
    plain = dpltm.generate_tickets(mlp(), data, rounds=1, iterations=12, batch_size=32, seed=5)
    assert plain[0].rewind_step == 0 and plain[0].theta_k is None and plain[0].rewind_weights is plain[0].theta0
    for bad in (12, -1, 1.5):
        with pytest.raises(DpltmUserError, match="rewind_step"):
            dpltm.generate_tickets(mlp(), data, rounds=1, iterations=12, rewind_step=bad)  # type: ignore[arg-type]


class _EagerGraphStandIn(GraphedSgdStep):
    """`GraphedSgdStep` without CUDA: its `_step` (gather, loss, backward, SGD, re-zeroing, the loss row) run
    eagerly on fresh gradients, as each replay of the captured graph runs it. With it the CUDA-graph branch of
    `train_classifier` (blocks of index rows, one Lightning step per block) runs on the CPU."""

    def __init__(self, model: torch.nn.Module, data: LabeledTensors, batch_size: int,
                 optimizer: torch.optim.Optimizer, keep_pruned: PrunedWeights | None = None,
                 losses: torch.Tensor | None = None) -> None:  # no capture
        self.model, self.data, self.optimizer = model, data, optimizer
        self.keep_pruned, self.losses = keep_pruned, losses
        self.index = torch.zeros(batch_size, dtype=torch.long)
        self.loss = torch.zeros(())
        self.position = torch.zeros(1, dtype=torch.long)

    def step(self, index: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)  # a replay's backward writes fresh gradients
        self.index.copy_(index)
        self._step()
        return self.loss


@pytest.mark.parametrize("snapshot_at", [1, 4, 5, 10])  # first step, a block's last, the next block's first, the end
def test_the_graph_blocks_keep_the_same_iterate_k_as_the_eager_loop(snapshot_at: int, tiny_splits: DatasetSplits,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`generate --rewind-step K --cuda-graphs` replays steps in blocks (here of 4): θ_K is taken after the K-th
    replay wherever it falls in a block, the same weights the eager loop keeps (the replay itself is compared
    with the eager step on a GPU, tests/dp/test_static_step.py)."""
    import dpltm.training.plain as plain

    def trained(graphs: bool) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        cfg = late_config()
        model = LeNet(build_architecture(20, 4, (16, 8), None), torch.Generator().manual_seed(1))
        masks = apply_masks_(model, prune_layerwise(model.weights(), model.full_masks(),
                                                    paper_prune_rates(model.mask_names())))
        result = train_classifier(model, tiny_splits.train, steps=10, batch_size=16, lr=0.2, seed=cfg.seed,
                                  log_every=1, masks=masks, cuda_graphs=graphs, snapshot_at=snapshot_at)
        assert result.snapshot is not None
        return result.losses, result.snapshot, {k: v.detach().clone() for k, v in model.state_dict().items()}

    eager_losses, eager_snapshot, eager_final = trained(False)
    monkeypatch.setattr(plain, "require_cuda_for_graphs", lambda device: None)
    monkeypatch.setattr(plain, "GraphedSgdStep", _EagerGraphStandIn)
    monkeypatch.setattr(plain, "GRAPH_BLOCK_STEPS", 4)
    block_losses, block_snapshot, block_final = trained(True)
    assert block_losses == pytest.approx(eager_losses, rel=1e-6)
    for key, value in eager_snapshot.items():
        torch.testing.assert_close(block_snapshot[key], value, rtol=0, atol=0, msg=key)
    for key, value in eager_final.items():
        torch.testing.assert_close(block_final[key], value, rtol=0, atol=0, msg=key)
    if snapshot_at < 10:
        assert not torch.equal(block_snapshot["hidden.0.weight"], block_final["hidden.0.weight"])


def test_the_api_leaves_the_model_at_theta0_when_generation_stops_early() -> None:
    """A diverged run (refused in one line) and an interrupted one (Ctrl-C inside the loss) leave the user's model at
    the θ0 it came with, never at weights trained on the tickets' data, and with no stale gradients."""
    import dpltm
    from tests.apidata import blobs, mlp

    data = blobs(200, 0)
    model = mlp()
    theta0 = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(DpltmUserError, match="diverged"):
        dpltm.generate_tickets(model, (data[0] * float("inf"), data[1]), rounds=1, iterations=20, rewind_step=2)
    assert all(torch.equal(v, theta0[k]) for k, v in model.state_dict().items())
    calls = []

    def interrupted(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 7:
            raise KeyboardInterrupt
        return torch.nn.functional.cross_entropy(outputs, targets)

    with pytest.raises(KeyboardInterrupt):
        dpltm.generate_tickets(model, data, rounds=2, iterations=5, loss=interrupted)
    assert all(torch.equal(v, theta0[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
