"""Per-record norm tables (dpltm.dp.engine.record_norm_tables): a layer fed the records themselves gets
its masked norm from a table made once per run. The step must equal the torch.func reference with or
without them, and a table must never be read where it no longer describes the layer's input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpltm.dp.engine import RecordTable, clipped_gradient_sum_of, record_norm_tables, table_rows
from dpltm.dp.step import EngineLayout, record_terms, step_layout, terms_of_batch
from tests.dp.reference import masked_reference


def _records(n: int = 30, width: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g, dtype=torch.float64), torch.randint(0, 5, (n,), generator=g)


def _masked(model: nn.Module, density: float = 0.5, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    masks = {n: torch.rand(p.shape, generator=g) < density for n, p in model.named_parameters()
             if n.endswith("weight")}
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in masks:
                p.mul_(masks[n])
    return masks


def _check_against_reference(model: nn.Module, masks: dict[str, torch.Tensor], records: torch.Tensor,
                             labels: torch.Tensor, index: torch.Tensor,
                             tables: dict[str, RecordTable]) -> None:
    x, y = records.index_select(0, index), labels.index_select(0, index)
    ref = masked_reference(model, masks, x, y)
    got = clipped_gradient_sum_of(model, x, y, ref.clip, masks, input_terms=table_rows(tables, index))
    torch.testing.assert_close(got.norms, ref.norms, rtol=1e-10, atol=1e-10)
    for name, value in ref.clipped_sum.items():
        torch.testing.assert_close(got.grad_sums[name], value, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("masked", [False, True])
def test_tables_give_the_reference_norms_and_sums(masked: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 7), nn.Tanh(), nn.Linear(7, 5)).double()
    masks = _masked(model) if masked else {}
    records, labels = _records()
    tables = record_norm_tables(model, masks, records)
    assert set(tables) == {"1"}  # the first linear layer sees the records; the second does not
    assert tables["1"].masked == masked and tables["1"].terms.shape == (30, 7 if masked else 1)
    _check_against_reference(model, masks, records, labels, torch.tensor([0, 3, 4, 17, 29]), tables)


def test_records_of_images_flattened_by_the_network() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 5)).double()
    masks = _masked(model)
    records, labels = _records()
    images = records.reshape(30, 1, 3, 4)
    tables = record_norm_tables(model, masks, images)
    assert set(tables) == {"1"}
    x, y = images[[2, 5, 9]], labels[[2, 5, 9]]
    ref = masked_reference(model, masks, x, y)
    got = clipped_gradient_sum_of(model, x, y, ref.clip, masks, input_terms=table_rows(tables, torch.tensor([2, 5, 9])))
    torch.testing.assert_close(got.norms, ref.norms, rtol=1e-10, atol=1e-10)


class Scaled(nn.Module):
    """Transforms the records before its linear layer: no table may apply."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.inplace = inplace
        self.linear = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.mul_(3.0) if self.inplace else x * 3.0)


@pytest.mark.parametrize("inplace", [False, True])
def test_no_table_for_a_layer_that_sees_transformed_records(inplace: bool) -> None:
    torch.manual_seed(0)
    model = Scaled(inplace).double()
    masks = _masked(model)
    records, _ = _records()
    assert record_norm_tables(model, masks, records.clone()) == {}


def test_a_table_is_not_read_when_the_layer_no_longer_sees_the_records() -> None:
    """Tables made for one network, handed to a step whose layer is fed something else (written in
    place, or a copy), are ignored: the norms are the reference's, not the table's."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(12, 5)).double()
    masks = _masked(plain)
    records, labels = _records()
    tables = record_norm_tables(plain, masks, records)
    assert set(tables) == {"0"}
    index = torch.tensor([1, 2, 3, 8])
    for inplace in (False, True):
        other = Scaled(inplace).double()
        other.linear.load_state_dict(plain[0].state_dict())
        other_masks = {"linear.weight": masks["0.weight"]}
        renamed = {"linear": tables["0"]}
        x, y = records.index_select(0, index), labels.index_select(0, index)
        ref = masked_reference(other, other_masks, x.clone(), y)
        got = clipped_gradient_sum_of(other, x, y, ref.clip, other_masks, input_terms=table_rows(renamed, index))
        torch.testing.assert_close(got.norms, ref.norms, rtol=1e-10, atol=1e-10)


def test_a_dense_table_is_never_read_for_a_masked_layer() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 5)).double()
    records, labels = _records()
    dense_tables = record_norm_tables(model, {}, records)
    masks = _masked(model)
    _check_against_reference(model, masks, records, labels, torch.tensor([0, 1, 2, 6]), dense_tables)
    masked_tables = record_norm_tables(model, masks, records)
    x, y = records[:4], labels[:4]
    ref = masked_reference(model, {}, x, y)
    got = clipped_gradient_sum_of(model, x, y, ref.clip, {}, input_terms=table_rows(masked_tables, torch.arange(4)))
    torch.testing.assert_close(got.norms, ref.norms, rtol=1e-10, atol=1e-10)


def test_the_step_layouts_terms_for_the_engine() -> None:
    """`record_terms` gives the engine's tables for an EngineLayout, and `terms_of_batch` their rows."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 5)).double()
    masks = _masked(model)
    layout = step_layout(model, masks, torch.float64)
    assert isinstance(layout, EngineLayout)
    records, _ = _records()
    terms = record_terms(model, layout, records)
    assert isinstance(terms, dict) and set(terms) == {"0"}
    rows = terms_of_batch(terms, torch.tensor([4, 7]))
    assert isinstance(rows, dict)
    expected = (records[[4, 7]] ** 2) @ masks["0.weight"].double().T
    torch.testing.assert_close(rows["0"].terms, expected)
