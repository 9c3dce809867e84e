"""Digests that let a checkpoint prove its arrays are the bytes it was saved with.

Orbax keeps no checksum of array data: a flipped bit on disk usually decodes to a slightly
different number and loads silently. So every checkpoint records, in its meta item (written in
the same atomic commit as the arrays), a digest of each array and of the meta itself:

  meta["integrity"] = {"algorithm": ALGORITHM, "meta_sha256": sha256 of the rest of the meta
                       (model, tokenizer, the run's config) as canonical JSON,
                       "arrays": {"<item><keystr path>": "<dtype>[<shape>]:<16 hex digits>"}}

An array's digest is two position-weighted sums of its elements' bit patterns, mod 2^32:
  d_j = Σ_i w_j(i) · bits(x_i)   (j = 1, 2; i the flat C-order index; w_j(i) = mix_j(i) | 1)
computed on device by one jitted reduction, whatever the array's sharding (integer sums do not
depend on the order of addition, so a multi-host sharded array and its single-device copy give
the same digest, and no host ever holds the whole array). Every w_j(i) is odd, hence invertible
mod 2^32: a change to any one element (a flipped byte) always changes both sums; several changes
go unnoticed with probability about 2^-64. It guards against bit rot, truncation and bad copies,
not against deliberate tampering (use a cryptographic hash of the files for that).

The digests vouch for the values a load returns: a changed byte that alters none of them (in
bytes of the storage format that a load does not use) goes unreported, and the values loaded are
the saved ones. Checkpoints without `meta["integrity"]` (written before digests existed) load
unverified. The errors a corrupt checkpoint raises (`unreadable`, `verify`) are built here too,
and `reading` makes such an error the one message a failed read shows.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pathlib
import re
import sys
import traceback
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

ALGORITHM = "wsum32x2"
KEY = "integrity"

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


class CheckpointError(ValueError):
  """A checkpoint exists but cannot be used (unreadable, corrupt, or for another model)."""


class CorruptCheckpointError(CheckpointError):
  """A checkpoint whose files do not decode or whose values differ from their recorded digests.
  `path` (the step folder), `step`, `what` (the array or item at fault, '' if unknown), `detail`
  (the cause)."""

  def __init__(self, message: str, *, path: str, step: int, what: str, detail: str):
    super().__init__(message)
    self.path, self.step, self.what, self.detail = path, step, what, detail


def _fmix32(h: jax.Array) -> jax.Array:
  """MurmurHash3's finaliser: a bijection of uint32 that spreads every input bit."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
  """The array's bit patterns as uint32 (8-byte elements: two words each, trailing axis)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = x.dtype.itemsize
  if size == 8:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jax.lax.bitcast_convert_type(x, _UINT[size]).astype(jnp.uint32)


def _array_digest(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Two uint32[] scalars (replicated whatever x's sharding): the sums of the module docstring."""
  w = _words(x)
  index = jnp.zeros(w.shape, jnp.uint32)  # flat C-order index, mod 2^32
  stride = 1
  for axis in reversed(range(w.ndim)):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, w.shape, axis) * jnp.uint32(stride)
    stride = stride * w.shape[axis] % 2**32
  w1 = _fmix32(index ^ jnp.uint32(0x9E3779B9)) | jnp.uint32(1)
  w2 = _fmix32(index + jnp.uint32(0x7F4A7C15)) | jnp.uint32(1)
  return jnp.sum(w * w1, dtype=jnp.uint32), jnp.sum(w * w2, dtype=jnp.uint32)


_digest_tree = jax.jit(lambda tree: jax.tree.map(_array_digest, tree))


def array_digests(items: Mapping[str, Any]) -> dict[str, str]:
  """{"<item><keystr path>": "<dtype>[<shape>]:<hex>"} for every array leaf of `items` (e.g.
  {"params": params, "train": {...}}). Blocks until the arrays are computed."""
  out = {}
  for item, tree in items.items():
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    if not leaves:
      continue
    # Python scalars (a step counter) are saved as the arrays jnp.asarray makes of them.
    arrays = [x if hasattr(x, "dtype") else jnp.asarray(x) for _, x in leaves]
    digests = _digest_tree(arrays)
    for (path, _), leaf, d in zip(leaves, arrays, digests):
      # Replicated (or single-device): every process reads its own copy.
      hi, lo = (int(np.asarray(v.addressable_data(0))) for v in d)
      shape = ",".join(str(n) for n in np.shape(leaf))
      dtype = jnp.dtype(leaf.dtype).name
      out[item + jax.tree_util.keystr(path)] = f"{dtype}[{shape}]:{hi:08x}{lo:08x}"
  return out


def meta_sha256(meta: Mapping[str, Any]) -> str:
  """sha256 of the meta as canonical JSON, without its own integrity record."""
  rest = {k: v for k, v in meta.items() if k != KEY}
  text = json.dumps(json.loads(json.dumps(rest)), sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(text.encode()).hexdigest()


def record(meta: Mapping[str, Any], items: Mapping[str, Any]) -> dict:
  """`meta` with its integrity record for the arrays of `items` (see the module docstring)."""
  meta = json.loads(json.dumps(dict(meta)))  # what the JSON item will read back
  meta[KEY] = {"algorithm": ALGORITHM, "meta_sha256": meta_sha256(meta),
               "arrays": array_digests(items)}
  return meta


def first_mismatch(meta: Mapping[str, Any], items: Mapping[str, Any] | None = None
                   ) -> tuple[str, str] | None:
  """None if `meta` (and the restored arrays of `items`, if given) match the digests recorded
  when they were saved, else (what differs: "meta" or an array's name such as
  "params['embed']['embedding']", how). A meta without a record (an older checkpoint) is None.
  An array restored in another dtype or shape than saved (a cast on load) cannot be compared and
  is skipped; one with no recorded digest is a mismatch (the record is incomplete)."""
  rec = meta.get(KEY)
  if not rec:
    return None
  if rec.get("algorithm") != ALGORITHM:
    return "meta", f"unknown digest algorithm {rec.get('algorithm')!r} (expected {ALGORITHM!r})"
  if meta_sha256(meta) != rec.get("meta_sha256"):
    return "meta", "its model, tokenizer and config record changed"
  saved = rec.get("arrays", {})
  for name, found in array_digests(items or {}).items():
    want = saved.get(name)
    if want is None:
      return name, "no digest was recorded for it"
    if want.split(":")[0] == found.split(":")[0] and want != found:
      return name, f"saved digest {want.split(':')[1]}, found {found.split(':')[1]}"
  return None


def _fix(path: str) -> str:
  """The fix for a corrupt step folder, naming the previous step of its run if there is one."""
  p = pathlib.Path(path)
  older = []
  if p.name.isdigit() and p.parent.is_dir():
    older = sorted((int(d.name) for d in p.parent.iterdir()
                    if d.name.isdigit() and int(d.name) < int(p.name)), reverse=True)
  prev = f" ({p.parent / str(older[0])})" if older else ""
  return (f"Fix: delete {path} so that the previous checkpoint{prev} is used, or point to "
          "another checkpoint; a training run resumes from the newest intact one by itself.")


def _array_named(err: Exception) -> str:
  """'<item>/<array key>' from a tensorstore error's spec (its OCDBT base path ends in the item,
  its key is the array's), or ''."""
  paths = re.findall(r"'path': '([^']*)'", str(err))
  base = next((p for p in paths if p.startswith("/") or "://" in p), "")
  key = next((p for p in paths if not (p.startswith("/") or "://" in p)), "")
  return f"{os.path.basename(base.rstrip('/'))}/{key.rstrip('/')}" if key else ""


# Errors of the runtime, not of a checkpoint's files: a device, the memory or the connection
# between processes failed while the files were being restored.
RUNTIME_ERRORS = (jax.errors.JaxRuntimeError, MemoryError)


# Step folders whose read this process began and did not finish (in flight, or failed): how the
# filters of `reading` know a failed read's late ones.
_UNFINISHED: set[str] = set()


@contextlib.contextmanager
def reading(path: str):
  """Around an orbax read of the step folder `path` (a restore, or its metadata): if it fails,
  the error the caller makes of it (`restore_error`) is the one message the user sees. Orbax reads
  a step's arrays concurrently on an event loop; when one read fails, the call raises and closes
  that loop while other reads still run, and each of them reports itself when it ends: a
  traceback from tensorstore's thread handing its result to the closed loop ("RuntimeError:
  Event loop is closed", an unraisable exception), or asyncio's log line "Task exception was
  never retrieved" with the read's error: dozens of lines for one truncated checkpoint,
  before and after the error. The filters that drop them are installed once, for the rest of the
  process (a late read can end at any time); every other unraisable exception and log record
  passes. A read that raises leaves `path` in `_UNFINISHED` on purpose."""
  _install_filters()
  paths = {path, os.path.abspath(path)} if "://" not in path else {path}
  _UNFINISHED.update(paths)
  yield
  _UNFINISHED.difference_update(paths)


def _install_filters() -> None:
  hook = sys.unraisablehook
  if not getattr(hook, "drops_late_reads", False):
    def drop_late_reads(unraisable):
      if not (_UNFINISHED and _on_a_closed_loop(unraisable)):
        hook(unraisable)
    drop_late_reads.drops_late_reads = True
    sys.unraisablehook = drop_late_reads
  log = logging.getLogger("asyncio")
  if _not_a_late_read not in log.filters:
    log.addFilter(_not_a_late_read)


def _on_a_closed_loop(unraisable) -> bool:
  """Whether an unraisable exception is a thread handing a result to a closed event loop."""
  err = unraisable.exc_value
  if not (isinstance(err, RuntimeError) and str(err) == "Event loop is closed"):
    return False
  return any(frame.f_code.co_name == "call_soon_threadsafe"
             for frame, _ in traceback.walk_tb(unraisable.exc_traceback))


def _not_a_late_read(record: logging.LogRecord) -> bool:
  """False for asyncio's "... exception was never retrieved" about a read of an unfinished
  read's step folder (its error names the folder's files). Runs on orbax's threads: it reads a
  copy of `_UNFINISHED`, which the main thread may be changing."""
  message = record.getMessage()
  if "exception was never retrieved" not in message:
    return True
  text = message + (str(record.exc_info[1]) if record.exc_info and record.exc_info[1] else "")
  return not any(path in text for path in tuple(_UNFINISHED))


def restore_error(path: str, step: int, err: Exception) -> CheckpointError:
  """The error for a step that orbax could not restore: `unreadable` (corrupt: training sets it
  aside and resumes from an older step) unless the runtime failed (`RUNTIME_ERRORS`), when the
  files are not blamed."""
  if not isinstance(err, RUNTIME_ERRORS):
    return unreadable(path, step, err)
  cause = str(err).splitlines()[0] if str(err) else ""
  return CheckpointError(
      f"Checkpoint {path} (step {step}) could not be restored: {type(err).__name__}: "
      f"{cause[:300]}. The runtime failed (a device, the memory or the connection between "
      "processes), not the checkpoint's files, which were not judged damaged and were left in "
      "place. Fix the cause and load it again.")


def unreadable(path: str, step: int, err: Exception) -> CorruptCheckpointError:
  """The error for a step whose files orbax/tensorstore cannot decode."""
  # tensorstore appends its whole JSON spec (kilobytes) to every error: keep the cause only.
  cause = str(err).split(" [tensorstore_spec")[0].split(" See full TensorStore")[0]
  cause = cause.splitlines()[0] if cause else ""
  cause = cause if len(cause) <= 300 else cause[:300] + "..."
  what = _array_named(err)
  detail = f"{type(err).__name__}: {cause}"
  return CorruptCheckpointError(
      f"Checkpoint {path} could not be read (step {step}{', array ' + what if what else ''}; "
      f"{detail}). It is probably truncated or corrupt (disk full, a copy that did not finish, "
      f"or files edited by hand). {_fix(path)}",
      path=path, step=step, what=what, detail=detail)


def verify(path: str, step: int, meta: Mapping[str, Any],
           items: Mapping[str, Any] | None = None) -> None:
  """Raise CorruptCheckpointError if the meta (or the restored arrays of `items`) of the step
  folder `path` differ from the digests recorded when it was saved (`first_mismatch`)."""
  bad = first_mismatch(meta, items)
  if bad is not None:
    what, detail = bad
    raise CorruptCheckpointError(
        f"Checkpoint {path} is corrupt (step {step}): {'' if what == 'meta' else 'array '}"
        f"{what} differs from what was saved ({detail}); its bytes changed on disk. "
        f"{_fix(path)}", path=path, step=step, what=what, detail=detail)
