"""Divergences between the verifier's and the drafter's next-token laws (DistillSpec).

Zhou et al. 2024, "DistillSpec: Improving Speculative Decoding via Knowledge Distillation", §3-4:
the drafter (student, law q) is trained to match the verifier (teacher, law p) under a divergence
D(p, q) averaged over the response tokens of a batch. Shapes: B batch, T tokens, V vocabulary;
`logits[..., V]` → per-token values f32[...]. All arithmetic is float32.

  fkl   forward KL   KL(p‖q) = Σ_x p log(p/q)            (mass-covering; the classic KD loss)
  rkl   reverse KL   KL(q‖p) = Σ_x q log(q/p)            (mode-seeking)
  jsd   JSD[β]       β KL(p‖m) + (1-β) KL(q‖m),  m = βp + (1-β)q,  β ∈ [0, 1]
  tvd   total variation  ½ Σ_x |p - q| = 1 - Σ_x min(p, q)

TVD matters most for speculative decoding: Σ min(p, q) is exactly the acceptance rate α of
speculative sampling (Leviathan et al. 2023, Cor. 3.6), so minimising TVD maximises α
(DistillSpec, Thm 4.1 / eq. 3).

**β convention.** β weights the *teacher* p, as written in DistillSpec (and in the GKD paper,
Agarwal et al. 2024, eq. 1). JSD[0] = JSD[1] = 0 (m is then q or p itself); for small β,
JSD[β]/β → KL(p‖q) (forward-KL-like) and as β → 1, JSD[β]/(1-β) → KL(q‖p) (reverse-KL-like);
β = ½ is the symmetric Jensen-Shannon divergence. TRL's `GKDTrainer.generalized_jsd_loss` agrees
for 0 < β < 1 in its recent releases, but *special-cases* β = 0 to KL(p‖q) and β = 1 to KL(q‖p),
where this formula gives 0; earlier TRL releases weighted the *student* term by β
(β KL(q‖m) + (1-β) KL(p‖m)) and mixed the laws geometrically in log space. A β tuned with TRL
therefore does not transfer here without checking which version it came from.

**Laws.** p and q are the laws speculative decoding compares: logits → temperature → top-k →
top-p, the same transform as `sampling.probs_from_logits`, here in log space (`log_law`) so that
tokens outside the support have log-probability -inf and every 0·log 0 term is an exact 0 with a
finite gradient. Temperature 0 (greedy) is rejected: its law is a one-hot argmax with zero
gradient almost everywhere, so nothing could be learned from it. To train a drafter for greedy
decoding use temperature 1 (greedy acceptance compares the argmaxes of exactly those laws).
KL with top-k/top-p truncation is infinite as soon as the two truncated supports differ, which
they almost always do, so that combination is rejected too; JSD and TVD are bounded and accept it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from spec_jax.decoding import sampling as sampling_lib

_NEG = jnp.finfo(jnp.float32).min


def _keep_mask(z: jax.Array, s: sampling_lib.Sampling) -> jax.Array | None:
  """bool[..., V]: tokens the law keeps after top-k then top-p (None: all), for logits already
  divided by the temperature. Same rules as `sampling.probs_from_logits`."""
  keep = None
  v = z.shape[-1]
  if s.top_k and s.top_k < v:
    kth = jax.lax.top_k(z, s.top_k)[0][..., -1:]
    keep = z >= kth
    z = jnp.where(keep, z, _NEG)
  if s.top_p < 1.0:
    probs = jax.nn.softmax(z, axis=-1)
    order = jnp.argsort(-probs, axis=-1)
    sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
    keep_sorted = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs < s.top_p
    keep_p = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
    keep = keep_p if keep is None else keep & keep_p
  return keep


def log_law(logits: jax.Array, s: sampling_lib.Sampling) -> jax.Array:
  """f32[..., V]: log of the law `s` draws from, -inf outside its support.

  exp(log_law(z, s)) equals `sampling.probs_from_logits(z, s)`; in log space, tokens that merely
  underflow in probability keep a finite log-probability (KL terms stay exact), and only tokens
  cut by top-k/top-p are -inf. The masks carry no gradient (they are comparisons)."""
  if s.greedy:
    raise ValueError("distill.temperature=0 (greedy) has no gradient: the greedy law is a "
                     "one-hot argmax. Train at distill.temperature=1.0 (greedy decoding compares "
                     "the argmaxes of those laws) or at the sampling temperature you decode with.")
  z = logits.astype(jnp.float32) / s.temperature
  keep = _keep_mask(z, s)
  if keep is None:
    return jax.nn.log_softmax(z, axis=-1)
  # Masked logits get a finite floor inside the softmax (no inf - inf), then exactly -inf.
  return jnp.where(keep, jax.nn.log_softmax(jnp.where(keep, z, _NEG), axis=-1), -jnp.inf)


def _weighted_log_ratio(w: jax.Array, log_a: jax.Array, log_b: jax.Array) -> jax.Array:
  """Σ_x w(x) (log a(x) - log b(x)) over the last axis, with terms where w = 0 exactly 0.

  Both logs are replaced by 0 where w = 0 *before* subtracting: a -inf - (-inf) = NaN in the
  branch `where` discards would still poison the gradient (0 · NaN = NaN in backprop)."""
  pos = w > 0
  diff = jnp.where(pos, log_a, 0.0) - jnp.where(pos, log_b, 0.0)
  return jnp.sum(jnp.where(pos, w * diff, 0.0), axis=-1)


def forward_kl(log_p: jax.Array, log_q: jax.Array, beta: float = 0.5) -> jax.Array:
  """KL(p‖q) = Σ p log(p/q) per token (f32[...]); +inf where q = 0 < p."""
  del beta
  return _weighted_log_ratio(jnp.exp(log_p), log_p, log_q)


def reverse_kl(log_p: jax.Array, log_q: jax.Array, beta: float = 0.5) -> jax.Array:
  """KL(q‖p) = Σ q log(q/p) per token; +inf where p = 0 < q."""
  del beta
  return _weighted_log_ratio(jnp.exp(log_q), log_q, log_p)


def jsd(log_p: jax.Array, log_q: jax.Array, beta: float = 0.5) -> jax.Array:
  """JSD[β] = β KL(p‖m) + (1-β) KL(q‖m), m = βp + (1-β)q (DistillSpec's convention: β weights
  the teacher p; see the module docstring for TRL's). Bounded: 0 ≤ JSD[β] ≤ H(β) ≤ log 2."""
  p, q = jnp.exp(log_p), jnp.exp(log_q)
  a, b = beta * p, (1.0 - beta) * q
  m = a + b
  # m > 0 wherever a > 0 or b > 0, the only cells the weighted sums read.
  log_m = jnp.log(jnp.where(m > 0, m, 1.0))
  return _weighted_log_ratio(a, log_p, log_m) + _weighted_log_ratio(b, log_q, log_m)


def total_variation(log_p: jax.Array, log_q: jax.Array, beta: float = 0.5) -> jax.Array:
  """½ Σ |p - q| per token, in [0, 1]."""
  del beta
  return 0.5 * jnp.sum(jnp.abs(jnp.exp(log_p) - jnp.exp(log_q)), axis=-1)


def acceptance_rate(log_p: jax.Array, log_q: jax.Array) -> jax.Array:
  """α = Σ min(p, q) per token: the chance speculative sampling accepts a draft from q
  (= 1 - TVD). Not a loss (no useful gradient where p = q); a metric."""
  return jnp.sum(jnp.minimum(jnp.exp(log_p), jnp.exp(log_q)), axis=-1)


# A dumb registry: configs name a divergence by string (config.distill.divergence).
DIVERGENCES = {"fkl": forward_kl, "rkl": reverse_kl, "jsd": jsd, "tvd": total_variation}


def check(name: str, beta: float, sampling: sampling_lib.Sampling) -> None:
  """ValueError naming the config field for an unknown divergence, β ∉ [0, 1], greedy
  temperature, or KL with a truncated (top-k/top-p) law."""
  if name not in DIVERGENCES:
    raise ValueError(f"distill.divergence={name!r} is not a divergence; choose one of "
                     f"{sorted(DIVERGENCES)}.")
  if not 0.0 <= float(beta) <= 1.0:  # also rejects NaN
    raise ValueError(f"distill.beta must be in [0, 1] (JSD[β] = β KL(p‖m) + (1-β) KL(q‖m), "
                     f"m = βp + (1-β)q), got {beta}.")
  if sampling.greedy:
    log_law(jnp.zeros((1,)), sampling)  # raises the temperature message
  if name in ("fkl", "rkl") and (sampling.top_k or sampling.top_p < 1.0):
    raise ValueError(
        f"distill.divergence={name!r} with distill.top_k={sampling.top_k}, "
        f"distill.top_p={sampling.top_p} is infinite whenever the verifier's and the drafter's "
        "truncated supports differ. Use distill.top_k=0 and distill.top_p=1.0, or a bounded "
        "divergence ('jsd', 'tvd').")


@functools.partial(jax.jit, static_argnames=("name", "sampling", "beta"))
def per_token(name: str, teacher_logits: jax.Array, student_logits: jax.Array, *,
              sampling: sampling_lib.Sampling, beta: float = 0.5) -> jax.Array:
  """f32[...]: divergence `name` between the teacher's law p and the student's law q at every
  position of logits[..., V] (same leading shapes, same vocabulary)."""
  if teacher_logits.shape[-1] != student_logits.shape[-1]:
    # docs/design.md §6: a vocabulary mismatch must fail loudly, never broadcast.
    raise ValueError(f"Verifier (teacher) vocabulary {teacher_logits.shape[-1]} != drafter "
                     f"(student) vocabulary {student_logits.shape[-1]}: the laws must be over "
                     "the same token ids (train the drafter with the verifier's tokenizer).")
  check(name, beta, sampling)
  return DIVERGENCES[name](log_law(teacher_logits, sampling), log_law(student_logits, sampling),
                           float(beta))


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
  """Σ v·w / Σ w (the floor 1e-8 makes an all-zero mask give 0, not NaN)."""
  w = mask.astype(jnp.float32)
  return jnp.sum(values * w) / jnp.maximum(jnp.sum(w), 1e-8)


@functools.partial(jax.jit, static_argnames=("name", "sampling", "beta"))
def divergence(name: str, teacher_logits: jax.Array, student_logits: jax.Array,
               mask: jax.Array, *, sampling: sampling_lib.Sampling, beta: float = 0.5
               ) -> jax.Array:
  """f32[]: divergence `name` ("fkl", "rkl", "jsd", "tvd") averaged over the tokens where
  mask[B, T] > 0 (the response), from logits[B, T, V] of the teacher (verifier, p) and the
  student (drafter, q) under `sampling`'s temperature/top-k/top-p. Differentiable in both.
  Jitted with name, sampling and beta static (they pick code; a new β compiles anew)."""
  return masked_mean(per_token(name, teacher_logits, student_logits, sampling=sampling,
                               beta=beta), mask)


@functools.partial(jax.jit, static_argnames=("sampling", "beta"))
def all_per_token(teacher_logits, student_logits, *, sampling: sampling_lib.Sampling,
                  beta: float = 0.5) -> dict[str, jax.Array]:
  """Every divergence plus α per token (one log_law per model): for metrics and reports."""
  log_p, log_q = log_law(teacher_logits, sampling), log_law(student_logits, sampling)
  out = {name: fn(log_p, log_q, beta) for name, fn in DIVERGENCES.items()}
  out["alpha"] = acceptance_rate(log_p, log_q)
  return out
