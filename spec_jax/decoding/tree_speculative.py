"""Tree speculative decoding: RSD-C, RSD-S, SpecInfer and SpecTr in one jitted `lax.while_loop`.

Shape legend: B batch, P padded prompt length, N max new tokens, L tree depth, M tree nodes (root
included), V vocabulary, S = P + N + M cache slots.

Cache layout (DESIGN.md §2). Committed tokens sit at slot = position. In a round with L_b
committed tokens, tree node j of row b sits at slot base = L_b - 1 plus j (the root, node 0, is
the last committed token at its own slot) and position base + depth(j). A node attends to the
committed prefix (slots < base) and to its ancestors (`trees.tree_mask`). After verification the
accepted path's K/V are gathered into slots L_b .. L_b + n - 1, where the next round expects
them; everything else in the tree region is stale and hidden by the next round's masks until it
is overwritten. All shapes are static: one compiled program per (B, P, N, tree shape).

One round:
  1. the drafter catches up (window [L-2, L-1], as in the chain loop) and grows the tree level by
     level with tree attention: one drafter call per level, L calls in all (`propose_tree`);
  2. the verifier scores all M nodes in one call (ancestor mask, positions base + depth);
  3. `tree_acceptance.verify_tree` walks the tree from the root (recursive rejection sampling
     with or without replacement, K-SEQ, or greedy) and returns the accepted path and the next
     token; the row emits n + 1 tokens, cut exactly where autoregressive decoding would stop;
  4. both caches move the accepted path's K/V into place.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.decoding import speculative
from spec_jax.decoding import tree_acceptance
from spec_jax.decoding import trees
from spec_jax.models import llama

TRACE_COUNT = {"tree": 0}


@dataclasses.dataclass(frozen=True)
class TreeDecode:
  """Static knobs of tree decoding: the tree shape and the verification rule ("auto": greedy at
  temperature 0, else the rule the tree's sampling scheme needs, `trees.TREE_RULES`). Other
  rules are for experiments and tests (e.g. a deliberately mismatched rule must lose exactness)."""
  tree: trees.TreeSpec
  rule: str = "auto"

  def rule_name(self, sampling: sampling_lib.Sampling) -> str:
    rule = self.rule
    if rule == "auto":
      rule = "greedy" if sampling.greedy else self.tree.rule
    if rule not in tree_acceptance.RULES:
      raise ValueError(f"decode.rule={rule!r} is not a tree rule; choose one of "
                       f"{['auto', *tree_acceptance.RULES]}.")
    if (rule == "greedy") != sampling.greedy:
      raise ValueError(f"decode.rule={rule!r} does not fit temperature={sampling.temperature}: "
                       "use 'greedy' with temperature 0 and a sampling rule otherwise ('auto').")
    return rule


@dataclasses.dataclass(frozen=True)
class LMTreeDrafter(speculative.LMDrafter):
  """A small LM that drafts trees (and, inherited, chains)."""

  def propose_tree(self, params, cache, tokens, lengths, rng, spec: trees.TreeSpec,
                   sampling: sampling_lib.Sampling):
    """Grow a draft tree of shape `spec` from each row's last committed token.

    Returns (tree: trees.Tree [B, M], q f32[B, M, V], anc bool[B, M, M], cache). q[b, j] is the
    exact law node j's children were drawn from (zeros at the deepest level, which has no
    children); anc[b, i, j] says node j is node i or one of its ancestors (the verifier's mask
    reuses it)."""
    apply = llama.make_apply(self.cfg)
    b = tokens.shape[0]
    size = cache.size
    m = spec.num_nodes
    last = lengths - 1
    # Catch-up window [L-2, L-1], as in LMDrafter.propose: it also rewrites the last accepted
    # node of the previous round, whose K/V may never have been computed (a depth-L node).
    prev = jnp.maximum(last - 1, 0)
    root = jnp.take_along_axis(tokens, last[:, None], 1)[:, 0]
    window = jnp.stack([jnp.take_along_axis(tokens, prev[:, None], 1)[:, 0], root], axis=1)
    slots = jnp.stack([jnp.where(last >= 1, prev, size), last], axis=1)
    logits, _, cache = apply(params, window, jnp.stack([prev, last], axis=1), cache, None, slots)
    logits = logits[:, -1:]                                               # [B, 1, V]

    offsets = spec.level_offsets
    levels = [trees.root_level(root)]
    anc = [jax.nn.one_hot(jnp.zeros((b, 1), jnp.int32), m, dtype=bool)]  # ancestor rows per level
    q_levels = []
    for d in range(1, spec.depth + 1):
      q = sampling_lib.probs_from_logits(logits, sampling)                # law at level d-1 nodes
      q_levels.append(q)
      level = trees.expand(spec, d, jax.random.fold_in(rng, d), logits, q, levels[-1],
                           offsets[d - 1], sampling)
      own = offsets[d] + jnp.arange(spec.level_widths[d - 1], dtype=jnp.int32)
      anc.append(trees.ancestor_rows(anc[-1], level.parent - offsets[d - 1],
                                     jnp.broadcast_to(own[None], level.parent.shape), m))
      levels.append(level)
      if d < spec.depth:  # feed level d to get its children's law (the deepest level is not fed)
        positions = jnp.broadcast_to((last + d)[:, None], level.tokens.shape)
        logits, _, cache = apply(params, level.tokens, positions, cache,
                                 trees.tree_mask(anc[-1], last, size), last[:, None] + own[None])
    q_levels.append(jnp.zeros((b, spec.level_widths[-1], self.vocab_size), jnp.float32))
    return (trees.assemble(spec, levels), jnp.concatenate(q_levels, axis=1),
            jnp.concatenate(anc, axis=1), cache)


def move_path(cache: llama.KVCache, lengths, path, num_accepted) -> llama.KVCache:
  """Gather the accepted path's K/V (node path[b, d] at slot L_b - 1 + path[b, d]) into slots
  L_b + d for d < n_b. The gather reads every source before the scatter writes (functional
  update), and path[d] ≥ d + 1 by the level layout, so no source is clobbered either way."""
  b, depth = path.shape
  size = cache.size
  rows = jnp.arange(b)[:, None]
  last = (lengths - 1)[:, None]
  src = jnp.clip(last + path, 0, size - 1)
  d = jnp.arange(depth)[None]
  dst = jnp.where(d < num_accepted[:, None], last + 1 + d, size)        # size = dropped write
  return llama.KVCache(k=cache.k.at[:, rows, dst].set(cache.k[:, rows, src], mode="drop"),
                       v=cache.v.at[:, rows, dst].set(cache.v[:, rows, src], mode="drop"))


@functools.partial(jax.jit, static_argnames=("v_cfg", "drafter", "decode", "sampling",
                                             "max_new_tokens", "stop_ids"))
def _tree_generate(v_params, d_params, prompt_tokens, prompt_lengths, rng, *, v_cfg, drafter,
                   decode, sampling, max_new_tokens, stop_ids):
  TRACE_COUNT["tree"] += 1
  spec = decode.tree
  rule = decode.rule_name(sampling)
  depth, m = spec.depth, spec.num_nodes
  v_apply = llama.make_apply(v_cfg)
  b, p = prompt_tokens.shape
  size = p + max_new_tokens + m  # the last round's tree overhangs the output by up to M slots
  state = speculative.prefill_state(v_params, d_params, prompt_tokens, prompt_lengths, rng,
                                    v_cfg=v_cfg, drafter=drafter, overhang=m, depth=depth,
                                    max_new_tokens=max_new_tokens)

  def body(s: speculative.SpecState) -> speculative.SpecState:
    key = jax.random.fold_in(s.rng, s.round)
    draft_key, accept_key = jax.random.split(key)
    tree, q, anc, d_cache = drafter.propose_tree(d_params, s.d_cache, s.tokens, s.lengths,
                                                 draft_key, spec, sampling)
    last = s.lengths - 1
    logits, _, v_cache = v_apply(v_params, tree.tokens, last[:, None] + tree.depth, s.v_cache,
                                 trees.tree_mask(anc, last, size),
                                 last[:, None] + jnp.arange(m, dtype=jnp.int32)[None])
    p_law = sampling_lib.probs_from_logits(logits, sampling)            # [B, M, V]
    verdict = tree_acceptance.verify_tree(
        p_law, q, tree.tokens, tree.parent, tree.depth, tree.valid, accept_key, rule=rule,
        max_depth=depth, max_candidates=spec.max_candidates)
    n = verdict.num_accepted
    path_tokens = jnp.take_along_axis(tree.tokens, verdict.path, axis=1)  # [B, L]
    emitted = jnp.concatenate([path_tokens, jnp.zeros((b, 1), jnp.int32)], axis=1)
    emitted = emitted.at[jnp.arange(b), n].set(verdict.next_token)
    tokens, lengths, num_new, done = speculative.commit_tokens(s, emitted, n + 1, stop_ids,
                                                               max_new_tokens)
    v_cache = move_path(v_cache, s.lengths, verdict.path, n)
    d_cache = move_path(d_cache, s.lengths, verdict.path, n)
    live = (~s.done).astype(jnp.int32)
    reached = verdict.reached.astype(jnp.int32) * live[:, None]
    st = s.stats
    stats = speculative.SpecStats(
        verifier_calls=st.verifier_calls + live,
        accepted=st.accepted + n * live,
        reached=st.reached + reached,
        accepted_at=st.accepted_at + (jnp.arange(depth)[None] < n[:, None]) * live[:, None],
        alpha_sum=st.alpha_sum + jnp.sum(verdict.alpha * reached, axis=1))
    return speculative.SpecState(tokens, lengths, num_new, done, v_cache, d_cache, s.rng,
                                 s.round + 1, stats)

  state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
  return speculative.SpecOutput(state.tokens, state.lengths, prompt_lengths, state.num_new,
                                state.round, state.stats)


def tree_generate(verifier_params, drafter_params, prompts: generate_lib.Prompts,
                  rng: jax.Array, *, verifier_cfg: llama.LlamaConfig,
                  drafter_cfg: llama.LlamaConfig | None = None, drafter=None,
                  decode: TreeDecode, sampling: sampling_lib.Sampling, max_new_tokens: int,
                  stop_ids: Sequence[int] = (), max_cache_len: int | None = None
                  ) -> speculative.SpecOutput:
  """Generate up to `max_new_tokens` per row with draft trees verified in one verifier call per
  round. Same stopping rule, output layout and counters as `speculative.speculative_generate`
  (stats.reached / accepted_at are per depth 1..L). The caches hold P + max_new_tokens + M slots
  (the last round's tree overhangs by M); `max_cache_len` (the verifier's context) bounds that."""
  if (drafter is None) == (drafter_cfg is None):
    raise ValueError("Pass exactly one of drafter_cfg (an LM drafter) or drafter.")
  drafter = drafter or LMTreeDrafter(drafter_cfg)
  speculative.check_pair(verifier_cfg, drafter)
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
  spec = decode.tree
  if max_cache_len is not None:
    room = max_cache_len - prompts.tokens.shape[1] - max_new_tokens
    if spec.num_nodes > room:
      raise ValueError(
          f"The draft tree ({spec.describe()}) has {spec.num_nodes} nodes but only {room} cache "
          f"slots are left after {prompts.tokens.shape[1]} prompt and {max_new_tokens} new tokens "
          f"(max_cache_len={max_cache_len}): use a smaller tree or fewer new tokens.")
  decode.rule_name(sampling)  # fail fast, outside jit
  return _tree_generate(
      verifier_params, drafter_params, prompts.tokens, prompts.lengths, rng, v_cfg=verifier_cfg,
      drafter=drafter, decode=decode, sampling=sampling, max_new_tokens=int(max_new_tokens),
      stop_ids=tuple(int(i) for i in stop_ids))
