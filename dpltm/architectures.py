"""The built-in networks `--arch` names, one entry each: the one list every front end reads.

Most are of dpltm.networks.lenet's LeNet family: an optional convolutional front — (output channels, kernel
side) per layer, each followed by the activation and 2×2 average pooling — then fully connected
layers; adding one of this family is one `ArchitectureEntry` line. Any other network is one file under
dpltm/networks/ (a `build(arch, generator)` returning a plain `nn.Module`) and one line here naming it
(`module`). The CLI's choices, the config check and the default hidden widths derive from this table.
Nothing heavy is imported here (no torch), so `dpltm --help` stays quick.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchitectureEntry:
    name: str
    conv: tuple[tuple[int, int], ...]
    """The convolutional front; () for a multilayer perceptron."""
    default_hidden: tuple[int, ...] | None
    """Its fully connected widths unless --hidden says otherwise (None: the config's, LeNet-300-100's)."""
    description: str
    module: str | None = None
    """A network of its own file: the module (under dpltm/networks/) whose `build(arch, generator)`
    returns it as a plain `nn.Module`; None for the LeNet family above (dpltm.networks.lenet.LeNet). Such a network
    trains through the DP engine's per-layer rules (dpltm.dp.engine) unless `fused_step`."""
    fused_step: bool = True
    """It trains in the fused ghost-norm DP step (dpltm.dp.step.takes_fused_step), so also static-shape and in
    CUDA graphs (`--cuda-graphs`): the LeNet family and ScatterNet's fully connected heads."""


ARCHITECTURES: dict[str, ArchitectureEntry] = {entry.name: entry for entry in (
    ArchitectureEntry("mlp", (), None, "LeNet-300-100 by default; the paper's"),
    ArchitectureEntry("lenet5", ((6, 5), (16, 5)), (120, 84),
                      "LeNet-5 (LeCun et al. 1998): two 5×5 convolutions with 6 and 16 maps, then 120, 84"),
    ArchitectureEntry("dp-cnn", (), (32,),
                      "the small CNN of the DP-SGD image benchmarks (16 8×8/2 and 32 4×4/2 convolutions, each with "
                      "2×2/1 max pooling, then 32): Opacus's and TF Privacy's MNIST examples; with --activation "
                      "tanh, Papernot et al. 2021's tempered-sigmoid network", module="dpltm.networks.dp_cnn",
                      fused_step=False),
    ArchitectureEntry("scatter-linear", (), (),
                      "a fixed ScatterNet front end (wavelet scattering, J = 2, per-record group normalisation; no "
                      "weights, reads no data) and one linear layer over its 81 maps: Tramèr & Boneh 2021",
                      module="dpltm.networks.scatter"),
    ArchitectureEntry("scatter-mlp", (), (100,),
                      "the same ScatterNet front end and fully connected layers over its maps (100 by default), "
                      "then the classes", module="dpltm.networks.scatter"),
    ArchitectureEntry("scatter-cnn", (), (32,),
                      "the same ScatterNet front end and Tramèr & Boneh 2021's small CNN over its maps (16 and 32 "
                      "3×3 convolutions, then 32); theirs with --activation tanh", module="dpltm.networks.scatter",
                      fused_step=False),
)}


def model_cli(arch: str | None, widths: list[int] | tuple[int, ...] | None, **rest: object) -> dict[str, object]:
    """The `model:` part of a command's settings: a built-in architecture brings its own hidden widths
    (LeNet-5's 120, 84) unless the command gives some."""
    entry = ARCHITECTURES.get(arch) if arch is not None else None
    if widths is None and entry is not None and entry.default_hidden is not None:
        widths = list(entry.default_hidden)
    return {"hidden": None if widths is None else list(widths), "arch": arch, **rest}
