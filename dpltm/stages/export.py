"""`dpltm export`: a trained model as a safetensors file, its privacy statement as metadata."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dpltm.errors import DpltmUserError


def stage_export(model: Path, out: Path | None, overwrite: bool, warn: Callable[[str], None]) -> dict[str, Any]:
    """Write the export (default: the model's path with .safetensors); returns what it holds."""
    from dpltm.export import SUFFIX, export_model
    from dpltm.outputs import prepare_output

    target = out or model.with_suffix(SUFFIX)
    if target.suffix != SUFFIX:
        raise DpltmUserError(f"--out {target}: an export is a {SUFFIX} file")
    prepare_output(target, overwrite=overwrite, inputs=[model])
    metadata = export_model(model, target, warn=warn)
    return {"output": str(target), "privacy": json.loads(metadata["privacy"]),
            "architecture": json.loads(metadata["architecture"]),
            "input_normalisation": json.loads(metadata["input_normalisation"]),
            "privacy_statement": metadata["privacy_statement"]}
