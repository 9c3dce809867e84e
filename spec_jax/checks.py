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


def timings(section, name: str) -> tuple[int, float | None]:
  """(timings, pause_s) of a timing program's config section `name` (`timing.kept_timing`:
  `timings` timings, the first pause pause_s seconds; absent: 1 and None, the default pause);
  ValueError naming the field unless timings is an integer >= 1 and pause_s a number >= 0."""
  count = integer(section.get("timings", 1), f"{name}.timings",
                  meaning=" (timings a run takes, the fastest kept; 3 on a shared machine)")
  pause = section.get("pause_s")
  if pause is not None and (isinstance(pause, bool) or not isinstance(pause, (int, float))
                            or not pause >= 0):
    raise ValueError(f"{name}.pause_s={pause!r} must be a number of seconds >= 0 (the first "
                     "pause between timings).")
  return count, pause
