"""YAML for settings files: PyYAML's safe loader, refusing a key given twice in one mapping.

PyYAML keeps the last of duplicate keys silently, so `train: {epochs: 5}` written twice in a
--config file (the second one meant for another section) would change a run unseen.
"""

from __future__ import annotations

from typing import Any

import yaml


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping holds one key twice; `key` names it."""

    def __init__(self, key: Any, mark: Any) -> None:
        super().__init__(None, None, f"duplicate key {key!r}", mark)
        self.key = key


class _StrictLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: the base class reports it
                break
            if duplicate:
                raise DuplicateKeyError(key, key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def safe_load_strict(text: str) -> Any:
    """`yaml.safe_load`, but a duplicate key in any mapping raises `DuplicateKeyError`."""
    return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader: builds plain values only
