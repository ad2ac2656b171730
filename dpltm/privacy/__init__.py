"""Privacy mathematics of dpltm: selection, events, accounting, calibration, the ledger.

See docs/privacy.md for the facts these modules build on; every formula's docstring cites its
theorem.
"""

from dpltm.privacy.accounting import (
    ACCOUNTANTS,
    NEIGHBORING,
    Bound,
    best_bound,
    composition_bounds,
    delta_for_epsilon,
    epsilon,
    gdp_epsilon,
    gdp_mu,
)
from dpltm.privacy.calibration import calibrate_noise_multiplier, calibrate_parameter
from dpltm.privacy.events import dpsgd_event, event_from_json, event_to_json, selection_event
from dpltm.privacy.exponential import (
    decisive_eps1,
    make_selection_rng,
    near_uniform,
    sample_exponential,
    score_sensitivity,
    selection_log_probabilities,
    selection_probabilities,
    ticket_scores,
)
from dpltm.privacy.ledger import PrivacyLedger, training_record

__all__ = [
    "ACCOUNTANTS",
    "NEIGHBORING",
    "Bound",
    "PrivacyLedger",
    "best_bound",
    "calibrate_noise_multiplier",
    "calibrate_parameter",
    "composition_bounds",
    "decisive_eps1",
    "delta_for_epsilon",
    "dpsgd_event",
    "epsilon",
    "event_from_json",
    "event_to_json",
    "gdp_epsilon",
    "gdp_mu",
    "make_selection_rng",
    "near_uniform",
    "sample_exponential",
    "score_sensitivity",
    "selection_event",
    "selection_log_probabilities",
    "selection_probabilities",
    "ticket_scores",
    "training_record",
]
