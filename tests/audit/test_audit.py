"""`dpltm audit`: the one-run lower bound's statistics, the canaries, and both directions of the
audit on a small setting: the real mechanism is never refuted; a broken one (no noise, no
clipping, noise on the wrong coordinates: test-only faults) is."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from dpltm.artefacts import Winner
from dpltm.audit.bounds import bound_from_scores, epsilon_lower_bound, p_value
from dpltm.audit.canaries import GradientCanaries, InputCanaries, inclusion_bits
from dpltm.audit.run import AuditPlan
from dpltm.data.types import DatasetSplits, LabeledTensors
from dpltm.errors import DpltmUserError
from dpltm.masks import apply_masks_
from dpltm.networks.lenet import LeNet, build_architecture
from dpltm.settings import TrainConfig, TrainSettings
from dpltm.training import pipeline
from tests.datafiles import write_digits
from tests.faults import FAULTS, fault

# ---- the statistics (Steinke, Nasr & Jagielski 2023) -------------------------------------------


def test_p_value_without_delta_is_the_binomial_tail() -> None:
    for r, v, eps in ((10, 10, 1.0), (100, 70, 0.5), (40, 20, 2.0)):
        accuracy = math.exp(eps) / (1 + math.exp(eps))
        assert p_value(1000, r, v, eps, 0.0) == pytest.approx(stats.binom.sf(v - 1, r, accuracy), rel=1e-12)
    assert p_value(1000, 100, 70, 1.0, 1e-3) > p_value(1000, 100, 70, 1.0, 0.0)  # δ only loosens


def test_the_bound_is_monotone_and_zero_for_chance_guessing() -> None:
    assert epsilon_lower_bound(1000, 100, 50, 1e-5, 0.05) == 0.0
    bounds = [epsilon_lower_bound(1000, 100, v, 1e-5, 0.05) for v in (60, 70, 80, 90, 100)]
    assert bounds == sorted(bounds) and bounds[0] > 0
    # at the bound the p-value sits at the significance level
    eps = epsilon_lower_bound(1000, 100, 90, 1e-5, 0.05)
    assert p_value(1000, 100, 90, eps, 1e-5) == pytest.approx(0.05, abs=1e-6)
    assert epsilon_lower_bound(500, 200, 200, 1e-5, 0.05) > epsilon_lower_bound(500, 100, 100, 1e-5, 0.05)


@pytest.mark.parametrize("epsilon", [0.5, 2.0])
def test_the_bound_covers_a_truly_dp_mechanism_at_its_confidence(epsilon: float) -> None:
    """ε-DP randomized response is the most an ε-DP run lets an attack guess: the lower bound
    computed from its scores exceeds ε in at most 5 % of trials (here: 200 trials)."""
    rng = np.random.default_rng(7)
    m, trials, exceed = 400, 200, 0
    keep = math.exp(epsilon) / (1 + math.exp(epsilon))
    for _ in range(trials):
        included = rng.random(m) < 0.5
        reported = np.where(rng.random(m) < keep, included, ~included)  # randomized response
        scores = reported + 0.01 * rng.random(m)  # the attack ranks its "in" answers first
        exceed += bound_from_scores(scores, included, delta=0.0, confidence=0.95).epsilon_lower_bound > epsilon
    assert exceed / trials <= 0.05 + 2 * math.sqrt(0.05 * 0.95 / trials)


def test_perfect_guesses_refute_small_epsilons() -> None:
    included = inclusion_bits(400, seed=3)
    bound = bound_from_scores(included.astype(float), included, delta=1e-5, confidence=0.95)
    assert bound.epsilon_lower_bound > 2.5 and bound.correct >= bound.guesses - abs(int(included.sum()) - 200)
    with pytest.raises(DpltmUserError, match="one score and one inclusion bit"):
        bound_from_scores([1.0, 2.0], [True], delta=1e-5)


def test_inclusion_bits_are_fair_coins() -> None:
    bits = inclusion_bits(20000, seed=1)
    assert abs(bits.mean() - 0.5) < 4 * math.sqrt(0.25 / bits.size)
    assert not np.array_equal(inclusion_bits(100, None), inclusion_bits(100, None))  # fresh randomness


# ---- the canaries --------------------------------------------------------------------------------


def _model(features: int = 30) -> LeNet:
    return LeNet(build_architecture(features, 4, (32,), None, "relu", "mlp"), torch.Generator().manual_seed(0))


def test_gradient_canaries_sit_on_distinct_surviving_weights_quiet_ones_first() -> None:
    from dpltm.dp.ghost import MaskLayout

    model = _model()
    masks = {name: torch.rand(mask.shape, generator=torch.Generator().manual_seed(2)) < 0.5
             for name, mask in model.full_masks().items()}
    masks = apply_masks_(model, masks)
    surviving = MaskLayout.of(model, masks).surviving
    features = torch.randn(100, 30)
    features[:, 20:] = 0  # ten features no record sets: their first-layer weights get no gradient
    canaries = GradientCanaries.draw(model, surviving, 60, clip=1.0, seed=0, features=features)
    pairs = set(zip(canaries.names, canaries.flat.tolist()))
    assert len(pairs) == 60 and all(name.endswith(".weight") for name in canaries.names)
    for name, flat in pairs:
        assert int(flat) in set(surviving[name].tolist())  # type: ignore[union-attr]
        assert name == "hidden.0.weight" and flat % 30 >= 20  # enough quiet weights: all quiet
    with pytest.raises(DpltmUserError, match="surviving weights"):
        GradientCanaries.draw(model, surviving, 10**6, clip=1.0, seed=0)


def test_sampled_gradient_canaries_add_exactly_the_clip_norm_and_excluded_ones_nothing() -> None:
    from dpltm.dp.ghost import MaskLayout

    model = _model()
    canaries = GradientCanaries.draw(model, MaskLayout.of(model, model.full_masks()).surviving, 20, clip=0.7, seed=4)
    canaries.start(model, torch.device("cpu"))
    rows = 100  # data rows 0..99; canary i is slot 100 + i of the sampled universe, in or out
    index = torch.tensor([3, 50, *(rows + i for i in range(20))])  # every canary slot sampled
    kept, sums = canaries.split(index, rows, dict(model.named_parameters()))
    assert kept.tolist() == [3, 50]
    assert sum(float(v.abs().sum()) for v in sums.values()) == pytest.approx(0.7 * int(canaries.included.sum()))
    for canary in range(20):
        name, flat = canaries.names[canary], int(canaries.flat[canary])
        value = float(sums[name].reshape(-1)[flat]) if name in sums else 0.0
        assert value == pytest.approx(0.7 if canaries.included[canary] else 0.0)
    with fault("no-clipping"):  # the switch reaches the canaries' clip factors too: full norm 100·C
        _, unclipped = canaries.split(index, rows, dict(model.named_parameters()))
    assert sum(float(v.abs().sum()) for v in unclipped.values()) == pytest.approx(70.0 * int(canaries.included.sum()))
    with pytest.raises(RuntimeError, match="does not know"):
        GradientCanaries.draw(model, {}, 5, clip=1.0, seed=0)


def test_ties_never_follow_the_inclusion_bits() -> None:
    """An attack with no information (all scores equal, or all NaN from a diverged model) refutes no real
    ε, whatever the canary seed is (the tie-breaks once shared a stream with the bits)."""
    for m in (200, 1000):
        included = inclusion_bits(m, seed=m)
        for scores in (np.zeros(m), np.full(m, np.nan)):
            # chance alone may refute a tiny ε (5 % of the time); a shared stream gave ε ≥ 4.35 here
            assert bound_from_scores(scores, included, delta=1e-5).epsilon_lower_bound < 0.5


def test_input_canaries_are_out_of_distribution_with_random_labels() -> None:
    reference = torch.rand(50, 8)
    canaries = InputCanaries.draw(reference, 5, 300, seed=2)
    assert canaries.features.shape == (300, 8) and float(canaries.features.min()) >= float(reference.min())
    assert set(canaries.labels.tolist()) == set(range(5))


# ---- both directions, through the training path ------------------------------------------------


def _splits(seed: int = 0) -> DatasetSplits:
    """Blobs with 10 extra features that are always 0 (like MNIST's border pixels)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(4, 20, generator=torch.Generator().manual_seed(99)) * 2

    def part(n: int) -> LabeledTensors:
        labels = torch.randint(0, 4, (n,), generator=g)
        x = torch.cat([centres[labels] + torch.randn(n, 20, generator=g), torch.zeros(n, 10)], dim=1)
        return LabeledTensors(x, labels)

    return DatasetSplits(name="blobs", source_split="train", train=part(1000), val=part(100), test=part(200),
                         num_features=30, num_classes=4, fingerprint="audit-blobs")


def _audit(tmp_path: Path, threat_model: str = "white-box", ticket: Winner | None = None,
           eps: float = 1.0, seed: int = 0) -> dict:  # type: ignore[type-arg]
    cfg = TrainConfig(train=TrainSettings(eps2=eps, epochs=4, batch_size=50, lr=0.1))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hidden=(32,)))
    plan = AuditPlan(threat_model, 200, seed=seed)
    report = pipeline.train(cfg, _splits(), tmp_path / f"m{seed}.pt", ticket=ticket, ticket_path=None, private=True,
                            progress=False, noise_seed=seed + 10, audit=plan)
    assert report.audit is not None
    return report.audit


def test_the_real_mechanism_is_not_refuted(tmp_path: Path) -> None:
    for seed in (0, 1):
        audit = _audit(tmp_path, seed=seed)
        assert audit["epsilon_lower_bound"] <= audit["epsilon_claimed"] <= 1.0 and not audit["refuted"]
        assert audit["epsilon_claimed"] > 0.99 and audit["threat_model"] == "white-box"
        assert set(audit["by_observation"]) == {"iterates", "final_model"}
        assert 60 < audit["canaries_included"] < 140
    black = _audit(tmp_path, "black-box")
    assert black["epsilon_lower_bound"] <= black["epsilon_claimed"] and set(black["by_observation"]) == {"final_model"}


@pytest.mark.parametrize("kind", ["no-noise", "no-clipping"])
def test_a_broken_mechanism_is_refuted(kind: str, tmp_path: Path) -> None:
    with fault(kind):
        audit = _audit(tmp_path)
    assert audit["refuted"] and audit["epsilon_lower_bound"] > audit["epsilon_claimed"] + 1.0


def test_the_claim_does_not_depend_on_the_inclusion_bits(tmp_path: Path) -> None:
    """The universe is N + m records whatever the draw: two canary seeds, the same q, σ, T and claim."""
    first, second = _audit(tmp_path, seed=0), _audit(tmp_path, seed=3)
    assert first["canaries_included"] != second["canaries_included"]
    assert first["epsilon_claimed"] == second["epsilon_claimed"]


def test_noise_on_the_wrong_coordinates_is_refuted(tmp_path: Path) -> None:
    """A ticket: the noise lands on the pruned weights, the canaries' (surviving) ones go bare."""
    model = LeNet(build_architecture(30, 4, (32,), None, "relu", "mlp"), torch.Generator().manual_seed(0))
    masks = {name: torch.rand(mask.shape, generator=torch.Generator().manual_seed(5)) < 0.6
             for name, mask in model.full_masks().items()}
    ticket = Winner(architecture=model.arch.to_dict(), round=1, density=0.6, layer_density={}, val_accuracy=0.0,
                    theta0={k: v.clone() for k, v in model.state_dict().items()}, masks=dict(masks),
                    source={"data": {"dataset": "public-blobs", "split": "train"}},
                    selection={"method": "best"}, privacy={})
    honest = _audit(tmp_path, ticket=ticket)
    assert not honest["refuted"]
    with fault("noise-on-pruned"):
        broken = _audit(tmp_path, ticket=ticket)
    assert broken["refuted"] and broken["epsilon_lower_bound"] > 2.0
    assert set(FAULTS) == {"no-noise", "no-clipping", "noise-on-pruned"}


# ---- the command -----------------------------------------------------------------------------


def test_dpltm_audit_reports_the_bound_beside_the_claim(tmp_path: Path, cli) -> None:
    root = write_digits(tmp_path / "data")
    result = cli("audit", "--dense", "--dataset", "digits", "--data-dir", str(root), "--eps", "2",
                 "--epochs", "2", "--batch-size", "64", "--canaries", "100", "--canary-seed", "0",
                 "--noise-seed", "5", "--device", "cpu", "--no-progress", "--json")
    report = json.loads(result.stdout)
    assert {"epsilon_lower_bound", "epsilon_claimed", "canaries", "confidence", "threat_model"} <= set(report)
    assert report["canaries"] == 100 and report["confidence"] == 0.95 and report["threat_model"] == "white-box"
    assert 0 <= report["epsilon_lower_bound"] <= report["epsilon_claimed"] <= 2.0
    # what the claim covers, beside the run's own ε (with a private ticket the two differ: its warm-up)
    assert report["claim_scope"].startswith("the training mechanism alone") and report["epsilon"] <= 2.0
    assert report["by_observation"]["iterates"]["guesses"] > 0  # the attack's best guesses, even unrefuted
    # an audit on private records publishes outputs of a DP run that no ledger counts: said in the JSON and on screen
    assert report["unaccounted"].startswith("not in any ledger: this audit trained with DP on the training records "
                                            "of digits")
    shown = cli("audit", "--dense", "--dataset", "digits", "--data-dir", str(root), "--eps", "2", "--epochs", "1",
                "--batch-size", "64", "--canaries", "100", "--canary-seed", "0", "--device", "cpu", "--no-progress")
    assert "not in any ledger" in shown.stderr and "count it in your own budget" in shown.stderr
    for args, message in ((["--dense", "--ticket", "x.pt"], "--ticket PATH"), ([], "--ticket PATH"),
                          (["--dense", "--canaries", "1"], "must lie in [2, "),
                          (["--dense", "--confidence", "1.5"], "--confidence")):
        bad = cli("audit", "--dataset", "digits", "--data-dir", str(root), "--device", "cpu",
                  *args, ok=False)
        assert bad.exit_code == 2 and message in bad.stderr and "Traceback" not in bad.output, (args, bad.output)


def test_dpltm_audit_on_a_same_data_ticket_says_it_is_not_end_to_end_dp(tmp_path: Path, cli) -> None:
    """The audit trains as `dpltm train` does, so it states the same scope: tickets generated without
    privacy on the private data make the run NOT end-to-end DP, whatever the audit finds."""
    root = write_digits(tmp_path / "data")
    common = ["--data-dir", str(root), "--device", "cpu", "--no-progress"]
    tickets, winner = str(tmp_path / "t.pt"), str(tmp_path / "w.pt")
    for args in (["generate", "--dataset", "digits", "--rounds", "1", "--iterations", "20", "--batch-size", "32",
                  "--out", tickets, "--logger", "none", *common],
                 ["select", "--best", "--tickets", tickets, "--out", winner]):
        cli(*args)
    recipe = ["--ticket", winner, "--dataset", "digits", "--eps", "2", "--epochs", "1", "--batch-size", "64", *common]
    trained = cli("train", *recipe, "--out", str(tmp_path / "m.pt"), "--logger", "none", "--json", ok=False)
    audited = cli("audit", *recipe, "--canaries", "100", "--canary-seed", "0", "--json", ok=False)
    assert trained.exit_code == 0 and audited.exit_code == 0, trained.output + audited.output
    train_report, audit_report = json.loads(trained.stdout), json.loads(audited.stdout)
    warning = train_report["warning"]
    assert warning.startswith("NOT end-to-end differentially private")
    assert audit_report["warning"] == warning and audit_report["end_to_end_dp"] is False
    assert audit_report["epsilon_scope"] == train_report["epsilon_scope"]
    assert " ".join(warning.split()) in " ".join(audited.stderr.split())  # on the terminal too, as train prints it
    text = cli("audit", *recipe, "--canaries", "100", "--canary-seed", "0", ok=False)
    assert text.exit_code == 0 and " ".join(warning.split()) in " ".join(text.stderr.split()), text.output
    assert train_report["epsilon_scope"] in " ".join(text.stderr.split())
    assert "the run's ε = ∞, not DP end to end (its DP phases alone: ε =" in " ".join(text.stderr.split())
