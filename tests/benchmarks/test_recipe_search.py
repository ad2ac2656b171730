"""The public recipe search's TAN proxy: same noise per step, same steps, the private run's rate."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from grid.recipe_search import proxy_batch

from dpltm.privacy.calibration import calibrate_noise_multiplier
from tests.datafiles import write_mnist


def test_same_rate_proxy_keeps_the_noise_per_step_and_the_rate() -> None:
    batch, private, public, sigma = 16384, 54000, 7208, 21.7
    expected, proxy_sigma = proxy_batch("same-rate", batch, private, public, sigma)
    assert expected / public == pytest.approx(batch / private)  # the private run's q, so its epochs
    assert proxy_sigma / expected == pytest.approx(sigma / batch)  # σC/L unchanged (TAN)
    assert expected < public


def test_public_batch_proxy_is_the_batch_itself_and_refuses_more_than_the_public_set() -> None:
    assert proxy_batch("public-batch", 4096, 54000, 7208, 6.8) == (4096.0, 6.8)
    with pytest.raises(ValueError, match="same-rate"):
        proxy_batch("public-batch", 8192, 54000, 7208, 6.8)
    with pytest.raises(ValueError, match="unknown proxy"):
        proxy_batch("tan", 8192, 54000, 7208, 6.8)


def test_search_beyond_the_public_set_with_the_same_rate_proxy(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    import tune_recipe

    data = tmp_path / "data"
    write_mnist(data, "MNIST", n_train=200, n_test=20)
    out = tmp_path / "search.csv"
    common = ["--public", "mnist:train", "--private-size", "5400", "--eps", "1", "--activations", "tanh",
              "--batch-epochs", "1000x2", "--lrs", "0.5", "2", "--lr-sigmas", "--data-dir", str(data),
              "--hidden", "8"]
    with pytest.raises(SystemExit):  # L = 1000 > 180 public training records
        tune_recipe.main(common + ["--out", str(out)])
    assert "same-rate" in capsys.readouterr().err
    tune_recipe.main(common + ["--proxy", "same-rate", "--seeds", "0", "1", "--out", str(out)])
    with out.open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 2 * 2 * 6  # seeds × rates × (final iterate + three EMA decays + two with a warm-up)
    assert sum(r["ema_warmup"] == "True" for r in rows) == 2 * 2 * 2
    sigma = calibrate_noise_multiplier(1000 / 5400, 12, 1.0, 1e-5)
    for row in rows:
        assert float(row["sigma"]) == pytest.approx(sigma, abs=1e-5)
        assert float(row["proxy_batch"]) == pytest.approx(1000 * 180 / 5400, abs=0.05)
        assert float(row["lr"]) == pytest.approx(float(row["lr_sigma"]) / sigma, rel=1e-4)
    assert {r["seed"] for r in rows} == {"0", "1"}
    assert "over 2 seed(s)" in capsys.readouterr().out
    old = tmp_path / "old.csv"
    old.write_text("epsilon,activation\n")
    with pytest.raises(SystemExit):
        tune_recipe.main(common + ["--proxy", "same-rate", "--out", str(old)])
    assert "other columns" in capsys.readouterr().err


@pytest.mark.parametrize(("extra", "message"), [
    (["--private-size", "0"], "must be at least 1"),
    (["--batch-epochs", "abc"], "is not LxE"),
    (["--batch-epochs", "0x5"], "must be at least 1"),
    (["--lrs", "-1"], "finite number above 0"),
    (["--private-size", "10"], "sample rate q must lie in"),  # L = 100 > N = 10
    (["--arch", "scatter-linear"], "searched with --front scatter and --arch mlp"),
    (["--arch", "foo"], "--arch must be one of"),
])
def test_bad_search_settings_are_one_line(extra: list[str], message: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    import tune_recipe

    write_mnist(tmp_path, "MNIST", n_train=200, n_test=20)
    with pytest.raises(SystemExit):
        tune_recipe.main(["--public", "mnist:train", "--eps", "1", "--activations", "tanh", "--batch-epochs", "100x1",
                          "--lrs", "1", "--hidden", "8", "--data-dir", str(tmp_path), *extra])
    assert message in capsys.readouterr().err


def test_the_search_averages_by_the_private_runs_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each scored EMA is what `train --ema D [--ema-warmup]` would release from the same iterates: EMA_1 = θ_1
    (not θ0), then dpltm.dp.averaging's rule, warm-up included."""
    import torch
    from grid import recipe_search

    from dpltm.data.types import DatasetSplits
    from dpltm.dp.averaging import Ema
    from tests.conftest import make_blobs

    public = DatasetSplits(name="blobs", source_split="train", train=make_blobs(120, 6, 3, 0),
                           val=make_blobs(40, 6, 3, 1), test=make_blobs(10, 6, 3, 2), num_features=6, num_classes=3,
                           fingerprint="b")
    iterates: list[list[torch.Tensor]] = []
    scored: list[list[torch.Tensor]] = []
    real_step, real_accuracies = recipe_search.noisy_step, recipe_search.accuracies

    def step(stack, *args, **kwargs):  # type: ignore[no-untyped-def]
        real_step(stack, *args, **kwargs)
        iterates.append([p.detach().clone() for p in stack.parameters()])

    def accuracies(stack, *args, **kwargs):  # type: ignore[no-untyped-def]
        scored.append([p.detach().clone() for p in stack.parameters()])
        return real_accuracies(stack, *args, **kwargs)

    monkeypatch.setattr(recipe_search, "noisy_step", step)
    monkeypatch.setattr(recipe_search, "accuracies", accuracies)
    rows = recipe_search.search_recipe(public, 1000, 1.0, 1e-5, "tanh", 50, 1, [0.5], hidden=(4,),
                                       proxy="same-rate")
    assert len(scored) == len(recipe_search.AVERAGES) == len(rows)
    for ema, got in zip(recipe_search.AVERAGES, scored):
        expected = iterates[0]
        for t, theta in enumerate(iterates[1:], start=1):
            weight = 1.0 if ema is None else float(Ema.weight(ema, torch.tensor(t)))
            expected = [e + weight * (x - e) for e, x in zip(expected, theta)]
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e)


def test_a_cnn_search_steps_each_rates_network_by_its_own_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """LeNet-5 does not stack: one network per rate, from the same θ0, stepped in turn by the DP training's
    own step (EachCandidate). With every privatised gradient fixed at 1, each network moves by exactly −T·lr_k,
    and every (rate, released weights) pair gets its row."""
    import torch
    from grid import recipe_search

    import dpltm.selection.noise_aware as noise_aware
    from dpltm.data.types import DatasetSplits
    from dpltm.networks.lenet import build_architecture, build_network
    from tests.conftest import make_blobs

    public = DatasetSplits(name="blobs", source_split="train", train=make_blobs(120, 784, 3, 0),
                           val=make_blobs(40, 784, 3, 1), test=make_blobs(10, 784, 3, 2), num_features=784,
                           num_classes=3, fingerprint="b")
    final: list[list[tuple[str, torch.Tensor]]] = []  # each network's weights when first scored: the final iterate
    real_each = noise_aware.EachCandidate
    assert recipe_search.AVERAGES[0] is None  # the final iterate is scored first

    class Recorded(real_each):  # type: ignore[misc, valid-type]
        def correct(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            if not final:
                final.extend([(n, p.detach().clone()) for n, p in m.named_parameters()] for m in self.models)
            return super().correct(*args, **kwargs)

    def ones(step, *args, **kwargs):  # type: ignore[no-untyped-def]
        return {name: torch.ones_like(p) for name, p in step.model.named_parameters()}

    monkeypatch.setattr(recipe_search, "EachCandidate", Recorded)
    monkeypatch.setattr(noise_aware.DpSgdStep, "gradients", ones)
    rates = [0.5, 0.01]
    rows = recipe_search.search_recipe(public, 1000, 1.0, 1e-5, "tanh", 50, 1, rates, hidden=(12, 8),
                                       proxy="same-rate", arch="lenet5")
    steps = rows[0]["steps"]
    assert len(final) == 2 and len(rows) == 2 * len(recipe_search.AVERAGES)
    architecture = build_architecture(784, 3, (12, 8), None, "tanh", "lenet5")
    theta0 = build_network(architecture, torch.Generator().manual_seed(0))
    for weights, rate in zip(final, rates):
        for (name, p), (_, p0) in zip(weights, theta0.named_parameters()):
            torch.testing.assert_close(p, p0.detach() - steps * rate, rtol=0, atol=1e-4,
                                       msg=lambda m, name=name: f"{name}: {m}")
    assert {(r["lr"], r["ema"], r["ema_warmup"]) for r in rows} == {
        (rate, "" if ema is None else ema.decay, ema is not None and ema.warmup)
        for rate in rates for ema in recipe_search.AVERAGES}


def test_the_scatter_cnn_head_is_searched_over_the_public_features(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """scatter-cnn's recipe search trains its head on the public records' scattering features through the DP
    engine (one network per rate, stepped in turn) and scores each rate and average."""
    import tune_recipe

    monkeypatch.setenv("DPLTM_FEATURE_CACHE", str(tmp_path / "features"))
    write_mnist(tmp_path, "MNIST", n_train=200, n_test=20)
    out = tmp_path / "search.csv"
    tune_recipe.main(["--public", "mnist:train", "--private-size", "5400", "--eps", "1", "--activations", "tanh",
                      "--batch-epochs", "1000x1", "--lrs", "1", "4", "--lr-sigmas", "--proxy", "same-rate",
                      "--momentum", "0.9", "--arch", "scatter-cnn", "--data-dir", str(tmp_path), "--out", str(out)])
    with out.open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 2 * 6 and {r["lr_sigma"] for r in rows} == {"1.0", "4.0"}
    assert all(0.0 <= float(r["public_val_accuracy"]) <= 1.0 for r in rows)
    assert "scatter-cnn tanh L=1000" in capsys.readouterr().out
    assert any((tmp_path / "features").iterdir())  # the features were computed once and cached
