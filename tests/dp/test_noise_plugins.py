"""Noise plug-ins: one shared suite over every entry of NOISE_PLUGINS, then what is
specific to differentially private dropout (dpd) and sensitivity-shaped noise (shaped), and
the CLI end to end.

The shared suite is what makes a plug-in safe to account as the Poisson-subsampled Gaussian
mechanism with its effective multiplier: noise of exactly that scale (× s) on the surviving
coordinates, none elsewhere, nothing at parameter 0, the same ε as the plain DP-SGD event, and
per-record contributions of norm ≤ C in the plug-in's clipping geometry.
"""

from __future__ import annotations

import json
import math
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from dpltm.checkpoint import load_checkpoint
from dpltm.data.types import LabeledTensors
from dpltm.dp import dpd as dpd_module
from dpltm.dp.dpd import DropoutNoise, dropout_rates, quantiles
from dpltm.dp.ghost import MaskLayout, clipped_gradient_sum
from dpltm.dp.mechanism import NoiseContext, ScaledGaussianNoise, dp_event_of
from dpltm.dp.noise import NOISE_PLUGINS, NoisePlugin, make_noise, noise_plugin
from dpltm.dp.shaped import ShapedNoise, public_sensitivity
from dpltm.errors import DpltmUserError
from dpltm.masks import Masks, apply_masks_
from dpltm.networks.lenet import LeNet, build_architecture
from dpltm.privacy.accounting import epsilon
from dpltm.privacy.comparisons import (
    COMPARISON_LABEL,
    dpd_paper_figure,
    dpd_paper_sigma,
)
from dpltm.privacy.events import dpsgd_event
from dpltm.privacy.ledger import NOISES, PrivacyLedger, training_record
from dpltm.pruning import paper_prune_rates, prune_layerwise
from tests.datafiles import write_mnist

PLUGINS = sorted(NOISE_PLUGINS)
FEATURES, CLASSES = 12, 5


def pruned_model(rounds: int = 3, seed: int = 0) -> tuple[LeNet, Masks]:
    model = LeNet(build_architecture(FEATURES, CLASSES, (10, 7), None), torch.Generator().manual_seed(seed))
    masks = model.full_masks()
    for _ in range(rounds):
        masks = apply_masks_(model, prune_layerwise(model.weights(), masks, paper_prune_rates(model.mask_names())))
    return model.double(), masks


def records(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, FEATURES, generator=g, dtype=torch.float64), torch.randint(0, CLASSES, (n,), generator=g)


def context(model: LeNet, masks: Masks, clip: float = 0.8) -> NoiseContext:
    """Every plug-in gets public data (those that need none ignore it); never the private set."""
    x, y = records(256, seed=99)
    return NoiseContext(model=model, masks=masks, clip=clip, private_dataset="private-blobs",
                        public_data=LabeledTensors(x, y), public_dataset="public-blobs")


def param_masks(model: LeNet, masks: Masks) -> dict[str, torch.Tensor | None]:
    return {f"{n.removesuffix('.weight')}.{part}": (masks[n] if part == "weight" else None)
            for n, _ in model.layers_in_order() for part in ("weight", "bias")}


def scale_of(mechanism, name: str, like: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    scales = mechanism.coordinate_scales() or {}
    s = scales.get(name)
    return torch.ones_like(like) if s is None else s.to(like.dtype)


# ---- the shared suite --------------------------------------------------------------------------


def test_ledger_and_registry_agree() -> None:
    """One table (dpltm/dp/noise.py) gives the classes, the CLI's choices and the ledger's vocabulary."""
    from dpltm import choices

    assert set(NOISES) == set(NOISE_PLUGINS) == {c.value for c in choices.Noise}
    for name, plugin in NOISE_PLUGINS.items():
        assert plugin.load().name == name


def test_one_module_and_one_line_make_a_mechanism(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mechanism is a module with its class and one `NoisePlugin` line: make_noise builds it, and its σ maps
    (what the planners and `dpltm account` read) come from that line and agree with the built mechanism."""

    @dataclass(frozen=True)
    class HalfNoise(ScaledGaussianNoise):
        sigma: float
        name: ClassVar[str] = "half"
        PER_PARAMETER: ClassVar[float] = 0.5

        @classmethod
        def build(cls, parameter: float, context: NoiseContext | None = None) -> HalfNoise:
            return cls(float(parameter))

        def description(self) -> str:
            return f"half noise, σ = {self.sigma}"

    module = types.ModuleType("tests_fake_noise")
    module.HalfNoise = HalfNoise  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(NOISE_PLUGINS, "half", NoisePlugin("half", f"{module.__name__}:HalfNoise", "half noise",
                                                           per_parameter=0.5))
    built = make_noise("half", 3.0)
    assert isinstance(built, HalfNoise) and built.effective_noise_multiplier == noise_plugin("half").effective_for(3.0)
    assert noise_plugin("half").parameter_for(1.5) == 3.0 and built.noise_std(2.0) == 3.0


def test_capabilities_drive_the_checks(monkeypatch: pytest.MonkeyPatch, tiny_splits) -> None:  # type: ignore[no-untyped-def]
    """A plug-in's declared capabilities, not its name, decide what a run may combine it with: declare
    that gaussian needs public data, and `dpltm run`'s plan check refuses it as it refuses shaped."""
    from dataclasses import replace

    from dpltm.config import resolve_train_config
    from dpltm.dp import noise as plugins
    from dpltm.stages.train import check_planned_training

    cfg = resolve_train_config({"dataset": "digits", "eps2": 1.0, "epochs": 1, "batch_size": 32}, None, "paper")
    check_planned_training(cfg, tiny_splits, "paper")
    gaussian = plugins.NOISE_PLUGINS["gaussian"]
    monkeypatch.setitem(plugins.NOISE_PLUGINS, "gaussian", replace(gaussian, needs_public_data=True))
    with pytest.raises(DpltmUserError, match="noise gaussian needs public data for its shape"):
        check_planned_training(cfg, tiny_splits, "paper")
    with pytest.raises(DpltmUserError, match="unknown noise 'laplace' \\(choose from gaussian, dpd, shaped\\)"):
        plugins.noise_plugin("laplace")


@pytest.mark.parametrize("name", PLUGINS)
def test_noise_scale_and_masking_on_zero_gradients(name: str) -> None:
    """(a) std per surviving coordinate = σ_eff·C·s within 5 %; (b) none on pruned coordinates."""
    model, masks = pruned_model()
    clip, parameter = 0.8, 1.3
    mechanism = make_noise(name, parameter, context(model, masks, clip))
    effective = noise_plugin(name).effective_for(parameter)
    assert mechanism.effective_noise_multiplier == pytest.approx(effective)
    layout = MaskLayout.of(model, masks, torch.float64, mechanism.coordinate_scales())
    zeros = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    # perturb may add in place (add_gaussian_all's contract): every draw gets fresh sums
    draws = [mechanism.perturb({k: v.clone() for k, v in zeros.items()}, layout.surviving, clip, g)
             for _ in range(400)]
    for pname, mask in param_masks(model, masks).items():
        stacked = torch.stack([d[pname] for d in draws])
        expected = effective * clip * scale_of(mechanism, pname, stacked[0])
        if mask is not None:
            assert torch.count_nonzero(stacked[:, ~mask]) == 0, pname  # (b)
            stacked, expected = stacked[:, mask], expected[mask]
        standardised = (stacked / expected).flatten()
        assert float(standardised.std()) == pytest.approx(1.0, rel=0.05), pname
        assert abs(float(standardised.mean())) < 0.05, pname
        # the shape, not just the average: per-coordinate std tracks σ_eff·C·s
        per_coordinate = stacked.std(dim=0).flatten()
        ratio = per_coordinate / expected.flatten()
        assert float(ratio.mean()) == pytest.approx(1.0, rel=0.05), pname
        if float(expected.max() / expected.min()) > 1.5:
            corr = torch.corrcoef(torch.stack([per_coordinate.log(), expected.flatten().log()]))[0, 1]
            assert float(corr) > 0.95, pname


@pytest.mark.parametrize("name", PLUGINS)
def test_parameter_zero_is_clipped_sgd(name: str) -> None:
    """(c) parameter 0 returns the clipped sums unchanged (σ = 0 equals clipped SGD)."""
    model, masks = pruned_model()
    mechanism = make_noise(name, 0.0, context(model, masks))
    assert mechanism.effective_noise_multiplier == 0.0
    x, y = records(20, seed=1)
    layout = MaskLayout.of(model, masks, torch.float64, mechanism.coordinate_scales())
    sums = clipped_gradient_sum(model, x, y, 0.8, layout).grad_sums
    out = mechanism.perturb(dict(sums), layout.surviving, 0.8, torch.Generator().manual_seed(0))
    assert set(out) == set(sums)
    for key, value in sums.items():
        assert torch.equal(out[key], value), key


@pytest.mark.parametrize("name", PLUGINS)
@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_accountant_sees_the_effective_multiplier(name: str, accountant: str) -> None:
    """(d) dp_event_of(mech) has the same ε as the plain DP-SGD event at σ_eff."""
    mechanism = make_noise(name, 1.1, context(*pruned_model()))
    q, steps, delta = 0.02, 150, 1e-5
    expected = epsilon(dpsgd_event(q, noise_plugin(name).effective_for(1.1), steps), delta, accountant)
    assert epsilon(dp_event_of(mechanism, q, steps), delta, accountant) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("name", PLUGINS)
def test_parameter_and_effective_round_trip(name: str) -> None:
    """(e) parameter_for ∘ effective_for = id, both ways, and the built plug-in agrees."""
    cls = noise_plugin(name)
    for value in (0.0, 0.37, 1.0, 2.49, 10.43):
        assert cls.parameter_for(cls.effective_for(value)) == pytest.approx(value, rel=1e-15, abs=0)
        assert cls.effective_for(cls.parameter_for(value)) == pytest.approx(value, rel=1e-15, abs=0)
    built = make_noise(name, 2.49, context(*pruned_model()))
    assert built.parameter == 2.49
    assert built.effective_noise_multiplier == pytest.approx(cls.effective_for(2.49))
    assert isinstance(built.description(), str) and built.description()


@pytest.mark.parametrize("name", PLUGINS)
def test_per_record_sensitivity_in_the_clipping_geometry(name: str) -> None:
    """(f) ghost clipping in ‖g/s‖ equals a torch.func per-sample computation, and every
    clipped per-record contribution has norm ≤ C in the rescaled space: the sensitivity the
    Gaussian mechanism with multiplier σ_eff needs."""
    model, masks = pruned_model(2)
    mechanism = make_noise(name, 1.0, context(model, masks))
    scales = {k: scale_of(mechanism, k, p.detach()) for k, p in model.named_parameters()}
    layout = MaskLayout.of(model, masks, torch.float64, mechanism.coordinate_scales())
    x, y = records(23, seed=5)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):  # type: ignore[no-untyped-def]
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    # the ticket's gradient is the surviving coordinates' share: the pruned weights (exactly 0 in the
    # plain network) get none
    for key, mask in param_masks(model, masks).items():
        if mask is not None:
            assert torch.count_nonzero(params[key][~mask]) == 0, key
            per_sample[key] = per_sample[key] * mask
    rescaled = torch.sqrt(sum(((g / scales[k]).flatten(1) ** 2).sum(1) for k, g in per_sample.items()))
    clip = float(rescaled.median())  # half the records are clipped
    got = clipped_gradient_sum(model, x, y, clip, layout)
    torch.testing.assert_close(got.norms, rescaled)
    factors = (clip / rescaled).clamp(max=1.0)
    for key, g in per_sample.items():
        torch.testing.assert_close(got.grad_sums[key], (g * factors.view(-1, *[1] * (g.dim() - 1))).sum(0))
    contribution = rescaled * factors  # ‖c_i g_i / s‖
    assert float(contribution.max()) <= clip * (1 + 1e-9)
    assert int((rescaled > clip).sum()) > 0


# ---- differentially private dropout ------------------------------------------------------------


def test_dpd_alpha_formula_on_a_known_model() -> None:
    """α = 4C²σ²/θ² for the surviving weights only; median and quartiles per layer."""
    model, masks = pruned_model(1)
    clip, sigma = 2.0, 0.5  # 4C²σ² = 4
    with torch.no_grad():
        model.hidden[0].weight.fill_(0.5)  # α = 4 / 0.25 = 16 everywhere
        out = model.output.weight
        out.copy_(torch.linspace(0.1, 2.0, out.numel(), dtype=out.dtype).reshape(out.shape))
        # pruned raw values are tiny: they would dominate α if they were counted (the masks beside the
        # model, not the weights' values, say which coordinates survive)
        model.hidden[1].weight[~masks["hidden.1.weight"]] = 1e-6
    metrics = DropoutNoise(sigma).epoch_metrics(model, masks, clip)
    assert set(metrics) == {f"dpd_alpha_{stat}/{layer}" for stat in ("q25", "median", "q75")
                            for layer in ("hidden.0", "hidden.1", "output")}
    for stat in ("q25", "median", "q75"):
        assert metrics[f"dpd_alpha_{stat}/hidden.0"] == pytest.approx(16.0)
    theta = out[masks["output.weight"]].detach()
    alpha = 4.0 / theta**2
    for stat, p in (("q25", 0.25), ("median", 0.5), ("q75", 0.75)):
        assert metrics[f"dpd_alpha_{stat}/output"] == pytest.approx(float(torch.quantile(alpha, p)))
    hidden_1 = model.hidden[1].weight[masks["hidden.1.weight"]].detach()
    assert metrics["dpd_alpha_median/hidden.1"] == pytest.approx(float((4.0 / hidden_1**2).median()), rel=0.5)
    assert metrics["dpd_alpha_q75/hidden.1"] < 1e6
    rates = dropout_rates(model, masks, clip, sigma)
    assert rates["output"].numel() == int(masks["output.weight"].sum())
    assert not bool(masks["output.weight"].all())  # pruned: the count above bites
    assert dropout_rates(model, None, clip, sigma)["output"].numel() == out.numel()  # None: the dense network


def test_dpd_quantiles_sample_large_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dpd_module, "QUANTILE_SAMPLE", 1000)
    values = torch.arange(100_000, dtype=torch.float64)
    q25, median, q75 = quantiles(values, (0.25, 0.5, 0.75))
    assert median == pytest.approx(50_000, rel=0.01)
    assert q25 == pytest.approx(25_000, rel=0.01) and q75 == pytest.approx(75_000, rel=0.01)


def test_dpd_privacy_md_section_4_figures() -> None:
    """docs/privacy.md §4: the paper's σ = 3.23 "for ε = 0.5" is ε ≈ 0.67 (PLD), ≈ 0.75 (RDP).

    The paper's MNIST settings (§5): N = 60000, S = 600 (ν = 0.01), E = 200 epochs, so
    T = E/ν = 20000 iterations, δ = 1e-4. Under add/remove the multiplier is 2σ = 6.46.
    """
    q, steps, delta, sigma = 600 / 60000, 200 * 60000 // 600, 1e-4, 3.23
    event = dpsgd_event(q, noise_plugin("dpd").effective_for(sigma), steps)
    assert round(epsilon(event, delta, "pld"), 2) == 0.67
    assert round(epsilon(event, delta, "rdp"), 2) == 0.75
    assert epsilon(event, delta, "pld") > 0.5  # the paper's figure understates ε


def test_dpd_paper_own_figures_are_reproduced_as_comparisons() -> None:
    """The DPD paper's §4.3–4.4 accounting, read as in dpltm.privacy.comparisons, gives its
    printed σ = 3.23 (zCDP) and σ = 10.88 (advanced composition) for ε = 0.5 to within 1 % —
    when composed over E = 200 data passes. Over the 20000 iterations actually run, the same
    formulas need far more noise. Either way it is a comparison, never a bound."""
    q, steps, delta = 0.01, 20000, 1e-4
    assert dpd_paper_sigma(0.5, q, steps, delta, "zcdp") == pytest.approx(3.23, rel=0.01)
    assert dpd_paper_sigma(0.5, q, steps, delta, "ac") == pytest.approx(10.88, rel=0.01)
    assert dpd_paper_sigma(0.5, q, steps, delta, "zcdp", compositions=steps) == pytest.approx(13.90, rel=0.01)
    assert dpd_paper_sigma(0.5, q, steps, delta, "ac", compositions=steps) == pytest.approx(83.25, rel=0.01)
    figure = dpd_paper_figure(3.23, q, steps, delta)
    assert figure.epsilon == pytest.approx(0.5, rel=0.02) and figure.compositions == 200
    assert "not a bound" in figure.label


def test_dpd_description_states_both_readings() -> None:
    text = DropoutNoise(3.23).description()
    assert "replace-one" in text and "add/remove" in text and "6.46" in text


# ---- sensitivity-shaped noise -------------------------------------------------------------------


def test_shaped_needs_public_data() -> None:
    model, masks = pruned_model()
    with pytest.raises(DpltmUserError, match="pass --public-dataset"):
        make_noise("shaped", 1.0, NoiseContext(model=model, masks=masks, clip=1.0, private_dataset="digits"))
    with pytest.raises(DpltmUserError, match="pass --public-dataset"):
        make_noise("shaped", 1.0, None)
    x, y = records(10, seed=3)
    with pytest.raises(DpltmUserError, match="private dataset"):
        make_noise("shaped", 1.0, NoiseContext(model=model, masks=masks, clip=1.0, private_dataset="digits",
                                               public_data=LabeledTensors(x, y), public_dataset="digits"))


def test_shaped_scales_follow_public_sensitivity() -> None:
    """s > 0 per parameter, geometric mean ≈ 1 over surviving coordinates, within [1/10, 10],
    1 on pruned coordinates, and non-increasing in the public sensitivity w."""
    model, ticket = pruned_model()
    ctx = context(model, ticket)
    noise = make_noise("shaped", 1.0, ctx)
    assert isinstance(noise, ShapedNoise)
    scales = noise.coordinate_scales()
    assert scales is not None and set(scales) == {k for k, _ in model.named_parameters()}
    masks = param_masks(model, ticket)
    w = public_sensitivity(model, ctx.public_data.features, ctx.public_data.labels)  # type: ignore[union-attr]
    kept_s, kept_w = [], []
    for key, s in scales.items():
        assert s is not None and s.shape == dict(model.named_parameters())[key].shape
        mask = masks[key]
        if mask is not None:
            assert torch.all(s[~mask] == 1.0)
        kept_s.append(s.flatten() if mask is None else s[mask])
        kept_w.append(w[key].flatten() if mask is None else w[key][mask])
    s_all, w_all = torch.cat(kept_s), torch.cat(kept_w)
    assert float(s_all.min()) >= 0.1 - 1e-12 and float(s_all.max()) <= 10.0 + 1e-12
    assert float(s_all.log().mean().exp()) == pytest.approx(1.0, rel=0.1)
    assert float(s_all.max() / s_all.min()) > 2.0  # it really shapes
    order = torch.argsort(w_all)
    assert torch.all(s_all[order][1:] <= s_all[order][:-1] + 1e-12)  # less noise where more sensitive
    metrics = noise.epoch_metrics(model, ticket, 1.0)
    assert metrics["shaped_scale_min"] == pytest.approx(float(s_all.min()))
    assert metrics["shaped_scale_median"] == pytest.approx(float(s_all.median()), rel=0.05)
    assert metrics["shaped_scale_max"] == pytest.approx(float(s_all.max()))


def test_ledger_statement_names_the_plug_in() -> None:
    for name in NOISES:
        ledger = PrivacyLedger(phase1="none", phase1_dataset=None, private_dataset="mnist", selection_eps1=None,
                               training=training_record(0.01, 2.0, 100), delta=1e-5, noise=name)
        assert f"'{name}'" in ledger.statement()
        assert PrivacyLedger.from_json(ledger.to_json()).noise == name


# ---- the CLI -------------------------------------------------------------------------------------

FAST = ["--epochs", "1", "--batch-size", "16", "--device", "cpu", "--no-progress", "--json"]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    write_mnist(root, "MNIST", n_train=80, n_test=20)
    write_mnist(root, "FashionMNIST", n_train=80, n_test=20)
    return root


def test_account_prints_the_dpd_paper_figure_as_a_comparison(cli) -> None:
    result = cli("account", "--q", "0.01", "--steps", "20000", "--sigma", "3.23", "--delta", "1e-4",
                 "--noise", "dpd", "--json")
    report = json.loads(result.stdout)
    assert report["effective_sigma"] == pytest.approx(6.46) and report["sigma"] == 3.23
    rows = {row["accountant"]: row for row in report["rows"]}
    assert round(rows["pld"]["epsilon"], 2) == 0.67 and rows["pld"]["kind"] == "upper bound"
    paper = rows["dpd-paper-zcdp"]
    assert paper["kind"] == COMPARISON_LABEL and paper["epsilon"] == pytest.approx(0.5, rel=0.02)
    table = cli("account", "--q", "0.01", "--steps", "200", "--sigma", "3.23", "--noise", "dpd", ok=False)
    assert table.exit_code == 0 and "COMPARISON ONLY" in table.stdout and "effective multiplier 6.46" in table.stdout
    plain = cli("account", "--q", "0.01", "--steps", "200", "--sigma", "3.23", "--json", ok=False)
    assert "dpd-paper-zcdp" not in plain.stdout


def test_train_with_dpd_reports_the_effective_multiplier(data_root: Path, tmp_path: Path, cli) -> None:
    out = tmp_path / "dpd.pt"
    result = cli("train", "--dense", "--dataset", "fashion-mnist", "--data-dir", str(data_root),
                 "--noise", "dpd", "--eps2", "2.0", "--out", str(out), *FAST)
    report = json.loads(result.stdout)
    assert report["noise_parameter"] == pytest.approx(report["noise_multiplier"] / 2)  # calibrated: σ_eff/2
    assert report["epsilon"] <= 2.0 and "'dpd'" in result.stderr
    body = load_checkpoint(out, "model")
    ledger = PrivacyLedger.from_json(body["privacy"]["ledger"])
    assert ledger.noise == "dpd" and ledger.training["sigma"] == pytest.approx(report["noise_multiplier"])  # type: ignore[index]
    record = body["history"][0]
    for layer in ("hidden.0", "hidden.1", "output"):
        for stat in ("q25", "median", "q75"):
            assert math.isfinite(record[f"dpd_alpha_{stat}/{layer}"])
        assert record[f"dpd_alpha_q25/{layer}"] <= record[f"dpd_alpha_median/{layer}"] <= record[
            f"dpd_alpha_q75/{layer}"]


def test_train_with_shaped_noise_and_public_data(data_root: Path, tmp_path: Path, cli) -> None:
    out = tmp_path / "shaped.pt"
    result = cli("train", "--dense", "--dataset", "fashion-mnist", "--data-dir", str(data_root),
                 "--noise", "shaped", "--public-dataset", "mnist", "--public-split", "test",
                 "--sigma", "1.5",
                 "--out", str(out), *FAST)
    report = json.loads(result.stdout)
    assert report["noise_multiplier"] == 1.5 and report["noise_parameter"] == 1.5
    record = load_checkpoint(out, "model")["history"][0]
    assert 0.1 <= record["shaped_scale_min"] <= record["shaped_scale_median"] <= record["shaped_scale_max"] <= 10
    for args, message in (
        (["--noise", "shaped"], "pass --public-dataset"),
        (["--noise", "shaped", "--public-dataset", "fashion-mnist"], "names the private dataset"),
    ):
        failed = cli("train", "--dense", "--dataset", "fashion-mnist", "--data-dir", str(data_root),
                     "--sigma", "1.0", "--out", str(tmp_path / "x.pt"), *FAST, *args, ok=False)
        assert failed.exit_code == 2, failed.output
        assert message in failed.stderr and "Traceback" not in failed.output
