"""The quality cost of lossy (lenient) speculative decoding, measured on the text it produced.

DistillSpec (Zhou et al. 2024, §5.3) trades quality for speed with a lenience function f:
accept a draft x ~ q with probability min(1, f(p(x))/q(x)). Lossless decoding emits exactly the
verifier's law p; lenient decoding emits, at a draft position,

  π = min(q, f(p)) + (1 - Σ min(q, f(p))) · norm(max(0, p - q))      (`acceptance.chain.lenient`)

We teacher-force the verifier (and the drafter) over prompt + generated tokens and report, per
generated token,
  verifier_loglik  mean log p_raw(x_t | x_<t) under the *raw* verifier (temperature 1, no
                   top-k/top-p): finite for every token and comparable across decoding
                   temperatures and rules; for lossless sampling at T = 1 its expectation is
                   -H(p), and leniency shows up as a drop;
  token_tv         mean ½‖π_t - p_t‖₁, p_t and q_t under the decoding temperature/top-k/top-p:
                   the total-variation distance between the lenient rule's one-step law and the
                   verifier's at the positions actually generated. 0 for lossless decoding (up
                   to float rounding, ~1e-7), and 0 for greedy decoding (one-hot laws, lossless
                   only). It is the law of a token emitted at a draft position; bonus tokens
                   (all γ accepted) follow p exactly, so the average over emitted tokens is at
                   most this value.

Shapes: B rows, S = prompt + generated slots, V vocabulary. Rows are processed one at a time
(`lax.map`) so memory stays at a few [S, V] float32 arrays (S·V·4 bytes each: ~30 MB for SmolLM2
at S = 160) whatever the batch size.
"""

from __future__ import annotations

import functools
from typing import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.decoding import acceptance
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.models import llama

# The rule's own lenience functions and residual floor (defined once, in acceptance.chain and
# acceptance.residuals); here ε is traced so that an ε sweep compiles once.
_LENIENCE_FNS = acceptance.chain.LENIENCE_FNS
_MIN_RESIDUAL_MASS = acceptance.residuals.MIN_RESIDUAL_MASS


def lenient_law(p: jax.Array, q: jax.Array, lenience: str = "lin", epsilon=1.0) -> jax.Array:
  """f32[..., V]: the one-step law π of lenient speculative sampling at a draft position (see
  the module docstring), given the verifier's law p and the drafter's q (f32[..., V]). At ε = 1
  π = p (up to float rounding). lenience is static, epsilon may be traced."""
  accepted = jnp.minimum(q, _LENIENCE_FNS[lenience](p, epsilon))
  residual = jnp.maximum(0.0, p - q)  # = max(0, p - min(q, f(p))) since f(p) >= p
  mass = jnp.sum(residual, axis=-1, keepdims=True)
  residual = jnp.where(mass > _MIN_RESIDUAL_MASS, residual / jnp.maximum(mass, 1e-30), p)
  return accepted + (1.0 - jnp.sum(accepted, axis=-1, keepdims=True)) * residual


@functools.partial(jax.jit, static_argnames=("v_cfg", "d_cfg", "sampling", "lenience"))
def _row_sums(v_params, d_params, tokens, prompt_lengths, lengths, *, v_cfg, d_cfg, sampling,
              lenience, epsilon):
  """d_cfg None: autoregressive output, whose law is exactly p (tv 0, no drafter forward)."""
  v_apply = llama.make_apply(v_cfg)
  s = tokens.shape[1]
  positions = jnp.arange(s, dtype=jnp.int32)[None]

  def one(row):
    toks, plen, length = row
    v_logits = v_apply(v_params, toks[None], positions)[0][0, :-1]  # [S-1, V]: predicts t+1
    target = toks[1:]
    t1 = jnp.arange(1, s)
    generated = ((t1 >= plen) & (t1 < length)).astype(jnp.float32)  # [S-1]
    loglik = jnp.take_along_axis(jax.nn.log_softmax(v_logits, -1), target[:, None], -1)[:, 0]
    if d_cfg is None:
      return jnp.sum(loglik * generated), jnp.zeros(()), jnp.sum(generated)
    d_logits = llama.make_apply(d_cfg)(d_params, toks[None], positions)[0][0, :-1]
    p = sampling_lib.probs_from_logits(v_logits, sampling)
    q = sampling_lib.probs_from_logits(d_logits, sampling)
    tv = 0.5 * jnp.sum(jnp.abs(lenient_law(p, q, lenience, epsilon) - p), axis=-1)
    return (jnp.sum(loglik * generated), jnp.sum(tv * generated), jnp.sum(generated))

  return jax.lax.map(one, (tokens, prompt_lengths, lengths))


def quality_sums(verifier_params, drafter_params, output, *, verifier_cfg: llama.LlamaConfig,
                 drafter_cfg: llama.LlamaConfig | None, sampling: sampling_lib.Sampling,
                 lenience: str = "lin", epsilon: float = 1.0) -> dict[str, np.ndarray]:
  """Per-row sums for one generate/speculative output (anything with tokens[B,S],
  prompt_lengths[B], lengths[B]): {"loglik_sum", "tv_sum", "tokens"}, each f32[B] on the host.
  drafter_cfg None (autoregressive output): the verifier is its own drafter and tv is 0."""
  acceptance.chain.lenience_fn(lenience, epsilon)  # validate outside jit, naming the field
  if drafter_cfg is None:  # exactly p: tv is 0 (not the float noise of π - p), and the
    # sampling's laws play no part (one program for every temperature)
    drafter_params, sampling, lenience, epsilon = None, None, "lin", 1.0
  sums = _row_sums(verifier_params, drafter_params, output.tokens, output.prompt_lengths,
                   output.lengths, v_cfg=verifier_cfg, d_cfg=drafter_cfg, sampling=sampling,
                   lenience=lenience, epsilon=jnp.float32(epsilon))
  return dict(zip(("loglik_sum", "tv_sum", "tokens"), (np.asarray(x) for x in
                                                       jax.device_get(sums))))


def summarize(per_row: Iterable[Mapping[str, np.ndarray]]) -> dict[str, float]:
  """Token means over every row given: {"verifier_loglik", "token_tv"} (per generated token)."""
  per_row = list(per_row)
  tokens = max(float(sum(np.sum(r["tokens"]) for r in per_row)), 1.0)
  return {"verifier_loglik": float(sum(np.sum(r["loglik_sum"]) for r in per_row)) / tokens,
          "token_tv": float(sum(np.sum(r["tv_sum"]) for r in per_row)) / tokens}
