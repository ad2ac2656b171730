"""Capturing training steps in CUDA graphs: warm up, capture, and undo what the warm-up changed.

The recipe is PyTorch's whole-network capture (torch.cuda.graphs docs): a few eager runs on a side
stream (so cuBLAS, autograd and the optimiser make their lazily allocated state outside the
graph), then one capture per piece into a shared memory pool. The warm-up ran real optimiser
steps, so the weights are restored and the optimiser's state (momentum, Adam's moments and step)
is set back to zero, which is what a step taken from fresh state reads. Replays then read and
write the same tensors: inputs are fed by copying into the static buffers a piece reads.

Used by the DP step (dpltm.dp.graphed) and the non-private generate step (dpltm.training.plain); these
paths run only where CUDA exists (tests marked `gpu`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

WARMUP_RUNS = 3


def capture(pieces: Sequence[Callable[[], None]], *, modules: Sequence[nn.Module],
            optimizer: torch.optim.Optimizer, generators: Sequence[torch.Generator] = (),
            reset: Sequence[Tensor] = (), before_capture: Callable[[], None] | None = None,
            ) -> list[torch.cuda.CUDAGraph]:
    """One CUDA graph per piece (in order), with the modules' parameters, the optimiser's state and
    the `reset` tensors (set to zero) as they were before the warm-up. `generators` are registered
    with every graph, so each replay draws fresh numbers from them."""
    saved = [p.detach().clone() for module in modules for p in module.parameters()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP_RUNS):
            for piece in pieces:
                piece()
    torch.cuda.current_stream().wait_stream(side)
    if before_capture is not None:
        before_capture()
    graphs: list[torch.cuda.CUDAGraph] = []
    for piece in pieces:
        graph = torch.cuda.CUDAGraph()
        for generator in generators:
            graph.register_generator_state(generator)
        with torch.cuda.graph(graph, pool=graphs[0].pool() if graphs else None):
            piece()
        graphs.append(graph)
    with torch.no_grad():
        for parameter, value in zip((p for module in modules for p in module.parameters()), saved):
            parameter.copy_(value)
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, Tensor):
                    value.zero_()
        for tensor in reset:
            tensor.zero_()
    torch.cuda.synchronize()
    return graphs
