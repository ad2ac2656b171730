"""The ScatterNet front end (`--arch scatter-linear|scatter-cnn`, issue 25): a fixed function of each
record with no parameters and no state, excluded from clipping, noise, the parameter count and every
file; its features computed once and cached, the cache rebuilt when the data or the settings change
or the file is damaged."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
import torch

from dpltm import feature_cache
from dpltm.architectures import ARCHITECTURES
from dpltm.data.types import DatasetSplits, LabeledTensors
from dpltm.dp.gaussian import GaussianNoise
from dpltm.dp.step import EngineLayout, private_gradients, step_layout
from dpltm.errors import DpltmUserError
from dpltm.feature_cache import features_of, network_inputs
from dpltm.masks import apply_masks_, full_masks, prunable_weights
from dpltm.networks.lenet import build_architecture, build_network
from dpltm.networks.scatter import CHANNELS, ScatterFront, scattering_class
from dpltm.pruning import paper_prune_rates, prune_layerwise
from tests.datafiles import write_mnist
from tests.dp.reference import masked_reference

SCATTER = ("scatter-linear", "scatter-mlp", "scatter-cnn")


@pytest.fixture(autouse=True)
def _nothing_recent() -> None:
    """Each test starts with no split held in memory: what it reads comes from its own cache folder."""
    feature_cache._recent.clear()


def _network(name: str, seed: int = 0, activation: str = "tanh") -> torch.nn.Module:
    arch = build_architecture(784, 10, ARCHITECTURES[name].default_hidden or (), None, activation, name)
    return build_network(arch, torch.Generator().manual_seed(seed))


def _images(n: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 784, generator=torch.Generator().manual_seed(seed))


def test_the_2d_torch_front_end_imports_whatever_kymatio_top_level_does() -> None:
    """kymatio 0.3's `import kymatio.torch` needs SciPy's removed sph_harm (3-D filters); dpltm imports its
    2-D torch front end alone, which works with any SciPy."""
    assert scattering_class().__name__ == "ScatteringTorch2D"


def test_a_missing_kymatio_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kymatio.scattering2d.frontend.torch_frontend", None)
    with pytest.raises(DpltmUserError, match="needs kymatio"):
        scattering_class()


@pytest.mark.parametrize("name", SCATTER)
def test_the_front_end_has_no_parameters_and_is_in_no_file(name: str) -> None:
    net = _network(name)
    assert list(net.front.parameters()) == [] and list(net.buffers()) == []  # type: ignore[union-attr]
    net(_images(2))  # builds the transform's filters: still nothing registered
    assert list(net.buffers()) == [] and not any(k.startswith("front") for k in net.state_dict())
    head = {"scatter-linear": {"output"}, "scatter-mlp": {"hidden.0", "output"},
            "scatter-cnn": {"conv.0", "conv.1", "hidden.0", "output"}}[name]
    assert {n.rsplit(".", 1)[0] for n in net.state_dict()} == head
    assert set(prunable_weights(net)) == {f"{layer}.weight" for layer in head}  # masks and the count: the head


def test_scatter_cnn_is_tramer_and_bonehs_head() -> None:
    net = _network("scatter-cnn")
    assert {n: tuple(p.shape) for n, p in net.named_parameters()} == {
        "conv.0.weight": (16, CHANNELS, 3, 3), "conv.0.bias": (16,), "conv.1.weight": (32, 16, 3, 3),
        "conv.1.bias": (32,), "hidden.0.weight": (32, 512), "hidden.0.bias": (32,), "output.weight": (10, 32),
        "output.bias": (10,)}
    linear = _network("scatter-linear")
    assert linear.output.weight.shape == (10, CHANNELS * 49)  # type: ignore[union-attr]
    assert not bool(linear.output.weight.any())  # the convex model starts at zero


def test_refusals_are_one_line() -> None:
    with pytest.raises(DpltmUserError, match="takes no --hidden"):
        build_architecture(784, 10, (32,), None, "tanh", "scatter-linear")
    with pytest.raises(DpltmUserError, match="square"):
        build_architecture(561, 6, (), None, "tanh", "scatter-linear")
    with pytest.raises(DpltmUserError, match="multiple of 4"):
        ScatterFront(30 * 30)
    with pytest.raises(DpltmUserError, match="scattering features, not 5"):
        _network("scatter-linear")(torch.rand(2, 5))


def test_a_records_features_do_not_depend_on_any_other_record() -> None:
    front = _network("scatter-cnn").front  # type: ignore[union-attr]
    x = _images(64)
    together = front(x)
    alone = torch.cat([front(x[i:i + 1]) for i in (0, 17, 63)])
    torch.testing.assert_close(alone, together[[0, 17, 63]], rtol=1e-5, atol=1e-5)
    other = x.clone()
    other[1:] = _images(63, seed=5)  # every other record changed
    torch.testing.assert_close(front(other)[0], together[0], rtol=1e-5, atol=1e-5)
    assert together.shape == (64, CHANNELS * 49)
    groups = together.reshape(64, 27, -1)  # per-record group normalisation: each group centred and scaled
    torch.testing.assert_close(groups.mean(-1), torch.zeros(64, 27), atol=1e-4, rtol=0)


def test_the_head_reads_raw_records_or_their_features_alike() -> None:
    net = _network("scatter-cnn")
    x = _images(5)
    torch.testing.assert_close(net(x), net(net.front(x)))  # type: ignore[union-attr]


def test_the_dp_step_clips_and_noises_the_head_alone() -> None:
    """The engine's step over cached features equals the torch.func masked reference over the head's
    parameters, and the noise stays off the pruned coordinates."""
    model = _network("scatter-cnn").double()
    masks = full_masks(model)
    masks = apply_masks_(model, prune_layerwise(prunable_weights(model), masks,
                                                paper_prune_rates(list(prunable_weights(model)))))
    layout = step_layout(model, masks, torch.float64)
    assert isinstance(layout, EngineLayout)
    x = model.front(_images(10).double())  # type: ignore[union-attr]
    y = torch.randint(0, 10, (10,), generator=torch.Generator().manual_seed(1))
    ref = masked_reference(model, masks, x, y)
    grads, norms, _ = private_gradients(model, x, y, clip=ref.clip, noise=GaussianNoise(0.0), expected_batch_size=10.0,
                                        generator=torch.Generator().manual_seed(0), layout=layout)
    torch.testing.assert_close(norms, ref.norms, rtol=1e-9, atol=1e-9)
    assert set(grads) == {n for n, _ in model.named_parameters()}
    for n, total in ref.clipped_sum.items():
        torch.testing.assert_close(grads[n], total / 10.0, rtol=1e-9, atol=1e-9)
    noisy, _, _ = private_gradients(model, x, y, clip=ref.clip, noise=GaussianNoise(2.0), expected_batch_size=10.0,
                                    generator=torch.Generator().manual_seed(0), layout=layout)
    for n, mask in masks.items():
        assert bool((noisy[n][~mask] == 0).all()), n


def test_dp_training_of_a_masked_head_reads_the_norm_tables_and_trains_as_without(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's DP training of a masked head over cached features takes its norms from the per-record
    tables (the head is fed the records themselves), and trains exactly as the per-batch norm does."""
    import dpltm.training.private as private_training
    from dpltm.dp.mechanism import NoiseContext
    from dpltm.settings import TrainSettings
    from dpltm.training.plan import plan_training
    from dpltm.training.private import run_private

    data = network_inputs(_network("scatter-linear"), _splits(n=60), cache_dir=tmp_path)
    real_terms = private_training.record_terms
    made: list[object] = []

    def trained(with_tables: bool) -> dict[str, torch.Tensor]:
        model = _network("scatter-linear", seed=3)
        masks = full_masks(model)
        masks["output.weight"] = torch.rand(masks["output.weight"].shape,
                                            generator=torch.Generator().manual_seed(4)) < 0.4
        masks = apply_masks_(model, masks)
        monkeypatch.setattr(private_training, "record_terms",
                            (lambda *a: made.append(real_terms(*a)) or made[-1]) if with_tables else (lambda *a: None))
        settings = TrainSettings(epochs=2, batch_size=20, eps2=None, sigma=1.0, lr=0.5, momentum=0.9, clip=0.05)
        run_private(model, data, plan_training(settings, len(data.train)), settings, seed=7,
                    epsilon_after=lambda steps: 0.0, progress=False,
                    noise_context=NoiseContext(model=model, masks=masks, clip=settings.clip, private_dataset="mnist"))
        return {k: v.detach().clone() for k, v in model.named_parameters()}

    looked_up, computed = trained(True), trained(False)
    # the head trains in the fused step (dpltm.dp.step.takes_fused_step): its table holds M a_i² per record
    assert made and isinstance(made[0], torch.Tensor) and tuple(made[0].shape) == (len(data.train), 10)
    for name, value in computed.items():
        torch.testing.assert_close(looked_up[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _splits(seed: int = 0, n: int = 40) -> DatasetSplits:
    g = torch.Generator().manual_seed(seed)
    part = lambda k: LabeledTensors(torch.rand(k, 784, generator=g), torch.randint(0, 10, (k,), generator=g))  # noqa: E731
    return DatasetSplits("mnist", "train", part(n), part(8), part(8), 784, 10, "fp")


def test_features_are_computed_once_then_read_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    net, data = _network("scatter-linear"), _splits()
    first = network_inputs(net, data, cache_dir=tmp_path)
    assert first.train.features.shape == (40, CHANNELS * 49) and first.num_features == 784
    assert first.fingerprint == data.fingerprint and torch.equal(first.train.labels, data.train.labels)
    files = sorted(tmp_path.glob("*.pt"))
    assert len(files) == 3  # one per split
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)  # private data: the user's alone

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("computed again")

    monkeypatch.setattr(feature_cache, "compute_features", never)
    held = network_inputs(net, data, cache_dir=tmp_path)  # held in memory by this process
    assert held.train.features.data_ptr() == first.train.features.data_ptr()
    feature_cache._recent.clear()
    again = network_inputs(net, data, cache_dir=tmp_path)  # from the files
    assert torch.equal(again.train.features, first.train.features)
    assert network_inputs(net, first, cache_dir=tmp_path) is not None  # features in: passed through


def test_the_cache_is_rebuilt_when_the_data_or_the_settings_change(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    front = _network("scatter-linear").front  # type: ignore[union-attr]
    x = _images(12)
    features_of(front, x, tmp_path)
    changed = x.clone()
    changed[3, 100] += 0.01  # one pixel of one record
    calls = []
    real = feature_cache.compute_features
    monkeypatch.setattr(feature_cache, "compute_features", lambda *a, **k: calls.append(1) or real(*a, **k))
    features_of(front, changed, tmp_path)
    assert calls == [1] and len(list(tmp_path.glob("*.pt"))) == 2
    settings = front.settings()
    monkeypatch.setattr(type(front), "settings", lambda self: {**settings, "kymatio": "0.4.0"})
    features_of(front, x, tmp_path)
    assert calls == [1, 1] and len(list(tmp_path.glob("*.pt"))) == 3


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign"])
def test_a_damaged_cache_file_is_rebuilt_never_used(tmp_path: Path, damage: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    front = _network("scatter-linear").front  # type: ignore[union-attr]
    x = _images(12)
    good = features_of(front, x, tmp_path)
    (path,) = tmp_path.glob("*.pt")
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:200])
    elif damage == "flip":
        body = torch.load(path, weights_only=True)
        body["features"][2, 7] += 1.0  # a silent change: only the checksum sees it
        torch.save(body, path)
    else:
        torch.save({"format": feature_cache.CACHE_FORMAT, "key": "0" * 64, "features": good}, path)
    feature_cache._recent.clear()
    again = features_of(front, x, tmp_path)
    torch.testing.assert_close(again, good)
    assert "damaged" in capsys.readouterr().err
    feature_cache._recent.clear()
    assert torch.equal(features_of(front, x, tmp_path), again)  # and the rebuilt file is good
    assert "damaged" not in capsys.readouterr().err


def test_a_cache_file_of_an_earlier_format_is_rebuilt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    front = _network("scatter-linear").front  # type: ignore[union-attr]
    x = _images(5)
    good = features_of(front, x, tmp_path)
    (path,) = tmp_path.glob("*.pt")
    body = torch.load(path, weights_only=True)
    torch.save({**body, "format": 1}, path)  # format 1 stored a plain SHA-256 of the features
    feature_cache._recent.clear()
    torch.testing.assert_close(features_of(front, x, tmp_path), good)
    assert "written by an earlier dpltm" in capsys.readouterr().err
    assert torch.load(path, weights_only=True)["format"] == feature_cache.CACHE_FORMAT


def test_the_checksum_covers_every_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pieces' checksum changes with one value in any piece, and with the piece size itself."""
    monkeypatch.setattr(feature_cache, "CHECKSUM_PIECE", 64)
    values = torch.arange(100, dtype=torch.float32).reshape(10, 10)  # 400 bytes: 7 pieces
    base = feature_cache._checksum(values)
    for row, col in ((0, 0), (5, 5), (9, 9)):
        changed = values.clone()
        changed[row, col] += 1
        assert feature_cache._checksum(changed) != base
    monkeypatch.setattr(feature_cache, "CHECKSUM_PIECE", 128)
    assert feature_cache._checksum(values) != base


def test_an_unwritable_cache_folder_is_a_note_not_a_failure(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    front = _network("scatter-linear").front  # type: ignore[union-attr]
    assert features_of(front, _images(3), blocked / "cache").shape == (3, CHANNELS * 49)
    assert "not written" in capsys.readouterr().err


def test_the_cache_folder_is_the_users(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DPLTM_FEATURE_CACHE", str(tmp_path / "c"))
    assert feature_cache.feature_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("DPLTM_FEATURE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert feature_cache.feature_cache_dir() == tmp_path / "x" / "dpltm" / "features"


@pytest.mark.slow
def test_cli_scatter_cnn_generate_select_train_export_predict(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    """Every stage takes the front end; the released model and export hold the head alone (no cached
    feature, nothing of the front end), and predict reads raw images through it."""
    data, cache = tmp_path / "data", tmp_path / "cache"
    write_mnist(data, "MNIST", n_train=200, n_test=40)
    write_mnist(data, "KMNIST", n_train=200, n_test=40)
    env = {"DPLTM_DATA_DIR": str(data), "DPLTM_FEATURE_CACHE": str(cache)}
    cli("generate", "--dataset", "kmnist", "--arch", "scatter-cnn", "--activation", "tanh", "--rounds", "2",
        "--iterations", "20", "--batch-size", "32", "--device", "cpu", "--out", str(tmp_path / "t.pt"),
        "--no-progress", env=env)
    cli("select", "--tickets", str(tmp_path / "t.pt"), "--noise-aware", "--private-size", "180", "--eps", "1",
        "--epochs", "1", "--batch-size", "32", "--out", str(tmp_path / "w.pt"), env=env)
    report = json.loads(cli("train", "--ticket", str(tmp_path / "w.pt"), "--dataset", "mnist", "--eps2", "1",
                            "--epochs", "1", "--batch-size", "32", "--device", "cpu", "--out", str(tmp_path / "m.pt"),
                            "--no-progress", "--json", env=env).stdout)
    assert report["end_to_end_dp"] is True and 0.9 < report["epsilon"] <= 1.0
    body = torch.load(tmp_path / "m.pt", weights_only=True)
    heads = {"conv.0", "conv.1", "hidden.0", "output"}
    assert {k.rsplit(".", 1)[0] for k in body["state_dict"] if not k.startswith("mask_")} == heads

    def tensors(value: object) -> list[torch.Tensor]:
        if isinstance(value, torch.Tensor):
            return [value]
        if isinstance(value, dict):
            return [t for v in value.values() for t in tensors(v)]
        if isinstance(value, (list, tuple)):
            return [t for v in value for t in tensors(v)]
        return []

    assert all(CHANNELS * 49 not in t.shape for t in tensors(body))  # no cached feature in the model file
    cli("export", "--model", str(tmp_path / "m.pt"), "--out", str(tmp_path / "m.safetensors"))
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "m.safetensors"))
    assert all(CHANNELS * 49 not in t.shape for t in exported.values())
    assert os.path.getsize(tmp_path / "m.safetensors") < 200_000
    predicted = json.loads(cli("predict", "--model", str(tmp_path / "m.safetensors"), "--dataset", "mnist",
                               "--json", env=env).stdout)
    assert predicted["accuracy"] == pytest.approx(report["test_accuracy"])
    assert 3 <= len(list(cache.glob("*.pt"))) <= 6  # one file per distinct split (keyed by content), none per stage


def test_an_unwritable_cache_folder_is_said_once_and_the_features_still_come(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A cache that cannot be written is skipped with one note per folder, not one per split, and the run
    goes on with the features it computed."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder would be")
    feature_cache._UNWRITABLE.discard(str(blocker))
    front = _network("scatter-linear").front  # type: ignore[union-attr]
    for seed in (0, 1, 2):
        features = features_of(front, _images(3, seed), blocker)
        assert features.shape == (3, CHANNELS * 49)
    assert capsys.readouterr().err.count("feature cache not written") == 1
