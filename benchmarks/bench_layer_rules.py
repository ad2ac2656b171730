"""Each layer type's exact rule against the torch.func fallback, side by side in one run (CPU).

ms per `clipped_gradient_sum_of` call (forward, one backward to the layers' outputs, norms, clipping,
clipped sums) on a network of one layer of the type, a mean over its positions and a linear head
(the head takes the same 2-D Linear rule in every column):

* rule: the registry's rule for the layer (dpltm.dp.rules);
* torch.func: the same layer type with its rule removed, so its per-sample gradients come from the
  torch.func fallback (vmap of a vector-Jacobian product; the check that a layer of unknown type adds
  up to its batch gradient is switched off, so only the per-sample gradients are compared);
* for Linear on sequences and Embedding also the rule's other form (the formed per-sample gradients
  instead of the T × T Grams, the per-id segment sums instead of the Gram of equal ids), which the
  rule picks by size or under a mask.

Timed in turn within every repeat (`interleaved`), median.

    python benchmarks/bench_layer_rules.py [--batch-size 64] [--repeats 10] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from dpltm.dp import conv_ghost
from dpltm.dp.engine import clipped_gradient_sum_of
from dpltm.dp.rules import RULES, FuncRule, embedding


class MeanOver(nn.Module):
    """Mean over the positions: dims 2… of (B, C, …) (channels first) or 1 of (B, T, d) (tokens)."""

    def __init__(self, channels_first: bool) -> None:
        super().__init__()
        self.channels_first = channels_first

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z.flatten(2).mean(dim=2) if self.channels_first else z.mean(dim=1)


@dataclass(frozen=True)
class Case:
    name: str
    layer: Callable[[], nn.Module]
    width: int
    """The layer's output channels (channels first) or last dimension (tokens), the head's input."""
    channels_first: bool
    data: Callable[[int, torch.Generator], torch.Tensor]
    masked: bool = False
    other_form: str | None = None
    """Which of `conv_ghost.use_grams` / `embedding.use_gram` to flip for the rule's other form."""


def floats(*shape: int) -> Callable[[int, torch.Generator], torch.Tensor]:
    return lambda batch, g: torch.randn(batch, *shape, generator=g)


def ids(vocabulary: int, tokens: int) -> Callable[[int, torch.Generator], torch.Tensor]:
    return lambda batch, g: torch.randint(0, vocabulary, (batch, tokens), generator=g)


CASES = (
    Case("Linear T=16 64→64", lambda: nn.Linear(64, 64), 64, False, floats(16, 64), other_form="use_grams"),
    Case("Linear T=128 32→32", lambda: nn.Linear(32, 32), 32, False, floats(128, 32), other_form="use_grams"),
    Case("Linear T=16 64→64 masked", lambda: nn.Linear(64, 64), 64, False, floats(16, 64), masked=True),
    Case("Conv1d 16→32 k5 same", lambda: nn.Conv1d(16, 32, 5, padding="same"), 32, True, floats(16, 128)),
    Case("Conv1d 16→32 k3 s2 g2", lambda: nn.Conv1d(16, 32, 3, stride=2, groups=2), 32, True, floats(16, 128)),
    Case("GroupNorm 8×32 16×16", lambda: nn.GroupNorm(8, 32), 32, True, floats(32, 16, 16)),
    Case("LayerNorm T=64 d=128", lambda: nn.LayerNorm(128), 128, False, floats(64, 128)),
    Case("Embedding 1000×64 T=32", lambda: nn.Embedding(1000, 64, padding_idx=0), 64, False, ids(1000, 32),
         other_form="use_gram"),
    Case("Embedding 1000×32 T=256", lambda: nn.Embedding(1000, 32), 32, False, ids(1000, 256),
         other_form="use_gram"),
    Case("Embedding 1000×64 T=32 masked", lambda: nn.Embedding(1000, 64), 64, False, ids(1000, 32), masked=True),
)


@contextmanager
def torch_func_for(layer_type: type[nn.Module]) -> Iterator[None]:
    """The layer type's rule removed (the torch.func rule serves it), its mixing check switched off."""
    rule, checks = RULES.pop(layer_type), FuncRule.checks
    FuncRule.checks = staticmethod(lambda module: False)  # type: ignore[method-assign]
    try:
        yield
    finally:
        RULES[layer_type], FuncRule.checks = rule, checks  # type: ignore[method-assign]


@contextmanager
def other_form(switch: str) -> Iterator[None]:
    """`conv_ghost.use_grams` or `embedding.use_gram` answering the opposite of what it would."""
    module = conv_ghost if switch == "use_grams" else embedding
    chooser = getattr(module, switch)
    setattr(module, switch, lambda *sizes: not chooser(*sizes))
    try:
        yield
    finally:
        setattr(module, switch, chooser)


def interleaved(steps: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median ms per call of each, timed in turn within every repeat, after 2 warm-up calls each."""
    for step in steps.values():
        for _ in range(2):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1000 for name, t in times.items()}


def steps_for(case: Case, batch: int) -> dict[str, Callable[[], None]]:
    """One `clipped_gradient_sum_of` call per column, on the case's network and a batch of its data."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    layer = case.layer()
    model = nn.Sequential(layer, MeanOver(case.channels_first), nn.Linear(case.width, 10))
    x, y = case.data(batch, g), torch.randint(0, 10, (batch,), generator=g)
    masks = {"0.weight": torch.rand(layer.weight.shape, generator=g) < 0.5} if case.masked else {}

    def call(context: Callable[[], AbstractContextManager[None]]) -> Callable[[], None]:
        def step() -> None:
            with context():
                clipped_gradient_sum_of(model, x, y, 1.0, masks)
        return step

    steps = {"rule": call(nullcontext), "torch.func": call(lambda: torch_func_for(type(layer)))}
    if case.other_form is not None:
        switch = case.other_form
        steps["other form"] = call(lambda: other_form(switch))
    return steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    print(f"ms per clipped_gradient_sum_of call, B = {args.batch_size}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}")
    print(f"{'layer':<32}{'rule':>10}{'other form':>12}{'torch.func':>12}{'× faster':>10}")
    for case in CASES:
        times = interleaved(steps_for(case, args.batch_size), args.repeats)
        other = f"{times['other form']:>12.2f}" if "other form" in times else f"{'—':>12}"
        print(f"{case.name:<32}{times['rule']:>10.2f}{other}{times['torch.func']:>12.2f}"
              f"{times['torch.func'] / times['rule']:>10.1f}")


if __name__ == "__main__":
    main()
