"""spec_jax: speculative decoding in JAX (docs/design.md).

Shape letters, one vocabulary for the whole package (docstrings, `x[B,T,V]` annotations,
`logits_BxTxV` suffixes and capital-letter einsums):
  B  batch
  T  tokens in one forward call
  S  cache slots
  P  padded prompt length
  O  max new tokens
  M  proposal nodes (root included; a chain has γ+1)
  A  deepest draft level (chain γ, tree depth L; at most A drafts accepted per round)
  C  candidates examined at one verification step
  W  width of one tree level
  V  vocabulary
  D  model width
  L  layers
  N  query heads
  K  key/value heads
  G  query heads per kv head
  H  head dim
  F  feed-forward width
  E  experts/heads stacked for a parallel map
A module may add a letter for a local axis (say so in its legend) but never reuses one of these
for something else: a reader who knows N is query heads must not meet N as "new tokens".
"""
