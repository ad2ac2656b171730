"""Released files carry only DP outputs and public facts (docs/privacy.md §8; issue 19).

A model checkpoint, its safetensors export and a private ticket made on a user's own data must
not tell two neighbouring datasets apart except through their DP outputs: no fingerprint of the
user's files, nothing else derived from the records. The official published files are a public
fact, so their fingerprint may stay.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dpltm.checkpoint import load_checkpoint
from dpltm.data import load_dataset
from dpltm.data.release import USER_DATA_NOTE, mismatch
from dpltm.data.sources import clear_cache
from dpltm.export import content_digest
from tests.datafiles import write_digits, write_mnist

FAST = ["--device", "cpu", "--no-progress", "--logger", "none", "--log-dir", "logs"]  # relative: the same in both runs


def _digits_rows(root: Path) -> list[list[int]]:
    with gzip.open(root / "DIGITS" / "digits.csv.gz", "rt") as handle:
        return [[int(v) for v in line.split(",")] for line in handle.read().splitlines()]


def _write_rows(root: Path, rows: list[list[int]]) -> None:
    (root / "DIGITS").mkdir(parents=True, exist_ok=True)
    with gzip.open(root / "DIGITS" / "digits.csv.gz", "wt") as handle:
        handle.write("\n".join(",".join(map(str, row)) for row in rows) + "\n")


@pytest.fixture(scope="module")
def neighbours(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two users' DIGITS-format files that differ in one record, and the same record counts.

    DIGITS' loader insists on its 1797 rows with the official count per digit, so in this format
    a neighbour replaces one record (same label, other pixels). The record is chosen to fall on
    the same side of the per-record hold-outs in both, so every public number (N, the split
    sizes) and hence σ and q agree: what differs may only be DP output."""
    first, second = tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")
    rows = _digits_rows(write_digits(first / "data"))
    base = load_dataset("digits", data_dir=first / "data")
    for index in range(50):
        changed = [list(r) for r in rows]
        changed[index][0] = (changed[index][0] + 7) % 17
        _write_rows(second / "data", changed)
        clear_cache()
        other = load_dataset("digits", data_dir=second / "data")
        if (len(other.train), len(other.val), len(other.test)) == (len(base.train), len(base.val), len(base.test)):
            assert other.fingerprint != base.fingerprint  # a neighbour that a fingerprint would betray
            return first, second
    raise AssertionError("no replacement kept the split sizes")


@pytest.fixture(scope="session")
def _invoke(cli):  # type: ignore[no-untyped-def]
    def run(folder: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> dict[str, Any]:
        """Run in `folder` with relative paths, so both runs name the same paths."""
        monkeypatch.chdir(folder)
        result = cli(*args, "--json")
        return json.loads(result.stdout)  # type: ignore[no-any-return]

    return run


def _without(body: dict[str, Any], dotted: tuple[str, ...]) -> dict[str, Any]:
    """`body` without the DP outputs named by dotted paths (a `*` walks a list)."""
    body = json.loads(json.dumps(body, default=lambda t: None))  # tensors out: they are the DP outputs

    def drop(node: Any, parts: list[str]) -> None:
        if parts[0] == "*":
            for item in node:
                drop(item, parts[1:])
        elif len(parts) == 1:
            node.pop(parts[0], None)
        elif parts[0] in node:
            drop(node[parts[0]], parts[1:])

    for path in dotted:
        drop(body, path.split("."))
    return body


def _fingerprints(root: Path) -> set[str]:
    """Every fingerprint the user's data has under the settings the runs use."""
    clear_cache()
    return {load_dataset("digits", data_dir=root).fingerprint,
            load_dataset("digits", data_dir=root, seed=3).fingerprint}


def _holds_none_of(path: Path, fingerprints: set[str], text: str) -> None:
    raw = path.read_bytes()
    for fingerprint in fingerprints:
        assert fingerprint.encode() not in raw and fingerprint not in text, (path, fingerprint)


MODEL_DP_OUTPUTS = ("state_dict", "history", "report.test_accuracy", "report.val_accuracy")
"""The released weights and what is measured from them (the accuracies, reported without privacy
by design); every other field must be the same for neighbouring datasets."""


def test_model_and_export_metadata_do_not_depend_on_the_users_records(neighbours: tuple[Path, Path],
                                                                     monkeypatch: pytest.MonkeyPatch, _invoke) -> None:
    bodies, exports = [], []
    for folder in neighbours:
        _invoke(folder, monkeypatch, "train", "--dense", "--dataset", "digits", "--data-dir", "data", "--seed", "3",
                "--eps", "2", "--epochs", "1", "--batch-size", "128", "--out", "m.pt", *FAST)
        _invoke(folder, monkeypatch, "export", "--model", "m.pt", "--out", "m.safetensors")
        bodies.append(load_checkpoint(folder / "m.pt", "model"))
        from safetensors import safe_open

        with safe_open(str(folder / "m.safetensors"), framework="pt") as handle:
            exports.append(handle.metadata())
            # the digest is a function of what the file releases (its metadata and DP weights), nothing else
            tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118
            assert exports[-1]["digest"] == content_digest(exports[-1], tensors)
    first, second = (_without(b, MODEL_DP_OUTPUTS) for b in bodies)
    assert first == second
    assert {k: v for k, v in exports[0].items() if k not in ("test_accuracy", "digest")} == \
        {k: v for k, v in exports[1].items() if k not in ("test_accuracy", "digest")}
    assert bodies[0]["data"]["fingerprint"] is None and bodies[0]["data"]["fingerprint_note"] == USER_DATA_NOTE
    assert json.loads(exports[0]["data"])["fingerprint"] is None
    for folder in neighbours:
        fingerprints = _fingerprints(folder / "data")
        body = load_checkpoint(folder / "m.pt", "model")
        _holds_none_of(folder / "m.pt", fingerprints, json.dumps(body, default=str))
        _holds_none_of(folder / "m.safetensors", fingerprints, "")
    # predict still knows the model's own data settings without a fingerprint
    shown = _invoke(neighbours[0], monkeypatch, "predict", "--model", "m.safetensors", "--data-dir", "data")
    assert shown["same_data_settings_as_training"] is True
    other = _invoke(neighbours[0], monkeypatch, "predict", "--model", "m.pt", "--data-dir", "data", "--split", "all",
                    "--expose-training-records")  # another division of its data: can hold its training records
    assert other["same_data_settings_as_training"] is False and other["exposes_training_records"] is True


PRIVATE_TICKET_DP_OUTPUTS = ("theta0", "masks", "density", "layer_density", "val_accuracy",
                             "private_ticket.rounds.*.density", "private_ticket.rounds.*.val_accuracy")


def test_private_ticket_metadata_does_not_depend_on_the_users_records(neighbours: tuple[Path, Path],
                                                                      monkeypatch: pytest.MonkeyPatch, _invoke) -> None:
    for folder in neighbours:
        _invoke(folder, monkeypatch, "generate", "--private", "--dataset", "digits", "--data-dir", "data",
                "--seed", "3", "--hidden", "16", "--eps", "2", "--warmup-epochs", "1", "--epochs", "1",
                "--density", "0.5", "--batch-size", "128", "--out", "p.pt", *FAST)
    first, second = (_without(load_checkpoint(f / "p.pt", "ticket"), PRIVATE_TICKET_DP_OUTPUTS) for f in neighbours)
    assert first == second
    assert first["source"]["data"]["fingerprint"] is None
    for folder in neighbours:
        body = load_checkpoint(folder / "p.pt", "ticket")
        _holds_none_of(folder / "p.pt", _fingerprints(folder / "data"), json.dumps(body, default=str))
    # the ticket still trains on its own data: matched by settings and counts
    report = _invoke(neighbours[0], monkeypatch, "train", "--ticket", "p.pt", "--data-dir", "data", "--out", "pm.pt",
                     *FAST)
    assert report["end_to_end_dp"] is True


def test_a_removed_record_changes_only_the_public_counts(tmp_path: Path) -> None:
    """Add/remove neighbours (MNIST's format allows removing one): the released record of the data
    differs in N alone, while the fingerprint a ticket set keeps would differ."""
    write_mnist(tmp_path / "a", n_train=60, n_test=20)
    write_mnist(tmp_path / "b", n_train=60, n_test=20)
    from dpltm.data.idx import decode_idx, write_idx

    raw = tmp_path / "b" / "MNIST" / "raw"
    for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"):
        array = decode_idx(gzip.decompress((raw / name).read_bytes()), raw / name)
        write_idx(raw / name, np.ascontiguousarray(array[1:]))
    clear_cache()
    first, second = (load_dataset("mnist", data_dir=tmp_path / n) for n in ("a", "b"))
    counts = ("n_train", "n_val", "n_test")
    released = [{k: v for k, v in d.summary().items() if k not in counts} for d in (first, second)]
    assert released[0] == released[1] and released[0]["fingerprint"] is None
    assert sum(first.summary()[k] for k in counts) == sum(second.summary()[k] for k in counts) + 1
    assert first.ticket_set_summary()["fingerprint"] != second.ticket_set_summary()["fingerprint"]
    assert mismatch(first.summary(), second) is not None and mismatch(first.summary(), first) is None


def test_official_files_keep_their_public_fingerprint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file that matched its official md5 is a public fact; the same bytes under another name are not
    checked against it, so they count as the user's."""
    from dpltm.data import tabular

    write_digits(tmp_path)
    path = tmp_path / "DIGITS" / "digits.csv.gz"
    monkeypatch.setitem(tabular.DIGITS_OFFICIAL, "digits.csv.gz", (_md5(path), path.stat().st_size))
    clear_cache()
    official = load_dataset("digits", data_dir=tmp_path)
    assert official.official_files and official.summary()["fingerprint"] == official.fingerprint
    monkeypatch.delitem(tabular.DIGITS_OFFICIAL, "digits.csv.gz")
    clear_cache()
    assert load_dataset("digits", data_dir=tmp_path).summary()["fingerprint"] is None


def _md5(path: Path) -> str:
    import hashlib

    return hashlib.md5(path.read_bytes()).hexdigest()


def test_export_drops_and_inspect_warns_about_an_old_files_fingerprint(neighbours: tuple[Path, Path],
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       cli, _invoke) -> None:
    """A model written before this rule carries the user's fingerprint: inspect says so, export drops it."""
    folder = neighbours[0]
    _invoke(folder, monkeypatch, "train", "--dense", "--dataset", "digits", "--data-dir", "data", "--seed", "3",
            "--eps", "2", "--epochs", "1", "--batch-size", "128", "--out", "old.pt", *FAST)
    body = torch.load(folder / "old.pt", weights_only=True)
    for key in ("official_files", "fingerprint_note", "seed", "val_fraction"):
        body["data"].pop(key)
    body["data"]["fingerprint"] = "0123456789abcdef"  # as older dpltm wrote it
    torch.save(body, folder / "old.pt")
    inspected = cli("inspect", "old.pt", ok=False)
    assert inspected.exit_code == 0 and "do not publish it" in inspected.stderr, inspected.output
    exported = cli("export", "--model", "old.pt", "--out", "old.safetensors", ok=False)
    assert exported.exit_code == 0 and "not copied to the export" in exported.stderr, exported.output
    assert b"0123456789abcdef" not in (folder / "old.safetensors").read_bytes()
    assert "0123456789abcdef" not in cli("inspect", "old.safetensors", ok=False).output
