"""The built-in networks `--arch` names, one entry each: the one list every front end reads.

Each is the masked network of dpltm.model: an optional convolutional front — (output channels,
kernel side) per layer, each followed by the activation and 2×2 average pooling — then fully
connected layers. Adding one of this family is one `ArchitectureEntry` line; the CLI's choices,
the config check and the default hidden widths derive from this table. Nothing heavy is imported
here (no torch), so `dpltm --help` stays quick.
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


ARCHITECTURES: dict[str, ArchitectureEntry] = {entry.name: entry for entry in (
    ArchitectureEntry("mlp", (), None, "LeNet-300-100 by default; the paper's"),
    ArchitectureEntry("lenet5", ((6, 5), (16, 5)), (120, 84),
                      "LeNet-5 (LeCun et al. 1998): two 5×5 convolutions with 6 and 16 maps, then 120, 84"),
)}


def model_cli(arch: str | None, widths: list[int] | tuple[int, ...] | None, **rest: object) -> dict[str, object]:
    """The `model:` part of a command's settings: a built-in architecture brings its own hidden widths
    (LeNet-5's 120, 84) unless the command gives some."""
    entry = ARCHITECTURES.get(arch) if arch is not None else None
    if widths is None and entry is not None and entry.default_hidden is not None:
        widths = list(entry.default_hidden)
    return {"hidden": None if widths is None else list(widths), "arch": arch, **rest}
