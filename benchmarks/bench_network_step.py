"""Time of one DP-SGD step on a convolutional ticket, against its non-private step, in one run.

For each network (`--arch`: lenet5, which takes the built-in networks' fused step, and dp-cnn, a
network of its own file, which takes the DP engine's per-layer rules), a ticket after `--rounds`
pruning rounds on MNIST-shaped rows gathered from a device-resident set, as in training. Printed as
ratios to that network's non-private masked step (forward, backward, SGD update, pruned weights
re-zeroed): the DP step (masked per-sample norms, clipping, noise on surviving weights, update), and
Opacus ghost clipping on the same network where Opacus is installed.

    python benchmarks/bench_network_step.py [--arch lenet5 dp-cnn] [--batch-size 256] [--device cpu]
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.nn.functional as F
from bench_dp_step import interleaved, timed

from dpltm.devices import resolve_device
from dpltm.dp.gaussian import GaussianNoise
from dpltm.dp.step import apply_gradients, private_gradients, step_layout
from dpltm.masks import PrunedWeights, apply_masks_, full_masks, prunable_weights
from dpltm.networks.lenet import build_architecture, build_network
from dpltm.pruning import paper_prune_rates, prune_layerwise


def ticket(arch_name: str, rounds: int, device: torch.device) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    hidden = {"lenet5": (120, 84), "dp-cnn": (32,)}.get(arch_name, (32,))
    arch = build_architecture(784, 10, hidden, None, "tanh", arch_name)
    model = build_network(arch, torch.Generator().manual_seed(0))
    masks = full_masks(model)
    for _ in range(rounds):
        weights = prunable_weights(model)
        masks = apply_masks_(model, prune_layerwise(weights, masks, paper_prune_rates(list(weights))))
    return model.to(device), {n: m.to(device) for n, m in masks.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", nargs="+", default=["lenet5", "dp-cnn"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=10, help="interleaved rounds of 5 steps each")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-opacus", action="store_true")
    args = parser.parse_args()
    device = resolve_device(args.device)
    g = torch.Generator(device=device).manual_seed(0)
    features = torch.rand(args.records, 784, device=device, generator=g)
    labels = torch.randint(0, 10, (args.records,), device=device, generator=g)
    index = torch.randperm(args.records, device=device, generator=g)[: args.batch_size].sort().values
    print(f"device={device} batch={args.batch_size} threads={torch.get_num_threads()}")
    print(f"{'network':<8}{'step':<34}{'ms/step':>10}{'× non-private':>16}")
    for name in args.arch:
        plain_model, plain_masks = ticket(name, args.rounds, device)
        plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.1)
        keep_pruned = PrunedWeights(plain_model, plain_masks)

        def plain_step(model=plain_model, opt=plain_opt, keep=keep_pruned) -> None:  # type: ignore[no-untyped-def]
            xb, yb = features.index_select(0, index), labels.index_select(0, index)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
            keep()

        dp_model, dp_masks = ticket(name, args.rounds, device)
        dp_opt = torch.optim.SGD(dp_model.parameters(), lr=0.1)
        layout = step_layout(dp_model, dp_masks, features.dtype)

        def dp_step(model=dp_model, opt=dp_opt, layout=layout, noise=GaussianNoise(1.0)) -> None:  # type: ignore[no-untyped-def]
            xb, yb = features.index_select(0, index), labels.index_select(0, index)
            grads, _, _ = private_gradients(model, xb, yb, clip=1.0, noise=noise, expected_batch_size=args.batch_size,
                                            generator=g, layout=layout)
            apply_gradients(model, grads, opt)

        path = "fused" if type(layout).__name__ == "MaskLayout" else "engine rules"
        results = interleaved({"non-private masked step": plain_step, f"dpltm DP step ({path})": dp_step}, device,
                              rounds=args.repeats, per_round=5)
        if not args.no_opacus:
            results.update(opacus_ghost(name, args.rounds, features[index], labels[index], device, args.repeats))
        base = results["non-private masked step"]
        for label, seconds in results.items():
            print(f"{name:<8}{label:<34}{1e3 * seconds:>10.2f}{seconds / base:>16.2f}")


def opacus_ghost(name: str, rounds: int, x: torch.Tensor, y: torch.Tensor, device: torch.device,
                 repeats: int) -> dict[str, float]:
    try:
        from opacus import PrivacyEngine
    except ImportError:
        return {}
    model, _ = ticket(name, rounds, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.cpu(), y.cpu()), batch_size=len(y))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        private_model, private_opt, criterion, _ = PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            poisson_sampling=False, grad_sample_mode="ghost", criterion=torch.nn.CrossEntropyLoss())

    def step() -> None:
        private_opt.zero_grad(set_to_none=True)
        criterion(private_model(x), y).backward()
        private_opt.step()

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return {"Opacus ghost clipping": timed(step, device, 5 * repeats)}
    except Exception as exc:  # a network Opacus cannot run in this mode: say so, keep the other rows
        print(f"{name}: Opacus ghost clipping failed ({type(exc).__name__}: {str(exc)[:80]})")
        return {}


if __name__ == "__main__":
    main()
