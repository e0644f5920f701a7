"""What a point's key hashes: one rule, declared on the dataclass fields it applies to.

A point's key (harness.config.point.Point.key) hashes every field of the point, those of its nested
dataclasses included, as plain JSON values, except the fields whose metadata say otherwise:
- OPTIONAL_IN_KEY: left out while the field holds its default. Such a field describes something a
  point may have beyond the plain case (a memory limit, a checkpoint, a prompt file, a repeat index),
  so a point without it is keyed exactly as if the field did not exist;
- NOT_IN_KEY: always left out. Such a field says how or under which name a point is measured (timed
  alone or interleaved, the strategy variant's name), not what is measured;
- keyed_as(form): hashed as `form(value)`, not as the value. Such a field names something by where
  it lives as well as what it is (a strategy class's import path): the form keeps what it is, so that
  moving code does not orphan the rows measured before the move.

A field is declared with `field(default=..., metadata=OPTIONAL_IN_KEY)`; nothing else in the harness
lists fields by name for the key.
"""
from __future__ import annotations

import copy
from dataclasses import MISSING, Field, fields, is_dataclass
from typing import Any

KEY_METADATA = "key"  # the metadata entry the rule reads
OPTIONAL_IN_KEY = {KEY_METADATA: "optional"}  # left out of the key while at its default
NOT_IN_KEY = {KEY_METADATA: "never"}  # never in the key
KEY_FORM = "key_form"  # the metadata entry holding keyed_as's function


def keyed_as(form) -> dict:
    """Field metadata: the key hashes form(value) instead of the value."""
    return {KEY_FORM: form}


def _default(spec: Field) -> Any:
    if spec.default is not MISSING:
        return spec.default
    if spec.default_factory is not MISSING:
        return spec.default_factory()
    raise TypeError(f"{spec.name} is declared optional in the key but has no default")


def keyed_fields(obj: Any, hashed: bool = False) -> dict[str, Any]:
    """The dataclass `obj` as the dict its key hashes (the module docstring's rule, applied at every
    level); values are copies, so the dict may be changed freely. keyed_as forms apply only where
    `hashed` (the dict that is hashed): without them the dict rebuilds the object."""
    keyed = {}
    for spec in fields(obj):
        value = getattr(obj, spec.name)
        rule = spec.metadata.get(KEY_METADATA)
        if rule == "never" or (rule == "optional" and value == _default(spec)):
            continue
        form = spec.metadata.get(KEY_FORM)
        if hashed and form is not None:
            value = form(value)
        keyed[spec.name] = keyed_fields(value, hashed) if is_dataclass(value) else copy.deepcopy(value)
    return keyed
