"""Token-level losses. Shapes: B batch, T tokens, V vocabulary. All arithmetic in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def cross_entropy(logits_BxTxV: jax.Array, targets_BxT: jax.Array, weights_BxT: jax.Array
                  ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Weighted mean next-token cross-entropy.

  loss = Σ w·(-log softmax(logits)[target]) / Σ w. Weights mask padding (0) or reweight tokens;
  Σ w is floored at 1e-8 (not 1) so that fractional weights still average correctly and an
  all-zero batch gives loss 0 instead of NaN.

  Returns (loss f32[], metrics) with metrics
    loss, accuracy (weighted argmax == target), perplexity = exp(loss),
    weight_sum (Σ w; callers averaging over batches weight each batch's metrics by it).
  """
  logits = logits_BxTxV.astype(jnp.float32)
  weights = weights_BxT.astype(jnp.float32)
  nll_BxT = optax.softmax_cross_entropy_with_integer_labels(logits, targets_BxT)
  weight_sum = jnp.sum(weights)
  denom = jnp.maximum(weight_sum, 1e-8)
  loss = jnp.sum(nll_BxT * weights) / denom
  correct = (jnp.argmax(logits, axis=-1) == targets_BxT).astype(jnp.float32)
  accuracy = jnp.sum(correct * weights) / denom
  metrics = {"loss": loss, "accuracy": accuracy, "perplexity": jnp.exp(loss),
             "weight_sum": weight_sum}
  return loss, metrics
