"""Distillation data: prompts with a response from a fixed dataset, the verifier or the drafter.

DistillSpec (Zhou et al. 2024, §4.2, Table 1) compares where the response tokens the divergence
is averaged over come from:
  fixed      the dataset's own continuation of the prompt;
  verifier   sampled from the verifier (teacher-generated; generated once and cached);
  onpolicy   sampled from the current drafter (student-generated, GKD's on-policy data),
             regenerated from the live params every `refresh_every` steps;
  mix        round(λ·B) rows of every batch on-policy, the other rows from `mix_with`
             ("fixed" or "verifier"); λ = `mix_lambda` (GKD's λ, the student-data fraction).
The mixture is a deterministic row split per batch rather than GKD's per-batch coin flip: every
step then sees both kinds of data in the proportion asked for, shapes stay static, and the run
stays a pure function of its seed (the expected composition is the same).

Shapes: B batch, P prompt tokens, O response tokens (the generation's max new tokens). Prompts
are the first P tokens of windows of P + O tokens cut from a TFDS split's packed token stream
(`pipeline.lm_batches`, any split with a text feature), so every prompt has exactly P tokens (no
padding, one compiled generation program) and the fixed data's response is the next O tokens.
Batch s is
  {"inputs": int32[B, P+O-1], "targets": int32[B, P+O-1], "weights": float32[B, P+O-1]}
with weights 1 exactly on the targets that are response tokens (positions P-1 .. P-2+n_b, n_b ≤ O
generated tokens: fewer when generation stopped at a stop token, which stays in the response).
All sources see the same prompts at step s; only the responses differ.
Chat data (data.name = spec_jax_sharegpt, `chat_data`): a row is one conversation turn, a prompt
of l_b ≤ P tokens at [0, l_b), its response after it, zeros after that; weights sit on l_b-1 ..
l_b-2+n_b, and every source works on chat rows as on corpus windows.

Reproducibility: the responses of batch s are drawn with fold_in(key(seed, source), s), so
verifier data depend on (seed, s) alone and on-policy data on (seed, s, the drafter's params at
the refresh that produced them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import Any, Callable

from absl import logging
import grain
import jax
import numpy as np
import tqdm

from spec_jax.data import pipeline
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.models import draft_init, llama
from spec_jax.training import chat_data

SOURCES = ("fixed", "verifier", "onpolicy", "mix")
_SALTS = {"verifier": 1, "onpolicy": 2}
_CACHE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Spec:
  """The data side of a distillation run (config.data plus the batch size)."""
  source: str
  prompt_tokens: int
  response_tokens: int
  batch_size: int
  temperature: float = 1.0
  refresh_every: int = 1
  mix_with: str = "verifier"
  mix_lambda: float = 0.5
  seed: int = 0
  # source = "verifier": distinct generated batches, cycled (0: one per training step), the share
  # of each batch's rows they fill (the rest: the corpus's own text), and rows per generation
  # call (0: one batch's rows; larger calls use the cores better on a CPU).
  verifier_batches: int = 0
  verifier_share: float = 1.0
  generate_batch: int = 0

  def __post_init__(self):
    if self.source not in SOURCES:
      raise ValueError(f"data.source={self.source!r} is not a data source; choose one of "
                       f"{list(SOURCES)}.")
    for f in ("prompt_tokens", "response_tokens", "refresh_every", "batch_size"):
      v = getattr(self, f)
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        field = "train.batch_size" if f == "batch_size" else f"data.{f}"
        raise ValueError(f"{field} must be an integer >= 1, got {v!r}.")
    if self.mix_with not in ("fixed", "verifier"):
      raise ValueError(f"data.mix_with={self.mix_with!r}: the rows a mixture adds to the "
                       "on-policy ones come from 'fixed' or 'verifier'.")
    if not 0.0 <= self.mix_lambda <= 1.0:
      raise ValueError(f"data.mix_lambda must be in [0, 1] (the on-policy fraction of each "
                       f"batch), got {self.mix_lambda}.")
    sampling_lib.Sampling(self.temperature)  # validates data.temperature (0 = greedy)
    for f in ("verifier_batches", "generate_batch"):
      v = getattr(self, f)
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise ValueError(f"data.{f} must be an integer >= 0 (0 = the default), got {v!r}.")
    if not 0.0 < self.verifier_share <= 1.0:
      raise ValueError(f"data.verifier_share must be in (0, 1] (the share of each batch's rows "
                       f"from verifier responses), got {self.verifier_share}.")
    if self.verifier_share < 1.0 and self.source != "verifier":
      raise ValueError(f"data.verifier_share={self.verifier_share} needs data.source='verifier' "
                       f"(got {self.source!r}); a mix's shares are data.mix_lambda.")
    if self.generate_batch % self.verifier_rows:
      raise ValueError(
          f"data.generate_batch={self.generate_batch} must be a multiple of the "
          f"{self.verifier_rows} verifier rows of a batch (whole batches are generated per "
          f"call). Fix: e.g. data.generate_batch={8 * self.verifier_rows}, or 0.")

  @classmethod
  def from_config(cls, data_cfg, batch_size: int, seed: int) -> "Spec":
    return cls(source=str(data_cfg.source), prompt_tokens=int(data_cfg.prompt_tokens),
               response_tokens=int(data_cfg.response_tokens), batch_size=int(batch_size),
               temperature=float(data_cfg.temperature),
               refresh_every=int(data_cfg.refresh_every), mix_with=str(data_cfg.mix_with),
               mix_lambda=float(data_cfg.mix_lambda), seed=int(seed),
               verifier_batches=data_cfg.get("verifier_batches", 0),
               verifier_share=float(data_cfg.get("verifier_share", 1.0)),
               generate_batch=data_cfg.get("generate_batch", 0))

  @property
  def sampling(self) -> sampling_lib.Sampling:
    return sampling_lib.Sampling(self.temperature)

  @property
  def onpolicy_rows(self) -> int:
    """Rows of each batch whose response the drafter generates."""
    if self.source == "onpolicy":
      return self.batch_size
    if self.source == "mix":
      # Rounded, not sampled: a fixed row count keeps the generation program's shape static.
      return int(round(self.mix_lambda * self.batch_size))
    return 0

  @property
  def verifier_rows(self) -> int:
    """Rows of each batch (its first ones) whose response comes from the verifier data."""
    if self.source == "verifier":
      return max(1, int(round(self.verifier_share * self.batch_size)))
    return self.batch_size  # a mix takes its verifier rows from full generated batches

  @property
  def needs_verifier_data(self) -> bool:
    return self.source == "verifier" or (
        self.source == "mix" and self.mix_with == "verifier"
        and self.onpolicy_rows < self.batch_size)


def check_schedule(train_cfg, spec: Spec) -> None:
  """On-policy data are regenerated every data.refresh_every steps from the live params; a run
  resumed at a checkpoint that is not a refresh step could not regenerate what it lost."""
  if spec.onpolicy_rows and train_cfg.checkpoint_every % spec.refresh_every:
    raise ValueError(
        f"train.checkpoint_every={train_cfg.checkpoint_every} must be a multiple of "
        f"data.refresh_every={spec.refresh_every} with on-policy data (data.source="
        f"{spec.source!r}), so that a resumed run regenerates exactly the data it lost.")


def blend_rows(batch_size: int, blend) -> tuple[int, tuple[int, ...]]:
  """(rows of `data.name`, rows of each blended dataset) in every batch of B rows: a blended
  dataset with fraction w gets round(w·B) rows, the main dataset the rest. ValueError naming
  data.blend when a fraction is outside (0, 1], gives no row, or the fractions exceed 1."""
  rows = []
  for entry in blend:
    if (not isinstance(entry, (tuple, list)) or len(entry) != 2 or not isinstance(entry[0], str)
        or isinstance(entry[1], bool) or not isinstance(entry[1], (int, float))):
      raise ValueError(f"data.blend entry {entry!r} is not a (dataset name, fraction) pair. Fix: "
                       "e.g. --config.data.blend=\"(('spec_jax_general/NAME', 0.5),)\".")
    name, fraction = entry
    n = int(round(float(fraction) * batch_size))
    if not 0.0 < fraction <= 1.0 or n < 1:
      raise ValueError(
          f"data.blend gives {name!r} the fraction {fraction}, which is {n} of the "
          f"{batch_size} rows of a batch. Fix: a fraction in (0, 1] of at least "
          f"1/{batch_size} (or a larger train.batch_size).")
    rows.append(n)
  if sum(rows) > batch_size:
    raise ValueError(f"data.blend's fractions take {sum(rows)} of the {batch_size} rows of a "
                     "batch. Fix: fractions that sum to at most 1 (the rest come from data.name).")
  return batch_size - sum(rows), tuple(rows)


def blend_counts(config, tokenizer) -> np.ndarray:
  """float64[V]: token frequencies of the training data: data.train_split of data.name, or of
  the blend, each dataset's frequencies weighted by its share of a batch's rows."""
  dc = config.data
  if chat_data.is_chat(dc.name):  # prompts and the corpus's responses of the train rows
    return chat_data.token_counts(dc.name, dc.train_split, tokenizer,
                                  prompt_tokens=int(dc.prompt_tokens),
                                  response_tokens=int(dc.response_tokens),
                                  data_dir=dc.data_dir or None)
  names = [dc.name] + [name for name, _ in dc.get("blend", ())]
  main, rows = blend_rows(config.train.batch_size, dc.get("blend", ()))
  total = np.zeros((tokenizer.vocab_size,), np.float64)
  for name, share in zip(names, (main, *rows)):
    if share:
      c = draft_init.count_tokens(pipeline.token_stream(
          name, dc.train_split, tokenizer, data_dir=dc.data_dir or None, text_key=dc.text_key),
          tokenizer.vocab_size)
      total += share * c / max(c.sum(), 1)
  return total


class _Concat:
  """Batch s of several window datasets, stacked along the rows (a class so it pickles)."""

  def __init__(self, parts):
    self.parts = parts

  def __call__(self, s):
    return np.concatenate([np.asarray(p[int(s)]) for p in self.parts], axis=0)


def windows(name: str, split: str, tokenizer, *, prompt_tokens: int, response_tokens: int,
            batch_size: int, seed: int, data_dir: str | None = None, text_key: str = "text",
            num_epochs: int | None = None, blend=()):
  """Index-addressable batches of int32[B, P+O] token windows of a split (shuffled by seed).

  blend: (name, fraction) pairs: every batch takes round(fraction·B) rows from each of those
  datasets' `split` (same text_key and data_dir) and the rest from `name`, in that order, so a
  run sees the mixture in the proportion asked for at every step (`blend_rows`). Chat data:
  `chat_data.windows` (no blend, text_key unused)."""
  if chat_data.is_chat(name):
    return chat_data.windows(name, split, tokenizer, prompt_tokens=prompt_tokens,
                             response_tokens=response_tokens, batch_size=batch_size, seed=seed,
                             data_dir=data_dir, num_epochs=num_epochs)
  if blend:
    main, rows = blend_rows(batch_size, blend)
    sources = ([(name, main)] if main else []) + [(n, r) for (n, _), r in zip(blend, rows)]
    parts = [windows(n, split, tokenizer, prompt_tokens=prompt_tokens,
                     response_tokens=response_tokens, batch_size=r, seed=seed,
                     data_dir=data_dir, text_key=text_key, num_epochs=num_epochs)
             for n, r in sources]
    return grain.MapDataset.range(min(len(p) for p in parts)).map(_Concat(parts))
  # lm_batches cuts windows of seq_len + 1 tokens: exactly one prompt + response row each, with
  # the same shuffling, resumability (batch s is a function of s) and data_dir handling.
  ds = pipeline.lm_batches(name, split, tokenizer, seq_len=prompt_tokens + response_tokens - 1,
                           batch_size=batch_size, seed=seed, data_dir=data_dir,
                           text_key=text_key, num_epochs=num_epochs)
  return ds.map(lambda b: np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1))


def make_batch(seqs: np.ndarray, num_new: np.ndarray, prompt_tokens) -> dict[str, np.ndarray]:
  """seqs int32[B, P+O] (prompt then response), num_new int32[B], prompt_tokens P or int32[B]
  (chat rows: each row's prompt length) → the training batch, with weights on the first
  num_new[b] response targets."""
  seqs = np.asarray(seqs, np.int32)
  t = np.arange(seqs.shape[1] - 1)[None, :]
  # The target at input position l-1 is the first response token.
  first = np.reshape(np.asarray(prompt_tokens), (-1, 1)) - 1
  weights = (t >= first) & (t < first + np.asarray(num_new)[:, None])
  return {"inputs": seqs[:, :-1], "targets": seqs[:, 1:], "weights": weights.astype(np.float32)}


def generate_responses(params, cfg: llama.LlamaConfig, prompts, rng: jax.Array, *,
                       sampling: sampling_lib.Sampling, response_tokens: int,
                       stop_ids=(), hidden_layers=()) -> tuple:
  """(seqs int32[B, P+O], num_new int32[B]) on the host: O tokens sampled after each prompt
  (int32[B, P], or right-padded `generate.Prompts` whose responses start at their lengths) by
  the jitted batched `generate` (one compiled program per shape). Positions past a row's stop
  are zero (and carry zero weight in `make_batch`). With `hidden_layers`, a third element:
  {layer: [B, P+O-1, D]}, the generating model's states over the batch's inputs
  (`make_batch(...)["inputs"]`, seqs without the last position) at those layers, zero from
  each row's last token on, where no target carries weight (`generate.GenerateOutput.hidden`)."""
  if not isinstance(prompts, generate_lib.Prompts):
    prompts = np.asarray(prompts, np.int32)
    prompts = generate_lib.Prompts(prompts, np.full((len(prompts),), prompts.shape[1], np.int32))
  out = generate_lib.generate(
      params, generate_lib.Prompts(jax.numpy.asarray(prompts.tokens, np.int32),
                                   jax.numpy.asarray(prompts.lengths, np.int32)),
      rng, cfg=cfg, sampling=sampling, max_new_tokens=response_tokens, stop_ids=stop_ids,
      hidden_layers=hidden_layers)
  # One host transfer per batch: the batch goes back to the host anyway (train_loop shards host
  # batches), and blocking here means the params it read are free to be donated next step.
  seqs, num_new, lengths, hidden = jax.device_get((out.tokens, out.num_new, out.lengths,
                                                   out.hidden))
  # Positions past a row's stop carry zero weight; pin them to 0 whatever the loop left there,
  # so a batch is a function of (seed, s, params) alone.
  seqs = np.where(np.arange(seqs.shape[1])[None] < lengths[:, None], seqs, 0).astype(np.int32)
  if not hidden_layers:
    return seqs, np.asarray(num_new, np.int32)
  return seqs, np.asarray(num_new, np.int32), {k: np.asarray(v[:, :-1]) for k, v in hidden.items()}


def pool_digest(key: dict) -> str:
  """The 16 hex digits that name a verifier pool's cache file, from everything its responses
  depend on (`programs.distill.pool_key`)."""
  return hashlib.sha256(json.dumps({**key, "v": _CACHE_VERSION}, sort_keys=True,
                                   default=str).encode()).hexdigest()[:16]


def source_key(seed: int, source: str) -> jax.Array:
  return jax.random.fold_in(jax.random.key(seed), _SALTS[source])


class VerifierData:
  """Verifier responses for batches 0..n-1, generated once and cached on disk.

  Teacher-generated data do not depend on the drafter, so every run with the same verifier,
  prompts, seed and sampling shares them: the cache file is keyed by those (`key`), and a cache
  holding more batches than a run needs serves it too (batch s depends on s alone). Batch s of
  a run is generated batch s mod n, so n < the run's steps (`data.verifier_batches`) cycles a
  pool. Each generation call covers `per_call` consecutive batches (its rng is folded with its
  first batch's index). Cost: one verifier generation of rows × O tokens per batch, paid once
  (on 2 CPU cores, SmolLM2 samples ~100 tokens/s at 8 rows per call and ~230 at 32-64). The key
  names the verifier by its config, not its weights: clear `cache_dir` after changing a
  checkpoint in place.

  `generate_fn` may also return the verifier's hidden states over each batch's inputs
  (`generate_responses(..., hidden_layers=...)`): they are kept beside the responses, in memory
  and in the cache file (`hidden_<layer>`, float32[n, B, P+O-1, D]), and `hidden(s)` hands them
  to the teacher cache in place of a teacher pass. A cache file written without them (or with
  other layers) serves its responses, and its batches' `hidden` is None.
  """

  SAVE_EVERY_S = 30.0

  def __init__(self, generate_fn: Callable[[np.ndarray, jax.Array], tuple], window_ds, *,
               num_batches: int, spec: Spec, key: dict, cache_dir: str | None,
               rows: int | None = None, per_call: int = 1, hidden_layers=()):
    self.seqs, self.num_new = None, None
    names = [f"hidden_{int(k)}" for k in hidden_layers]
    hidden = []  # per batch: {layer: [B, P+O-1, D]}, or None where the cache had none
    rows = spec.batch_size if rows is None else rows
    num_batches = -(-num_batches // per_call) * per_call  # whole calls
    self.num_batches = num_batches
    path = None
    if cache_dir:
      path = os.path.join(cache_dir, f"verifier_responses_{pool_digest(key)}.npz")
      if os.path.exists(path):
        with np.load(path) as f:
          self.seqs, self.num_new = f["seqs"], f["num_new"]
          stored = ({int(n[len("hidden_"):]): f[n] for n in names}
                    if names and all(n in f.files for n in names) else {})
        hidden = [{k: v[s] for k, v in stored.items()} if stored else None
                  for s in range(len(self.seqs))]
    # Batch s depends on (key, s) only, so a shorter cache is a valid prefix of a longer one.
    have = 0 if self.seqs is None else len(self.seqs) // per_call * per_call
    self._hidden = hidden[:have]
    if have >= num_batches:
      logging.info("Verifier responses for %d batches from %s%s.", num_batches, path,
                   " with their hidden states" if self.hidden(0) is not None else "")
      return
    t0 = time.perf_counter()
    rng = source_key(spec.seed, "verifier")
    seqs = [] if self.seqs is None else list(self.seqs[:have])
    num_new = [] if self.num_new is None else list(self.num_new[:have])
    last_save = time.perf_counter()
    # Call by call with a progress bar; the cache is rewritten every SAVE_EVERY_S (and at the
    # end), so a killed run keeps what it generated (the cache is a valid prefix).
    for s in tqdm.tqdm(range(have, num_batches, per_call), desc="verifier responses",
                       unit="call", disable=jax.process_index() != 0):
      prompts = chat_data.prompts_of([window_ds[t] for t in range(s, s + per_call)], rows,
                                     spec.prompt_tokens)
      seq, n, *h = generate_fn(prompts, jax.random.fold_in(rng, s))
      seqs.extend(np.split(np.asarray(seq), per_call))
      num_new.extend(np.split(np.asarray(n), per_call))
      parts = {k: np.split(v, per_call) for k, v in h[0].items()} if h else {}
      self._hidden.extend({k: v[i] for k, v in parts.items()} if parts else None
                          for i in range(per_call))
      if path and (time.perf_counter() - last_save > self.SAVE_EVERY_S
                   or s + per_call == num_batches):
        self._save(path, cache_dir, seqs, num_new, key, self._hidden)
        last_save = time.perf_counter()
    self.seqs, self.num_new = np.stack(seqs), np.stack(num_new)
    logging.info("Generated verifier responses for batches %d..%d in %.1f s.", have,
                 num_batches - 1, time.perf_counter() - t0)

  @staticmethod
  def _save(path: str, cache_dir: str, seqs, num_new, key: dict, hidden) -> None:
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp.npz"  # atomic: a killed run leaves no truncated cache
    # Hidden states are kept only when every batch has them (a file is one prefix of batches).
    states = ({f"hidden_{k}": np.stack([h[k] for h in hidden]) for k in hidden[0]}
              if hidden and all(h is not None for h in hidden) else {})
    np.savez(tmp, seqs=np.stack(seqs), num_new=np.stack(num_new), key=json.dumps(key, default=str),
             **states)
    os.replace(tmp, path)

  def __getitem__(self, s: int) -> tuple[np.ndarray, np.ndarray]:
    s = int(s) % self.num_batches
    return self.seqs[s], self.num_new[s]

  def hidden(self, s: int) -> dict[int, np.ndarray] | None:
    """The verifier's hidden states over batch s's inputs ({layer: [B, P+O-1, D]}), or None."""
    return self._hidden[int(s) % self.num_batches]


def _read_block(path: str, key: str) -> list[tuple[np.ndarray, np.ndarray]] | None:
  """The on-policy rows of a block `_write_block` kept, if they are this block's (key)."""
  if not os.path.exists(path):
    return None
  with np.load(path) as f:
    if str(f["key"]) != key:
      return None
    return list(zip(f["seqs"], f["num_new"]))


def _write_block(path: str, key: str, rows) -> None:
  """Keep a block's on-policy rows beside the checkpoints (one file, the current block's,
  replaced atomically): a run stopped inside the block and resumed there reads the rows the
  block's first params generated, which its own params could not regenerate."""
  from spec_jax import parallel  # noqa: PLC0415 (imports the models)
  if not parallel.is_writer():
    return
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f"{path}.{os.getpid()}.tmp.npz"
  np.savez(tmp, key=key, seqs=np.stack([r[0] for r in rows]),
           num_new=np.stack([r[1] for r in rows]))
  os.replace(tmp, path)


class DistillData:
  """Batch s of a distillation run: `get(s, drafter_params)`.

  On-policy rows are generated for batches [r·n, (r+1)·n) at once, from the params passed with
  the first of them to arrive (n = refresh_every). A run resumed from a checkpoint at a multiple
  of n therefore regenerates exactly what an uninterrupted run generated (the program requires
  train.checkpoint_every to be a multiple of n); one stopped inside a block (a pre-emption saves
  the step it stopped at) reads the block's rows back from `block_dir`, where each block's rows
  are kept until the next block's replace them.
  """

  def __init__(self, spec: Spec, window_ds, *, drafter_generate: Callable | None = None,
               verifier_data: VerifierData | None = None, block_dir: str | None = None):
    self.spec = spec
    self.window_ds = window_ds
    self.drafter_generate = drafter_generate
    self.verifier_data = verifier_data
    self.block_dir = block_dir
    self._onpolicy: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    self._block = None
    if spec.onpolicy_rows and drafter_generate is None:
      raise ValueError(f"data.source={spec.source!r} needs a drafter generation function.")
    if spec.needs_verifier_data and verifier_data is None:
      raise ValueError(f"data.source={spec.source!r} needs verifier responses.")

  def _refresh(self, s: int, params: Any) -> None:
    n = self.spec.refresh_every
    block = s // n
    if self._block == block:
      return
    k = self.spec.onpolicy_rows
    rng = source_key(self.spec.seed, "onpolicy")
    p = self.spec.prompt_tokens
    steps = range(block * n, (block + 1) * n)
    key = json.dumps({"block": block, "spec": dataclasses.asdict(self.spec)}, sort_keys=True,
                     default=str)
    path = self.block_dir and os.path.join(self.block_dir, "block.npz")
    rows = _read_block(path, key) if path else None
    if rows is None:
      # The whole block at once, from the params of its first step: an uninterrupted run and a
      # run resumed at the block's start (a checkpoint step) then see the same data.
      rows = [tuple(np.asarray(x) for x in self.drafter_generate(
          params, chat_data.prompts_of([self.window_ds[t]], k, p), jax.random.fold_in(rng, t))[:2])
              for t in steps]
      if path:
        _write_block(path, key, rows)
    self._onpolicy = dict(zip(steps, rows))
    self._block = block

  def responses(self, s: int, params: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """(seqs int32[B, P+O], num_new int32[B]) of batch s."""
    return self._rows(s, params)[:2]

  def _rows(self, s: int, params: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seqs, num_new, prompt_lengths int32[B]) of batch s. The rows the verifier pool fills
    hold the prompts of pool batch s mod n (chat prompts differ in length)."""
    spec = self.spec
    window = self.window_ds[s]
    # The corpus's rows (pure on-policy: all replaced below; the window only supplies prompts).
    seqs, num_new, lengths = chat_data.window_rows(window, spec.prompt_tokens,
                                                   spec.response_tokens)
    k = spec.onpolicy_rows
    if spec.needs_verifier_data:
      pool, pool_new = self.verifier_data[s]
      n = len(pool)  # data.verifier_share < 1: the rows past the pool's are the corpus's text
      seqs = np.concatenate([pool, seqs[n:]])
      num_new = np.concatenate([pool_new, num_new[n:]])
      if isinstance(window, dict):
        pool_lengths = self.window_ds[int(s) % self.verifier_data.num_batches]["prompt_lengths"]
        lengths = np.concatenate([lengths[:k], pool_lengths[k:n], lengths[n:]])
    if k:
      self._refresh(s, params)
      on_seqs, on_new = self._onpolicy[s]
      # On-policy rows first: the rows a mixture takes from the other source keep their index.
      seqs = np.concatenate([on_seqs, seqs[k:]])
      num_new = np.concatenate([on_new, num_new[k:]])
    return seqs, num_new, lengths

  def get(self, s: int, params: Any = None) -> dict[str, np.ndarray]:
    return make_batch(*self._rows(s, params))
