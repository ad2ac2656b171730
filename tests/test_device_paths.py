"""The paths added since the CUDA-graph tests, on each device: the per-record norm tables, the
ScatterNet front end, DP training of a masked head over its features, and `make_private` with its own
copy of the records. Each runs on the CPU here and on CUDA under `pytest -m gpu`, so the GPU variant
checks the very property the CPU one does (the code is the same; only where the tensors live differs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dp_accounting import dp_event, pld
from torch import nn

import dpltm
from dpltm.architectures import ARCHITECTURES
from dpltm.data.types import DatasetSplits, LabeledTensors
from dpltm.dp.engine import record_norm_tables
from dpltm.masks import apply_masks_, full_masks
from dpltm.networks.lenet import build_architecture, build_network
from tests.apidata import blobs, mlp
from tests.dp.test_record_tables import _check_against_reference as check_against_reference

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _network(name: str, seed: int = 0) -> nn.Module:
    arch = build_architecture(784, 10, ARCHITECTURES[name].default_hidden or (), None, "tanh", name)
    return build_network(arch, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("device", DEVICES)
def test_norm_tables_give_the_reference_norms_and_sums(device: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 7), nn.Tanh(), nn.Linear(7, 5)).double().to(device)
    g = torch.Generator().manual_seed(1)
    masks = {n: (torch.rand(p.shape, generator=g) < 0.5).to(device) for n, p in model.named_parameters()
             if n.endswith("weight")}
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in masks:
                p.mul_(masks[n])
    records = torch.randn(30, 12, generator=g, dtype=torch.float64).to(device)
    labels = torch.randint(0, 5, (30,), generator=g).to(device)
    tables = record_norm_tables(model, masks, records)
    assert set(tables) == {"1"} and tables["1"].terms.device.type == device
    check_against_reference(model, masks, records, labels, torch.tensor([0, 3, 4, 17, 29], device=device), tables)


@pytest.mark.parametrize("device", DEVICES)
def test_scatter_features_are_the_same_on_each_device(device: str) -> None:
    net = _network("scatter-linear").to(device)
    x = torch.rand(6, 784, generator=torch.Generator().manual_seed(2))
    on_device = net.front(x.to(device))  # type: ignore[union-attr]
    assert on_device.device.type == device
    torch.testing.assert_close(on_device.cpu(), _network("scatter-linear").front(x), rtol=1e-4, atol=1e-4)  # type: ignore[union-attr]


@pytest.mark.parametrize("device", DEVICES)
def test_dp_training_of_a_masked_scatter_head_keeps_pruned_weights_zero(device: str, tmp_path: Path) -> None:
    """The CLI's DP training over cached features (norm tables on), on the device the data lives on:
    pruned head weights stay exactly zero and the trained head separates the classes of its records."""
    from dpltm.dp.mechanism import NoiseContext
    from dpltm.feature_cache import network_inputs
    from dpltm.settings import TrainSettings
    from dpltm.training.plan import plan_training
    from dpltm.training.private import run_private

    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 2, (120,), generator=g)
    images = torch.rand(120, 784, generator=g) * 0.2 + labels[:, None].float() * torch.linspace(0, 0.8, 784)

    def part(a: int, b: int) -> LabeledTensors:
        return LabeledTensors(images[a:b], labels[a:b])

    model = _network("scatter-linear", seed=3)
    splits = network_inputs(model, DatasetSplits("mnist", "train", part(0, 80), part(80, 100), part(100, 120), 784, 10,
                                                 "fp"), cache_dir=tmp_path)
    data = DatasetSplits(**{**splits.__dict__, **{k: LabeledTensors(getattr(splits, k).features.to(device),
                                                                     getattr(splits, k).labels.to(device))
                                                  for k in ("train", "val", "test")}})
    masks = full_masks(model)
    masks["output.weight"] = torch.rand(masks["output.weight"].shape, generator=torch.Generator().manual_seed(4)) < 0.4
    model.to(device)
    masks = apply_masks_(model, {k: v.to(device) for k, v in masks.items()})
    settings = TrainSettings(epochs=3, batch_size=20, eps2=None, sigma=0.5, lr=0.5, momentum=0.9, clip=1.0)
    run_private(model, data, plan_training(settings, len(data.train)), settings, seed=7,
                epsilon_after=lambda steps: 0.0, progress=False,
                noise_context=NoiseContext(model=model, masks=masks, clip=settings.clip, private_dataset="mnist"))
    weight = model.get_parameter("output.weight")
    assert weight.device.type == device and bool((weight[~masks["output.weight"]] == 0).all())
    with torch.no_grad():
        predicted = model(data.test.features).argmax(1)
    assert float((predicted == data.test.labels).float().mean()) >= 0.8


@pytest.mark.parametrize("device", DEVICES)
def test_make_private_on_the_device_of_the_model_and_records(device: str) -> None:
    model = mlp().to(device)
    masks = {"0.weight": (torch.rand(16, 10, generator=torch.Generator().manual_seed(1)) < 0.5).to(device)}
    x, y = blobs(600, 0)
    private = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
                                 (x.to(device), y.to(device)), target_epsilon=1.0, delta=1e-5, epochs=4, batch_size=60,
                                 masks=masks, masks_from="random mask", noise_seed=3)
    private.fit()
    plan = private.plan
    accountant = pld.PLDAccountant()
    accountant.compose(dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(plan.sample_rate, dp_event.GaussianDpEvent(plan.noise_multiplier)), plan.steps))
    assert private.epsilon == pytest.approx(float(accountant.get_epsilon(1e-5)), rel=1e-9) and private.epsilon <= 1.0
    assert bool((model[0].weight[~masks["0.weight"]] == 0).all())
    tx, ty = blobs(300, 2)
    assert private.evaluate((tx.to(device), ty.to(device))) > 0.8


@pytest.mark.gpu
@pytest.mark.parametrize("steps", [2, 120])  # 2: fewer steps than the capture's warm-up runs
def test_generate_with_cuda_graphs_takes_the_eager_steps(steps: int) -> None:
    """`train_classifier(cuda_graphs=True)` (generate's IMP rounds): the same batches and updates as
    the eager loop, each replay writing its own loss (in the graph) to the round's loss record, the
    pruned weights staying exactly zero, and late rewinding's θ_K (`snapshot_at`) the eager loop's."""
    from dpltm.masks import prunable_weights
    from dpltm.networks.lenet import LeNet
    from dpltm.pruning import paper_prune_rates, prune_layerwise
    from dpltm.training.plain import train_classifier

    g = torch.Generator().manual_seed(0)
    data = LabeledTensors(torch.rand(500, 20, generator=g).cuda(), torch.randint(0, 4, (500,), generator=g).cuda())

    snapshot_at = min(steps, 7)

    def trained(graphs: bool) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor],
                                       dict[str, torch.Tensor]]:
        model = LeNet(build_architecture(20, 4, (16, 8), None), torch.Generator().manual_seed(1)).cuda()
        masks = apply_masks_(model, prune_layerwise(prunable_weights(model), full_masks(model),
                                                    paper_prune_rates(list(prunable_weights(model)))))
        result = train_classifier(model, data, steps=steps, batch_size=32, lr=0.1, seed=2, log_every=10, masks=masks,
                                  cuda_graphs=graphs, snapshot_at=snapshot_at)
        assert result.snapshot is not None
        return result.losses, {k: v.detach().clone() for k, v in model.named_parameters()}, masks, result.snapshot

    eager_losses, eager, _, eager_snapshot = trained(False)
    graph_losses, graphed, masks, graph_snapshot = trained(True)
    for name, value in eager_snapshot.items():
        torch.testing.assert_close(graph_snapshot[name], value, rtol=1e-4, atol=1e-5, msg=f"θ_K {name}")
    assert len(graph_losses) == -(-steps // 10) and all(loss > 0 for loss in graph_losses)  # each loss written
    torch.testing.assert_close(torch.tensor(graph_losses), torch.tensor(eager_losses), rtol=1e-4, atol=1e-5)
    for name, value in eager.items():
        torch.testing.assert_close(graphed[name], value, rtol=1e-4, atol=1e-5, msg=name)
    for name, mask in masks.items():
        assert bool((graphed[name][~mask] == 0).all()), name


def _masked_head(name: str, device: str, seed: int = 0) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A ScatterNet head with random non-zero weights (scatter-linear starts at zero) and a random mask."""
    net = _network(name, seed).double().to(device)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_((torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.05).to(device))
    masks = full_masks(net)
    for n in masks:
        masks[n] = torch.rand(masks[n].shape, generator=g) < 0.5
    return net, apply_masks_(net, masks)


@pytest.mark.parametrize("name", ["scatter-linear", "scatter-mlp"])
def test_fully_connected_scatter_heads_take_the_fused_step_with_the_engines_sums(name: str) -> None:
    """ScatterNet's linear and MLP heads train in the fused ghost-norm step (which also runs static-shape and
    in CUDA graphs); its norms and masked clipped sums are the DP engine's, which scatter-cnn keeps."""
    from dpltm.dp.engine import clipped_gradient_sum_of
    from dpltm.dp.ghost import MaskLayout, clipped_gradient_sum
    from dpltm.dp.step import EngineLayout, step_layout

    net, masks = _masked_head(name, "cpu")
    features = torch.randn(24, 81 * 49, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    labels = torch.randint(0, 10, (24,), generator=torch.Generator().manual_seed(6))
    layout = step_layout(net, masks, torch.float64)
    assert isinstance(layout, MaskLayout)
    fused = clipped_gradient_sum(net, features, labels, 0.3, layout)
    engine = clipped_gradient_sum_of(net, features, labels, 0.3, masks)
    torch.testing.assert_close(fused.norms, engine.norms, rtol=1e-9, atol=1e-12)
    assert set(fused.grad_sums) == set(engine.grad_sums)
    for n, total in engine.grad_sums.items():
        torch.testing.assert_close(fused.grad_sums[n], total, rtol=1e-9, atol=1e-12, msg=n)
    for n, mask in masks.items():
        assert torch.count_nonzero(fused.grad_sums[n][~mask]) == 0
    cnn = _network("scatter-cnn")
    assert isinstance(step_layout(cnn, full_masks(cnn)), EngineLayout)


@pytest.mark.parametrize("device", DEVICES)
def test_a_scatter_head_trains_static_shape_and_in_cuda_graphs_as_in_the_eager_step(device: str) -> None:
    """`train --cuda-graphs` on a ScatterNet linear head: the static-shape step (captured in CUDA graphs on a
    GPU) trains exactly as the eager fused step, without noise, and keeps pruned weights at zero."""
    from dpltm.dp.gaussian import GaussianNoise
    from dpltm.dp.ghost import MaskLayout
    from dpltm.dp.graphed import StaticShapeDpStep
    from dpltm.dp.sampling import poisson_batches_at_once
    from dpltm.dp.step import apply_gradients, private_gradients

    n = 64
    train = LabeledTensors(torch.randn(n, 81 * 49, generator=torch.Generator().manual_seed(7),
                                       dtype=torch.float64).to(device),
                           torch.randint(0, 10, (n,), generator=torch.Generator().manual_seed(8)).to(device))
    batches = [b.to(device) for b in poisson_batches_at_once(n, 0.25, 6, torch.Generator().manual_seed(9))]

    def run(static: bool, graphs: bool = False) -> tuple[nn.Module, dict[str, torch.Tensor]]:
        net, masks = _masked_head("scatter-linear", device)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
        noise = GaussianNoise(0.0)
        generator = torch.Generator(device=device).manual_seed(3)
        if static:
            step = StaticShapeDpStep(net, masks, train, clip=0.4, noise=noise, expected_batch_size=16.0, capacity=24,
                                     generator=generator, optimizer=optimizer, graphs=graphs)
            for index in batches:
                step.step(index)
        else:
            layout = MaskLayout.of(net, masks, torch.float64)
            for index in batches:
                grads, _, _ = private_gradients(net, train.features[index], train.labels[index], clip=0.4,
                                                noise=noise, expected_batch_size=16.0, generator=generator,
                                                layout=layout)
                apply_gradients(net, grads, optimizer)
        return net, masks

    eager, masks = run(static=False)
    for static in ([run(static=True)[0]] + ([run(static=True, graphs=True)[0]] if device == "cuda" else [])):
        for (name, a), b in zip(eager.named_parameters(), static.parameters()):
            torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-11, msg=name)
        assert torch.count_nonzero(static.output.weight[~masks["output.weight"]]) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_dp_callback_on_the_device(device: str) -> None:
    """`DPCallback` under a Lightning Trainer on the device: its per-step checks (the closure it wraps, the weights'
    and gradients' marks read with `torch._foreach_norm`) take no sound step for a write, ε is dp-accounting's for
    the steps run, the first step's gradient is the masked clipped sum plus N(0, σ²C²) on surviving entries only,
    over L, and the stepped weights stay guarded after Lightning moves a GPU module back to the CPU."""
    import lightning as L

    from dpltm.dp.engine import clipped_gradient_sum_of
    from dpltm.errors import DpltmUserError
    from dpltm.lightning import poisson_loader
    from tests.api.test_api import Classifier, GradientSpy

    def trainer(*callbacks: L.Callback) -> L.Trainer:
        return L.Trainer(max_epochs=2, callbacks=list(callbacks), logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         accelerator="gpu" if device == "cuda" else "cpu", devices=1)

    x, y = blobs(400, 0)
    loader = poisson_loader(torch.utils.data.TensorDataset(x, y), batch_size=40, seed=5)
    module = Classifier()
    theta0 = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    masks = {"model.0.weight": torch.rand(16, 10, generator=torch.Generator().manual_seed(1)) < 0.5}
    callback = dpltm.DPCallback(target_epsilon=2.0, max_grad_norm=0.5, masks=masks, masks_from="public")
    spy = GradientSpy()
    trainer(callback, spy).fit(module, loader)
    plan = callback.plan
    assert plan is not None and callback.steps_done == plan.steps == 20
    accountant = pld.PLDAccountant()
    accountant.compose(dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(0.1, dp_event.GaussianDpEvent(plan.noise_multiplier)), 20))
    assert callback.epsilon == pytest.approx(float(accountant.get_epsilon(1e-5)), rel=1e-9) and callback.epsilon <= 2
    ledger = callback.ledger()
    assert ledger is not None and ledger.end_to_end_dp
    weight = module.model[0].weight
    assert bool((weight[~masks["model.0.weight"].to(weight.device)] == 0).all())
    # the first step: the masked clipped sum (recomputed on the CPU) plus noise of standard deviation σC, over L
    reference = mlp()
    reference.load_state_dict(theta0)
    with torch.no_grad():
        reference[0].weight.mul_(masks["model.0.weight"])
    bx, by = (t.cpu() for t in module.seen[0])
    sums = clipped_gradient_sum_of(reference, bx, by, 0.5, {"0.weight": masks["model.0.weight"]}).grad_sums
    assert spy.first is not None
    first = {name: gradient.cpu() for name, gradient in spy.first.items()}
    pruned = first["model.0.weight"][~masks["model.0.weight"]]
    assert bool((pruned == 0).all())
    noise = torch.cat([(first[f"model.{name}"] * 40 - value)[masks["model.0.weight"]] if name == "0.weight"
                       else (first[f"model.{name}"] * 40 - value).flatten() for name, value in sums.items()])
    assert noise.numel() > 100
    assert 0.75 < float(noise.std()) / (plan.noise_multiplier * 0.5) < 1.25
    # the weights this fit stepped (moved back to the CPU by Lightning after a GPU fit) stay guarded
    with pytest.raises(DpltmUserError, match="already took 20 steps in another private run"):
        trainer(dpltm.DPCallback(noise_multiplier=1.0)).fit(module, loader)
