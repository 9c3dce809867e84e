"""Metrics to TensorBoard event files (tensorboardX) and `<workdir>/metrics.jsonl`.

clu's and flax's metric writers import TensorFlow, which spec_jax does not install; tensorboardX
writes the same event files without it. The JSON-lines file is for scripts and reports: one object
per step, `{"step": s, "train/loss": ..., "eval/loss": ...}`. Values written at the same step by
several calls (train and eval) are merged into one line.

Only process 0 writes (multi-host runs would otherwise write every line N times).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

import sys

import jax
import numpy as np


def _import_tensorboardx():
  """tensorboardX without PyTorch: its writer imports torch when it is installed (the test
  requirements install it for the HF parity tests) only to accept torch tensors, which spec_jax
  never passes, and that import costs ~1.2 s in every process that writes metrics. An entry of
  None in sys.modules makes that optional import fail; it is removed again afterwards, so code
  that wants torch still gets it."""
  if "tensorboardX" in sys.modules or "torch" in sys.modules:
    import tensorboardX  # noqa: PLC0415
    return tensorboardX
  sys.modules["torch"] = None
  try:
    import tensorboardX  # noqa: PLC0415
    import tensorboardX.summary  # noqa: F401, PLC0415
  finally:
    del sys.modules["torch"]
  return tensorboardX


tensorboardX = _import_tensorboardx()
hparams_summary = tensorboardX.summary.hparams

JSONL = "metrics.jsonl"


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in d.items():
    key = f"{prefix}{k}"
    if isinstance(v, Mapping):
      out.update(_flatten(v, key + "."))
    else:
      out[key] = v
  return out


def _scalar(v) -> float:
  return float(np.asarray(v))


def _json_value(v: float):
  # JSON has no NaN/Inf; strings keep a diverged run's record readable by json.loads.
  return v if math.isfinite(v) else str(v)


class MetricsWriter:
  """`write_scalars(step, {name: value})`, `write_hparams(config)`, `flush()`, `close()`."""

  def __init__(self, workdir: str, *, enabled: bool | None = None):
    self.workdir = os.path.abspath(workdir)
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self._pending_step: int | None = None
    self._pending: dict[str, Any] = {}
    self._tb = None
    self._jsonl = None
    if self.enabled:
      os.makedirs(self.workdir, exist_ok=True)
      self._tb = tensorboardX.SummaryWriter(logdir=self.workdir, flush_secs=30)
      self._jsonl = open(os.path.join(self.workdir, JSONL), "a", encoding="utf-8")

  @property
  def jsonl_path(self) -> str:
    return os.path.join(self.workdir, JSONL)

  def truncate_after(self, step: int) -> None:
    """Drop metrics.jsonl lines with step > `step`, and have TensorBoard purge its events after
    `step` (a new event file starting with a purge marker): a resumed run recomputes the steps
    after its checkpoint (step -1: a fresh start over a run killed before its first checkpoint),
    and readers should not see two values for one step."""
    if not self.enabled:
      return
    self._emit()
    self._tb.close()
    self._tb = tensorboardX.SummaryWriter(logdir=self.workdir, flush_secs=30,
                                          purge_step=max(step + 1, 0))
    self._jsonl.close()
    with open(self.jsonl_path, encoding="utf-8") as f:
      lines = f.readlines()
    keep = []
    for line in lines:
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        continue  # a line cut by a kill mid-write
      if isinstance(row, dict) and row.get("step", -1) <= step:
        keep.append(json.dumps(row) + "\n")
    tmp = self.jsonl_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      f.writelines(keep)
    os.replace(tmp, self.jsonl_path)
    self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Scalars (python or 0-d array values) at `step`."""
    if not self.enabled:
      return
    step = int(step)
    if self._pending_step is not None and step != self._pending_step:
      self._emit()
    self._pending_step = step
    for name, value in scalars.items():
      v = _scalar(value)
      self._tb.add_scalar(name, v, step)
      self._pending[name] = _json_value(v)

  def write_hparams(self, config) -> None:
    """The run's config as TensorBoard hparams (flattened, dotted keys) and as text, at step 0.
    `config`: a ConfigDict or a (nested) dict."""
    if not self.enabled:
      return
    if hasattr(config, "to_json_best_effort"):
      config = json.loads(config.to_json_best_effort())
    flat = _flatten(config)
    hp = {k: v if isinstance(v, (bool, int, float, str)) else json.dumps(v)
          for k, v in flat.items()}
    # Written into this writer's own event file: tensorboardX's add_hparams would open a new
    # run in a timestamped subfolder.
    for summary in hparams_summary(hp, {}):
      self._tb.file_writer.add_summary(summary, 0)
    self._tb.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)

  def _emit(self) -> None:
    if self._pending_step is None:
      return
    self._jsonl.write(json.dumps({"step": self._pending_step, **self._pending}) + "\n")
    self._pending_step, self._pending = None, {}

  def flush(self) -> None:
    if not self.enabled:
      return
    self._emit()
    self._jsonl.flush()
    self._tb.flush()

  def close(self) -> None:
    if not self.enabled or self._tb is None:
      return
    self.flush()
    self._jsonl.close()
    self._tb.close()
    self._tb = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def read_jsonl(workdir_or_path: str) -> list[dict]:
  """Rows of a metrics.jsonl (a workdir or the file's path)."""
  path = workdir_or_path
  if os.path.isdir(path):
    path = os.path.join(path, JSONL)
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]
