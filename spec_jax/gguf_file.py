"""Read GGUF files (llama.cpp's format): the key/value metadata and the tensors, memory-mapped.

`gguf.GGUFReader` builds a numpy view per vocabulary string, ~10 s on Gemma 3's 262k tokens; this
reads the header with `struct` in ~0.2 s and leaves dequantization to gguf-py (`gguf.quants`).
A leaf module: `models/gguf_import.py` reads weights and `data/tokenizer.py` tokenizers with it.

Layout (GGUF v2/v3, little endian): magic "GGUF", u32 version, u64 tensor count, u64 kv count;
the kv pairs (string key, u32 type, value); per tensor: string name, u32 n_dims, u64 dims
(innermost first), u32 ggml type, u64 offset into the data section; the data section starts at
the next multiple of `general.alignment` (default 32).
"""

from __future__ import annotations

import dataclasses
import mmap
import pathlib
import struct

import numpy as np

_STRING, _ARRAY = 8, 9
# Value types -> struct formats (numpy reads the same codes for arrays).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}


@dataclasses.dataclass(frozen=True)
class Tensor:
  name: str
  shape: tuple[int, ...]  # numpy order (outermost first): GGUF's dims reversed
  ggml_type: int
  offset: int             # absolute byte offset in the file


def _parse(buf) -> tuple[dict, list[Tensor]]:
  if buf[:4] != b"GGUF":
    raise ValueError(f"no GGUF magic (starts with {bytes(buf[:4])!r})")
  version, num_tensors, num_kv = struct.unpack_from("<IQQ", buf, 4)
  if version not in (2, 3):
    raise ValueError(f"GGUF version {version}; versions 2 and 3 are read")
  pos = 24

  def take(fmt):
    nonlocal pos
    out = struct.unpack_from(fmt, buf, pos)
    pos += struct.calcsize(fmt)
    return out

  def string():
    nonlocal pos
    (n,) = take("<Q")
    pos += n
    return buf[pos - n:pos].decode("utf-8")

  def value(vtype):
    nonlocal pos
    if vtype == _STRING:
      return string()
    if vtype == _ARRAY:
      etype, count = take("<IQ")
      if etype in _SCALARS:
        arr = np.frombuffer(buf, np.dtype(_SCALARS[etype]), count, pos).copy()  # map closes
        pos += arr.nbytes
        return arr
      return [value(etype) for _ in range(count)]
    if vtype not in _SCALARS:
      raise ValueError(f"unknown GGUF value type {vtype} at byte {pos}")
    return take(_SCALARS[vtype])[0]

  meta = {}
  for _ in range(num_kv):
    key = string()
    meta[key] = value(take("<I")[0])
  infos = []
  for _ in range(num_tensors):
    name = string()
    (n_dims,) = take("<I")
    dims = take(f"<{n_dims}Q")
    ggml_type, offset = take("<IQ")
    infos.append((name, tuple(int(d) for d in reversed(dims)), ggml_type, offset))
  align = int(meta.get("general.alignment", 32))
  start = -(-pos // align) * align
  return meta, [Tensor(n, s, t, start + o) for n, s, t, o in infos]


def read_metadata(path: str | pathlib.Path) -> dict:
  """The key/value metadata: strings, Python scalars, lists of strings, numpy arrays of numbers.
  ValueError on a file that is not GGUF."""
  return read(path)[0]


def read(path: str | pathlib.Path) -> tuple[dict, dict[str, Tensor]]:
  """(metadata, tensors by name). ValueError on a file that is not GGUF or is truncated."""
  path = pathlib.Path(path)
  size = path.stat().st_size
  with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
    try:
      meta, tensors = _parse(buf)
    except (struct.error, UnicodeDecodeError, IndexError) as e:
      raise ValueError(f"unreadable GGUF header ({type(e).__name__}: {e}); the file is "
                       "truncated or corrupt") from None
  out = {}
  for t in tensors:
    if t.offset + nbytes(t) > size:
      raise ValueError(f"tensor {t.name!r} ends past the end of the file ({size} bytes): the "
                       "file is truncated")
    out[t.name] = t
  return meta, out


def nbytes(t: Tensor) -> int:
  import gguf  # local: only GGUF users need it
  block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.ggml_type)]
  return int(np.prod(t.shape)) // block * type_size


def type_name(t: Tensor) -> str:
  import gguf
  try:
    return gguf.GGMLQuantizationType(t.ggml_type).name
  except ValueError:
    return f"type {t.ggml_type}"


def dequantize(path: str | pathlib.Path, t: Tensor) -> np.ndarray:
  """Tensor `t` of the file at `path` as float32 in numpy order. NotImplementedError for a
  quantization type gguf-py cannot dequantize."""
  import gguf
  qtype = gguf.GGMLQuantizationType(t.ggml_type)
  block, type_size = gguf.GGML_QUANT_SIZES[qtype]
  raw = np.memmap(path, np.uint8, mode="r", offset=t.offset, shape=(nbytes(t),))
  rows = raw.reshape(*t.shape[:-1], t.shape[-1] // block * type_size)
  return np.asarray(gguf.quants.dequantize(rows, qtype), np.float32).reshape(t.shape)
