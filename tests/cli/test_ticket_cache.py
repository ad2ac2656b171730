"""Public tickets are public artefacts (dpltm.tickets.cache): `dpltm run` keeps the ticket sets it made on
public data and a second run with the same settings on the same public data skips the generation."""

from __future__ import annotations

import os
from pathlib import Path

from tests.cli.test_rewind import data_root  # noqa: F401


def test_run_makes_public_tickets_once(cli, data_root: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """Public tickets are public artefacts: a second `run` with the same settings on the same public data
    takes them from the cache (the same file), and other settings make their own; a damaged cached file is ignored."""
    common = ["run", "--dataset", "fashion-mnist", "--public-dataset", "mnist", "--public-split", "train",
              "--arch", "mlp", "--rounds", "1", "--iterations", "5", "--epochs", "1", "--batch-size", "16",
              "--choice", "best", "--eps", "1", "--data-dir", str(data_root), "--device", "cpu", "--no-progress"]
    first = cli(*common, "--out", str(tmp_path / "a" / "m.pt"))
    assert "from the cache of public tickets" not in first.stderr
    second = cli(*common, "--out", str(tmp_path / "b" / "m.pt"))
    assert "from the cache of public tickets" in second.stderr and "round 0:" not in second.stderr
    assert (tmp_path / "a" / "m-tickets.pt").read_bytes() == (tmp_path / "b" / "m-tickets.pt").read_bytes()
    other = cli(*[a if a != "5" else "6" for a in common], "--out", str(tmp_path / "c" / "m.pt"))
    assert "from the cache of public tickets" not in other.stderr
    cached = list(Path(os.environ["DPLTM_TICKET_CACHE"]).iterdir())
    assert len(cached) == 2
    for path in cached:
        path.write_bytes(b"not a ticket set")
    again = cli(*common, "--out", str(tmp_path / "d" / "m.pt"))
    assert "is not usable" in again.stderr and "round 0:" in again.stderr
