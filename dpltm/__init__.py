"""dpltm: differentially private training of neural networks by way of lottery tickets.

The Python API (imported on first use, so `import dpltm` and the CLI stay quick):

* `generate_tickets(model, data, ...)`: iterative magnitude pruning of any model's weight matrices
  and kernels (not private: use public data);
* `select_ticket(tickets, model=, public=, val=, planned=PlannedPrivateRun(...))`: the noise-aware choice (each
  ticket trained under the planned DP noise on public data, as `dpltm run` chooses); `rule="best"` the paper's
  score, `eps1=...` the exponential mechanism over it;
* `make_private(model, optimizer, data, target_epsilon=..., masks=...)`: masked DP-SGD with
  Poisson sampling, per-sample clipping and Gaussian noise on the surviving weights; reports ε;
* `DPCallback`: the same DP-SGD for an existing LightningModule;
* `account(sample_rate=..., noise_multiplier=..., steps=...)`: ε of a DP-SGD run;
* `get_epsilon(path, delta)`: ε of a saved run or model at any δ (a run's own: `run.get_epsilon(delta)`);
* `load_model(path)`: the released model of a `dpltm train` checkpoint.

Coming from Opacus: `make_private_with_epsilon` and Opacus's argument names work where dpltm does the same,
and are refused in one line naming dpltm's way otherwise (dpltm.opacus_names; docs/api.md).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_API = {
    "generate_tickets": "dpltm.api", "make_private": "dpltm.api",
    "select_ticket": "dpltm.ticket_choice", "PlannedPrivateRun": "dpltm.ticket_choice",
    "PrivateTraining": "dpltm.api", "Ticket": "dpltm.api", "account": "dpltm.api", "load_model": "dpltm.api",
    "make_private_with_epsilon": "dpltm.api", "get_epsilon": "dpltm.api", "PrivacyEngine": "dpltm.opacus_names",
    "evaluate": "dpltm.api", "DPCallback": "dpltm.lightning", "PoissonBatchSampler": "dpltm.lightning",
    "poisson_loader": "dpltm.lightning",
    "DpltmUserError": "dpltm.errors",
}
__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'dpltm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
