"""Every user mistake a tester found on the real CLI: one line, exit code 2, nothing written.

Each case runs `dpltm.cli.main()` (the console entry point, the parser's own errors included)
with `sys.argv`, the working directory and $DPLTM_DATA_DIR set as a user's shell would; a few
run again as a real `python -m dpltm.cli` subprocess. For each: exit code 2, stderr exactly one
non-empty line starting `dpltm: error:`, no traceback anywhere, and no file created or changed
(names, sizes and mtimes of the working directory and the data directory, before and after).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from dpltm.artefacts.format import FORMAT_VERSION
from dpltm.cli import main
from dpltm.errors import DpltmUserError
from tests.datafiles import write_digits, write_mnist


@dataclass(frozen=True)
class Case:
    id: str
    args: tuple[str, ...]
    message: str  # a fragment the one line must contain
    files: dict[str, bytes | Callable[[Path], bytes]] = field(default_factory=dict)
    """Written into the working directory first; a callable makes the bytes from the trained model's path."""
    data: str = "good"  # "good" or "truncated-digits"
    env: dict[str, str] = field(default_factory=dict)  # set in the environment for this case


GEN = ("generate", "--dataset", "digits", "--rounds", "1", "--iterations", "5", "--device", "cpu",
       "--no-progress")
TRAIN = ("train", "--dense", "--dataset", "digits", "--epochs", "1", "--device", "cpu", "--no-progress")
ACCOUNT = ("account", "--q", "0.01", "--steps", "1000")


_ALIAS_BOMB = ("generate: {rounds: [&a [" + '"' + "x" * 100 + '"], ' + ", ".join(
    f"&{n} [{', '.join([f'*{p}'] * 9)}]" for p, n in zip("abcde", "bcdef", strict=True)) + "]}\n").encode()
"""A YAML alias bomb: small on disk, a value whose repr runs to megabytes."""


_RUN_JSON = b'{"format": "dpltm-run-v1", "command": "train", "history": [{"epoch": 1}]}'
"""The smallest run record `dpltm plot` draws."""


def _broken_model(edit: Callable[[dict], None]) -> Callable[[Path], bytes]:
    """The trained model's file with `edit` applied to its body (top-level schema intact)."""

    def make(model: Path) -> bytes:
        body = torch.load(model, weights_only=True)
        edit(body)
        buffer = io.BytesIO()
        torch.save(body, buffer)
        return buffer.getvalue()

    return make


_BROKEN_MODELS: list[tuple[str, Callable[[dict], None], str]] = [
    ("architecture-empty", lambda b: b.__setitem__("architecture", {}), "'architecture' is invalid"),
    ("architecture-text-width", lambda b: b["architecture"].__setitem__("hidden", "abc"), "'architecture' is invalid"),
    ("architecture-negative", lambda b: b["architecture"].__setitem__("hidden", [-3]), "'architecture' is invalid"),
    ("state-dict-foreign", lambda b: b.__setitem__("state_dict", {"a": torch.zeros(2)}),
     "does not fit its architecture"),
    ("state-dict-not-tensors", lambda b: b.__setitem__("state_dict", dict.fromkeys(b["state_dict"], 5)),
     "is not a tensor"),
    ("state-dict-wrong-shape", lambda b: b["state_dict"].__setitem__("output.bias", torch.zeros(3)),
     "has shape (3,)"),
    ("config-data-int", lambda b: b["config"].__setitem__("data", 5), "'config.data' is not a mapping"),
    ("config-seed-text", lambda b: b["config"].__setitem__("seed", "x"), "'config.seed' is not an integer"),
    ("statement-stored", lambda b: b["privacy"].__setitem__("statement", "(ε = 0.1)-DP"),
     "computed from its ledger, not stored"),
    ("report-stored", lambda b: b.__setitem__("report", {"epsilon": 0.1}), "holds unknown ['report']"),
    ("caveats-int", lambda b: b["privacy"].__setitem__("caveats", 5), "'privacy.caveats' has the wrong type"),
    ("no-outcome", lambda b: b.pop("outcome"), "lacks 'outcome'"),
    ("ledger-empty", lambda b: b["privacy"].__setitem__("ledger", {}), "'privacy.ledger' is invalid"),
]


def _broken_export(key: str, text: str) -> Callable[[Path], bytes]:
    """An export of the trained model with metadata `key` set to `text`."""

    def make(model: Path) -> bytes:
        from safetensors.torch import save

        from dpltm.export import FORMAT

        body = torch.load(model, weights_only=True)
        metadata = {"format": FORMAT, "architecture": json.dumps(body["architecture"]), "data": "{}",
                    "privacy": "{}", "input_normalisation": "{}", "privacy_statement": "DP", "ledger": "{}"}
        metadata[key] = text
        return save({k: v.contiguous() for k, v in body["state_dict"].items()}, metadata=metadata)

    return make


def _set_json(key: str, field: str, value: object) -> Callable[[dict[str, str]], None]:
    """Edit one field of one JSON value of an export's metadata."""

    def edit(metadata: dict[str, str]) -> None:
        record = json.loads(metadata[key])
        record[field] = value
        metadata[key] = json.dumps(record)

    return edit


def _edited_export(edit: Callable[[dict[str, str]], None], keep_digest: bool = False) -> Callable[[Path], bytes]:
    """The trained model's real export with its metadata edited by hand; without its digest unless `keep_digest`
    (as an export written before digests: the checks behind the digest must hold on their own)."""

    def make(model: Path) -> bytes:
        import tempfile

        from safetensors import safe_open
        from safetensors.torch import save

        from dpltm.export import export_model

        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "e.safetensors"
            export_model(model, out)
            with safe_open(str(out), framework="pt") as handle:
                metadata = dict(handle.metadata())
                tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118
        edit(metadata)
        if not keep_digest:
            metadata.pop("digest")
        return save(tensors, metadata=metadata)

    return make


def _set_privacy(key: str, value: object) -> Callable[[dict[str, str]], None]:
    def edit(metadata: dict[str, str]) -> None:
        metadata["privacy"] = json.dumps({**json.loads(metadata["privacy"]), key: value})
    return edit


def _set_sigma(metadata: dict[str, str]) -> None:
    ledger = json.loads(metadata["ledger"])
    ledger["training"]["sigma"] = 50.0
    metadata["ledger"] = json.dumps(ledger)


def _swap_activation(metadata: dict[str, str]) -> None:
    """relu ↔ tanh: an edit that still builds a network, one that predicts otherwise."""
    record = json.loads(metadata["architecture"])
    record["activation"] = "tanh" if record["activation"] == "relu" else "relu"
    metadata["architecture"] = json.dumps(record)


def _headed_without_body(kind: str) -> bytes:
    """A file with dpltm's header and nothing else (a tester's hand-made 'checkpoint')."""
    buffer = io.BytesIO()
    torch.save({"format": "dpltm", "kind": kind, "format_version": FORMAT_VERSION}, buffer)
    return buffer.getvalue()

CASES = [
    # ---- --config files ------------------------------------------------------------------
    Case("config-binary", (*GEN, "--config", "c.yaml"), "not UTF-8",
         {"c.yaml": bytes(range(128, 256)) + b"\x00\x01"}),
    Case("config-dev-zero", (*GEN, "--config", "/dev/zero"), "not a regular file"),
    Case("config-duplicate-key", (*GEN, "--config", "c.yaml"), "gives the key 'seed' twice (line 2)",
         {"c.yaml": b"seed: 1\nseed: 2\n"}),
    Case("config-duplicate-nested-key", (*GEN, "--config", "c.yaml"), "gives the key 'rounds' twice",
         {"c.yaml": b"generate:\n  rounds: 1\n  rounds: 2\n"}),
    Case("config-alias-bomb", (*GEN, "--config", "c.yaml"), "more characters)", {"c.yaml": _ALIAS_BOMB}),
    Case("generate-iterations-1e15", (*GEN[:5], "--iterations", "1000000000000000", *GEN[7:]),
         "--iterations must be at most 1000000"),
    Case("config-iterations-1e15", (*GEN[:5], *GEN[7:], "--config", "c.yaml"), "--iterations must be at most",
         {"c.yaml": b"generate: {iterations: 1000000000000000}\n"}),
    Case("config-bool-maybe", (*GEN, "--config", "c.yaml"), "generate.controls='maybe' is not a valid boolean",
         {"c.yaml": b"generate: {controls: maybe}\n"}),
    Case("config-bool-from-int", (*GEN, "--config", "c.yaml"), "generate.controls=1 is not a valid boolean",
         {"c.yaml": b"generate: {controls: 1}\n"}),
    Case("config-seed-true", (*GEN, "--config", "c.yaml"), "seed=True is not a valid int",
         {"c.yaml": b"seed: true\n"}),
    Case("config-data-string", (*GEN, "--config", "c.yaml"), "section 'data'",
         {"c.yaml": b'data: "x"\n'}),
    Case("config-data-string-select", ("select", "--config", "c.yaml"), "section 'data'",
         {"c.yaml": b'data: "x"\n'}),
    Case("config-epochs-x-train", (*TRAIN, "--config", "c.yaml"), "train.epochs='x' is not a valid int",
         {"c.yaml": b"train: {epochs: x}\n"}),
    Case("config-epochs-x-generate", (*GEN, "--config", "c.yaml"), "train.epochs='x' is not a valid int",
         {"c.yaml": b"train: {epochs: x}\n"}),
    Case("config-dataset-int", (*GEN, "--config", "c.yaml"), "data.dataset=5 is not a valid string",
         {"c.yaml": b"data: {dataset: 5}\n"}),
    Case("config-unknown-section", (*TRAIN, "--config", "c.yaml"), "unknown section 'trian'",
         {"c.yaml": b"trian: {epochs: 3}\n"}),
    Case("config-unknown-key", (*GEN, "--config", "c.yaml"), "unknown config key(s) ['epoch']",
         {"c.yaml": b"train: {epoch: 3}\n"}),
    Case("config-experiment-profile", (*GEN, "--config", "c.yaml"), "unknown section",
         {"c.yaml": b"name: quick\nepsilons: [1.0]\n"}),
    Case("config-lr-inf", (*GEN, "--config", "c.yaml"), "--lr must be a finite number",
         {"c.yaml": b"generate: {lr: .inf}\n"}),
    # ---- non-finite and absurd numbers -----------------------------------------------------
    Case("generate-val-fraction-0", (*GEN, "--val-fraction", "0"), "--val-fraction 0 leaves no validation records"),
    Case("generate-lr-inf", (*GEN, "--lr", "inf"), "--lr must be a finite number"),
    Case("generate-lr-1e30", (*GEN, "--lr", "1e30"), "--lr must lie in (0, 1000]"),
    Case("generate-lr-nan", (*GEN, "--lr", "nan"), "--lr must be a finite number"),
    Case("generate-val-fraction-nan", (*GEN, "--val-fraction", "nan"), "--val-fraction must be a finite"),
    Case("generate-prune-rate-inf", (*GEN, "--prune-rates", "inf"), "--prune-rates must be a finite"),
    Case("generate-prune-rates-per-layer", (*GEN, "--prune-rates", "0.1,0.2"), "one rate or one per layer (3:"),
    Case("generate-seed-negative", (*GEN, "--seed", "-1"), "--seed must lie in"),
    Case("train-noise-seed-negative", (*TRAIN, "--eps2", "1", "--noise-seed", "-1"), "'--noise-seed'"),
    Case("select-seed-negative", ("select", "--eps1", "0.1", "--seed", "-1"), "'--seed'"),
    Case("audit-canary-seed-negative", ("audit", "--dense", "--dataset", "digits", "--canary-seed", "-1"),
         "'--canary-seed'"),
    Case("audit-canaries-1e12", ("audit", "--dense", "--dataset", "digits", "--threat-model", "black-box",
                                 "--canaries", "1000000000000", "--device", "cpu"),
         "--canaries must lie in [2, 100000]"),
    Case("private-density-1e-9", ("generate", "--private", "--dataset", "digits", "--density", "1e-9",
                                  "--device", "cpu", "--no-progress"), "would keep no weight"),
    Case("run-private-density-1e-9", ("run", "--dataset", "digits", "--ticket-source", "private", "--density", "1e-9",
                                      "--device", "cpu", "--no-progress"), "would keep no weight"),
    Case("train-lr-inf", (*TRAIN, "--eps2", "1", "--lr", "inf"), "--lr must be a finite number"),
    Case("train-lr-1e30", (*TRAIN, "--eps2", "1", "--lr", "1e30"), "--lr must lie in (0, 1000]"),
    Case("train-clip-inf", (*TRAIN, "--eps2", "1", "--clip", "inf"), "--clip must be a finite number"),
    Case("train-physical-batch-0", (*TRAIN, "--eps2", "1", "--physical-batch", "0"),
         "--physical-batch must be at least 1, got 0"),
    Case("train-physical-batch-negative", (*TRAIN, "--eps2", "1", "--physical-batch", "-5"),
         "--physical-batch must be at least 1, got -5"),
    Case("train-physical-batch-fraction", (*TRAIN, "--eps2", "1", "--physical-batch", "2.5"), "'--physical-batch'"),
    Case("train-augmult-0", (*TRAIN, "--eps2", "1", "--augmult", "0"), "--augmult must be at least 1"),
    Case("train-augmult-huge", (*TRAIN, "--eps2", "1", "--augmult", "1000000"), "--augmult must lie in [1, 16]"),
    Case("train-augmult-fraction", (*TRAIN, "--eps2", "1", "--augmult", "2.5"), "'--augmult'"),
    Case("train-augmult-dp-cnn", (*TRAIN, "--eps2", "1", "--arch", "dp-cnn", "--augmult", "2"),
         "--arch dp-cnn takes one image per record"),
    Case("run-physical-batch-0", ("run", "--dataset", "digits", "--physical-batch", "0"),
         "--physical-batch must be at least 1, got 0"),
    Case("train-lr-under-tuned", (*TRAIN, "--eps2", "1", "--recipe", "tuned", "--lr", "0.1"),
         "--lr 0.1 would be ignored"),
    Case("train-delta-nan", (*TRAIN, "--eps2", "1", "--delta", "nan"), "--delta must be a finite number"),
    Case("train-sigma-inf", (*TRAIN, "--sigma", "inf"), "--sigma must be a finite number"),
    Case("train-target-eps-inf", (*TRAIN, "--eps2", "1", "--max-eps", "inf"), "--max-eps must be"),
    Case("select-nu-inf", ("select", "--nu", "inf"), "--nu must be a finite number"),
    # ---- runaway model sizes ----------------------------------------------------------------
    Case("hidden-huge", (*GEN, "--hidden", "100000,100000"), "dpltm builds at most 1e+08"),
    Case("hidden-wide-first-layer", (*GEN, "--dataset", "mnist", "--hidden", "200000"), "784 inputs"),
    Case("project-to-huge", (*GEN, "--project-to", "10000000"), "--project-to 10000000"),
    # ---- data on disk -----------------------------------------------------------------------
    Case("digits-300-of-1797-rows", GEN, "DIGITS has 1797 rows", data="truncated-digits"),
    # ---- privacy parameters -----------------------------------------------------------------
    Case("select-eps1-1e308", ("select", "--eps1", "1e308"), "--eps1 must lie in (0, 100]"),
    Case("select-eps1-nan", ("select", "--eps1", "nan"), "--eps1 must be a finite number"),
    Case("train-sigma-tiny", (*TRAIN, "--sigma", "1e-9"), "--sigma must be at least 0.3"),
    Case("train-eps2-huge", (*TRAIN, "--eps2", "1e6"), "--eps must lie in (0, 100]"),
    Case("train-sigma-1e300", (*TRAIN, "--sigma", "1e300"), "--sigma must be at most 10000"),
    Case("account-sigma-1e300", (*ACCOUNT, "--sigma", "1e300"), "--sigma must be a finite number in [0.3, 10000]"),
    Case("train-shaped-noise-without-public-data", (*TRAIN, "--noise", "shaped"),
         "--noise shaped needs public data: pass --public-dataset"),
    Case("train-non-private-lr-sigma", (*TRAIN, "--non-private", "--lr-sigma", "1"), "a --non-private run has no σ"),
    Case("train-epochs-too-many-steps", (*TRAIN, "--epochs", "99999999"), "--epochs 99999999 at"),
    Case("account-sigma-tiny", (*ACCOUNT, "--sigma", "1e-9"), "--sigma must be a finite number in [0.3, 10000]"),
    Case("account-sigma-nan", (*ACCOUNT, "--sigma", "nan"), "--sigma must be a finite number in [0.3, 10000]"),
    Case("account-steps-1e12", ("account", "--q", "0.01", "--steps", "1000000000000", "--sigma", "1"),
         "steps must be at most 1e+06"),
    Case("account-epochs-too-many-steps",
         ("account", "--dataset-size", "60000", "--batch-size", "1", "--epochs", "1000", "--sigma", "1"),
         "steps must be at most"),
    Case("account-eps-1e9", (*ACCOUNT, "--eps", "1e9"), "--eps must lie in (0, 100]"),
    Case("account-eps1-1e308", (*ACCOUNT, "--sigma", "1", "--eps1", "1e308"), "eps1 must lie in (0, 100]"),
    Case("account-delta-nan", (*ACCOUNT, "--sigma", "1", "--delta", "nan"), "delta must lie"),
    Case("account-q-nan", ("account", "--q", "nan", "--steps", "10", "--sigma", "1"), "--q must lie in (0, 1]"),
    Case("account-epsilon-beyond-range", ("account", "--q", "1", "--steps", "1000000", "--sigma", "1"),
         "no meaningful privacy"),
    Case("train-epsilon-beyond-range", (*TRAIN, "--sigma", "0.3", "--epochs", "500"), "no meaningful privacy"),
    Case("account-sigma-and-eps", (*ACCOUNT, "--sigma", "1", "--eps", "1"), "not both"),
    Case("account-q-and-dataset-size",
         (*ACCOUNT, "--sigma", "1", "--dataset-size", "1000", "--batch-size", "10", "--epochs", "1"), "not both"),
    Case("account-steps-and-epochs", ("account", "--steps", "100", "--epochs", "2", "--sigma", "1"), "not both"),
    # ---- outputs that would destroy an input or an earlier result ({tickets}, {winner}: real files) --
    Case("select-out-is-tickets", ("select", "--best", "--out", "{tickets}"), "also this command's input"),
    Case("select-best-seed", ("select", "--best", "--seed", "3"), "--best has none (the highest score): drop --seed"),
    Case("select-random-nu", ("select", "--rule", "random", "--nu", "3"), "--rule random looks at no score"),
    Case("select-out-in-proc", ("select", "--rule", "random", "--tickets", "{tickets}", "--out", "/proc/w.pt"),
         "cannot write in /proc: /proc is the kernel's"),
    Case("select-rule-private-size-negative", ("select", "--rule", "noise-aware", "--tickets", "{tickets}",
                                               "--private-size", "-3"), "--private-size must be at least 2"),
    Case("select-rule-random-eps1", ("select", "--rule", "random", "--tickets", "{tickets}", "--eps1", "0.5"),
         "the random selection spends no ε1"),
    Case("select-existing-output", ("select", "--best", "--out", "{winner}"), "already exists: pass --overwrite"),
    Case("train-out-is-ticket", ("train", "--ticket", "{winner}", "--dataset", "digits", "--eps2", "1",
                                 "--out", "{winner}", "--device", "cpu"), "also this command's input"),
    Case("train-existing-output", (*TRAIN, "--eps2", "1", "--out", "{tickets}"), "already exists: pass --overwrite"),
    Case("generate-out-is-config", (*GEN, "--config", "c.yaml", "--out", "c.yaml"), "--config file",
         {"c.yaml": b"seed: 0\n"}),
    Case("predict-out-is-data", ("predict", "--model", "{model}", "--device", "cpu", "--out",
                                 "{data}/DIGITS/digits.csv.gz", "--overwrite"), "also this command's input"),
    Case("train-out-is-data", (*TRAIN, "--eps2", "1", "--out", "{data}/DIGITS/digits.csv.gz", "--overwrite"),
         "also this command's input"),
    Case("generate-out-is-data", (*GEN, "--out", "{data}/DIGITS/digits.csv.gz", "--overwrite"),
         "also this command's input"),
    Case("plot-out-is-run-json", ("plot", "r.json", "--out", "r.json", "--overwrite"), "also this command's input",
         {"r.json": _RUN_JSON}),
    # ---- paths the file system cannot hold, names with control characters ------------------------
    *[Case(f"long-name-{cmd[0]}", (*cmd, "--out", "x" * 300 + suffix), "the file system allows", {"r.json": _RUN_JSON})
      for cmd, suffix in [(TRAIN + ("--eps2", "1"), ".pt"), (GEN, ".pt"), (("select", "--best"), ".pt"),
                          (("export", "--model", "{model}"), ".safetensors"),
                          (("predict", "--model", "{model}", "--device", "cpu"), ".csv"),
                          (("plot", "r.json"), ".png")]],
    Case("long-name-log-dir", (*TRAIN, "--eps2", "1", "--logger", "csv", "--log-dir", "x" * 300),
         "the file system allows"),
    Case("long-name-folder", (*TRAIN, "--eps2", "1", "--out", "x" * 300 + "/m.pt"), "the file system allows"),
    Case("long-name-data-dir", (*TRAIN, "--eps2", "1", "--data-dir", "x" * 300), "the file system allows"),
    Case("newline-in-path", ("inspect", "a\nb.pt"), "checkpoint a\\nb.pt does not exist"),
    # ---- launch environment, loggers, devices: checked before any work ---------------------------
    Case("rank-not-a-number", (*TRAIN, "--eps2", "1"), "$RANK='abc' is not a whole number", env={"RANK": "abc"}),
    Case("local-rank-on-one-process", (*TRAIN, "--eps2", "1"), "$LOCAL_RANK=1 says this is not the first process",
         env={"LOCAL_RANK": "1"}),
    Case("num-nodes-without-launcher", (*TRAIN, "--eps2", "1", "--num-nodes", "2"), "--num-nodes 2: start one"),
    Case("log-dir-is-a-file", (*TRAIN, "--eps2", "1", "--logger", "csv", "--log-dir", "f.txt"),
         "--log-dir f.txt is not a directory", {"f.txt": b"x"}),
    # the run's own folder under the root, checked with the other outputs (before "training on …" is printed)
    Case("log-dir-command-folder-is-a-file", (*TRAIN, "--eps2", "1", "--logger", "csv", "--log-dir", "logs"),
         "--log-dir logs: logs/train is not a directory, and the run's log goes in logs/train/digits",
         {"logs/train": b"x"}),
    Case("log-dir-dataset-folder-is-a-file", (*GEN, "--logger", "csv", "--log-dir", "logs"),
         "logs/generate/digits is not a directory", {"logs/generate/digits": b"x"}),
    # /sys: writable to root by os.access, yet nothing can be made there; refused before any work, not at the save
    Case("out-on-a-pseudo-file-system", (*TRAIN, "--eps2", "1", "--out", "/sys/dpltm-test/m.pt"), " /sys"),
    Case("log-dir-on-a-pseudo-file-system", (*TRAIN, "--eps2", "1", "--logger", "csv", "--log-dir", "/sys/dpltm-test"),
         " /sys"),
    Case("hidden-only-separators", (*GEN, "--hidden", ","), "--hidden takes comma-separated numbers"),
    Case("hidden-exponent", (*GEN, "--hidden", "1e2"), "--hidden takes positive integers up to 1000000 (digits"),
    Case("hidden-other-digits", (*GEN, "--hidden", "٣٠"), "--hidden takes positive integers"),
    Case("hidden-past-any-width", (*GEN, "--hidden", "99999999999999999999999999"), "--hidden takes positive"),
    Case("scatter-mlp-without-hidden-layers", (*GEN, "--config", "c.yaml"),
         "scatter-mlp needs at least one hidden layer", {"c.yaml": b"model: {arch: scatter-mlp, hidden: []}\n"}),
    Case("predict-split-all-holds-training-records",
         ("predict", "--model", "{model}", "--device", "cpu", "--split", "all", "--part", "test"),
         "otherwise than the model's training did (--split train), so its test part can hold per-record labels"),
    Case("train-out-safetensors", (*TRAIN, "--eps2", "1", "--out", "m.safetensors"), "names a safetensors file"),
    Case("generate-out-safetensors", (*GEN, "--out", "t.SAFETENSORS"), "names a safetensors file"),
    Case("generate-no-validation-records", (*GEN, "--val-fraction", "0.000001"), "drew no validation records"),
    Case("train-patience-without-validation", (*TRAIN, "--eps2", "1", "--val-fraction", "0", "--patience", "1"),
         "--patience stops on validation accuracy"),
    Case("account-eps-aliases-at-odds", (*ACCOUNT, "--eps", "1", "--eps2", "2"),
         "--eps and --eps2 are one option, given twice with different values"),
    Case("account-eps-repeated-at-odds", (*ACCOUNT, "--eps", "0.5", "--eps", "5"),
         "--eps was given twice with different values (--eps 0.5 and --eps 5): give it once"),
    Case("train-delta-repeated-at-odds", (*TRAIN, "--eps2", "1", "--delta", "1e-5", "--delta=1e-3"),
         "--delta was given twice with different values (--delta 1e-5 and --delta 1e-3)"),
    Case("account-neighbouring-aliases-at-odds",
         (*ACCOUNT, "--sigma", "1", "--neighbouring", "replace-one", "--neighboring=add-remove"),
         "--neighbouring and --neighboring are one option"),
    Case("device-empty", (*TRAIN, "--eps2", "1", "--device", ""), "--device got an empty value"),
    Case("data-dir-empty", (*TRAIN, "--eps2", "1", "--data-dir="), "--data-dir got an empty value"),
    Case("export-an-export", ("export", "--model", "e.safetensors", "--out", "x.safetensors"),
         "is a safetensors file (a `dpltm export`), not a dpltm checkpoint",
         {"e.safetensors": _edited_export(lambda metadata: None)}),
    Case("audit-confidence-below-one-half", ("audit", "--dense", "--dataset", "digits", "--confidence", "0.3"),
         "--confidence must lie in [0.5, 1)"),
    Case("config-yaml-syntax-error-has-its-line", (*GEN, "--config", "c.yaml"), "(line 4, column 1)",
         {"c.yaml": b"seed: 1\ngenerate:\n  rounds: [1\n"}),
    Case("select-nu-1e308", ("select", "--nu", "1e308"), "--nu must lie in [0, 1e+06]"),
    Case("run-freeze-names-no-layer", ("run", "--dataset", "digits", "--public-dataset", "mnist", "--rewind", "public",
                                       "--freeze", "nope",
                                       "--device", "cpu", "--no-progress"),
         "--freeze names no layer of this network: nope"),
    Case("train-freeze-only-commas", (*TRAIN, "--eps2", "1", "--freeze", ",,"),
         "is not a valid list (an item between its commas is empty)"),
    Case("generate-out-exists-and-is-no-ticket-file", (*GEN, "--out", "s.pt"),
         "--out s.pt exists and is no ticket file this command can continue", {"s.pt": b"not a checkpoint"}),
    Case("generate-private-delta-one-half", ("generate", "--dataset", "digits", "--private", "--delta", "0.5",
                                             "--device", "cpu", "--no-progress"),
         "the PLD accountant gives epsilon 0 at this setting (delta = 0.5"),
    Case("inspect-empty-path", ("inspect", ""), "an argument is empty: a path or name was expected"),
    Case("run-project-to-zero", ("run", "--dataset", "digits", "--project-to", "0"),
         "--project-to must be a positive width, got 0"),
    Case("hidden-empty", (*GEN, "--hidden", ""), "--hidden got an empty value"),
    Case("hidden-blank", (*GEN, "--hidden", " "), "--hidden got an empty value"),
    Case("hidden-empty-item", (*GEN, "--hidden", "300,,100"), "--hidden has an empty item in '300,,100'"),
    Case("prune-rates-empty-item", (*GEN, "--prune-rates", "0.3,,0.2"), "--prune-rates has an empty item"),
    Case("run-private-public-dataset", ("run", "--ticket-source", "private", "--dataset", "digits",
                                        "--public-dataset", "mnist"), "--public-dataset applies to public tickets"),
    Case("run-private-public-split", ("run", "--ticket-source", "private", "--dataset", "digits",
                                      "--public-split", "all"), "--public-split applies to public tickets only"),
    Case("run-private-cuda-graphs", ("run", "--ticket-source", "private", "--dataset", "digits", "--cuda-graphs"),
         "a private ticket's DP warm-up and training run in the eager step"),
    Case("export-out-names-a-folder", ("export", "--model", "m.pt", "--out", "d/"), "e.g. --out d/model.safetensors"),
    Case("out-empty", (*TRAIN, "--eps2", "1", "--out", ""), "--out takes the name of the file to write"),
    Case("out-names-a-folder", (*TRAIN, "--eps2", "1", "--out", "models/"), "--out models/ names a folder"),
    Case("out-names-a-folder-with-equals", (*GEN, "--out=t/"), "give the file to write in it (e.g. --out t/tickets.pt"),
    Case("run-cuda-graphs-scatter-cnn", ("run", "--dataset", "mnist", "--public-dataset", "kmnist", "--arch",
                                         "scatter-cnn", "--cuda-graphs", "--no-progress"),
         "--arch scatter-cnn trains in the eager step"),
    Case("run-cuda-graphs-on-cpu", ("run", "--dataset", "digits", "--public-dataset", "mnist", "--cuda-graphs",
                                    "--device", "cpu", "--no-progress"), "--cuda-graphs needs a CUDA device"),
    Case("download-mirror-bad-ipv6", ("download", "mnist", "--mirror", "http://[::1"), "must be an http:// or"),
    Case("download-mirror-bad-port", ("download", "mnist", "--mirror", "http://host:port/"), "must be an http:// or"),
    # ---- conflicting options ----------------------------------------------------------------
    Case("select-best-and-eps1", ("select", "--best", "--eps1", "0.1"), "drop --eps1"),
    Case("select-noise-aware-and-best", ("select", "--noise-aware", "--best", "--private-size", "10"),
         "its own choice: drop --best"),
    Case("audit-dense-and-ticket", ("audit", "--dense", "--ticket", "x.pt", "--dataset", "digits"),
         "or --dense, not both"),
    Case("select-noise-aware-without-size", ("select", "--noise-aware"), "needs --private-size"),
    Case("select-halving-negative", ("select", "--noise-aware", "--private-size", "10", "--halving", "-1"),
         "--halving must lie in [0, 10]"),
    Case("select-halving-without-noise-aware", ("select", "--best", "--halving", "2"),
         "--halving (select.halving) drops candidates of the noise-aware choice"),
    Case("select-search-without-noise-aware", ("select", "--best", "--search", "start"),
         "widens the noise-aware choice"),
    Case("select-search-unknown", ("select", "--noise-aware", "--private-size", "10", "--search", "start,everything"),
         "--search: unknown 'everything'"),
    Case("run-search-with-best", ("run", "--dataset", "digits", "--public-dataset", "mnist", "--choice", "best",
                                  "--search", "start", "--no-progress"), "the best selection trains no candidate"),
    Case("run-search-unknown", ("run", "--dataset", "digits", "--public-dataset", "mnist", "--search", "rewind",
                                "--no-progress"), "--search: unknown 'rewind'"),
    Case("run-search-private-ticket", ("run", "--dataset", "digits", "--ticket-source", "private", "--search",
                                       "start", "--no-progress"), "--search"),
    Case("run-halving-with-best", ("run", "--dataset", "digits", "--public-dataset", "mnist", "--choice", "best",
                                   "--halving", "1", "--no-progress"), "the best selection trains none"),
    Case("run-halving-too-many", ("run", "--dataset", "digits", "--public-dataset", "mnist", "--halving", "11",
                                  "--no-progress"), "--halving must lie in [0, 10]"),
    Case("run-halving-private-tickets", ("run", "--dataset", "digits", "--ticket-source", "private", "--halving", "2",
                                         "--no-progress"), "--halving applies to public tickets only"),
    Case("select-planned-run-without-noise-aware", ("select", "--eps2", "1"), "add --noise-aware"),
    Case("train-non-private-with-eps2", (*TRAIN, "--non-private", "--eps2", "1"), "drop --eps/--sigma"),
    Case("train-non-private-with-sigma", (*TRAIN, "--non-private", "--sigma", "1"), "drop --eps/--sigma"),
    Case("generate-rounds-unbounded", (*GEN[:3], "--rounds", "1000000", "--iterations", "1", "--no-progress"),
         "--rounds must lie in [0, 100]"),
    Case("generate-out-damaged-existing", (*GEN, "--out", "t.pt"), "t.pt is not a readable dpltm checkpoint",
         files={"t.pt": b"not a checkpoint"}),
    Case("train-lr-and-lr-sigma", (*TRAIN, "--eps2", "1", "--lr", "0.5", "--lr-sigma", "2"),
         "give --lr (a fixed step size) or --lr-sigma"),
    Case("train-scatter-recipe-on-an-mlp-ticket", ("train", "--ticket", "{winner}", "--dataset", "digits", "--recipe",
                                                   "scatter", "--epochs", "1", "--device", "cpu", "--no-progress"),
         "--recipe scatter is for scatter-linear, scatter-mlp, scatter-cnn; this ticket's network is mlp"),
    Case("select-noise-aware-nu", ("select", "--noise-aware", "--private-size", "1000", "--nu", "3"),
         "--nu weighs density in the score"),
    Case("select-best-reselect", ("select", "--best", "--reselect"), "--reselect allows another exponential"),
    # --best (like every rule but the noise-aware one) reads no data and computes nothing: data options are refused
    Case("select-best-device", ("select", "--best", "--device", "cpu"),
         "--device is for --noise-aware, which trains on data; --best reads only the ticket file: drop it"),
    Case("select-best-data-dir", ("select", "--best", "--data-dir", "{data}"), "--data-dir is for --noise-aware"),
    Case("select-exponential-device-and-data-dir", ("select", "--eps1", "0.1", "--device", "cpu", "--data-dir",
                                                    "{data}"),
         "--device and --data-dir are for --noise-aware, which trains on data; the exponential selection reads only"),
    Case("train-clip-tiny", (*TRAIN, "--eps2", "1", "--clip", "1e-300"), "--clip must be at least 1e-06"),
    Case("config-clip-tiny", (*TRAIN, "--eps2", "1", "--config", "c.yaml"),
         "--clip must be at least 1e-06 (below it the clipped gradients and the noise σ·C lose all precision in "
         "float32), got 1e-09 (in section 'train' of c.yaml)", {"c.yaml": b"train: {clip: 1e-9}\n"}),
    Case("config-lr-quoted", (*TRAIN, "--eps2", "1", "--config", "c.yaml"),
         "train.lr='0.1' is not a valid float: it is a string (in quotes); write the number without them (in "
         "section 'train' of c.yaml)", {"c.yaml": b'train: {lr: "0.1"}\n'}),
    # `-` is standard output to many tools; every dpltm output is a file: no file named '-' is made
    *[Case(f"out-stdout-{cmd[0]}", (*cmd, "--out", "-"),
           "--out - : this command writes a file; give a path, '-' (standard output) is not supported",
           {"r.json": _RUN_JSON})
      for cmd in [(*TRAIN, "--eps2", "1"), GEN, ("select", "--best"), ("export", "--model", "{model}"),
                  ("predict", "--model", "{model}", "--device", "cpu"), ("plot", "r.json")]],
    Case("train-clip-huge", (*TRAIN, "--eps2", "1", "--clip", "1e30"), "--clip must be at most 1e+06"),
    Case("train-out-names-a-csv", (*TRAIN, "--eps2", "1", "--out", "m.csv"), "--out m.csv names a CSV file"),
    Case("predict-out-names-a-model-file", ("predict", "--model", "{model}", "--out", "p.safetensors"),
         "--out p.safetensors names a model file, but this command writes CSV"),
    Case("train-non-private-with-dp-options", (*TRAIN, "--non-private", "--noise", "dpd", "--clip", "5"),
         "--non-private trains without clipping, noise or accounting: drop --noise, --clip"),
    Case("train-non-private-with-noise-seed", (*TRAIN, "--non-private", "--noise-seed", "3", "--accountant", "rdp"),
         "drop --noise-seed, --accountant"),
    Case("train-non-private-with-delta", (*TRAIN, "--non-private", "--delta", "1e-6"), "drop --delta"),
    Case("train-public-split-alone", (*TRAIN, "--eps2", "1", "--public-split", "test"),
         "--public-split chooses a split of --public-dataset"),
    Case("train-dense-public-tickets", (*TRAIN, "--eps2", "1", "--public-tickets"), "drop it with --dense"),
    Case("train-dense-rewind-public", (*TRAIN, "--eps2", "1", "--rewind", "public"), "drop them with --dense"),
    Case("train-dense-output-layer", (*TRAIN, "--eps2", "1", "--output-layer", "keep"), "drop them with --dense"),
    Case("train-rewind-foo", (*TRAIN, "--eps2", "1", "--rewind", "foo"),
         "--rewind must be init, public or a step K ≥ 1"),
    Case("train-rewind-warmup", (*TRAIN, "--eps2", "1", "--rewind", "warmup"), "got 'warmup'"),
    Case("train-output-layer-foo", (*TRAIN, "--eps2", "1", "--output-layer", "foo"), "'foo' is not one of"),
    Case("config-rewind-foo", (*TRAIN, "--eps2", "1", "--config", "c.yaml"),
         "--rewind must be init, public or a step K", {"c.yaml": b"train: {rewind: foo}\n"}),
    Case("config-output-layer-list", (*TRAIN, "--eps2", "1", "--config", "c.yaml"),
         "train.output_layer=['keep'] is not a valid string", {"c.yaml": b"train: {output_layer: [keep]}\n"}),
    Case("train-same-data-rewind-public", ("train", "--ticket", "{winner}", "--dataset", "digits", "--eps2", "1",
                                           "--rewind", "public", "--device", "cpu"), "is not DP"),
    Case("train-output-layer-keep-from-init", ("train", "--ticket", "{winner}", "--dataset", "digits", "--eps2", "1",
                                               "--output-layer", "keep", "--device", "cpu"),
         "--output-layer keep applies with --rewind public"),
    Case("run-private-rewind-public", ("run", "--dataset", "digits", "--ticket-source", "private", "--rewind",
                                       "public"), "--rewind applies to public tickets only"),
    Case("run-output-layer-keep-across-inputs", ("run", "--dataset", "digits", "--public-dataset", "mnist", "--rewind",
                                                 "public", "--output-layer", "keep", "--device", "cpu"),
         "output layer cannot carry over"),
    Case("run-rewind-foo", ("run", "--dataset", "digits", "--rewind", "foo"), "got 'foo'"),
    Case("run-scatter-recipe-across-widths", ("run", "--dataset", "digits", "--recipe", "scatter", "--choice", "best"),
         "--recipe scatter trains scatter-linear tickets, made on kmnist's 784 values"),
    Case("run-cnn-recipe-on-an-mlp", ("run", "--dataset", "digits", "--recipe", "cnn", "--arch", "mlp"),
         "--recipe cnn was chosen for --arch lenet5; --arch mlp trains with --recipe tuned or paper"),
    Case("run-scatter-recipe-on-lenet5", ("run", "--dataset", "mnist", "--public-dataset", "kmnist", "--recipe",
                                          "scatter", "--arch", "lenet5"),
         "--arch lenet5 trains with --recipe cnn, tuned or paper"),
    Case("train-cnn-recipe-on-an-mlp", (*TRAIN, "--eps2", "1", "--recipe", "cnn", "--arch", "mlp"),
         "--recipe cnn is LeNet-5's (--arch lenet5)"),
    # ---- files with dpltm's header and no body ------------------------------------------------
    Case("inspect-headed-empty", ("inspect", "e.pt"), "damaged 'tickets' checkpoint",
         {"e.pt": _headed_without_body("tickets")}),
    Case("select-headed-empty", ("select", "--best", "--tickets", "e.pt"), "damaged 'tickets' checkpoint",
         {"e.pt": _headed_without_body("tickets")}),
    Case("train-headed-empty", ("train", "--ticket", "e.pt", "--dataset", "digits", "--eps2", "1"),
         "damaged 'ticket' checkpoint", {"e.pt": _headed_without_body("ticket")}),
    # ---- `run`: everything checked before the (long) ticket generation ---------------------------
    Case("run-same-dataset", ("run", "--dataset", "mnist", "--public-dataset", "mnist"), "must differ"),
    Case("run-projection-mismatch", ("run", "--dataset", "digits", "--public-dataset", "mnist", "--project-to", "100"),
         "projection width must be 64"),
    Case("run-unknown-dataset", ("run", "--dataset", "cifar"), "'cifar' is not one of"),
    Case("run-cnn-across-input-sizes", ("run", "--dataset", "digits", "--public-dataset", "mnist", "--arch", "dp-cnn"),
         "use --arch mlp"),
    Case("generate-dp-cnn-on-8x8", (*GEN, "--arch", "dp-cnn"), "at least 14×14 pixels"),
    Case("generate-private-dp-cnn", ("generate", "--private", "--dataset", "digits", "--arch", "dp-cnn", "--eps", "1"),
         "at least 14×14 pixels"),
    Case("train-freeze-unknown-layer", (*TRAIN, "--eps2", "1", "--freeze", "hidden.9"), "names no layer"),
    Case("train-freeze-every-layer", (*TRAIN, "--eps2", "1", "--freeze", "hidden.0,hidden.1,output"), "every layer"),
    Case("train-freeze-number", (*TRAIN, "--eps2", "1", "--freeze", "0"), "freeze"),
    Case("run-private-freeze", ("run", "--ticket-source", "private", "--dataset", "digits", "--freeze", "hidden.0"),
         "--freeze applies to public tickets only"),
    Case("generate-scatter-linear-hidden", (*GEN, "--arch", "scatter-linear", "--hidden", "32"), "takes no --hidden"),
    Case("generate-private-lenet5-on-8x8", ("generate", "--private", "--dataset", "digits", "--arch", "lenet5",
                                            "--eps", "1"), "too small for this network"),
    # ---- model checkpoints that pass the top-level schema but are broken inside ------------------
    *[Case(f"{cmd}-{name}", args, message, {"b.pt": _broken_model(edit)})
      for name, edit, message in _BROKEN_MODELS
      for cmd, args in [("predict", ("predict", "--model", "b.pt", "--device", "cpu")),
                        ("export", ("export", "--model", "b.pt")), ("inspect", ("inspect", "b.pt"))]],
    # ---- safetensors exports whose metadata has the wrong types ----------------------------------
    *[Case(f"{cmd}-export-{key}-{label}", args, message, {"b.safetensors": _broken_export(key, text)})
      for key, text, label, message in [("data", "5", "int", "'data' is not a JSON object"),
                                        ("architecture", "[1, 2]", "list", "'architecture' is not a JSON object"),
                                        ("privacy", "[]", "list", "'privacy' is not a JSON object"),
                                        ("test_accuracy", "{", "not-json", "'test_accuracy' is not JSON"),
                                        ("ledger", "[" * 100_000 + "]" * 100_000, "deep", "'ledger' is not JSON"),
                                        ("privacy_statement", "", "empty", "no privacy statement")]
      for cmd, args in [("predict", ("predict", "--model", "b.safetensors", "--device", "cpu")),
                        ("inspect", ("inspect", "b.safetensors"))]],
    # ---- real exports whose privacy copies were edited by hand: each must match its ledger --------
    *[Case(f"{cmd}-export-edited-{label}", args, message, {"b.safetensors": _edited_export(edit)})
      for label, edit, message in [
          ("epsilon", _set_privacy("epsilon", 0.01), "says epsilon = 0.01, its ledger gives"),
          ("scope", _set_privacy("end_to_end_dp", "sometimes"), "says end_to_end_dp = sometimes"),
          ("sigma", _set_sigma, "privacy record is inconsistent")]
      for cmd, args in [("predict", ("predict", "--model", "b.safetensors", "--device", "cpu")),
                        ("inspect", ("inspect", "b.safetensors"))]],
    # ---- real exports whose network or data record was edited: the file is blamed, never a flag not given ----
    *[Case(f"predict-export-edited-{label}", ("predict", "--model", "b.safetensors", "--device", "cpu"), message,
           {"b.safetensors": _edited_export(edit)})
      for label, edit, message in [
          ("activation", _set_json("architecture", "activation", "swish"), "its architecture record does not build"),
          ("dataset", _set_json("data", "dataset", "cifar"), "names its training data 'cifar'"),
          ("val-fraction", _set_json("data", "val_fraction", 7), "records settings of its data"),
          # settings dpltm can use but that rebuild other held-out records: refused, never reported as its test set
          ("seed", _set_json("data", "seed", 1), "do not give the data it was trained and tested on"),
          ("split", _set_json("data", "split", "all"), "do not give the data it was trained and tested on"),
          ("hidden-as-text", _set_json("architecture", "hidden", "300"), "hidden and conv must be lists"),
          ("in-features-as-text", _set_json("architecture", "in_features", "64"), "in_features must be a whole"),
          ("builtin-by-name", _set_json("architecture", "name", "lenet5"), "described by its layers"),
          ("wider-input", _set_json("architecture", "in_features", 32), "its weights do not fit its architecture")]],
    # ---- real exports edited after export with their digest kept: refused as changed, whatever was edited ----
    *[Case(f"{cmd}-export-digest-{label}", args, "contents differ from the digest written at export",
           {"b.safetensors": _edited_export(edit, keep_digest=True)})
      for label, edit in [("activation", _swap_activation),  # builds and predicts, differently: only the digest sees it
                          ("test-accuracy", lambda m: m.__setitem__("test_accuracy", "0.999")),
                          ("source", lambda m: m.__setitem__("source_checkpoint", "elsewhere.pt"))]
      for cmd, args in [("predict", ("predict", "--model", "b.safetensors", "--device", "cpu")),
                        ("inspect", ("inspect", "b.safetensors"))]],
    Case("plot-deep-json", ("plot", "r.json"), "nested too deeply",
         {"r.json": b"[" * 100_000 + b"]" * 100_000}),
]

#: Run again as a real subprocess (slower: each imports torch afresh).
SUBPROCESS_IDS = ("config-binary", "generate-lr-inf", "hidden-huge", "digits-300-of-1797-rows",
                  "account-steps-1e12", "select-eps1-1e308")


@pytest.fixture(scope="module")
def data_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    good = tmp_path_factory.mktemp("data")
    write_digits(good)
    write_mnist(good, "MNIST", n_train=50, n_test=20)
    truncated = tmp_path_factory.mktemp("truncated")
    write_digits(truncated)
    digits = truncated / "DIGITS" / "digits.csv.gz"
    rows = gzip.decompress(digits.read_bytes()).decode().splitlines(keepends=True)
    digits.write_bytes(gzip.compress("".join(rows[:300]).encode()))
    return {"good": good, "truncated-digits": truncated}


@pytest.fixture(scope="module")
def tickets(data_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real ticket set, for `select` (which reads its settings before the ticket file)."""
    folder = tmp_path_factory.mktemp("tickets")
    path = folder / "t.pt"
    code, _, err = _run_in_process([*GEN, "--batch-size", "16", "--data-dir", str(data_dirs["good"]),
                                    "--out", str(path)], folder, data_dirs["good"])
    assert code == 0, err
    code, _, err = _run_in_process(["select", "--best", "--tickets", str(path), "--out", str(folder / "w.pt")],
                                   folder, data_dirs["good"])
    assert code == 0, err
    return path


@pytest.fixture(scope="module")
def model(tickets: Path, data_dirs: dict[str, Path]) -> Path:
    """A trained model (one epoch on DIGITS), for predict/export/inspect."""
    path = tickets.parent / "m.pt"
    code, _, err = _run_in_process([*TRAIN, "--eps2", "1", "--logger", "none", "--out", str(path)],
                                   tickets.parent, data_dirs["good"])
    assert code == 0, err
    return path


def _run_in_process(args: list[str], cwd: Path, data: Path) -> tuple[int, str, str]:
    """`main()` as the console script runs it; returns (exit code, stdout, stderr)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        mp.setenv("DPLTM_DATA_DIR", str(data))
        mp.setattr(sys, "argv", ["dpltm", *args])
        out, err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = io.StringIO(), io.StringIO()
        try:
            try:
                main()
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            return code, sys.stdout.getvalue(), sys.stderr.getvalue()
        finally:
            sys.stdout, sys.stderr = out, err


def _run_subprocess(args: list[str], cwd: Path, data: Path) -> tuple[int, str, str]:
    env = {**os.environ, "DPLTM_DATA_DIR": str(data), "COLUMNS": "200"}
    result = subprocess.run([sys.executable, "-m", "dpltm.cli", *args], cwd=cwd, env=env, text=True,
                            capture_output=True, timeout=300)
    return result.returncode, result.stdout, result.stderr


def snapshot(*roots: Path) -> dict[str, tuple[int, int]]:
    """Every path under `roots` with its mtime and size (directories included)."""
    out = {}
    for root in roots:
        for path in [root, *root.rglob("*")]:
            st = path.lstat()  # a link as itself (a loop of links has no target to stat)
            out[str(path)] = (st.st_mtime_ns, st.st_size)
    return out


def assert_one_line_error(code: int, stdout: str, stderr: str, message: str) -> None:
    assert "Traceback" not in stdout + stderr, stderr
    assert code == 2, (code, stderr)
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), stderr
    assert lines[0].startswith("dpltm: error: "), stderr
    assert message in lines[0], lines[0]


def _prepare(case: Case, cwd: Path, data_dirs: dict[str, Path], tickets: Path) -> list[str]:
    model = tickets.parent / "m.pt"
    for name, content in case.files.items():
        (cwd / name).parent.mkdir(parents=True, exist_ok=True)
        (cwd / name).write_bytes(content(model) if callable(content) else content)
    args = [a.replace("{tickets}", str(tickets)).replace("{winner}", str(tickets.parent / "w.pt"))
            .replace("{model}", str(model)).replace("{data}", str(data_dirs[case.data])) for a in case.args]
    if args[0] == "select" and "--tickets" not in args:
        args += ["--tickets", str(tickets)]
    return args


def _check(case: Case, runner, tmp_path: Path, data_dirs: dict[str, Path], tickets: Path,  # type: ignore[no-untyped-def]
           also: tuple[str, ...] = ()) -> None:
    cwd = tmp_path / "work"
    cwd.mkdir()
    data = data_dirs[case.data]
    args = _prepare(case, cwd, data_dirs, tickets)
    before = snapshot(tmp_path, data, tickets.parent)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in case.env.items():
            mp.setenv(name, value)
        code, stdout, stderr = runner(args, cwd, data)
    assert_one_line_error(code, stdout, stderr, case.message)
    assert all(fragment in stderr for fragment in also), stderr
    after = snapshot(tmp_path, data, tickets.parent)
    assert after == before


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_user_mistake_is_one_line_and_writes_nothing(case: Case, tmp_path: Path, data_dirs: dict[str, Path],
                                                     tickets: Path, model: Path) -> None:
    _check(case, _run_in_process, tmp_path, data_dirs, tickets)


@pytest.mark.parametrize("case", [c for c in CASES if c.id in SUBPROCESS_IDS], ids=list(SUBPROCESS_IDS))
def test_user_mistake_as_a_real_subprocess(case: Case, tmp_path: Path, data_dirs: dict[str, Path],
                                           tickets: Path) -> None:
    _check(case, _run_subprocess, tmp_path, data_dirs, tickets)


def test_an_exports_statement_is_its_ledgers_never_the_stored_text(model: Path, tmp_path: Path) -> None:
    """An export's stored statement may be an older release's wording or an edit: what dpltm shows is
    the ledger's own statement (after the file's CAVEAT lines)."""
    from dpltm.export import load_exported, read_metadata

    edited = tmp_path / "e.safetensors"
    edited.write_bytes(_edited_export(lambda m: m.__setitem__("privacy_statement", "(ε = 0.001, δ = 1e-5)-DP"))(model))
    honest = tmp_path / "h.safetensors"
    honest.write_bytes(_edited_export(lambda m: None, keep_digest=True)(model))
    shown, expected = read_metadata(edited), read_metadata(honest)
    assert "0.001" not in shown["privacy_statement"] and shown["privacy_statement"] == expected["privacy_statement"]
    assert load_exported(edited).privacy == load_exported(honest).privacy


def test_an_exports_digest_covers_its_weights_and_older_exports_without_one_still_load(model: Path,
                                                                                        tmp_path: Path) -> None:
    """One weight changed after export, the metadata untouched: refused. The same file without a digest (an export
    written before digests) loads, and its digest is the one `content_digest` gives for what was written."""
    from safetensors import safe_open
    from safetensors.torch import save

    from dpltm.export import content_digest, export_model, load_exported

    path = tmp_path / "e.safetensors"
    export_model(model, path)
    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata())
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118
    assert metadata["digest"] == content_digest(metadata, tensors)
    load_exported(path)
    name = next(k for k, v in tensors.items() if v.is_floating_point() and bool((v != 0).any()))
    flat = tensors[name].flatten()
    index = int((flat != 0).nonzero()[0])
    flat[index] = flat[index] * 1.5
    tensors[name] = flat.view(tensors[name].shape)
    path.write_bytes(save(tensors, metadata=metadata))
    with pytest.raises(DpltmUserError, match="differ from the digest written at export"):
        load_exported(path)
    del metadata["digest"]
    path.write_bytes(save(tensors, metadata=metadata))
    load_exported(path)


# ---- unreadable data folders ------------------------------------------------------------------


@pytest.mark.parametrize(("dataset", "folder"), [("digits", "DIGITS"), ("mnist", "raw")])
def test_unreadable_data_folder_is_one_line_naming_it(dataset: str, folder: str, tmp_path: Path,
                                                      data_dirs: dict[str, Path], tickets: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """chmod 000 does not stop root (tests run as root here): stat() raising EACCES stands in."""
    real_is_file = pathlib.Path.is_file

    def denied(self: pathlib.Path) -> bool:
        if folder in self.parts:
            raise PermissionError(13, "Permission denied", str(self))
        return real_is_file(self)

    monkeypatch.setattr(pathlib.Path, "is_file", denied)
    case = Case(f"unreadable-{folder}", (*GEN[:2], dataset, *GEN[3:]), "Permission denied")
    named = str(data_dirs["good"] / ("DIGITS" if dataset == "digits" else "MNIST/raw"))
    _check(case, _run_in_process, tmp_path, data_dirs, tickets, also=(f"cannot read {named}{os.sep}",))


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="chmod 000 does not stop root")
def test_chmod_000_raw_folder_is_one_line(tmp_path: Path, data_dirs: dict[str, Path], tickets: Path) -> None:
    data = tmp_path / "data"
    write_mnist(data, "MNIST", n_train=50, n_test=20)
    raw = data / "MNIST" / "raw"
    raw.chmod(0)
    try:
        cwd = tmp_path / "work"
        cwd.mkdir()
        code, stdout, stderr = _run_subprocess([*GEN[:2], "mnist", *GEN[3:]], cwd, data)
        assert_one_line_error(code, stdout, stderr, "Permission denied")
        assert str(raw) in stderr
        assert not list(cwd.iterdir())
    finally:
        raw.chmod(0o755)


# ---- the pure checks behind the data cases ------------------------------------------------------


def test_find_file_names_the_path_it_cannot_search(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dpltm.data.sources import find_file

    target = tmp_path / "raw" / "x.gz"

    def denied(self: pathlib.Path) -> bool:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(pathlib.Path, "is_file", denied)
    with pytest.raises(DpltmUserError, match=f"cannot read {re.escape(str(target))}: Permission denied"):
        find_file([target])


def test_official_md5_only_for_the_official_name_and_size(tmp_path: Path) -> None:
    from dpltm.data.sources import official_md5

    official = {"f.gz": ("0123", 5)}
    (tmp_path / "f.gz").write_bytes(b"12345")
    (tmp_path / "g.gz").write_bytes(b"12345")
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "f.gz").write_bytes(b"123")
    assert official_md5(tmp_path / "f.gz", official) == "0123"
    assert official_md5(tmp_path / "g.gz", official) is None  # not an official name
    assert official_md5(tmp_path / "short" / "f.gz", official) is None  # cut short: checked structurally


def test_digits_of_the_official_size_must_have_the_official_md5(tmp_path: Path) -> None:
    from dpltm.data import load_dataset
    from dpltm.data.tabular import DIGITS_OFFICIAL

    (tmp_path / "DIGITS").mkdir()
    size = DIGITS_OFFICIAL["digits.csv.gz"][1]
    (tmp_path / "DIGITS" / "digits.csv.gz").write_bytes(bytes(size))
    with pytest.raises(DpltmUserError, match="differs from the official 9b335364a7bfd63947c7480a5bd51f2d"):
        load_dataset("digits", data_dir=tmp_path)


def test_digits_must_have_the_official_rows_per_digit(tmp_path: Path) -> None:
    from dpltm.data import load_dataset

    write_digits(tmp_path)
    path = tmp_path / "DIGITS" / "digits.csv.gz"
    rows = gzip.decompress(path.read_bytes()).decode().splitlines()
    rows[0] = rows[0].rsplit(",", 1)[0] + ",9"  # 1797 rows, but one digit relabelled
    path.write_bytes(gzip.compress(("\n".join(rows) + "\n").encode()))
    with pytest.raises(DpltmUserError, match=r"DIGITS has 1797 rows .* found 1797 \(177, "):
        load_dataset("digits", data_dir=tmp_path)
    assert load_dataset("digits", data_dir=write_digits(tmp_path / "ok")).num_features == 64


# ---- inputs that would block, loggers not installed, a full disk --------------------------------


@pytest.mark.parametrize(("args", "fifo"), [((*GEN, "--config", "p.yaml"), "p.yaml"), (("inspect", "p.pt"), "p.pt"),
                                            (("predict", "--model", "p.pt"), "p.pt"),
                                            (("plot", "p.json"), "p.json")])
def test_fifo_input_is_refused_not_read(args: tuple[str, ...], fifo: str, tmp_path: Path,
                                        data_dirs: dict[str, Path], tickets: Path) -> None:
    """A named pipe would block the read forever: refused before it is opened."""
    cwd = tmp_path / "work"
    cwd.mkdir()
    os.mkfifo(cwd / fifo)
    code, stdout, stderr = _run_in_process(list(args), cwd, data_dirs["good"])
    assert_one_line_error(code, stdout, stderr, "not a regular file")


@pytest.mark.skipif(__import__("importlib.util").util.find_spec("mlflow") is not None, reason="MLflow installed")
def test_missing_logger_package_is_refused_before_any_work(tmp_path: Path, data_dirs: dict[str, Path],
                                                           tickets: Path) -> None:
    case = Case("logger-mlflow-missing", (*TRAIN, "--eps2", "1", "--logger", "mlflow"), "needs MLflow")
    _check(case, _run_in_process, tmp_path, data_dirs, tickets)


@pytest.mark.parametrize("command", ["train", "generate", "predict", "export"])
def test_full_disk_is_one_line_and_leaves_no_file(command: str, tmp_path: Path, data_dirs: dict[str, Path],
                                                  tickets: Path, model: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC while the output is written: one line, the temp file removed, no run folder left."""
    import errno

    import dpltm.outputs

    real_fsync = os.fsync

    def full(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[-1].startswith(".out."):
            raise OSError(errno.ENOSPC, "No space left on device", "out")
        real_fsync(fd)

    if not os.path.exists("/proc/self/fd"):
        pytest.skip("needs /proc to tell the output's writes from the others")
    monkeypatch.setattr(dpltm.outputs.os, "fsync", full)
    args = {"train": [*TRAIN, "--eps2", "1", "--logger", "csv"], "generate": [*GEN, "--logger", "csv"],
            "predict": ["predict", "--model", str(model), "--device", "cpu"],
            "export": ["export", "--model", str(model)]}[command]
    out = "out" + (".safetensors" if command == "export" else "")
    cwd = tmp_path / "work"
    cwd.mkdir()
    code, stdout, stderr = _run_in_process([*args, "--out", out], cwd, data_dirs["good"])
    assert "Traceback" not in stdout + stderr, stderr
    assert code == 2, (code, stderr)
    errors = [line for line in stderr.splitlines() if line.startswith("dpltm:")]  # after progress lines
    assert errors == [stderr.splitlines()[-1]] and "cannot write out" in errors[0] and "No space left" in errors[0]
    assert [str(p.relative_to(cwd)) for p in cwd.rglob("*") if p.is_file()] == []


@pytest.mark.parametrize(("val_accuracy", "shown"), [(float("nan"), "(no validation set)"),
                                                     (None, "(no validation set)"), (0.5, "(validation 0.5000)")])
def test_a_run_without_validation_records_says_so_not_nan(val_accuracy: float | None, shown: str) -> None:
    from rich.console import Console

    from dpltm.artefacts.trained_model import TrainingReport
    from dpltm.stages.train import print_training_report

    console = Console(file=io.StringIO(), width=200)
    unread = dict.fromkeys(("epsilon", "epsilon_dp_part", "epsilon_scope", "warning", "epsilon_spent_at_stop",
                            "delta", "accountant", "composition", "neighboring", "end_to_end_dp", "private",
                            "caveats", "privacy", "tickets", "density", "transfer", "released_weights",
                            "noise_parameter", "sigma_calibrated", "sample_rate", "dataset", "randomness",
                            "processes", "log_dir"))
    print_training_report(TrainingReport(**unread, test_accuracy=0.9, val_accuracy=val_accuracy, epochs_run=1,
                                         steps=2, stop_reason="finished 1 epochs", noise_multiplier=None,
                                         statement="non-private", output="m.pt"), console)
    assert shown in console.file.getvalue() and "nan" not in console.file.getvalue()  # type: ignore[attr-defined]


def _flipped(model: Path) -> bytes:
    """The model's file with one byte of its largest tensor entry changed (the zip's CRC-32 then fails)."""
    import zipfile

    raw = bytearray(model.read_bytes())
    with zipfile.ZipFile(model) as archive:
        entry = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    name_length = int.from_bytes(raw[entry.header_offset + 26:entry.header_offset + 28], "little")
    extra_length = int.from_bytes(raw[entry.header_offset + 28:entry.header_offset + 30], "little")
    start = entry.header_offset + 30 + name_length + extra_length
    raw[start + entry.file_size // 2] ^= 0x40
    return bytes(raw)


def test_a_loop_of_symbolic_links_and_a_damaged_checkpoint_are_one_line_errors(
        tmp_path: Path, data_dirs: dict[str, Path], tickets: Path, model: Path) -> None:
    cwd = tmp_path / "work"
    cwd.mkdir()
    for a, b in (("l.pt", "k.pt"), ("k.pt", "l.pt"), ("l.safetensors", "k.safetensors"),
                 ("k.safetensors", "l.safetensors")):
        (cwd / a).symlink_to(b)
    (cwd / "flip.pt").write_bytes(_flipped(model))
    data = data_dirs["good"]
    before = snapshot(tmp_path, data, tickets.parent)
    for args, message in (((*TRAIN, "--eps2", "1", "--out", "l.pt"), "--out l.pt is a loop of symbolic links"),
                          (("export", "--model", str(model), "--out", "l.safetensors"), "is a loop of symbolic links"),
                          (("inspect", "flip.pt"), "flip.pt is damaged: its entry"),
                          (("export", "--model", "flip.pt", "--out", "x.safetensors"), "fails its CRC-32 check")):
        code, stdout, stderr = _run_in_process(list(args), cwd, data)
        assert_one_line_error(code, stdout, stderr, message)
    assert snapshot(tmp_path, data, tickets.parent) == before


def test_a_ticket_file_that_cannot_record_a_draw_is_named_as_such(tmp_path: Path, data_dirs: dict[str, Path],
                                                                   tickets: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """select --eps1 records its draw in the ticket file: a ticket folder on a read-only file system is refused
    before the draw, naming the ticket file (it blamed "output directory … is not writable" for an --out that was
    elsewhere)."""
    import dpltm.outputs

    real = dpltm.outputs.check_storage

    def read_only_tickets(folder: Path) -> None:
        if folder.resolve() == tickets.parent.resolve():
            raise DpltmUserError(f"cannot write in {folder}: its file system is read-only")
        real(folder)

    monkeypatch.setattr(dpltm.outputs, "check_storage", read_only_tickets)
    before = tickets.read_bytes()
    code, _, stderr = _run_in_process(["select", "--eps1", "0.1", "--tickets", str(tickets), "--out",
                                       str(tmp_path / "w.pt")], tmp_path, data_dirs["good"])
    assert code == 2 and "Traceback" not in stderr, stderr
    assert "a draw that spends ε1 is recorded in the ticket file" in stderr.splitlines()[-1]
    assert tickets.read_bytes() == before and not (tmp_path / "w.pt").exists()
