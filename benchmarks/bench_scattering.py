"""Seconds to scatter N MNIST-sized images: kymatio's `Scattering2D` against dpltm's batched transform
(`dpltm.networks.scattering`, the ScatterNet front end's), interleaved, in one run.

Both in the chunks the feature cache uses (`dpltm.feature_cache.CHUNK`), median of `--repeats` rounds; the
maximum difference between their maps is printed beside the times.

    python benchmarks/bench_scattering.py [--images 8192] [--repeats 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from dpltm.devices import resolve_device
from dpltm.feature_cache import CHUNK
from dpltm.networks.scatter import scattering_class
from dpltm.networks.scattering import Scattering2D


def seconds(transform: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor) -> float:
    if images.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for first in range(0, images.shape[0], CHUNK):
        transform(images[first:first + CHUNK])
    if images.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = resolve_device(args.device)
    images = torch.rand(args.images, 28, 28, generator=torch.Generator().manual_seed(0)).to(device)
    contenders = {"kymatio Scattering2D": scattering_class()(J=2, shape=(28, 28), L=8).to(device),
                  "dpltm batched scattering": Scattering2D(28, device=device)}
    for transform in contenders.values():
        transform(images[:64])  # warm-up: filters, FFT plans
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.repeats):
        for name, transform in contenders.items():
            samples[name].append(seconds(transform, images))
    with torch.no_grad():
        sample = images[:256]
        difference = (contenders["dpltm batched scattering"](sample)
                      - contenders["kymatio Scattering2D"](sample)).abs().max().item()
    base = statistics.median(samples["kymatio Scattering2D"])
    print(f"device={device} images={args.images} threads={torch.get_num_threads()} chunk={CHUNK}")
    print(f"{'transform':<28}{'s':>8}{'images/s':>11}{'× kymatio':>11}")
    for name, values in samples.items():
        median = statistics.median(values)
        print(f"{name:<28}{median:>8.2f}{args.images / median:>11.0f}{median / base:>11.2f}")
    print(f"largest difference between the maps: {difference:.2e}")


if __name__ == "__main__":
    main()
