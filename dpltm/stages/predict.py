"""`dpltm predict`: a trained model (checkpoint or safetensors export) on a dataset's records.

The model's own data settings (split rule, validation fraction, seed) rebuild the same test set it
was evaluated on when the dataset is the one it was trained on, so `predict` reproduces the
training report's test accuracy. Predictions are post-processing of the released model: they
spend no privacy budget.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dpltm.choices import Part
from dpltm.errors import DpltmUserError
from dpltm.paths import check_not_input

PARTS = tuple(choice.value for choice in Part)
TRAINING_RECORDS_EXPOSED = ("per-record labels and model outputs of the private training records: not "
                            "differentially private")
"""What `--part train` on the model's own dataset releases. The DP guarantee covers the model, not
its outputs on the very records it protects: their labels and per-record outputs (and the accuracy
on them) are a membership and attribute signal the ledger does not count."""


def pools_apart(model_split: str, split: str, part: str) -> bool:
    """Whether `part` of the data divided by `split` cannot hold a training record of a model trained under
    `model_split`: a model trained on the official training portion (`train`) and any part of the official test
    portion (`test`), or a model trained on the test portion and the validation or training part under `train`
    (drawn from the training portion). Every other pair can share records (`all` pools both portions)."""
    return (model_split == "train" and split == "test") or (model_split == "test" and split == "train"
                                                            and part != "test")


def predictions_csv(labels: Any, probabilities: Any) -> str:
    """index,label,prediction,p_0..p_{K-1}: one row per record, in the data's order."""
    classes = probabilities.shape[1]
    buffer = io.StringIO()
    buffer.write(",".join(["index", "label", "prediction", *(f"p_{k}" for k in range(classes))]) + "\n")
    predicted = probabilities.argmax(1)
    for i in range(len(labels)):
        cells = [str(i), str(int(labels[i])), str(int(predicted[i]))]
        cells += [f"{float(p):.6g}" for p in probabilities[i]]
        buffer.write(",".join(cells) + "\n")
    return buffer.getvalue()


def exposes_training_records(name: str, same: bool, part: str, split: str | None, model_split: str,
                             consent: bool) -> bool:
    """Whether the records predicted on can hold the model's training records (`same`: its own dataset); refused
    without the user's `consent` (--expose-training-records), and a consent that consents to nothing is refused."""
    exposes = part == "train" and same
    if exposes and not consent:
        raise DpltmUserError(f"--part train on {name}, the model's training data: the output holds "
                             f"{TRAINING_RECORDS_EXPOSED}; pass --expose-training-records to write it anyway")
    if same and split is not None and split != model_split and not pools_apart(model_split, split, part):
        exposes = True  # another division of the model's own data: any part can hold its training records
        if not consent:
            raise DpltmUserError(f"--split {split} divides {name} otherwise than the model's training did "
                                 f"(--split {model_split}), so its {part} part can hold {TRAINING_RECORDS_EXPOSED}; "
                                 f"leave --split out to use the model's own {part} set, or pass "
                                 "--expose-training-records to write it anyway")
    if consent and not exposes:  # a consent that consents to nothing would suggest it did
        raise DpltmUserError(f"--expose-training-records: this {part} part of {name} holds none of the model's "
                             "training records: drop the flag")
    return exposes


def data_settings(model_path: Path, name: str, trained_on: Mapping[str, Any] | None,
                  split: str | None) -> dict[str, Any]:
    """`load_dataset`'s settings: the model file's own (`trained_on`: its training data's, on that dataset), under
    --split; a bad one from the file is the file's fault, not a flag's."""
    from dpltm.data.loaders import check_load_options

    settings: dict[str, Any] = {}
    if trained_on is not None:
        settings = {"split": trained_on.get("split") or "train", "val_fraction": trained_on.get("val_fraction", 0.1),
                    "seed": trained_on.get("seed") or 0}
        try:
            check_load_options(name, settings["split"], settings["val_fraction"], settings["seed"])
        except DpltmUserError as exc:
            raise DpltmUserError(f"{model_path} records settings of its data that dpltm cannot use (a damaged or "
                                 f"edited file?): {exc}") from None
    if split is not None:
        check_load_options(name, split, 0.1, 0)  # --split, the user's own
        settings["split"] = split
    return settings


def stage_predict(model_path: Path, dataset: str | None, part: str, data_dir: Path | None, device: str,
                  out: Path | None, overwrite: bool, download: bool = False,
                  split: str | None = None, expose_training_records: bool = False) -> dict[str, Any]:
    """`split` (the pool to draw from, as in training) defaults to the model's own on its training
    dataset, else to "train" (the official test set is the test set). The training part of the
    model's own dataset is refused unless `expose_training_records` (see `TRAINING_RECORDS_EXPOSED`)."""
    import torch

    from dpltm.data import load_dataset
    from dpltm.data.loaders import DATASETS
    from dpltm.data.release import mismatch
    from dpltm.devices import resolve_device
    from dpltm.export import load_any_model
    from dpltm.outputs import check_text_output_name, prepare_output, write_text_atomic
    from dpltm.privacy.ledger import json_float

    if part not in PARTS:
        raise DpltmUserError(f"--part must be one of {', '.join(PARTS)}, got {part!r}")
    loaded = load_any_model(model_path)
    trained_on = loaded.data
    if dataset is None and trained_on.get("dataset") not in DATASETS:  # the file's word, not a flag's
        raise DpltmUserError(f"{model_path} names its training data {trained_on.get('dataset')!r}, not a dataset dpltm "
                             "knows (a damaged or edited file?): pass --dataset")
    name = dataset or trained_on["dataset"]
    same = name == trained_on["dataset"]
    exposes = exposes_training_records(name, same, part, split, str(trained_on.get("split") or "train"),
                                       expose_training_records)
    if overwrite and out is None:
        raise DpltmUserError("--overwrite replaces the file --out names, and no --out was given: drop --overwrite, "
                             "or give --out")
    if out is not None:
        check_text_output_name(out, "CSV")
        prepare_output(out, overwrite=overwrite, inputs=[model_path])
    settings = data_settings(model_path, name, trained_on if same else None, split)
    torch_device = resolve_device(device)
    if download:
        from dpltm.data.download import fetch_for_run

        fetch_for_run([name], data_dir)
    data = load_dataset(name, data_dir=data_dir, device=torch_device, **settings)
    if out is not None:
        check_not_input(out)  # a data file just read
    differs = mismatch(trained_on, data) if same and split is None else None
    if differs is not None:  # the held-out parts rebuilt from the file's settings are not the ones it was tested on
        raise DpltmUserError(f"{model_path} records data settings that do not give the data it was trained and "
                             f"tested on ({differs}): the file was edited, or {name}'s files changed; its "
                             "training records cannot be told apart, so nothing is predicted")
    in_features, num_classes = loaded.model.arch.in_features, loaded.model.arch.num_classes  # as built, not as stored
    if data.num_features != in_features or data.num_classes != num_classes:
        raise DpltmUserError(f"the model takes {in_features} features and predicts {num_classes} "
                             f"classes; {name} has {data.num_features} features and {data.num_classes} classes")
    records = {"test": data.test, "val": data.val, "train": data.train}[part]
    model = loaded.model.to(torch_device)
    with torch.no_grad():
        probabilities = torch.cat([torch.softmax(model(records.features[i : i + 8192]), dim=1)
                                   for i in range(0, len(records), 8192)]) if len(records) else torch.empty(0, 0)
    correct = int((probabilities.argmax(1) == records.labels).sum()) if len(records) else 0
    report = {
        "model": str(model_path), "model_format": loaded.source, "dataset": name, "part": part,
        "records": len(records), "accuracy": correct / len(records) if len(records) else float("nan"),
        # settings and counts (a released model holds no fingerprint of user data: dpltm.data.release)
        "same_data_settings_as_training": same and mismatch(trained_on, data) is None,
        "trained_on": trained_on["dataset"], "end_to_end_dp": loaded.privacy.end_to_end_dp,
        "epsilon": json_float(loaded.privacy.epsilon), "delta": loaded.privacy.delta,
        "statement": loaded.privacy.statement, "predictions": None if out is None else str(out),
        "exposes_training_records": exposes,
        "warning": f"NOT differentially private: {TRAINING_RECORDS_EXPOSED} ({len(records)} records)" if exposes
        else None,
    }
    if out is not None:
        write_text_atomic(predictions_csv(records.labels.cpu(), probabilities.cpu()), out)
    return report
