"""The library API's privacy record holds under the ways people really drive it (issue 19, §1–2):
second fits, resumes from Lightning checkpoints, changed batch sizes, saved and resumed
`make_private` runs, hand-fed batches, public data that overlaps the private records, optimisers
that evaluate twice, reloaded loaders. Every ε is checked against dp-accounting fed the segments
that really ran."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.privacy_accountant import NeighboringRelation

import dpltm
from dpltm.errors import DpltmUserError
from dpltm.lightning import poisson_loader
from tests.apidata import blobs, mlp


def composed_epsilon(segments: list[tuple[float, float, int]], delta: float = 1e-5,
                     neighboring: NeighboringRelation | None = None) -> float:
    """dp-accounting's PLD accountant fed every (q, σ, steps) segment by hand."""
    relation = neighboring or NeighboringRelation.ADD_OR_REMOVE_ONE
    accountant = pld_privacy_accountant.PLDAccountant(relation)
    for q, sigma, steps in segments:
        accountant.compose(dp_event.SelfComposedDpEvent(
            dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps))
    return float(accountant.get_epsilon(delta))


def as_ran(records: list[dict[str, Any]]) -> list[tuple[float, float, int]]:
    return [(r["q"], r["sigma"], int(r["steps"])) for r in records]


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = mlp()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer(max_epochs: int, callback: L.Callback, root: Path | None = None, **kwargs: Any) -> L.Trainer:
    return L.Trainer(max_epochs=max_epochs, callbacks=[callback], logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                     default_root_dir=root, **kwargs)


def loader(batch_size: int, seed: int | None = None, n: int = 400) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    x, y = blobs(n, 0)
    return poisson_loader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size, seed=seed)


def keys_anywhere(value: Any) -> set[str]:
    if isinstance(value, dict):
        return {str(k) for k in value} | {k for v in value.values() for k in keys_anywhere(v)}
    if isinstance(value, (list, tuple)):
        return {k for v in value for k in keys_anywhere(v)}
    return set()


# ---- DPCallback: every segment composed ------------------------------------------------------------

def test_resuming_a_spent_budget_is_refused_and_a_raised_budget_is_calibrated_for_what_is_left(tmp_path) -> None:  # type: ignore[no-untyped-def]
    first = dpltm.DPCallback(target_epsilon=0.5, noise_seed=1)
    module = Classifier()
    t1 = trainer(1, first)
    t1.fit(module, loader(40))
    ckpt = tmp_path / "one.ckpt"
    t1.save_checkpoint(ckpt)
    assert 0.45 < first.epsilon <= 0.5
    # the same target, one epoch more: what is left is nothing (today's bug printed 0.99999 for a true 1.186)
    again = dpltm.DPCallback(target_epsilon=0.5)
    with pytest.raises(DpltmUserError, match="cannot reach epsilon 0.5"):
        trainer(2, again).fit(Classifier(), loader(40), ckpt_path=ckpt)
    # a larger total budget: σ of the second segment is calibrated for what is left
    more = dpltm.DPCallback(target_epsilon=1.0)
    trainer(2, more).fit(Classifier(), loader(40), ckpt_path=ckpt)
    segments = more.segments.records()
    assert [s["steps"] for s in segments] == [10, 10] and segments[0]["sigma"] != segments[1]["sigma"]
    truth = composed_epsilon(as_ran(segments))
    assert more.epsilon == pytest.approx(truth, rel=1e-9) and 0.95 < truth <= 1.0
    assert [r["epoch"] for r in more.history] == [1, 2]
    statement = more.ledger().statement()  # type: ignore[union-attr]
    assert "Earlier segment 1" in statement


def test_a_second_fit_with_the_same_callback_composes_both() -> None:
    callback = dpltm.DPCallback(noise_multiplier=1.2, noise_seed=3)
    module = Classifier()
    trainer(1, callback).fit(module, loader(40))
    one = callback.epsilon
    trainer(1, callback).fit(module, loader(40, seed=6))
    assert callback.steps_done == 20
    assert callback.epsilon == pytest.approx(composed_epsilon([(0.1, 1.2, 20)]), rel=1e-9) and callback.epsilon > one
    assert callback.get_epsilon() == callback.epsilon  # Opacus's name, at the run's δ and at another
    assert callback.get_epsilon(1e-3) == pytest.approx(composed_epsilon([(0.1, 1.2, 20)], 1e-3), rel=1e-9)
    with pytest.raises(DpltmUserError, match="^delta must lie in"):
        callback.get_epsilon(1.5)
    # with a target: the first fit spends it all, so a second fit is refused in one line
    spent = dpltm.DPCallback(target_epsilon=1.0)
    trainer(1, spent).fit(Classifier(), loader(40))
    with pytest.raises(DpltmUserError, match="cannot reach epsilon 1"):
        trainer(1, spent).fit(Classifier(), loader(40))


def test_a_changed_batch_size_is_a_new_segment_not_a_replan() -> None:
    callback = dpltm.DPCallback(noise_multiplier=1.0)
    module = Classifier()
    trainer(1, callback).fit(module, loader(200, n=1000))  # q = 0.2, 5 steps
    large_q = callback.epsilon
    trainer(1, callback).fit(module, loader(10, n=1000))  # q = 0.01, 100 steps
    truth = composed_epsilon([(0.2, 1.0, 5), (0.01, 1.0, 100)])
    assert callback.epsilon == pytest.approx(truth, rel=1e-9)
    assert callback.epsilon > large_q  # today's bug printed less after the change than before it


def test_checkpoints_hold_no_seed_and_two_resumes_draw_different_noise(tmp_path) -> None:  # type: ignore[no-untyped-def]
    t1 = trainer(1, dpltm.DPCallback(noise_multiplier=1.0, noise_seed=7))
    t1.fit(Classifier(), loader(40))
    ckpt = tmp_path / "one.ckpt"
    t1.save_checkpoint(ckpt)
    stored = torch.load(ckpt, weights_only=False)
    state = next(v for k, v in stored["callbacks"].items() if "DPCallback" in k)
    assert not any("seed" in k or "generator" in k for k in keys_anywhere(state))
    weights = []
    for _ in range(2):  # the same checkpoint, even the same noise_seed argument
        module = Classifier()
        trainer(2, dpltm.DPCallback(noise_multiplier=1.0, noise_seed=7)).fit(module, loader(40), ckpt_path=ckpt)
        weights.append(module.model[0].weight.detach().clone())
    assert not torch.equal(weights[0], weights[1])
    # a seeded sampler would replay the first fit's batches: refused on resume
    with pytest.raises(DpltmUserError, match="replay the batches"):
        trainer(2, dpltm.DPCallback(noise_multiplier=1.0)).fit(Classifier(), loader(40, seed=9), ckpt_path=ckpt)


def test_an_old_callback_state_with_a_seed_is_refused() -> None:
    callback = dpltm.DPCallback(noise_multiplier=1.0)
    with pytest.raises(DpltmUserError, match="older dpltm"):
        callback.load_state_dict({"steps_done": 10, "history": [], "seed": 3, "generator": None})


class TwoLoaders(Classifier):
    """A module whose loader is rebuilt every epoch, with another batch size the second time."""

    def __init__(self) -> None:
        super().__init__()
        self.built = 0

    def train_dataloader(self) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
        self.built += 1
        return loader(40 if self.built == 1 else 10)


def test_a_reloaded_loader_is_checked_again() -> None:
    callback = dpltm.DPCallback(noise_multiplier=1.0)
    with pytest.raises(DpltmUserError, match="reloaded training loader"):
        trainer(2, callback, reload_dataloaders_every_n_epochs=1).fit(TwoLoaders())
    assert callback.steps_done == 10  # the first epoch's steps stay counted


class LbfgsClassifier(Classifier):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters(), lr=0.1)


def test_optimisers_that_evaluate_twice_are_refused() -> None:
    with pytest.raises(DpltmUserError, match="LBFGS"):
        trainer(1, dpltm.DPCallback(noise_multiplier=1.0)).fit(LbfgsClassifier(), loader(40))
    model = mlp()
    with pytest.raises(DpltmUserError, match="LBFGS"):
        dpltm.make_private(model, torch.optim.LBFGS(model.parameters()), blobs(100, 0), noise_multiplier=1.0,
                           batch_size=10)


def test_callback_refuses_batches_the_sampler_did_not_draw() -> None:
    x, y = blobs(400, 0)
    full = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=400)
    poisson = loader(40)
    poisson_batches = iter(full)

    class Swapped(torch.utils.data.DataLoader):  # type: ignore[type-arg]
        """A Poisson loader's sampler, but every batch is the full dataset."""

        def __iter__(self):  # type: ignore[no-untyped-def]
            for _ in iter(poisson.batch_sampler):  # type: ignore[union-attr]
                yield next(poisson_batches)

    swapped = Swapped(torch.utils.data.TensorDataset(x, y), batch_sampler=poisson.batch_sampler)
    with pytest.raises(DpltmUserError, match="did not come from the run's Poisson sampler"):
        trainer(1, dpltm.DPCallback(noise_multiplier=1.0)).fit(Classifier(), swapped)


# ---- make_private: own batches only, save/resume, public data checked -------------------------------

def test_step_takes_no_batch() -> None:
    model = mlp()
    private = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), blobs(300, 0),
                                 noise_multiplier=1.0, batch_size=30)
    x, y = blobs(300, 0)
    with pytest.raises(DpltmUserError, match="takes no batch"):
        private.step(x, y)  # 100 full-batch steps here once printed ε 0.718 (true 91.8)
    with pytest.raises(DpltmUserError, match="gone"):
        private.batches()
    assert private.steps_done == 0 and private.epsilon == 0.0
    private.step()
    assert private.epsilon == pytest.approx(composed_epsilon([(0.1, 1.0, 1)]), rel=1e-9)


def test_save_and_resume_compose_the_segments_and_store_no_seed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = blobs(600, 0)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    masks = {"0.weight": torch.rand(16, 10, generator=torch.Generator().manual_seed(1)) < 0.5}
    first = dpltm.make_private(model, optimizer, data, target_epsilon=0.5, epochs=1, batch_size=60, masks=masks,
                               masks_from="public", noise_seed=2)
    first.fit()
    path = first.save(tmp_path / "run.pt")
    body = torch.load(path, weights_only=True)
    assert not any("seed" in k or "generator" in k for k in keys_anywhere(body))
    model2 = mlp()
    optimizer2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    resumed = dpltm.make_private(model2, optimizer2, data, target_epsilon=1.0, epochs=2, batch_size=60, masks=masks,
                                 masks_from="public", resume_from=path)
    torch.testing.assert_close(model2[0].weight, model[0].weight)
    assert resumed.steps_done == 10 and resumed.epochs_done == 1
    resumed.fit()
    segments = resumed.segments.records()
    assert [s["steps"] for s in segments] == [10, 10]
    truth = composed_epsilon(as_ran(segments))
    assert resumed.epsilon == pytest.approx(truth, rel=1e-9) and 0.95 < truth <= 1.0
    assert [r["epoch"] for r in resumed.history] == [1, 2]
    model3 = mlp()
    before = {k: v.clone() for k, v in model3.state_dict().items()}
    with pytest.raises(DpltmUserError, match="cannot reach epsilon 0.5"):  # nothing left of the first budget
        dpltm.make_private(model3, torch.optim.SGD(model3.parameters(), lr=0.1), data, target_epsilon=0.5, epochs=2,
                           batch_size=60, masks=masks, masks_from="public", resume_from=path)
    assert all(torch.equal(v, before[k]) for k, v in model3.state_dict().items())  # a refused resume changes nothing
    fresh = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)  # optimizer2 is `resumed`'s (refused)
    with pytest.raises(DpltmUserError, match="noise_seed cannot be combined"):
        dpltm.make_private(model2, fresh, data, target_epsilon=1.0, epochs=2, batch_size=60, masks=masks,
                           masks_from="public", resume_from=path, noise_seed=1)
    with pytest.raises(DpltmUserError, match="masks differ"):
        dpltm.make_private(model2, fresh, data, target_epsilon=1.0, epochs=2, batch_size=60,
                           masks={"0.weight": torch.ones(16, 10)}, masks_from="public", resume_from=path)


def test_masks_from_public_data_or_tickets_is_checked_for_overlap() -> None:
    public, private_data = blobs(300, 1), blobs(300, 2)
    model = mlp()
    tickets = dpltm.generate_tickets(model, public, val=blobs(100, 3), rounds=1, iterations=5, batch_size=32)
    masks = tickets[1].masks
    ok = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), private_data, noise_multiplier=1.0,
                            batch_size=30, masks=masks, masks_from=tickets)
    assert "checked: no exact copy of a private training record" in str(ok.masks_from)
    leaked = (torch.cat([private_data[0], public[0][:5]]), torch.cat([private_data[1], public[1][:5]]))
    for given in (tickets, tickets[1], public):
        with pytest.raises(DpltmUserError, match="5 of the private training records are among"):
            dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), leaked, noise_multiplier=1.0,
                               batch_size=30, masks=masks, masks_from=given)


@pytest.mark.parametrize(("change", "match"), [
    ({"optimizer": "foreign"}, "not the model's"),
    ({"train": "wide"}, "does not accept the features"),
    ({"train": "labels"}, "labels must lie in \\[0, 2\\]"),
    ({"batch_size": 300}, "^batch_size \\(300\\) must be smaller"),
    ({"batch_size": 2.5}, "^batch_size must be an integer"),
    ({"epochs": 0}, "^epochs must be at least 1"),
    ({"delta": 2.0}, "^delta must lie in"),
    ({"delta": 1e-5, "target_delta": 1e-6}, "disagree"),
    ({"max_grad_norm": float("nan")}, "^max_grad_norm must be a finite number"),
    ({"noise_multiplier": 0.01}, "^noise_multiplier must be at least"),
    ({"neighboring": "swap"}, "^neighboring must be"),
    ({"accountant": "gdp"}, "^accountant .gdp.: the GDP accountant.s central limit theorem is an approximation"),
    ({"accountant": "moments"}, "^accountant must be"),
    ({"model": "not a model"}, "^model must be a torch.nn.Module"),
    ({"model": "bfloat16"}, "^trainable parameter '0.weight' is bfloat16: DP training needs float32 or float64"),
    ({"model": "float16"}, "^trainable parameter '0.weight' is float16"),
    ({"selection_eps1": 0.1}, "pass the ticket's masks"),
])
def test_make_private_checks_its_arguments_in_its_own_words(change: dict[str, Any], match: str) -> None:
    model = mlp()
    kwargs: dict[str, Any] = {"noise_multiplier": 1.0, "batch_size": 30}
    train: Any = blobs(300, 0)
    optimizer: Any = torch.optim.SGD(model.parameters(), lr=0.1)
    for key, value in change.items():
        if key == "optimizer":
            optimizer = torch.optim.SGD(mlp().parameters(), lr=0.1)
        elif key == "train" and value == "wide":
            train = blobs(300, 0, d=12)
        elif key == "train":
            x, y = train
            train = (x, y + 1)
        elif key == "model" and value in ("bfloat16", "float16"):
            model = mlp().to(getattr(torch, value))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        elif key == "model":
            model = value
        else:
            kwargs[key] = value
    if "noise_multiplier" in change:
        kwargs["noise_multiplier"] = change["noise_multiplier"]
    with pytest.raises(DpltmUserError, match=match):
        dpltm.make_private(model, optimizer, train, **kwargs)


def test_target_delta_replace_one_and_no_claimed_holdouts() -> None:
    model = mlp()
    private = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), blobs(300, 0),
                                 noise_multiplier=1.0, batch_size=30, target_delta=1e-6, neighboring="replace-one")
    private.fit()
    truth = composed_epsilon([(0.1, 1.0, 10)], delta=1e-6, neighboring=NeighboringRelation.REPLACE_ONE)
    assert private.epsilon == pytest.approx(truth, rel=1e-9)
    assert private.epsilon > composed_epsilon([(0.1, 1.0, 10)], delta=1e-6)
    report = private.report()
    assert report["neighboring"] == "replace_one" and report["delta"] == 1e-6
    assert "replace-one" in report["statement"] and "held out" not in report["statement"]


class Augmented(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A map-style dataset read per item, with fresh noise on every read (per-epoch augmentation)."""

    def __init__(self, n: int) -> None:
        self.x, self.y = blobs(n, 0)
        self.reads = 0

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads += 1
        return self.x[i] + 0.01 * torch.randn(10), self.y[i]


def test_datasets_are_read_per_batch_and_loaders_lend_their_dataset() -> None:
    data = Augmented(300)
    model = mlp()
    lazy = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data, noise_multiplier=1.0,
                              batch_size=30, in_memory=False)
    before = data.reads
    lazy.fit()
    assert 200 < data.reads - before < 400  # one read per sampled record (10 steps of ~30), nothing held
    assert lazy.epsilon == pytest.approx(composed_epsilon([(0.1, 1.0, 10)]), rel=1e-9)
    model = mlp()
    loader_given = torch.utils.data.DataLoader(Augmented(300), batch_size=30, shuffle=True)
    run = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader_given, noise_multiplier=1.0)
    assert run.plan.expected_batch_size == 30 and run.plan.sample_rate == pytest.approx(0.1)  # the loader's own
    run.step()

    class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield from zip(*blobs(10, 0))

    for stream in (Stream(), torch.utils.data.DataLoader(Stream(), batch_size=2)):
        with pytest.raises(DpltmUserError, match="IterableDataset"):
            dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), stream, noise_multiplier=1.0,
                               batch_size=3)


# ---- what an adversarial review of the API found (each failed before its fix) -----------------------

def test_a_collate_that_adds_rows_is_refused() -> None:
    x, y = blobs(300, 0)

    def doubled(items):  # type: ignore[no-untyped-def]
        xs, ys = torch.stack([i[0] for i in items]), torch.stack([i[1] for i in items])
        return torch.cat([xs, xs]), torch.cat([ys, ys])

    model = mlp()
    with pytest.raises(DpltmUserError, match="exactly one row"):
        dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                           torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), collate_fn=doubled,
                                                       batch_size=30),
                           noise_multiplier=1.0, batch_size=30)


class RawStep(Classifier):
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):  # type: ignore[no-untyped-def]
        optimizer_closure()
        optimizer.optimizer.step()


def test_steps_that_skip_the_privatisation_are_refused() -> None:
    callback = dpltm.DPCallback(noise_multiplier=1.0)
    with pytest.raises(DpltmUserError, match="no longer differentially private"):
        trainer(1, callback).fit(RawStep(), loader(40))
    assert callback.epsilon == float("inf")
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = dpltm.make_private(model, optimizer, blobs(300, 0), noise_multiplier=1.0, batch_size=30)
    before = model[0].weight.detach().clone()
    torch.nn.functional.cross_entropy(model(blobs(30, 1)[0]), blobs(30, 1)[1]).backward()
    with pytest.raises(DpltmUserError, match="must go through"):
        optimizer.step()
    assert torch.equal(model[0].weight, before)
    run.step()  # its own steps still run


def test_resume_keeps_the_provenance_that_made_the_epsilon(tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = blobs(300, 0)
    masks = {"0.weight": torch.rand(16, 10, generator=torch.Generator().manual_seed(1)) < 0.5}
    model = mlp()
    run = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data, noise_multiplier=1.0,
                             batch_size=30, epochs=1, masks=masks, masks_from="these records", masks_private=True)
    run.fit()
    path = run.save(tmp_path / "run.pt")
    model = mlp()
    with pytest.raises(DpltmUserError, match="masks_private=True"):
        dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data, noise_multiplier=1.0,
                           batch_size=30, epochs=2, masks=masks, masks_from="public (trust me)", resume_from=path)
    with pytest.raises(DpltmUserError, match="used SGD"):
        dpltm.make_private(model, torch.optim.Adam(model.parameters()), data, noise_multiplier=1.0, batch_size=30,
                           epochs=2, masks=masks, masks_from="these records", masks_private=True, resume_from=path)
    first = dpltm.DPCallback(noise_multiplier=1.0, masks={"model.0.weight": masks["0.weight"]},
                             masks_from="these records", masks_private=True)
    t1 = trainer(1, first)
    t1.fit(Classifier(), loader(40))
    t1.save_checkpoint(tmp_path / "one.ckpt")
    with pytest.raises(DpltmUserError, match="masks_private=True"):
        trainer(2, dpltm.DPCallback(noise_multiplier=1.0)).fit(Classifier(), loader(40),
                                                              ckpt_path=tmp_path / "one.ckpt")


def test_the_mechanism_cannot_be_swapped_under_the_ledger() -> None:
    model = mlp()
    run = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), blobs(300, 0), noise_multiplier=1.0,
                             batch_size=30)
    for name in ("plan", "settings", "masks_private", "selection_eps1"):
        with pytest.raises(AttributeError):
            setattr(run, name, None)


def test_the_overlap_check_says_what_it_can_check() -> None:
    public, private_data = blobs(300, 1), blobs(300, 2)
    model = mlp()
    tickets = dpltm.generate_tickets(model, public, rounds=1, iterations=5, batch_size=32)
    dataset = torch.utils.data.TensorDataset(*private_data)
    cases = [
        ({"train": dataset, "in_memory": False, "masks_from": tickets, "masks": tickets[1].masks}, "in_memory=True"),
        ({"masks_from": (public[0][:0], public[1][:0]), "masks": tickets[1].masks}, "no public records"),
        ({"masks_from": tickets, "masks": {"0.weight": torch.rand(16, 10) < 0.5}}, "none of theirs"),
    ]
    for kwargs, match in cases:
        train = kwargs.pop("train", private_data)
        with pytest.raises(DpltmUserError, match=match):
            dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), train, noise_multiplier=1.0,
                               batch_size=30, **kwargs)


@pytest.mark.parametrize(("train", "match"), [
    ("subset-sampler", "its own sampler"),
    ("float-labels", "class labels must be integers"),
    ("column-labels", "shape \\(N,\\)"),
    ("dict", "got dict"),
    ("empty", "empty"),
])
def test_more_bad_data_in_one_line(train: str, match: str) -> None:
    x, y = blobs(300, 0)
    data: Any = {
        "subset-sampler": torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                                      sampler=torch.utils.data.SubsetRandomSampler(range(100))),
        "float-labels": (x, y.float()),
        "column-labels": (x, y[:, None]),
        "dict": {"x": x, "y": y},
        "empty": (x[:0], y[:0]),
    }[train]
    model = mlp()
    with pytest.raises(DpltmUserError, match=match):
        dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data, noise_multiplier=1.0,
                           batch_size=30)


def test_lists_float64_and_dict_batches_work() -> None:
    x, y = blobs(300, 0)
    model = mlp()
    run = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), [x.double(), y],
                             noise_multiplier=1.0, batch_size=30)
    run.step()
    model64 = mlp().double()
    run64 = dpltm.make_private(model64, torch.optim.SGD(model64.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
                               batch_size=30)
    run64.step()
    assert run64.evaluate((x, y)) > 0.0
    with pytest.raises(DpltmUserError, match="at most 100"):
        dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), target_epsilon=150.0,
                           batch_size=30)

    class Records(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 300

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": x[i], "y": y[i]}

    class DictClassifier(Classifier):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            return F.cross_entropy(self.model(batch["x"]), batch["y"])

    callback = dpltm.DPCallback(noise_multiplier=1.0)
    trainer(1, callback).fit(DictClassifier(), poisson_loader(Records(), batch_size=30))
    assert callback.steps_done == 10


def test_a_saved_run_exports_to_safetensors_with_its_statement(tmp_path, cli) -> None:  # type: ignore[no-untyped-def]
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file


    model = mlp()
    masks = {"0.weight": torch.rand(16, 10, generator=torch.Generator().manual_seed(1)) < 0.5}
    run = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), blobs(300, 0), target_epsilon=1.0,
                             epochs=1, batch_size=30, masks=masks, masks_from="public")
    run.fit()
    path = run.save(tmp_path / "run.pt")
    out = tmp_path / "run.safetensors"
    cli("export", "--model", str(path), "--out", str(out))
    tensors = load_file(str(out))
    torch.testing.assert_close(tensors["0.weight"], model[0].weight.detach())
    assert torch.equal(tensors["mask_0.weight"], masks["0.weight"])
    with safe_open(str(out), framework="pt") as handle:
        metadata = handle.metadata()
    assert metadata["privacy_statement"] == run.ledger().statement()  # type: ignore[union-attr]
    assert json.loads(metadata["privacy"])["epsilon"] == pytest.approx(run.epsilon)
    predicted = cli("predict", "--model", str(out), ok=False)
    assert predicted.exit_code == 2 and "your own model" in predicted.stderr


def test_a_new_run_on_weights_another_run_trained_is_refused(tmp_path: Path) -> None:
    """Its ε would count only its own steps; continuing, resuming or loading other weights is fine."""
    model, data = mlp(), blobs(300, 0)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    first = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data, noise_multiplier=1.0,
                               batch_size=30)
    with_no_steps = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                                       noise_multiplier=1.0, batch_size=30)  # nothing stepped yet: allowed
    first.fit()
    path = first.save(tmp_path / "first.pt")
    with pytest.raises(DpltmUserError, match="^this model already took 10 steps in another private run"):
        dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data, noise_multiplier=1.0,
                           batch_size=30)
    resumed = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data, noise_multiplier=1.0,
                                 batch_size=30, epochs=2, resume_from=path)
    assert resumed.steps_done == 10 and with_no_steps.steps_done == 0
    with pytest.raises(DpltmUserError, match="has done 1 of epochs=1"):  # a refused resume keeps the guard
        dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data, noise_multiplier=1.0,
                           batch_size=30, epochs=1, resume_from=path)
    with pytest.raises(DpltmUserError, match="^this model already took 10 steps"):
        dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data, noise_multiplier=1.0,
                           batch_size=30)
    with pytest.raises(DpltmUserError, match="^generate_tickets takes the model's current weights as θ0, and these "
                                             "took 10 DP steps"):
        dpltm.generate_tickets(model, blobs(100, 5), rounds=1, iterations=5)
    model.load_state_dict(start)
    dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data, noise_multiplier=1.0, batch_size=30)


def test_a_new_callback_on_a_module_another_callback_trained_is_refused() -> None:
    x, y = blobs(300, 0)

    def fit(callback: dpltm.DPCallback, module: L.LightningModule) -> None:
        trainer = L.Trainer(max_epochs=1, callbacks=[callback], logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
        trainer.fit(module, poisson_loader(torch.utils.data.TensorDataset(x, y), batch_size=30))

    module = Classifier()
    fit(dpltm.DPCallback(noise_multiplier=1.0), module)
    with pytest.raises(DpltmUserError, match="already took 10 steps in another private run"):
        fit(dpltm.DPCallback(noise_multiplier=1.0), module)


def test_hostile_inputs_found_by_review_get_one_line_errors_or_work() -> None:
    x, y = blobs(300, 0)
    model = mlp()
    with pytest.raises(DpltmUserError, match="^class labels must be integers of shape \\(N,\\)"):
        dpltm.evaluate(model, (x, y[:, None]))  # (N, 1) against (N,) would broadcast to an N × N "accuracy"
    with pytest.raises(DpltmUserError, match="^model must be a torch.nn.Module"):
        dpltm.evaluate("model", (x, y))  # type: ignore[arg-type]
    with pytest.raises(DpltmUserError, match="^poisson_loader takes a Dataset, not a \\(features, labels\\) pair"):
        poisson_loader((x, y), 40)  # type: ignore[arg-type]
    with pytest.raises(DpltmUserError, match="^poisson_loader chooses the batches itself: drop drop_last"):
        poisson_loader(torch.utils.data.TensorDataset(x, y), 40, drop_last=True)
    with pytest.raises(DpltmUserError, match="^say where the masks come from"):
        dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
                           batch_size=30, masks={"0.weight": torch.ones(16, 10)}, masks_from=" ")
    with pytest.raises(DpltmUserError, match="^mask 0.weight must be a 0/1 tensor, got NoneType"):
        dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
                           batch_size=30, masks={"0.weight": None}, masks_from="public")
    for kwargs, match in (({"rounds": -1}, r"^rounds must be in \[0, 100\]"),
                          ({"iterations": 2.5}, "^iterations must be"),
                          ({"lr": float("nan")}, "^lr must be a finite number"),
                          ({"prune_rate": 1.0}, "^prune_rate must lie in \\(0, 1\\)"),
                          ({"output_prune_rate": 0.0}, "^output_prune_rate must lie in \\(0, 1\\)")):
        with pytest.raises(DpltmUserError, match=match):
            dpltm.generate_tickets(mlp(), (x, y), **{"rounds": 1, "iterations": 5, **kwargs})
    with pytest.raises(DpltmUserError, match="^labels must lie in \\[0, 2\\]"):
        dpltm.generate_tickets(mlp(), (x, y + 5), rounds=1, iterations=5)
    with pytest.raises(DpltmUserError, match="^ticket generation diverged in round 0"):
        dpltm.generate_tickets(mlp(), (x * float("inf"), y), rounds=1, iterations=5)

    # features that require grad, NumPy counts: they work
    import numpy as np

    run = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x.requires_grad_(), y),
                             noise_multiplier=1.0, batch_size=np.int64(30), max_grad_norm=np.float32(1.0))
    run.fit()
    assert run.steps_done == 10


def test_masks_are_the_runs_own_copy() -> None:
    """Editing the caller's mask tensor after make_private changes nothing: pruned weights stay zero."""
    x, y = blobs(300, 0)
    model = mlp()
    mask = torch.rand(16, 10, generator=torch.Generator().manual_seed(0)) < 0.5
    run = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
                             batch_size=30, masks={"0.weight": mask}, masks_from="public")
    pruned = ~mask.clone()
    mask.fill_(True)
    run.fit()
    assert bool((model[0].weight[pruned] == 0).all())


def test_fit_checks_its_epochs_and_validation_data_before_any_step_and_warns_on_training_records() -> None:
    x, y = blobs(300, 0)
    model = mlp()
    run = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
                             batch_size=30, epochs=2)
    with pytest.raises(DpltmUserError, match="^fit\\(epochs=5\\): only 2 of the run's planned epochs are left"):
        run.fit(epochs=5)
    with pytest.raises(DpltmUserError, match="^the model does not accept the features"):
        run.fit(val=(x[:, :5], y))
    assert run.steps_done == 0
    with pytest.warns(UserWarning, match="^40 of the 40 evaluation records are private training records"):
        run.evaluate((x[:40], y[:40]))
    held_out = blobs(50, 9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run.fit(epochs=1, val=held_out)
    assert run.steps_done == 10


def test_token_ids_reach_an_embedding_and_other_integers_become_floats() -> None:
    class Bag(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(20, 8)
            self.out = torch.nn.Linear(8, 3)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.out(self.embed(tokens).mean(1))

    g = torch.Generator().manual_seed(0)
    tokens, y = torch.randint(0, 20, (300, 5), generator=g), torch.randint(0, 3, (300,), generator=g)
    model = Bag()
    run = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (tokens, y), noise_multiplier=1.0,
                             batch_size=30)
    run.fit()
    assert run.steps_done == 10
    counts = torch.randint(0, 50, (300, 10), generator=g)  # int64 measurements (NumPy's default): numbers
    model = mlp()
    run = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (counts, y), noise_multiplier=1.0,
                             batch_size=30)
    run.fit()
    assert run.steps_done == 10 and 0 <= dpltm.evaluate(model, (counts, y)) <= 1
    pixels = torch.randint(0, 256, (300, 10), generator=g, dtype=torch.uint8)
    model = mlp()
    run = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (pixels, y), noise_multiplier=1.0,
                             batch_size=30)
    run.fit()
    assert run.steps_done == 10


def test_finished_runs_are_freed_with_their_records() -> None:
    """The optimiser guard and the stepped-weights guard hold runs weakly: a sweep of make_private calls does not keep
    every run's copy of the records alive (one did, and grew a benchmark to 22 GB)."""
    import gc
    import weakref

    x, y = blobs(300, 0)
    refs = []
    for _ in range(3):
        model = mlp()
        run = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
                                 batch_size=30)
        run.fit()
        refs.append(weakref.ref(run))
    del run, model
    gc.collect()
    assert all(ref() is None for ref in refs)


@pytest.mark.parametrize("edit", ["segments emptied", "segments shortened", "epochs_done negative",
                                  "history dropped", "ledger dropped"])
def test_a_run_file_whose_spent_record_was_altered_is_not_resumed(tmp_path: Path, edit: str) -> None:
    """A resume composes its budget with the file's segments: a file whose segments were emptied or shortened
    (re-saved, so it loads) while its privacy record still holds the steps would state a smaller ε than the
    weights' steps spent; each part of the record is checked against the others."""
    from dpltm.checkpoint import save_atomic

    data = blobs(300, 0)

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = mlp()
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    first = dpltm.make_private(*fresh(), data, target_epsilon=1.0, epochs=2, batch_size=30)
    first.fit(epochs=1)
    path = first.save(tmp_path / "run.pt")
    body = torch.load(path, weights_only=True)
    if edit == "segments emptied":
        body.update(segments=[], epochs_done=0, history=[])
    elif edit == "segments shortened":
        body["segments"][0]["steps"] = 1
        body["history"][-1]["steps"] = 1
    elif edit == "epochs_done negative":
        body["epochs_done"] = -5
    elif edit == "history dropped":
        body["history"] = []
    else:
        body["ledger"] = None
    altered = tmp_path / "altered.pt"
    save_atomic(body, altered, "run")
    with pytest.raises(DpltmUserError, match="refusing to resume from it$"):
        dpltm.make_private(*fresh(), data, target_epsilon=1.0, epochs=2, batch_size=30, resume_from=altered)
    honest = dpltm.make_private(*fresh(), data, target_epsilon=1.0, epochs=2, batch_size=30, resume_from=path)
    assert honest.steps_done == 10


def _api_refusals() -> dict[str, tuple[Any, str]]:
    """Hostile arguments a sweep found answered by a library's own traceback, a silent wrong answer, or (on_epoch)
    only after an epoch of private steps: each is now one line naming the argument."""
    data = blobs(200, 0)

    def run(**kwargs: Any) -> Any:
        model = mlp()
        return dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=20, **kwargs)

    def tickets() -> list[Any]:
        return dpltm.generate_tickets(mlp(), data, val=blobs(60, 1), rounds=1, iterations=5)

    meta = mlp().to("meta")
    return {
        "noise_seed past 2**63": (lambda: run(noise_multiplier=1.0, noise_seed=2**70), "^noise_seed must be in"),
        "callback noise_seed": (lambda: dpltm.DPCallback(target_epsilon=1.0, noise_seed=2**64), "^noise_seed must be"),
        "masks_private not a bool": (lambda: run(noise_multiplier=1.0, masks_private="no"), "^masks_private must be"),
        "meta parameters": (lambda: dpltm.make_private(meta, torch.optim.SGD(meta.parameters(), lr=0.1), data,
                                                       noise_multiplier=1.0, batch_size=20), "meta device"),
        "complex features": (lambda: dpltm.evaluate(mlp(), (data[0].to(torch.complex64), data[1])),
                             "^features must be real numbers"),
        "on_epoch not callable": (lambda: run(noise_multiplier=1.0).fit(on_epoch=5), "^on_epoch must be callable"),
        "generate seed text": (lambda: dpltm.generate_tickets(mlp(), data, rounds=1, iterations=5, seed="a"),
                               "^seed must be an integer"),
        "generate seed negative": (lambda: dpltm.generate_tickets(mlp(), data, rounds=1, iterations=5, seed=-1),
                                   r"^seed must be in \[0, "),
        "generate lr overflow": (lambda: dpltm.generate_tickets(mlp(), data, rounds=1, iterations=5, lr=1e300),
                                 r"^lr must lie in \(0, 1000\]"),
        "rounds that empty a layer": (lambda: dpltm.generate_tickets(mlp(), data, rounds=60, iterations=1),
                                      "would prune every weight of 0.weight"),
        "select from numbers": (lambda: dpltm.select_ticket([1, 2]), "^tickets must be a non-empty list"),
        "select eps1 as text": (lambda: dpltm.select_ticket(tickets(), eps1="0.1"), "^eps1 must be a number"),
        "select seed negative": (lambda: dpltm.select_ticket(tickets(), eps1=0.1, seed=-1), r"^seed must be in"),
        "account delta text": (lambda: dpltm.account(sample_rate=0.01, noise_multiplier=1.0, steps=10, delta="x"),
                               "^delta must be a number"),
        "account rate text": (lambda: dpltm.account(sample_rate="0.01", noise_multiplier=1.0, steps=10),
                              "^sample_rate must be a number"),
        "save to None": (lambda: run(noise_multiplier=1.0).save(None), "^path must be a file path, got None"),
        "save to ''": (lambda: run(noise_multiplier=1.0).save(""), "^path must be a file path, got an empty one"),
        "save as safetensors": (lambda: run(noise_multiplier=1.0).save("run.safetensors"), "names a safetensors"),
        "load None": (lambda: dpltm.load_model(None), "^path must be a file path"),
        "sampler n fractional": (lambda: dpltm.PoissonBatchSampler(100.5, 10), "^n must be an integer"),
        "sampler steps negative": (lambda: dpltm.PoissonBatchSampler(100, 10, steps=-3), "^steps must be at least 1"),
        "sampler seed text": (lambda: dpltm.PoissonBatchSampler(100, 10, seed="a"), "^seed must be an integer"),
        "loader batch size text": (lambda: dpltm.poisson_loader(torch.utils.data.TensorDataset(*data), "10"),
                                   "^batch_size must be an integer"),
        "evaluate batch size negative": (lambda: dpltm.evaluate(mlp(), data, batch_size=-1), "^batch_size must be"),
        "evaluate no records": (lambda: dpltm.evaluate(mlp(), (data[0][:0], data[1][:0])), "^there are no records"),
        "evaluate labels past the classes": (lambda: dpltm.evaluate(mlp(), (data[0], data[1] + 10)),
                                             r"^class labels must lie in \[0, 2\]"),
        "evaluate negative labels": (lambda: dpltm.evaluate(mlp(), (data[0], data[1] - 5)), "^class labels must"),
        "evaluate NaN features": (lambda: dpltm.evaluate(mlp(), (data[0] * float("nan"), data[1])),
                                  "^the features hold NaN"),
    }


@pytest.mark.parametrize("case", list(_api_refusals()))
def test_hostile_api_arguments_get_one_line_errors(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    call, match = _api_refusals()[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(DpltmUserError, match=match):
            call()
    assert not list(tmp_path.iterdir())  # nothing written


def _masked_run(**kwargs: Any) -> Any:
    x, y = blobs(200, 0)
    model = mlp()
    masks = {"0.weight": torch.rand(16, 10, generator=torch.Generator().manual_seed(2)) < 0.5}
    return dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), batch_size=20,
                              masks=masks, **kwargs)


def test_before_the_first_step_a_run_reports_what_chose_its_masks(tmp_path: Path) -> None:
    """The masks are on the model from make_private on: a model released before any DP step shows the ticket, so
    ε is the selection's ε1 (pure, at every δ), or ∞ for masks made on these records; 0 only without either."""
    chosen = _masked_run(noise_multiplier=1.0, masks_from="public tickets, chosen on private accuracies",
                         selection_eps1=0.5)
    assert chosen.epsilon == chosen.get_epsilon(1e-9) == chosen.epsilon_dp_part == 0.5
    assert dpltm.get_epsilon(chosen.save(tmp_path / "chosen.pt")) == 0.5
    assert chosen.report()["epsilon"] == 0.5 and "epsilon1 = 0.5" in chosen.report()["statement"]
    same_data = _masked_run(noise_multiplier=1.0, masks_from="tickets made on these records", masks_private=True)
    assert same_data.epsilon == math.inf == dpltm.get_epsilon(same_data.save(tmp_path / "same.pt"), delta=1e-6)
    report = same_data.report()  # the ledger report's keys, strict JSON
    assert "NOT differentially private" in report["statement"] and report["overall_epsilon"] == "inf"
    assert report["end_to_end_dp"] is False and json.loads(json.dumps(report, allow_nan=False)) == report
    public = _masked_run(noise_multiplier=1.0, masks_from="public data")
    assert public.epsilon == 0.0 == dpltm.get_epsilon(public.save(tmp_path / "public.pt"))
    with pytest.raises(DpltmUserError, match="delta"):
        dpltm.get_epsilon(tmp_path / "public.pt", delta=0.0)
    chosen.step()
    assert chosen.epsilon > 0.5


def test_a_target_epsilon_covers_the_selections_eps1_too(tmp_path: Path) -> None:
    """target_epsilon is the whole run's budget: with selection_eps1 σ is calibrated so that selection and
    training together meet it, fresh and after a resume (basic composition there)."""
    run = _masked_run(target_epsilon=1.0, epochs=2, masks_from="public tickets", selection_eps1=0.5)
    run.fit()
    assert 0.95 < run.epsilon <= 1.0
    alone = _masked_run(target_epsilon=1.0, epochs=2, masks_from="public tickets")
    assert run.plan.noise_multiplier > alone.plan.noise_multiplier
    x, y = blobs(200, 0)
    model, masks = mlp(), {"0.weight": torch.rand(16, 10, generator=torch.Generator().manual_seed(2)) < 0.5}
    first = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), target_epsilon=1.0,
                               epochs=1, batch_size=20, masks=masks, masks_from="public tickets", selection_eps1=0.5)
    first.fit()
    path = first.save(tmp_path / "run.pt")
    resumed = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), target_epsilon=1.5,
                                 epochs=2, batch_size=20, masks=masks, masks_from="public tickets",
                                 selection_eps1=0.5, resume_from=path)
    resumed.fit()
    assert 1.3 < resumed.epsilon <= 1.5
    with pytest.raises(DpltmUserError, match="cannot reach epsilon 1"):
        dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), target_epsilon=1.0,
                           epochs=3, batch_size=20, masks=masks, masks_from="public tickets", selection_eps1=0.5,
                           resume_from=resumed.save(tmp_path / "run2.pt"))


def test_the_progress_bar_never_shows_less_than_the_epsilon_spent() -> None:
    """Lightning's bars round to nearest (TQDM: 3 significant digits; Rich: 3 decimals): the bar gets ε rounded up
    to both, the loggers the smallest float32 ≥ ε."""
    from dpltm.privacy.display import for_progress_bar
    from dpltm.run_log import float32_at_least

    for value in [2.3503058489402444, 1.6904, 0.012341, 4e-5, 999.95, 123.4567, *torch.logspace(-4, 3, 200).tolist()]:
        shown = float32_at_least(for_progress_bar(value))
        assert float(f"{shown:.3g}") >= value and float(f"{shown:.3f}") >= value
    callback = dpltm.DPCallback(noise_multiplier=1.1, noise_seed=0)
    t = trainer(1, callback)
    t.fit(Classifier(), loader(20, n=200))
    bar = t.progress_bar_metrics["ε"]
    assert float(f"{bar:.3g}") >= callback.epsilon and float(f"{bar:.3f}") >= callback.epsilon
    assert float(t.callback_metrics["epsilon"]) >= callback.epsilon and "epsilon" not in t.progress_bar_metrics


def test_review_findings_planned_delta_mask_layouts_and_an_array_delta_are_one_line() -> None:
    import numpy as np

    assert dpltm.PlannedPrivateRun(private_size=1000, epochs=1, batch_size=50, target_epsilon=1.0,
                                   delta=None).delta == 1e-5  # the default, as make_private takes None
    x, y = blobs(200, 0)
    for mask in (torch.ones(16, 10, device="meta"), torch.ones(16, 10).to_sparse()):
        model = mlp()
        with pytest.raises(DpltmUserError, match="mask 0.weight must be a dense tensor"):
            dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
                               batch_size=20, masks={"0.weight": mask}, masks_from="public data")
    model = mlp()
    with pytest.raises(DpltmUserError, match="delta must be a number"):
        dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
                           batch_size=20, delta=np.array([1e-5, 1e-5]), target_delta=1e-5)
    with pytest.raises(DpltmUserError, match="n must be in"):
        dpltm.PoissonBatchSampler(10**18, 2)  # a draw is one int64 a record: refused, not an 8 EB allocation

    class Huge(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 2**45

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return x[i % 200], y[i % 200]

    model = mlp()
    with pytest.raises(DpltmUserError, match="draws from at most"):
        dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), Huge(), noise_multiplier=1.0,
                           batch_size=20, in_memory=False)


def test_a_lazily_read_label_past_the_classes_is_one_line_and_spends_nothing() -> None:
    x, y = blobs(200, 0)
    y[1:] = 7  # record 0 (the one make_private probes) is sound; the rest name no output of the 3-class model
    model = mlp()
    run = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.utils.data.TensorDataset(x, y),
                             noise_multiplier=1.0, batch_size=20, in_memory=False)
    with pytest.raises(DpltmUserError, match=r"labels must lie in \[0, 2\].*a batch of the training dataset"):
        run.step()
    assert run.steps_done == 0 and run.epsilon == 0.0
    y[1:] = 1  # sound again: a step runs (and fixes the model's classes, with one forward pass)
    run.step()
    y[:] = 7  # the later batches are checked without a forward pass, as surely
    with pytest.raises(DpltmUserError, match=r"labels must lie in \[0, 2\].*a batch of the training dataset"):
        run.step()
    assert run.steps_done == 1
