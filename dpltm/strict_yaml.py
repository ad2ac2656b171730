"""YAML for settings files: PyYAML's safe loader, refusing a key given twice in one mapping, and
reading `1e-5` as the number it is.

PyYAML keeps the last of duplicate keys silently, so `train: {epochs: 5}` written twice in a
--config file (the second one meant for another section) would change a run unseen. PyYAML follows
YAML 1.1, whose floats need a dot and a signed exponent: `1e-5` and `1.5e3` would be strings, which
a settings file could then not tell from a quoted "0.1" (refused: dpltm.config._coerce).
"""

from __future__ import annotations

import re
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


EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$")
"""A float in exponent notation as YAML 1.2 spells it (`1e-5`, `1E3`, `1.5e3`): plain scalars that YAML 1.1
leaves as strings. Tried after the 1.1 resolvers, so every int and dotted float keeps its meaning."""
EXPONENT_TAG = "tag:dpltm,2026:exponent-float"


class ExponentFloat(float):
    """A float written in exponent notation that keeps its text: a setting that takes text (a name, a layer list)
    gets what was written (`1e5`), not 100000.0, and messages show it as written."""

    text: str

    def __new__(cls, text: str) -> ExponentFloat:
        value = super().__new__(cls, text.replace("_", ""))
        value.text = text
        return value

    def __repr__(self) -> str:
        return self.text

    __str__ = __repr__


def _construct_exponent(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> ExponentFloat:
    return ExponentFloat(loader.construct_scalar(node))


_StrictLoader.add_implicit_resolver(EXPONENT_TAG, EXPONENT_FLOAT, list("-+0123456789."))
_StrictLoader.add_constructor(EXPONENT_TAG, _construct_exponent)


AMBIGUOUS_NUMBER = re.compile(r"^[-+]?(?:0[0-9_]+|[0-9][0-9_]*:[0-9_:]*(?:\.[0-9_]*)?)$")
"""Plain scalars YAML 1.1 reads as numbers other than a reader would: a leading zero (`0100` is octal 64) and
base 60 (`1:00` is 60). Refused in one line rather than read as what few would mean (digit separators, `1_000`,
read as Python reads them)."""
AMBIGUOUS_TAG = "tag:dpltm,2026:ambiguous-number"


def _refuse_ambiguous(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
    text = loader.construct_scalar(node)
    raise yaml.constructor.ConstructorError(
        None, None, f"{text!r} is a number only in YAML 1.1 (a leading zero is octal, ':' base 60): write it as a "
                    "plain decimal, or quote it for text", node.start_mark)


_StrictLoader.add_implicit_resolver(AMBIGUOUS_TAG, AMBIGUOUS_NUMBER, list("-+0123456789"))
_StrictLoader.add_constructor(AMBIGUOUS_TAG, _refuse_ambiguous)
for _first, _resolvers in _StrictLoader.yaml_implicit_resolvers.items():  # before YAML 1.1's int and float
    _resolvers.sort(key=lambda resolver: resolver[0] != AMBIGUOUS_TAG)


def safe_load_strict(text: str) -> Any:
    """`yaml.safe_load`, but a duplicate key in any mapping raises `DuplicateKeyError`."""
    return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader: builds plain values only
