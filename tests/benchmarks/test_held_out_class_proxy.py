"""benchmarks/held_out_class_proxy.py: the public data split by class, the tickets' classes and the proxy's apart."""

from __future__ import annotations

import torch
from held_out_class_proxy import class_split, parse_known

from dpltm.data.types import DatasetSplits


def test_the_class_split_partitions_every_part_and_keeps_the_label_space(tiny_splits: DatasetSplits) -> None:
    seen, unseen = class_split(tiny_splits, {0, 1})
    for part in ("train", "val", "test"):
        whole, a, b = (getattr(d, part) for d in (tiny_splits, seen, unseen))
        assert set(a.labels.tolist()) == {0, 1} and set(b.labels.tolist()) == {0, 1}  # B renamed onto A's units
        assert len(a) + len(b) == len(whole)
        assert torch.equal(torch.cat([a.features, b.features]).sort(0).values, whole.features.sort(0).values)
        for original, renamed in ((2, 0), (3, 1)):  # class 2's records are B's class 0, in order
            assert torch.equal(b.features[b.labels == renamed], whole.features[whole.labels == original])
    assert seen.num_classes == unseen.num_classes == tiny_splits.num_classes  # the output layer stays whole
    assert len({seen.fingerprint, unseen.fingerprint, tiny_splits.fingerprint}) == 3  # never resumed as the whole


def test_known_private_accuracies_parse_per_dataset_and_eps() -> None:
    assert parse_known(["mnist:1=0.93,0.94", "fashion-mnist:0.2=0.8"]) == {
        ("mnist", 1.0): [0.93, 0.94], ("fashion-mnist", 0.2): [0.8]}
