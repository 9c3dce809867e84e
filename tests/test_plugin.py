"""The plug-in claim: a method defined outside the library (docs/adding_a_method.md's in-context
bigram drafter, executed from the document as written) registers through the public API and runs
through `evaluate` and `generate` by name, with no edit anywhere else. Greedy output is the
verifier's; the sampled law is exact (chi-square), and a planted wrong q fails that test."""

import pathlib
import re
import types

import jax.numpy as jnp
import pytest

from configs import evaluate as evaluate_config
from configs import generate as generate_config
from spec_jax import testing
from spec_jax.decoding import methods
from spec_jax.decoding.drafters import trees
from spec_jax.decoding.sampling import Sampling
from spec_jax.programs import evaluate, generate

DOC = pathlib.Path(__file__).parent.parent / "docs" / "adding_a_method.md"


@pytest.fixture(scope="module")
def bigram():
  """The document's code block, executed as a module of its own (it registers `bigram`)."""
  blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
  code = next(b for b in blocks if "class BigramDrafter" in b)
  module = types.ModuleType("bigram_plugin")
  exec(compile(code, str(DOC), "exec"), module.__dict__)  # noqa: S102 (our own document)
  yield module
  methods.unregister("bigram")


def test_registered_method_runs_through_evaluate_by_name(bigram, tmp_path):
  assert "bigram" in methods.names()
  config = evaluate_config.get_config("smoke")
  config.eval.update(methods=("bigram@3",), gammas=(2,), temperatures=(0.0, 1.0))
  rows = evaluate.run(config, str(tmp_path))
  by = {(r["method"], r["temperature"]): r for r in rows}
  for t in (0.0, 1.0):
    row = by["bigram", t]
    assert row["gamma"] == 3 and row["verifier_tokens_per_call"] == 4
    assert row["drafter_calls"] == 0 and row["cost_ratio_c"] == 0.0  # no drafter model
    assert 1.0 <= row["block_efficiency"] <= 4.0 and row["acceptance_rate"] is not None
    assert len(row["per_position_acceptance"]) == 3
  assert by["bigram", 0.0]["identical_to_greedy"] is True
  # Its options come from its dataclass and are validated, naming the field, before loading.
  config.eval.methods = ("bigram@3",)
  config.eval.bigram = {"smoothing": 0.0}
  with pytest.raises(ValueError, match=r"eval.bigram.smoothing=0.0 must be > 0"):
    evaluate.run(config, str(tmp_path / "bad"))
  config.eval.bigram = {"smoothness": 1.0}
  with pytest.raises(ValueError, match=r"eval.bigram.smoothness is not an option of bigram"):
    evaluate.run(config, str(tmp_path / "bad"))


def test_registered_method_runs_through_generate_by_name(bigram, tmp_path):
  config = generate_config.get_config("smoke")
  config.prompts = ("To be, or not to be", "the the the the")
  plain = generate.run(config, str(tmp_path / "ar"))
  config.method = "bigram@3"
  drafted = generate.run(config, str(tmp_path / "bigram"))
  assert [r["completion"] for r in drafted] == [r["completion"] for r in plain]
  assert all(r["method"] == "bigram@3" and r["verifier_calls"] >= 1 for r in drafted)


class _Unsmoothed:
  """Planted bug: draws from the smoothed counts but reports q from 10x the pseudo-count."""

  def __init__(self, drafter):
    self.inner = drafter
    self.shape, self.vocab_size = drafter.shape, drafter.vocab_size
    self.verifier_layers = drafter.verifier_layers

  def init(self, *args):
    return self.inner.init(*args)

  def commit(self, *args):
    return self.inner.commit(*args)

  def propose(self, params, state, tokens, lengths, rng, sampling):
    proposal, state = self.inner.propose(params, state, tokens, lengths, rng, sampling)
    wrong = jnp.where(proposal.q.sum(-1, keepdims=True) > 0,
                      0.5 * proposal.q + 0.5 / self.vocab_size, 0.0)
    return proposal.replace(q=wrong), state


def _pvalue(bigram, wrap=None):
  v_cfg, v_params = testing.tiny_model(seed=0, vocab_size=6, sharpness=3.0)
  drafter = bigram.BigramDrafter(v_cfg.vocab_size, trees.chain(2), smoothing=0.5)
  if wrap is not None:
    drafter = wrap(drafter)
  # "1 4" recurs: the counts after 4 and 1 are not uniform from the first round on.
  return testing.sd_law_pvalue(v_cfg, v_params, drafter, {}, [1, 4, 2, 1, 4, 1], n=3,
                               min_accepted=200, sampling=Sampling(1.0))


def test_registered_method_samples_the_verifiers_law(bigram):
  assert _pvalue(bigram) > 1e-3


def test_a_wrong_q_in_the_registered_method_is_caught(bigram):
  assert _pvalue(bigram, _Unsmoothed) < 1e-6


def test_the_methods_program_lists_every_registered_method(bigram, tmp_path):
  from configs import methods as methods_config
  from spec_jax.programs import methods as methods_program
  text = methods_program.run(methods_config.get_config(), str(tmp_path))
  rows = [line for line in text.splitlines()[2:] if line.startswith("| ")]
  assert [r.split(" | ")[0][2:] for r in rows] == list(methods.names())
  assert "bigram.smoothing=0.1" in text and "`rsd_c:b1-b2-...@L`" in text
  assert (tmp_path / "methods.md").read_text() == text
