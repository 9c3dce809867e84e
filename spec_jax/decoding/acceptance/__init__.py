"""Acceptance rules behind one signature, `rule(p f32[B, M, V], proposal, rng) -> Verdict`.

  greedy       chains and trees: keep drafts equal to argmax p (output = verifier greedy)
  speculative  chains: Leviathan et al. 2023, Alg. 1 (`chain.speculative_sampling`)
  lenient      chains, lossy: DistillSpec's lenience (`chain.lenient`, needs lenience/epsilon)
  top_k_relaxed  chains at temperature 0, lossy: keep drafts among the verifier's top k
               (Stern et al. 2018; `chain.top_k_relaxed`, p = the verifier's T = 1 law)
  rrs_without  trees with siblings drawn without replacement: RSD, dyn (`tree.verify_tree`)
  rrs_with     i.i.d. siblings: SpecInfer
  kseq         i.i.d. siblings: SpecTr's K-SEQ
A rule is exact only on proposals drawn the way it assumes (`Rule.fits`); `resolve` refuses the rest
before anything compiles, unless asked to run them anyway (tests that show the loss).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from spec_jax.decoding import protocols
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.decoding.acceptance import chain, kseq, residuals, tree  # noqa: F401
from spec_jax.decoding.acceptance.chain import LENIENCES, positive_int, validate_gamma  # noqa: F401
from spec_jax.decoding.acceptance.residuals import acceptance_rate  # noqa: F401


def _chain_rule(kernel):
  def rule(p, proposal: protocols.Proposal, rng, **static):
    return kernel(p, proposal.q, proposal.drafts, rng, **static)
  rule.__name__ = kernel.__name__
  rule.__doc__ = f"`chain.{kernel.__name__}` on a chain proposal."
  return rule


def _tree_rule(name):
  def rule(p, proposal: protocols.Proposal, rng):
    verdict = tree.verify_tree(p, proposal.q, proposal.tokens, proposal.parent, proposal.depth,
                               proposal.valid, rng, rule=name, max_depth=proposal.depth_bound,
                               max_candidates=proposal.candidate_bound)
    return verdict.replace(chain=proposal.chain)
  rule.__name__ = name
  rule.__doc__ = f"`tree.verify_tree` with rule={name!r}."
  return rule


def _greedy(p, proposal: protocols.Proposal, rng):
  """Greedy verification; the chain fast path for chains, the tree walk for trees."""
  if proposal.chain:
    return chain.greedy(p, proposal.q, proposal.drafts, rng)
  return _tree_rule("greedy")(p, proposal, rng)


@dataclasses.dataclass(frozen=True)
class Rule:
  """One acceptance rule and what it declares about itself.

  fn: rule(p f32[B, M, V], proposal, rng, **static) -> Verdict.
  fits: the proposal schemes (`protocols.SCHEMES`) it is exact on. A chain is a tree with one
    child per node, so every tree rule fits it; chain rules need the chain layout. Siblings drawn
    without replacement verified with a with-replacement rule (rrs_with, kseq) lose exactness
    (tests/test_tree_acceptance.py shows it).
  chains_only: it reads a chain's [B, γ] layout. greedy: it decides at temperature 0 (from ranks).
  law: the verifier law p it reads: "sampling" (the decoding law after temperature / top-k /
    top-p) or "full" (softmax at temperature 1: top_k_relaxed ranks the whole law, where greedy's
    p is one-hot)."""
  fn: Callable
  fits: tuple[str, ...]
  chains_only: bool = False
  greedy: bool = False
  law: str = "sampling"

  def __call__(self, p, proposal, rng, **static):
    return self.fn(p, proposal, rng, **static)


# A dumb registry: configs name a rule by string; each entry declares what it needs.
RULES = {
    "greedy": Rule(_greedy, protocols.SCHEMES, greedy=True),
    "speculative": Rule(_chain_rule(chain.speculative_sampling), ("chain",), chains_only=True),
    "lenient": Rule(_chain_rule(chain.lenient), ("chain",), chains_only=True),
    "top_k_relaxed": Rule(_chain_rule(chain.top_k_relaxed), ("chain",), chains_only=True,
                          greedy=True, law="full"),
    "rrs_without": Rule(_tree_rule("rrs_without"), ("chain", "without_replacement", "iid")),
    "rrs_with": Rule(_tree_rule("rrs_with"), ("chain", "iid")),
    "kseq": Rule(_tree_rule("kseq"), ("chain", "iid")),
}


def verifier_law(name: str, logits: jax.Array, sampling) -> jax.Array:
  """p f32[B, M, V], the verifier law rule `name` reads (`Rule.law`) from its logits."""
  if RULES[name].law == "full":
    return jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  return sampling_lib.probs_from_logits(logits, sampling)


def resolve(name: str, shape, sampling, *, lenience: str = "lin", epsilon: float = 1.0,
            allow_inexact: bool = False, relaxed_top_k: int = 2):
  """The rule a decode config names, for proposals of `shape` (a `drafters.trees.TreeSpec`) under
  `sampling`: (rule name, rule function). "auto" is greedy at temperature 0, else the lossless
  rule of the shape's sampling scheme. ValueError naming decode.rule when the rule does not fit:
  greedy with temperature > 0 (or a sampling rule at temperature 0), a chain rule on a tree, a
  with-replacement rule on siblings drawn without replacement (unless allow_inexact)."""
  if name == "auto":
    name = "greedy" if sampling.greedy else shape.rule
  if name not in RULES:
    raise ValueError(f"decode.rule={name!r} is not a rule; choose one of "
                     f"{['auto', *RULES]}.")
  if name == "greedy" and not sampling.greedy:
    raise ValueError("decode.rule='greedy' needs greedy sampling (temperature 0); with "
                     "temperature > 0 use a sampling rule ('auto' picks the exact one).")
  if name == "top_k_relaxed" and not sampling.greedy:
    raise ValueError("decode.rule='top_k_relaxed' relaxes greedy decoding (temperature 0); "
                     "with temperature > 0 use a sampling rule, or 'lenient' for a lossy one.")
  if not RULES[name].greedy and sampling.greedy:
    raise ValueError(f"decode.rule={name!r} samples, but temperature=0 means greedy decoding. "
                     "Set sampling.temperature > 0, or use rule 'greedy' (or 'auto').")
  if RULES[name].chains_only and not shape.is_chain:
    raise ValueError(f"decode.rule={name!r} verifies chains, but the drafter proposes "
                     f"{shape.describe()} trees: use the tree's rule {shape.rule!r} (or 'auto').")
  if shape.scheme not in RULES[name].fits and not allow_inexact:
    raise ValueError(
        f"decode.rule={name!r} is not exact for {shape.describe()}: its siblings are drawn "
        f"{shape.scheme.replace('_', ' ')}, which {name!r} does not assume. Use {shape.rule!r} "
        "(or 'auto'); set decode.allow_inexact=True only to measure the loss.")
  fn = RULES[name].fn
  if name == "top_k_relaxed":
    if isinstance(relaxed_top_k, bool) or not isinstance(relaxed_top_k, int) or relaxed_top_k < 1:
      raise ValueError(f"decode.relaxed_top_k={relaxed_top_k!r} must be an integer >= 1 (1 = "
                       "greedy but for ties at the top; Stern et al. 2018 used up to 10).")
    fn = functools.partial(fn, k=relaxed_top_k)
  if name == "lenient":
    chain.lenience_fn(lenience, epsilon)  # validate here, outside jit, naming the field
    fn = functools.partial(fn, lenience=lenience, epsilon=float(epsilon))
  return name, fn
