"""dpltm's DP step against Opacus 1.6 on the models people train, side by side in one run: ms a step and peak memory.

Models, on synthetic data of real shapes (speed and memory do not depend on the values):
* `resnet18-gn`: ResNet-18 (torchvision's layout) with GroupNorm(32) for BatchNorm, 32×32×3 inputs, 10 classes;
* `transformer`: a 4-layer pre-norm encoder (d = 256, 4 heads, FFN 1024, sequence 128, vocabulary 10k) whose
  attention is built from nn.Linear layers, over token and position embeddings, mean-pooled to 2 classes;
* `gn-cnn`: a small CNN with GroupNorm on 28×28×1 (two conv blocks, a linear head);
* `embedding`: Embedding(10k, 64) → LayerNorm → Linear → mean over 64 tokens → Linear.
Steps: the non-private step (mean loss, backward, SGD), dpltm's DP step (`make_private(...).step()`: a Poisson batch
of the expected size, masked per-sample clipping, one noise draw, SGD), dense and with a random mask of density 0.3,
Opacus ghost clipping and Opacus hooks (dense: Opacus cannot restrict clipping or noise to a mask) on a fixed batch of
that size. Each (model, step) runs in a fresh process, so that its peak memory is its own: on the CPU the rise of
the peak resident set over the process's size before the first step, in a process of its own whose allocator hands
freed blocks back at once (MALLOC_MMAP_THRESHOLD_, else freed memory kept in the heap counts); on CUDA
`torch.cuda.max_memory_allocated` over what was allocated before it.
A step is timed after `--warmup` steps; each method runs `--rounds` times in turn, and
the fastest round's median of `--steps` is reported (other work on a shared machine only slows a step).

    python benchmarks/bench_models.py [--device cuda] [--models resnet18-gn,transformer] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB, SEQ, WIDTH, HEADS = 10_000, 128, 256, 4
METHODS = ("non-private", "dpltm", "dpltm masked", "opacus ghost", "opacus hooks")


class Attention(nn.Module):
    """Multi-head self-attention from nn.Linear layers (as transformer libraries write it)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value, self.out = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = (f(x).reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for f in (self.query, self.key, self.value))
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = Attention(width, heads)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Encoder(nn.Module):
    def __init__(self, layers: int = 4, width: int = WIDTH, heads: int = HEADS, classes: int = 2) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, width), nn.Embedding(SEQ, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, classes)

    def forward(self, ids: Tensor) -> Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).repeat(ids.shape[0], 1)  # contiguous: Opacus views it
        x = self.blocks(self.tokens(ids) + self.positions(positions))
        return self.head(self.norm(x).mean(1))


class EmbeddingModel(nn.Module):
    def __init__(self, width: int = 64, classes: int = 2) -> None:
        super().__init__()
        self.embed, self.norm = nn.Embedding(VOCAB, width), nn.LayerNorm(width)
        self.mix, self.head = nn.Linear(width, width), nn.Linear(width, classes)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mix(self.norm(self.embed(ids)))).mean(1))


def gn_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))


class BasicBlock(nn.Module):
    """ResNet's basic block with GroupNorm (torchvision's, but its residual added out of place: Opacus's hooks
    cannot take torchvision's in-place `out += identity` on a hooked layer's output)."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(32, outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(32, outputs)
        self.shortcut = (nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.GroupNorm(32, outputs))
                         if stride != 1 or inputs != outputs else nn.Identity())

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(out)) + self.shortcut(x))


def resnet18_gn(classes: int = 10) -> nn.Module:
    """ResNet-18 (He et al. 2016; torchvision's layout: a 7×7/2 stem, max pooling, 2-2-2-2 basic blocks of 64 to
    512 channels) with GroupNorm(32) in place of batch normalisation, as DP training needs (De et al. 2022)."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.GroupNorm(32, 64), nn.ReLU(),
                               nn.MaxPool2d(3, 2, 1)]
    inputs = 64
    for outputs, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(inputs, outputs, stride), BasicBlock(outputs, outputs, 1)]
        inputs = outputs
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes))


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int, torch.Generator], tuple[Tensor, Tensor]]]] = {
    "resnet18-gn": (resnet18_gn, lambda n, g: (torch.randn(n, 3, 32, 32, generator=g),
                                                torch.randint(0, 10, (n,), generator=g))),
    "transformer": (Encoder, lambda n, g: (torch.randint(0, VOCAB, (n, SEQ), generator=g),
                                           torch.randint(0, 2, (n,), generator=g))),
    "gn-cnn": (gn_cnn, lambda n, g: (torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))),
    "embedding": (EmbeddingModel, lambda n, g: (torch.randint(0, VOCAB, (n, 64), generator=g),
                                                torch.randint(0, 2, (n,), generator=g))),
}


def random_masks(model: nn.Module, density: float, generator: torch.Generator) -> dict[str, Tensor]:
    from dpltm.dp.engine import prunable_weight_names

    parameters = dict(model.named_parameters())
    return {name: (torch.rand(parameters[name].shape, generator=generator) < density).to(parameters[name].device)
            for name in prunable_weight_names(model)}


def make_step(model_name: str, method: str, batch: int, device: torch.device) -> Callable[[], None]:
    """One step of `method` on a fresh `model_name`, its data built and moved before any timing."""
    build, data = MODELS[model_name]
    g = torch.Generator().manual_seed(0)
    model = build().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if method.startswith("dpltm"):
        import dpltm

        x, y = data(4 * batch, g)
        masks = random_masks(model, 0.3, g) if method == "dpltm masked" else None
        run = dpltm.make_private(model, optimizer, (x.to(device), y.to(device)), noise_multiplier=1.0, epochs=1000,
                                 batch_size=batch, masks=masks, noise_seed=0,
                                 masks_from="random masks (a benchmark)" if masks else None)
        return run.step
    x, y = (t.to(device) for t in data(batch, g))
    if method == "non-private":
        def plain() -> None:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        return plain
    return opacus_step(model, optimizer, x, y, "ghost" if method == "opacus ghost" else "hooks")


def opacus_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor,
                mode: str) -> Callable[[], None]:
    from opacus import PrivacyEngine

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.cpu(), y.cpu()), batch_size=len(y))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            poisson_sampling=False, grad_sample_mode=mode,
            **({"criterion": nn.CrossEntropyLoss()} if mode == "ghost" else {}))
    private_model, private_optimizer = made[0], made[1]
    criterion = made[2] if mode == "ghost" else nn.CrossEntropyLoss()

    def step() -> None:
        private_optimizer.zero_grad(set_to_none=True)
        criterion(private_model(x), y).backward()
        private_optimizer.step()
    return step


def resident_bytes(field: str) -> int:
    """The process's resident set now (VmRSS) or its peak since the last reset (VmHWM), from /proc/self/status."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(model_name: str, method: str, batch: int, device: torch.device, warmup: int, steps: int) -> dict[str, Any]:
    """ms a step (median) and the peak memory the steps added, in MB."""
    step = make_step(model_name, method, batch, device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:  # the peak resident set reset to the present one (Linux: clear_refs 5), so the build's peak is not counted
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        before = resident_bytes("VmRSS")
    times = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(warmup + steps):
            start = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if cuda else resident_bytes("VmHWM")
    return {"ms": 1000 * statistics.median(times), "peak_mb": max(peak - before, 0) / 2**20}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--batch-size", type=int, default=None, help="default: 32 on the CPU, 128 on CUDA")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each method, interleaved")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    args.batch = batch = args.batch_size or (128 if device.type == "cuda" else 32)
    if args.one:  # a child: one measurement, printed as JSON
        print(json.dumps(measure(*args.one, batch, device, args.warmup, args.steps)))
        return
    print(f"device {device}, torch {torch.__version__}, batch {batch}; ms a step: the fastest of {args.rounds} "
          f"interleaved runs' medians of {args.steps} steps after {args.warmup}; peak memory: the steps' own, in a "
          "fresh process each")
    print(f"{'model':<12} {'step':<13} {'ms/step':>9} {'peak MB':>9} {'vs non-private':>15}")
    for model_name in args.models.split(","):
        results = interleaved(model_name, args.methods.split(","), args)
        for method, r in results.items():
            if "failed" in r:
                print(f"{model_name:<12} {method:<13} failed: {r['failed'][:150]}")
                continue
            plain, ghost = results.get("non-private", {}), results.get("opacus ghost", {})
            versus_plain = f"{r['ms'] / plain['ms']:.2f}x" if "ms" in plain else "-"
            print(f"{model_name:<12} {method:<13} {r['ms']:>9.1f} {r['peak_mb']:>9.1f} {versus_plain:>15}", flush=True)
        ghost = results.get("opacus ghost", {})
        for method in ("dpltm", "dpltm masked"):
            r = results.get(method, {})
            if "ms" in r and "ms" in ghost:
                print(f"{model_name:<12} {method + ' / ghost':<26} time {r['ms'] / ghost['ms']:.2f}x, "
                      f"peak memory {r['peak_mb'] / max(ghost['peak_mb'], 1e-9):.2f}x (target <= 1 each)")


def interleaved(model_name: str, methods: list[str], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each method `--rounds` times, in turn (a slower spell of the machine falls on all alike): per method the
    fastest round's median step (other work on the machine only ever slows a step) and the largest peak memory."""
    rounds: dict[str, list[dict[str, Any]]] = {method: [] for method in methods}
    for _ in range(args.rounds):
        for method in methods:
            if rounds[method] and "failed" in rounds[method][-1]:
                continue
            rounds[method].append(child_measure(model_name, method, args, args.steps))
            if args.device == "cpu" and "failed" not in rounds[method][-1] and len(rounds[method]) == 1:
                # the memory of live tensors: glibc keeps freed blocks below its (rising) mmap threshold in the
                # heap, so the resident set's peak would count what was freed; a fixed low threshold hands
                # every large block back when freed (and slows the step, so this child is not timed)
                memory = child_measure(model_name, method, args, 1, {"MALLOC_MMAP_THRESHOLD_": "131072"})
                rounds[method][-1]["live_mb"] = memory.get("peak_mb", float("nan"))
    return {method: (runs[-1] if "failed" in runs[-1] else
                     {"ms": min(r["ms"] for r in runs),
                      "peak_mb": runs[0]["live_mb"] if "live_mb" in runs[0] else max(r["peak_mb"] for r in runs)})
            for method, runs in rounds.items()}


def child_measure(model_name: str, method: str, args: argparse.Namespace, steps: int,
                  env: dict[str, str] | None = None) -> dict[str, Any]:
    """One measurement in a fresh process (`env` added to its environment)."""
    child = subprocess.run([sys.executable, __file__, "--one", model_name, method, "--device", args.device,
                            "--batch-size", str(args.batch), "--warmup", str(args.warmup), "--steps", str(steps)],
                           capture_output=True, text=True, env={**os.environ, **(env or {})})
    if child.returncode != 0:
        return {"failed": (child.stderr.strip().splitlines() or ["?"])[-1]}
    return dict(json.loads(child.stdout.strip().splitlines()[-1]))


if __name__ == "__main__":
    main()
