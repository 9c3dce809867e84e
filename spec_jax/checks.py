"""Checks of config values that refuse a bad one with the field's name (docs/design.md §2): the
integer counts and sizes every program reads. No jax: the checks run before anything loads."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _is_int(value) -> bool:
  return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def integer(value, field: str, low: int = 1, meaning: str = "") -> int:
  """`value` as an int; ValueError naming `field` unless it is an integer >= low. `meaning`
  (e.g. " (0 = never)") follows the bound in the message."""
  if not _is_int(value) or value < low:
    raise ValueError(f"{field}={value!r} must be an integer >= {low}{meaning}.")
  return int(value)


def integers(values: Sequence, field: str, low: int = 1, *, empty_ok: bool = False
             ) -> tuple[int, ...]:
  """`values` as a tuple of ints; ValueError naming `field` unless each is an integer >= low
  (and, unless empty_ok, there is at least one)."""
  values = tuple(values)
  if (not values and not empty_ok) or not all(_is_int(v) and v >= low for v in values):
    raise ValueError(f"{field}={values!r} must hold integers >= {low}"
                     + ("." if empty_ok else " (at least one)."))
  return tuple(int(v) for v in values)
