"""Noise-aware ticket choice: candidates trained side by side under the planned DP noise, on
public data only, with the same per-sample clipping as the private step."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dpltm.artefacts import TicketSet
from dpltm.data.types import DatasetSplits
from dpltm.dp.batched import StackedMLP, clipped_sums, noisy_step
from dpltm.dp.ghost import MaskLayout, clipped_gradient_sum
from dpltm.errors import DpltmUserError
from dpltm.masks import Masks
from dpltm.selection.noise_aware import (
    PlannedRun,
    candidate_model,
    halving_keep,
    noise_aware_choice,
    paired_gains,
    rung_steps,
    winning_index,
)
from dpltm.settings import DataSettings, GenerateConfig, GenerateSettings, ModelSettings
from dpltm.tickets.imp import generate_tickets


def candidate_models(tickets: TicketSet, device: torch.device, start: str = "init",
                     output_layer: str = "reinit") -> tuple[list[torch.nn.Module], list[Masks]]:
    """Every ticket of the set as a network at `start`, and its masks (round 0 is the dense one)."""
    built = [candidate_model(tickets, ticket, device, None, start, output_layer, ()) for ticket in tickets.tickets]
    return [model for model, _, _ in built], [ms for _, ms, _ in built]


@pytest.fixture
def tickets(tiny_splits: DatasetSplits, tmp_path: Path) -> TicketSet:
    cfg = GenerateConfig(data=DataSettings(dataset="blobs"), model=ModelSettings(hidden=(16,)),
                         generate=GenerateSettings(rounds=3, iterations=40, batch_size=32, prune_rates=(0.6,)))
    return generate_tickets(cfg, tiny_splits, tmp_path / "t.pt", progress=False)


def test_batched_clipped_sums_equal_the_single_model_dp_step(tickets: TicketSet, tiny_splits: DatasetSplits) -> None:
    models, masks = candidate_models(tickets, torch.device("cpu"))
    assert len(models) == len(masks) == len(tickets.tickets)
    assert any(not bool(m.all()) for ms in masks for m in ms.values())  # real tickets among the candidates
    stack = StackedMLP(models, masks)
    x, y = tiny_splits.train.features[:50], tiny_splits.train.labels[:50]
    weight_sums, bias_sums = clipped_sums(stack, x, y, clip=0.5)
    for k, (model, ticket) in enumerate(zip(models, masks)):
        single = clipped_gradient_sum(model, x, y, 0.5, MaskLayout.of(model, ticket, x.dtype))
        for layer, (name, _) in enumerate(model.layers_in_order()):
            prefix = name.removesuffix('.weight')
            torch.testing.assert_close(weight_sums[layer][k], single.grad_sums[f"{prefix}.weight"],
                                       rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(bias_sums[layer][k], single.grad_sums[f"{prefix}.bias"], rtol=1e-4, atol=1e-5)


def test_pruned_weights_stay_exactly_zero_under_noise(tickets: TicketSet, tiny_splits: DatasetSplits) -> None:
    stack = StackedMLP(*candidate_models(tickets, torch.device("cpu")))
    assert any(bool((mask == 0).any()) for mask in stack.masks)  # the check below bites
    optimizer = torch.optim.SGD(stack.parameters(), lr=0.5, momentum=0.9)
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        noisy_step(stack, optimizer, tiny_splits.train.features[:64], tiny_splits.train.labels[:64], clip=1.0,
                   noise_multiplier=3.0, expected_batch_size=64, generator=generator)
    for weight, mask in zip(stack.weights, stack.masks):
        assert torch.count_nonzero(weight[mask == 0]) == 0


def test_picks_the_dense_network_when_every_ticket_is_worse(tickets: TicketSet, tiny_splits: DatasetSplits) -> None:
    # cripple every pruned ticket: keep one input weight of the first layer, so it cannot learn
    crippled = []
    for ticket in tickets.tickets[1:]:
        first = ticket.masks["hidden.0.weight"]
        first.zero_()
        first[0, 0] = True
        crippled.append(replace(ticket, density=0.05))
    tickets = replace(tickets, tickets=(tickets.tickets[0], *crippled))
    plan = PlannedRun(noise_multiplier=0.5, expected_batch_size=64, steps=60, clip=1.0, lr=0.5)
    choice = noise_aware_choice(tickets, tiny_splits, plan, seed=0)
    assert choice.index == 0 and choice.candidates[0].density == 1.0
    assert choice.candidates[0].public_val_accuracy > max(c.public_val_accuracy for c in choice.candidates[1:])
    assert choice.public_data.fingerprint == tiny_splits.fingerprint


def test_reads_only_the_tickets_own_public_data(tickets: TicketSet, tiny_splits: DatasetSplits) -> None:
    private = replace(tiny_splits, name="private", fingerprint="private-v1")
    plan = PlannedRun(noise_multiplier=1.0, expected_batch_size=64, steps=2, clip=1.0, lr=0.1)
    with pytest.raises(DpltmUserError, match="not the data that made them"):
        noise_aware_choice(tickets, private, plan, seed=0)


@pytest.mark.parametrize("warmup", [False, True])
def test_with_ema_the_candidates_are_compared_by_their_averaged_weights(
        tickets: TicketSet, tiny_splits: DatasetSplits, monkeypatch: pytest.MonkeyPatch,  # type: ignore[type-arg]
        warmup: bool) -> None:
    import dpltm.selection.noise_aware as module

    iterates: list[list[torch.Tensor]] = []
    evaluated: list[list[torch.Tensor]] = []

    def recording_step(stack, *args, **kwargs):  # type: ignore[no-untyped-def]
        noisy_step(stack, *args, **kwargs)
        iterates.append([p.detach().clone() for p in stack.parameters()])

    def recording_correct(stack, x, y):  # type: ignore[no-untyped-def]
        evaluated.append([p.detach().clone() for p in stack.parameters()])
        return torch.zeros(stack.size, len(y), dtype=torch.bool)

    monkeypatch.setattr(module, "noisy_step", recording_step)
    monkeypatch.setattr(module, "correct_predictions", recording_correct)
    plan = PlannedRun(noise_multiplier=0.5, expected_batch_size=64, steps=6, clip=1.0, lr=0.5, ema=0.8,
                      ema_warmup=warmup)
    noise_aware_choice(tickets, tiny_splits, plan, seed=3)
    expected = [p.clone() for p in iterates[0]]  # the average starts at the first iterate
    for t, step in enumerate(iterates[1:], start=1):  # as the private run averages (warm-up: 2/11, 3/12, …)
        d = min(0.8, (1 + t) / (10 + t)) if warmup else 0.8
        expected = [d * e + (1 - d) * p for e, p in zip(expected, step)]
    for got, want in zip(evaluated[0], expected):
        torch.testing.assert_close(got, want)


def test_convolutional_tickets_are_chosen_by_the_private_step_itself(tmp_path: Path) -> None:
    """LeNet-5 candidates go through the DP training's own step (one engine): the dense network is a
    candidate, pruned weights stay zero, and the choice is a function of the public data only."""
    import dpltm.selection.noise_aware as module
    from tests.conftest import make_blobs

    images = DatasetSplits(name="blob-images", source_split="train", train=make_blobs(160, 784, 3, 0),
                           val=make_blobs(60, 784, 3, 1), test=make_blobs(30, 784, 3, 2), num_features=784,
                           num_classes=3, fingerprint="blob-images-v1")
    cfg = GenerateConfig(data=DataSettings(dataset="blobs"), model=ModelSettings(hidden=(12,), arch="lenet5"),
                         generate=GenerateSettings(rounds=2, iterations=10, batch_size=32, prune_rates=(0.5,)))
    tickets = generate_tickets(cfg, images, tmp_path / "t.pt", progress=False)
    plan = PlannedRun(noise_multiplier=1.0, expected_batch_size=32, steps=6, clip=1.0, lr=0.2)
    stepped: list[module.EachCandidate] = []
    original = module.EachCandidate.step

    def spy(self, optimizer, x, y, generator, index=None):  # type: ignore[no-untyped-def]
        stepped.append(self)
        original(self, optimizer, x, y, generator, index)

    module.EachCandidate.step = spy  # type: ignore[method-assign]
    try:
        choice = noise_aware_choice(tickets, images, plan, seed=0)
    finally:
        module.EachCandidate.step = original  # type: ignore[method-assign]
    assert len(stepped) == 6 and len(choice.candidates) == 3 and choice.candidates[0].density == 1.0
    assert all(0.0 <= c.public_val_accuracy <= 1.0 for c in choice.candidates)
    _, masks = candidate_models(tickets, torch.device("cpu"))  # the tickets' masks, beside the networks
    assert len(stepped[-1].models) == len(masks) and any(not bool(m.all()) for ms in masks for m in ms.values())
    for model, ticket in zip(stepped[-1].models, masks):
        for name, layer in (*model.conv_layers_in_order(), *model.layers_in_order()):
            assert torch.count_nonzero(layer.weight[~ticket[name]]) == 0
    with pytest.raises(DpltmUserError, match="not the data that made them"):
        noise_aware_choice(tickets, replace(images, fingerprint="private-v1"), plan, seed=0)


def test_candidates_start_where_the_planned_run_starts(tickets: TicketSet) -> None:
    """With `--rewind public` every candidate is simulated from its round's public-trained weights (θ0's
    output layer under `reinit`, its own under `keep`), pruned weights exactly zero; by default from θ0."""
    theta0 = tickets.theta0
    at_init, _ = candidate_models(tickets, torch.device("cpu"))
    public, masks = candidate_models(tickets, torch.device("cpu"), start="public")
    kept, _ = candidate_models(tickets, torch.device("cpu"), start="public", output_layer="keep")
    for k, ticket in enumerate(tickets.tickets):
        trained = ticket.trained or {}
        for name, value in public[k].state_dict().items():
            mask = masks[k].get(name)
            expected = theta0[name] if name.startswith("output.") else trained[name]
            expected = expected * mask if mask is not None else expected
            assert torch.equal(value, expected), (k, name)
            assert torch.equal(kept[k].state_dict()[name], trained[name] if mask is None else trained[name] * mask)
        for name, value in at_init[k].state_dict().items():
            mask = masks[k].get(name)
            assert torch.equal(value, theta0[name] if mask is None else theta0[name] * mask)


def test_a_public_start_changes_what_the_choice_trains_not_what_it_reads(tickets: TicketSet,
                                                                         tiny_splits: DatasetSplits) -> None:
    plan = PlannedRun(noise_multiplier=1.0, expected_batch_size=64, steps=5, clip=1.0, lr=0.1, start="public")
    choice = noise_aware_choice(tickets, tiny_splits, plan, seed=0)
    assert len(choice.candidates) == len(tickets.tickets) and choice.plan.start == "public"
    old = replace(tickets, tickets=tuple(replace(t, trained=None) for t in tickets.tickets))
    with pytest.raises(DpltmUserError, match="no public-trained weights"):
        noise_aware_choice(old, tiny_splits, plan, seed=0)


def test_the_public_proxy_is_epoch_matched(tickets: TicketSet, tiny_splits: DatasetSplits,  # type: ignore[type-arg]
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Given the private set's size N, candidates make as many passes over the public set as the private
    run makes over N (L_pub = L·n/N) with the same noise per step σ/L; without it, the private L and σ."""
    plan = PlannedRun(noise_multiplier=4.0, expected_batch_size=1600, steps=6, clip=1.0, lr=0.1, private_size=54000)
    batch, sigma = plan.on_public(7208)
    assert batch == round(1600 * 7208 / 54000) == 214 and sigma / batch == pytest.approx(4.0 / 1600, rel=1e-12)
    assert replace(plan, private_size=None).on_public(7208) == (1600, 4.0)
    rates = []
    import dpltm.selection.noise_aware as module

    real = module.poisson_steps
    monkeypatch.setattr(module, "poisson_steps", lambda n, q, *a: rates.append(q) or real(n, q, *a))
    n = len(tiny_splits.train)
    noise_aware_choice(tickets, tiny_splits, replace(plan, expected_batch_size=400, private_size=4 * n), seed=0)
    assert set(rates) == {100 / n}  # L_pub = 400 · n / 4n


def test_the_candidates_batches_are_drawn_in_blocks_with_the_poisson_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """`poisson_steps` gives exactly `steps` batches, block by block when the draws would not fit at once, each a
    sorted set of distinct indices by the same inclusion rule (the realised rate ≈ q)."""
    import dpltm.selection.noise_aware as module

    monkeypatch.setattr(module, "MAX_DRAWS_AT_ONCE", 3000)  # n = 1000: three steps per block
    generator = torch.Generator().manual_seed(0)
    batches = list(module.poisson_steps(1000, 0.1, 10, generator, torch.device("cpu")))
    assert len(batches) == 10
    assert all(torch.equal(b, b.unique()) and (b.numel() == 0 or 0 <= int(b.min()) <= int(b.max()) < 1000)
               for b in batches)
    sizes = torch.tensor([b.numel() for b in batches], dtype=torch.float64)
    assert abs(float(sizes.mean()) - 100) < 4 * (1000 * 0.1 * 0.9 / 10) ** 0.5
    assert list(module.poisson_steps(1000, 0.1, 0, generator, torch.device("cpu"))) == []


def test_paired_gains_are_the_mean_and_standard_error_of_the_per_record_differences() -> None:
    correct = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    gains, se = paired_gains(correct)
    torch.testing.assert_close(gains, torch.tensor([0.0, 0.25, 0.0], dtype=torch.float64))
    # differences [0,0,1,0]: sd 0.5, SE 0.25; [-1,-1,1,1]: sd 2/√3, SE 1/√3
    torch.testing.assert_close(se, torch.tensor([0.0, 0.25, 1 / 3 ** 0.5], dtype=torch.float64))


def test_a_ticket_must_beat_the_dense_network_by_two_standard_errors() -> None:
    accuracy = torch.tensor([0.90, 0.92, 0.95, 0.93])
    assert winning_index(accuracy, torch.tensor([0.0, 0.02, 0.05, 0.03]), torch.tensor([0.0, 0.02, 0.03, 0.01])) == 3
    assert winning_index(accuracy, torch.tensor([0.0, 0.02, 0.05, 0.03]), torch.tensor([0.0, 0.02, 0.03, 0.02])) == 0
    assert winning_index(accuracy, torch.tensor([0.0, 0.02, 0.05, 0.03]), torch.tensor([0.0, 0.001, 0.001, 0.001])) == 2


def test_the_rule_keeps_the_dense_network_against_noise_and_finds_a_real_gain() -> None:
    """Frequencies over simulated validation sets (n = 800, five tickets). Each ticket is the dense
    network's per-record correctness with some records flipped (the models err on mostly the same
    records): with flips that cancel on average (2 % each way) the argmax would pick a ticket 5 times in
    6, while the rule keeps the dense network in about 9 draws in 10 (each ticket passes 2 SE with
    p ≈ 2.3 %); a ticket that truly gains 5 points (6 % of records fixed, 1 % broken) is found almost
    always."""
    g = torch.Generator().manual_seed(0)
    trials, n = 400, 800

    def draw(fixed: list[float], broken: list[float]) -> int:
        dense = torch.rand(n, generator=g) < 0.85
        u = torch.rand(len(fixed), n, generator=g)
        tickets = torch.where(dense, u >= torch.tensor(broken)[:, None], u < torch.tensor(fixed)[:, None])
        correct = torch.cat([dense[None], tickets])
        gains, se = paired_gains(correct)
        return winning_index(correct.double().mean(dim=1), gains, se)

    even = [0.02 * 0.85 / 0.15] * 5  # wrong→right flips balancing the right→wrong ones: no gain on average
    null = [draw(even, [0.02] * 5) for _ in range(trials)]
    assert 0.82 <= null.count(0) / trials <= 0.97
    real = [draw([even[0], 0.06 / 0.15, *even[2:]], [0.02, 0.01 / 0.85, 0.02, 0.02, 0.02]) for _ in range(trials)]
    assert real.count(2) / trials >= 0.97


@pytest.mark.parametrize("name, hidden", [("scatter-linear", ()), ("scatter-mlp", (12,))])
@pytest.mark.parametrize("table", [False, True])
def test_stacked_scatter_heads_equal_the_engine_step(name: str, hidden: tuple[int, ...], table: bool) -> None:
    """ScatterNet's linear and MLP heads train stacked in the noise-aware choice: each candidate's clipped
    sums equal the DP engine's for that network alone (the path every other network takes), with the first
    layer's norm terms computed per step or looked up in the per-record table."""
    from dpltm.dp.engine import clipped_gradient_sum_of
    from dpltm.networks.lenet import Architecture, build_network
    from dpltm.selection.noise_aware import stacks

    arch = Architecture(in_features=64, hidden=hidden, num_classes=3, activation="tanh", name=name)
    generator = torch.Generator().manual_seed(3)
    models, masks = [], []
    for k in range(3):
        model = build_network(arch, generator)
        with torch.no_grad():
            for p in model.parameters():  # scatter-linear starts at zero: give every candidate its own weights
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
        ms = {n: (torch.rand(p.shape, generator=generator) < (1.0 if k == 0 else 0.4)).float()
              for n, p in model.named_parameters() if n.endswith("weight")}
        with torch.no_grad():  # a ticket's pruned weights are zero (as `rewind` leaves them)
            for n, p in model.named_parameters():
                p.mul_(ms.get(n, 1.0))
        models.append(model)
        masks.append(ms)
    assert all(stacks(m) for m in models)
    stack = StackedMLP(models, masks)
    records = torch.randn(40, 81 * 2 * 2, generator=generator)
    index = torch.tensor([3, 7, 7, 20, 1, 39, 12, 0])
    x, y = records[index], torch.randint(0, 3, (len(index),), generator=generator)
    first = stack.first_layer_terms(records).index_select(0, index) if table else None
    weight_sums, bias_sums = clipped_sums(stack, x, y, clip=0.7, first_terms=first)
    for k, (model, ms) in enumerate(zip(models, masks)):
        single = clipped_gradient_sum_of(model, x, y, 0.7, ms).grad_sums
        for layer, (mask_name, _) in enumerate(model.layers_in_order()):
            prefix = mask_name.removesuffix(".weight")
            torch.testing.assert_close(weight_sums[layer][k], single[f"{prefix}.weight"], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(bias_sums[layer][k], single[f"{prefix}.bias"], rtol=1e-4, atol=1e-5)
            assert torch.count_nonzero(weight_sums[layer][k][ms[mask_name] == 0]) == 0


def test_a_scatter_cnn_is_not_stacked() -> None:
    from dpltm.networks.lenet import Architecture, build_network
    from dpltm.selection.noise_aware import stacks

    arch = Architecture(in_features=64, hidden=(8,), num_classes=3, name="scatter-cnn")
    assert not stacks(build_network(arch))


def test_successive_halving_rungs_double_their_budget() -> None:
    assert rung_steps(1700, 2) == [425, 850] and rung_steps(1700, 1) == [850] and rung_steps(1700, 0) == []
    assert rung_steps(8, 3) == [1, 2, 4] and rung_steps(3, 5) == [1]  # no rung at step 0 or at T
    with pytest.raises(DpltmUserError, match="--halving must be ≥ 0"):
        rung_steps(10, -1)


def test_halving_keeps_the_dense_network_and_the_better_half_of_the_tickets() -> None:
    correct = torch.tensor([[0, 0, 0, 0],    # dense: the worst, kept (every ticket is compared with it)
                            [1, 0, 0, 0],
                            [1, 1, 1, 0],
                            [1, 1, 0, 0],
                            [1, 1, 0, 0]], dtype=torch.bool)
    assert halving_keep(correct) == [0, 2, 3]  # ⌈4/2⌉ tickets; the tie between rows 3 and 4: the earlier
    assert halving_keep(correct[:2]) == [0, 1] and halving_keep(correct[:3]) == [0, 2]


@pytest.mark.parametrize("ema", [None, 0.8])
def test_halving_scores_a_dropped_candidate_where_it_stopped(tickets: TicketSet,
                                                            tiny_splits: DatasetSplits, ema: float | None) -> None:
    """Up to the first rung the halving run is the full run (same seed, same candidates): a candidate dropped
    there reports exactly what a run of that many steps scores it (by its EMA when the plan averages); the
    winner comes from those that trained all T steps, the dense network always among them."""
    plan = PlannedRun(noise_multiplier=1.0, expected_batch_size=48, steps=8, clip=1.0, lr=0.5, momentum=0.5,
                      ema=ema, ema_warmup=ema is not None)
    halved = noise_aware_choice(tickets, tiny_splits, plan, seed=4, halving=2)
    short = noise_aware_choice(tickets, tiny_splits, replace(plan, steps=2), seed=4)
    steps = [c.steps for c in halved.candidates]
    assert len(steps) == len(tickets.tickets) == 4 and steps[0] == 8
    assert sorted(steps) == [2, 4, 8, 8]  # 1 dropped at T/4 (3 tickets → 2), 1 at T/2 (2 → 1)
    assert halved.rungs == (2, 4) and halved.to_json()["halving_rungs"] == [2, 4] and short.rungs == ()
    first_out = steps.index(2)
    assert halved.candidates[first_out] == replace(short.candidates[first_out], steps=2)
    assert halved.candidates[halved.index].steps == 8
    survivors = [k for k, c in enumerate(halved.candidates) if c.steps == 8]
    assert survivors[0] == 0 and halved.index in survivors


def test_halving_carries_each_kept_candidates_optimiser_state(tickets: TicketSet,
                                                               tiny_splits: DatasetSplits) -> None:
    import dpltm.selection.noise_aware as module

    plan = PlannedRun(noise_multiplier=1.0, expected_batch_size=48, steps=8, clip=1.0, lr=0.5, momentum=0.9)
    stack = StackedMLP(*candidate_models(tickets, torch.device("cpu")))
    optimizer = module._optimizer(stack.parameters(), plan)
    averaged = [p.detach().clone() + 1 for p in stack.parameters()]
    noisy_step(stack, optimizer, tiny_splits.train.features[:48], tiny_splits.train.labels[:48], clip=1.0,
               noise_multiplier=1.0, expected_batch_size=48, generator=torch.Generator().manual_seed(0))
    before = [(p.detach().clone(), optimizer.state[p]["momentum_buffer"].clone()) for p in stack.parameters()]
    fresh, kept_average, _ = module._keep_rows(stack, [0, 2], optimizer, plan, averaged, None)
    assert stack.size == 2
    for (weight, buffer), p in zip(before, stack.parameters()):
        torch.testing.assert_close(p.detach(), weight[[0, 2]])
        torch.testing.assert_close(fresh.state[p]["momentum_buffer"], buffer[[0, 2]])
    for mean, kept in zip(averaged, kept_average):  # type: ignore[arg-type]
        torch.testing.assert_close(kept, mean[[0, 2]])


def test_halving_steps_unstacked_candidates_too(tickets: TicketSet, tiny_splits: DatasetSplits,  # type: ignore[type-arg]
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Candidates with a frozen layer train one by one (`EachCandidate`): halving drops them from that
    loop, and the survivors are the networks that trained all T steps."""
    import dpltm.selection.noise_aware as module

    sizes: list[int] = []
    original = module.EachCandidate.step

    def spy(self, optimizer, x, y, generator, index=None):  # type: ignore[no-untyped-def]
        sizes.append(len(self.models))
        original(self, optimizer, x, y, generator, index)

    monkeypatch.setattr(module.EachCandidate, "step", spy)
    plan = PlannedRun(noise_multiplier=1.0, expected_batch_size=48, steps=6, clip=1.0, lr=0.5, momentum=0.5,
                      ema=0.8, freeze=("hidden.0",))
    choice = noise_aware_choice(tickets, tiny_splits, plan, seed=1, halving=1)
    assert sizes == [4, 4, 4, 3, 3, 3]  # after T/2 the dense network and ⌈3/2⌉ tickets
    assert sorted(c.steps for c in choice.candidates) == [3, 6, 6, 6]
