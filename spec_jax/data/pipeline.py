"""Input pipeline: TFDS data sources -> token streams -> packed, index-addressable LM batches.

Reading goes through `tfds.data_source` style random access (array_record), never `tfds.load`,
which would import TensorFlow (docs/design.md §4). Our local datasets (`LOCAL_NAMES`: the two
corpora of `spec_jax.data.corpora`, ShareGPT and HumanEval) are built from installed files on
first use; any other TFDS dataset works by name once it has been prepared in
`data_dir` in array_record format, and nothing is ever downloaded here.

Batches are a `grain.MapDataset`: batch s is a pure function of (corpus, tokenizer, seq_len,
batch_size, seed, s), so a training run resumed at step s reads `ds[s]` and sees exactly what an
uninterrupted run would have seen; no iterator state needs checkpointing.

Shapes: B = batch_size, T = seq_len; a split's token stream is int32[n_tokens] (not N, which
is query heads in the package legend).
"""

from __future__ import annotations

import contextlib
import io

import fcntl
import functools
import hashlib
import os
import re
from typing import Iterator, Sequence

from absl import logging
import grain
import numpy as np
import tensorflow_datasets as tfds

from spec_jax.data import corpora
from spec_jax.data import humaneval
from spec_jax.data import sharegpt
from spec_jax.data import tokenizer as tokenizer_lib

_DEFAULT_DATA_DIR = "~/.cache/spec_jax/tensorflow_datasets"
# Bump when the token-cache layout or tokenization rule changes: old files are then ignored.
_TOKEN_CACHE_VERSION = 1
_ENCODE_CHUNK = 512  # documents per `encode_batch` call: big enough to use the Rust threads
# The datasets this repo builds itself (importing their modules registered them with TFDS).
LOCAL_NAMES = (*corpora.NAMES, sharegpt.NAME, humaneval.NAME)


def _install_bucket_skip() -> None:
  """A builder made for a dataset not yet prepared reads its info from TFDS's GCS bucket
  (`DatasetInfo.initialize_from_bucket`), which makes a temp folder (/tmp/tmpXXXXtfds) before it
  finds GCS off, as it is here, and leaves it behind empty. With GCS off the call does nothing
  else, so it is skipped; with GCS on (or a TFDS without the switch) it runs as TFDS wrote it."""
  info_cls = tfds.core.dataset_info.DatasetInfo
  original = info_cls.initialize_from_bucket
  if getattr(original, "_spec_jax_skip", False):
    return

  @functools.wraps(original)
  def initialize_from_bucket(self) -> None:
    if not getattr(tfds.core.utils.gcs_utils, "_is_gcs_disabled", False):
      original(self)

  initialize_from_bucket._spec_jax_skip = True
  info_cls.initialize_from_bucket = initialize_from_bucket


_install_bucket_skip()


def data_dir(path: str | None = None) -> str:
  """The TFDS data dir: `path`, else $SPEC_JAX_DATA_DIR, else ~/.cache/spec_jax/tensorflow_datasets.

  Both our corpora and the token caches (`<data_dir>/spec_jax_token_cache/`) live there.
  """
  return _resolve_data_dir(path)


# The public functions take a `data_dir` argument, which shadows `data_dir()` inside them.
def _resolve_data_dir(path: str | None) -> str:
  path = path or os.environ.get("SPEC_JAX_DATA_DIR") or _DEFAULT_DATA_DIR
  return os.path.abspath(os.path.expanduser(path))


def _base_name(name: str) -> str:
  return name.split("/")[0].split(":")[0]


def _prepare_hint(name: str, root: str) -> str:
  base = _base_name(name)
  return (f"Prepare it once in array_record format, on a machine with network access (and with "
          f"TensorFlow, if that dataset's builder needs it): `tfds build {base} "
          f"--data_dir={root} --file_format=array_record`, then copy {os.path.join(root, base)} "
          "here if that was another machine. A dataset already prepared as tfrecord converts "
          f"with `tfds convert_format --dataset_dir={os.path.join(root, base)} "
          "--out_file_format=array_record`.")


@functools.lru_cache(maxsize=32)
def _builder(name: str, root: str) -> tfds.core.DatasetBuilder:
  """A prepared, random-access builder for `name` in `root`, building our own datasets if
  needed."""
  if _base_name(name) in LOCAL_NAMES:
    try:
      builder = tfds.builder(name, data_dir=root, file_format="array_record")
    except ValueError as e:  # e.g. spec_jax_pystdlib/py310 asked of Python 3.11
      configs = [c.name for c in tfds.builder_cls(_base_name(name)).BUILDER_CONFIGS]
      raise ValueError(f"Cannot make {name!r}: {e}\nThis interpreter provides the configs "
                       f"{configs or '(none)'} of {_base_name(name)!r}.") from None
    if builder.is_prepared():
      return builder
    # Two processes sharing the default data dir (a sweep, pytest-xdist) must not both build:
    # TFDS's final rename of its incomplete.* folder fails for the second one.
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, f".{_base_name(name)}.lock"), "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      builder = tfds.builder(name, data_dir=root, file_format="array_record")
      if not builder.is_prepared():
        logging.info("Building %s into %s from local files (first use).", name, root)
        # try_download_gcs=False: never look for a pre-built copy on GCS. TFDS prints
        # "Downloading and preparing dataset Unknown size ..." for every builder, which is
        # wrong for local files: the line above says what happens.
        with contextlib.redirect_stdout(io.StringIO()):
          builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
              try_download_gcs=False, compute_stats=tfds.download.ComputeStatsMode.SKIP))
    return builder
  try:
    builder = tfds.builder(name, data_dir=root)
  except tfds.core.registered.DatasetNotFoundError:
    raise ValueError(
        f"Unknown dataset name {name!r}. spec_jax builds its own datasets {list(LOCAL_NAMES)} "
        f"from local files; any other TFDS dataset must already be prepared in {root}. "
        + _prepare_hint(name, root)) from None
  if not builder.is_prepared():
    raise FileNotFoundError(
        f"TFDS dataset {name!r} is not prepared in data_dir={root} (spec_jax never downloads at "
        "run time). " + _prepare_hint(name, root))
  formats = {builder.info.file_format, *builder.info.alternative_file_formats}
  if not formats & tfds.core.file_adapters.FileFormat.with_random_access():
    raise ValueError(
        f"TFDS dataset {name!r} in {root} is stored as {builder.info.file_format.value}, which "
        "has no random access (and reading tfrecord needs TensorFlow). "
        + _prepare_hint(name, root))
  return builder


def check_dataset(name: str, data_dir: str | None = None, field: str = "data.name") -> None:
  """An error naming `field` unless `name` is one of spec_jax's own datasets (built on first
  use, later) or a TFDS dataset prepared under `data_dir`; nothing is built or read."""
  if _base_name(name) in LOCAL_NAMES:
    return
  try:
    _builder(name, _resolve_data_dir(data_dir))
  except (ValueError, FileNotFoundError) as e:
    raise type(e)(f"{field}={name!r}: {e}") from None


def _check_split(builder: tfds.core.DatasetBuilder, name: str, split: str) -> None:
  available = list(builder.info.splits.keys())
  # TFDS split syntax allows "train[:10%]" and "train+validation"; check each base name.
  for part in split.split("+"):
    base = part.split("[")[0].strip()
    if base not in available:
      raise ValueError(f"Unknown split {split!r} for dataset {name!r}: {base!r} is not one of "
                       f"the available splits {available}. Fix: the config's data.train_split, "
                       "data.eval_split or data.prompt_split (whichever holds it) naming one "
                       "of them.")


def _check_text_key(builder: tfds.core.DatasetBuilder, name: str, text_key: str) -> None:
  features = builder.info.features
  keys = list(features.keys())
  if text_key not in keys:
    raise ValueError(f"text_key={text_key!r} is not a feature of dataset {name!r}; available "
                     f"feature keys: {keys}.")
  feature = features[text_key]
  is_string = (isinstance(feature, tfds.features.Tensor) and tuple(feature.shape) == ()
               and np.dtype(feature.np_dtype) == np.dtype(object))
  if not is_string:
    raise ValueError(f"text_key={text_key!r} of dataset {name!r} is a {type(feature).__name__} "
                     f"of shape {feature.shape}, not a scalar text feature; feature keys: {keys}.")


class TextSource(Sequence[str]):
  """Random access to one text feature of one split: `len(src)`, `src[i] -> str`.

  Order is the TFDS record order, which is fixed once the dataset is prepared (TFDS orders
  records by a hash of their keys), so indices are stable across processes and machines.
  """

  def __init__(self, records, text_key: str, description: str):
    self._records = records
    self._text_key = text_key
    self.description = description  # e.g. "spec_jax_shakespeare/1.0.0 train"

  def __len__(self) -> int:
    return len(self._records)

  def _decode(self, record) -> str:
    value = record[self._text_key]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)

  def __getitem__(self, index: int) -> str:  # type: ignore[override]
    n = len(self)
    if not -n <= index < n:
      raise IndexError(f"index {index} out of range for {self.description} ({n} documents)")
    return self._decode(self._records[index % n])

  def __getitems__(self, indices: Sequence[int]) -> list[str]:
    """Batched read (array_record reads many records in one call)."""
    return [self._decode(r) for r in self._records.__getitems__(list(indices))]

  def __iter__(self) -> Iterator[str]:
    for start in range(0, len(self), _ENCODE_CHUNK):
      yield from self.__getitems__(range(start, min(start + _ENCODE_CHUNK, len(self))))

  def __repr__(self) -> str:
    return f"TextSource({self.description}, {len(self)} documents)"


def text_source(name: str, split: str, *, data_dir: str | None = None,
                text_key: str = "text") -> TextSource:
  """Documents of `split` of TFDS dataset `name` as a random-access sequence of str.

  Our corpora (`spec_jax_shakespeare`, `spec_jax_pystdlib`) are built on first use; other
  datasets must already be prepared in array_record format under `data_dir`.
  """
  root = _resolve_data_dir(data_dir)
  builder = _builder(name, root)
  _check_split(builder, name, split)
  _check_text_key(builder, name, text_key)
  records = builder.as_data_source(split=split)
  return TextSource(records, text_key, f"{builder.info.full_name} {split}")


def example_source(name: str, split: str, *, data_dir: str | None = None):
  """The records of `split` of TFDS dataset `name` with random access: `len(src)`, `src[i]` ->
  {feature: value} (text as bytes; a Sequence feature as a dict of arrays). For datasets whose
  examples are not one text (`spec_jax_sharegpt` conversations, `spec_jax_humaneval` problems);
  built on first use like `text_source`."""
  root = _resolve_data_dir(data_dir)
  builder = _builder(name, root)
  _check_split(builder, name, split)
  return builder.as_data_source(split=split)


def _token_cache_path(src: TextSource, root: str, split: str, text_key: str,
                      fingerprint: str) -> str:
  full_name = src.description.split(" ")[0]  # name/config/version: a rebuild bumps the version
  key = repr((_TOKEN_CACHE_VERSION, full_name, split, text_key, fingerprint, len(src)))
  # The digest keeps distinct keys apart after the readable part is made filename-safe.
  digest = hashlib.sha256(key.encode()).hexdigest()[:12]
  readable = re.sub(r"[^\w.+-]", "_", f"{split}-{text_key}-{fingerprint}")
  return os.path.join(root, "spec_jax_token_cache", full_name, f"{readable}-{digest}.npy")


def _tokenize_to_file(src: TextSource, tokenizer, path: str) -> None:
  """Tokenize every document of `src`, append EOS to each, write int32[n_tokens] to `path`
  atomically.

  Chunks go to a raw file first so that memory stays bounded for large corpora (lm1b is ~1B
  tokens); the .npy is written by copying it, then renamed into place so that a crashed or
  concurrent run never leaves a truncated cache that a later run would trust.
  """
  if not 0 < tokenizer.vocab_size <= np.iinfo(np.int32).max:
    raise ValueError(f"vocab_size={tokenizer.vocab_size} does not fit int32 token ids.")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f"{path}.{os.getpid()}.tmp"
  raw = tmp + ".raw"
  eos = [tokenizer.eos_id]
  n_tokens = 0
  try:
    with open(raw, "wb") as f:
      for start in range(0, len(src), _ENCODE_CHUNK):
        texts = src.__getitems__(range(start, min(start + _ENCODE_CHUNK, len(src))))
        ids = tokenizer.encode_batch(texts)
        count = sum(len(x) for x in ids) + len(ids)
        flat = np.fromiter((t for x in ids for t in (*x, *eos)), dtype=np.int32, count=count)
        f.write(flat.tobytes())
        n_tokens += count
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.int32, shape=(n_tokens,))
    if n_tokens:
      out[:] = np.memmap(raw, dtype=np.int32, mode="r", shape=(n_tokens,))
    out.flush()
    del out
    os.replace(tmp, path)
  finally:
    for p in (raw, tmp):
      if os.path.exists(p):
        os.remove(p)


def token_stream(name: str, split: str, tokenizer, *, data_dir: str | None = None,
                 text_key: str = "text") -> np.ndarray:
  """int32[n_tokens]: every document of the split tokenized and followed by `tokenizer.eos_id`.

  Documents come in `text_source` order. The array is cached on disk under
  `<data_dir>/spec_jax_token_cache/` keyed by (dataset name/config/version, split, text_key,
  `tokenizer.cache_key`: vocabulary, EOS and template; document count), so only the first call
  tokenizes; later calls memory-map the file (read-only).
  """
  src = text_source(name, split, data_dir=data_dir, text_key=text_key)
  root = _resolve_data_dir(data_dir)
  path = _token_cache_path(src, root, split, text_key, tokenizer_lib.cache_key(tokenizer))
  if not os.path.exists(path):
    logging.info("Tokenizing %s with %s into %s.", src, tokenizer.fingerprint, path)
    _tokenize_to_file(src, tokenizer, path)
  return np.load(path, mmap_mode="r")


def _mix_seed(seed: int, salt: str) -> int:
  """A 32-bit seed from any int: grain shuffles with seed + epoch, so raw seeds s and s + 1 would
  share all but one epoch's order; hashing decorrelates neighbouring seeds."""
  return int.from_bytes(hashlib.sha256(f"{salt}:{int(seed)}".encode()).digest()[:4], "little")


class _PackWindows:
  """Window indices int[B] -> the packed LM batch; a class (not a lambda) so it pickles for grain
  worker processes."""

  def __init__(self, tokens: np.ndarray, seq_len: int):
    self.tokens = tokens
    self.seq_len = seq_len

  def __getstate__(self):
    # A worker process reopens the memory-mapped cache instead of receiving a pickled copy of a
    # stream that may hold billions of tokens.
    if isinstance(self.tokens, np.memmap) and self.tokens.filename:
      return {"path": self.tokens.filename, "seq_len": self.seq_len}
    return self.__dict__

  def __setstate__(self, state):
    if "path" in state:
      state = {"tokens": np.load(state["path"], mmap_mode="r"), "seq_len": state["seq_len"]}
    self.__dict__.update(state)

  def __call__(self, window_ids: np.ndarray) -> dict[str, np.ndarray]:
    width = self.seq_len + 1
    # windows_BxT1[b] = tokens[w_b * (T+1) : (w_b + 1) * (T+1)], gathered in one fancy index.
    windows_BxT1 = np.asarray(
        self.tokens[np.asarray(window_ids)[:, None] * width + np.arange(width)], dtype=np.int32)
    return {
        "inputs": windows_BxT1[:, :-1],
        "targets": windows_BxT1[:, 1:],
        "weights": np.ones(windows_BxT1[:, 1:].shape, np.float32),
    }


def _check_positive(**kwargs) -> None:
  for key, value in kwargs.items():
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"{key} must be an integer >= 1, got {value!r}.")


def lm_batches(name: str, split: str, tokenizer, *, seq_len: int, batch_size: int, seed: int,
               data_dir: str | None = None, text_key: str = "text",
               num_epochs: int | None = None) -> grain.MapDataset:
  """Packed language-modelling batches, addressable by step.

  The split's token stream is cut into non-overlapping windows of T+1 tokens (documents are
  packed across window boundaries, separated by EOS; the tail shorter than T+1 is dropped). Each
  epoch visits the windows in a fresh order drawn from `seed` and the epoch number and keeps
  floor(windows / B) full batches. `ds[s]` is

    {"inputs": int32[B, T], "targets": int32[B, T], "weights": float32[B, T]}

  with targets[b, t] = inputs[b, t + 1] within the window (targets[b, T-1] is the window's last
  token) and weights all 1.0 (kept for masked losses). `len(ds)` is num_epochs * batches per
  epoch, or sys.maxsize when num_epochs is None (repeat forever).
  """
  _check_positive(seq_len=seq_len, batch_size=batch_size)
  if num_epochs is not None:
    _check_positive(num_epochs=num_epochs)
  tokens = token_stream(name, split, tokenizer, data_dir=data_dir, text_key=text_key)
  n_windows = len(tokens) // (seq_len + 1)
  if n_windows < batch_size:
    raise ValueError(
        f"Split {split!r} of {name!r} has {len(tokens)} tokens ({tokenizer.fingerprint}), which "
        f"make {n_windows} windows of seq_len + 1 = {seq_len + 1} tokens; one batch needs "
        f"batch_size = {batch_size} windows ({batch_size * (seq_len + 1)} tokens). Use a "
        "smaller seq_len or batch_size, or a larger split.")
  ds = grain.MapDataset.range(n_windows).shuffle(seed=_mix_seed(seed, "lm_batches"))
  # Batch before repeat: grain batches each epoch separately (no batch straddles two epochs), and
  # repeat passes the epoch on to shuffle, which reseeds with seed + epoch.
  ds = ds.batch(batch_size, drop_remainder=True).map(_PackWindows(tokens, seq_len))
  return ds.repeat(num_epochs)


# How many tokens `_prefix_text` may back off: a cut inside a character leaves at most 3 stray
# bytes, and a BPE re-merge at the end touches a few tokens. A tokenizer that normalizes text
# (decode(encode(x)) != x) fails every try, and its documents are skipped.
_MAX_PROMPT_BACKOFF = 16


def _prefix_text(doc: str, ids: Sequence[int], k: int, tokenizer) -> str | None:
  """The longest decode(ids[:j]), j <= k, that is a prefix of `doc` and re-encodes to <= k
  tokens. A cut inside a multi-byte character decodes to U+FFFD (not a prefix), and BPE may
  re-merge the end of a prefix differently, hence the check instead of trusting ids[:k]."""
  for j in range(k, max(0, k - _MAX_PROMPT_BACKOFF), -1):
    text = tokenizer.decode(ids[:j])
    if doc.startswith(text) and len(tokenizer.encode(text)) <= k:
      return text
  return None


def load_prompts(name: str, split: str, tokenizer, *, num: int, prompt_tokens: int, seed: int,
                 data_dir: str | None = None, text_key: str = "text",
                 allow_fewer: bool = False) -> list[str]:
  """`num` prompts: prefixes of ~`prompt_tokens` tokens of distinct documents of the split.

  Documents are visited in an order drawn from `seed` (grain's index shuffle: O(1) memory even
  for millions of documents); those with fewer than `prompt_tokens` tokens are skipped. Each
  prompt is an exact prefix of its document, cut at a token boundary, and
  `len(tokenizer.encode(prompt)) <= prompt_tokens`. A split with fewer such documents is an
  error, or with `allow_fewer` gives them all (in the same order: a prefix of any larger count).
  """
  _check_positive(num=num, prompt_tokens=prompt_tokens)
  src = text_source(name, split, data_dir=data_dir, text_key=text_key)
  order = grain.MapDataset.range(len(src)).shuffle(seed=_mix_seed(seed, "load_prompts"))
  prompts: list[str] = []
  chunk = max(2 * num, 64)
  for start in range(0, len(src), chunk):
    indices = [order[i] for i in range(start, min(start + chunk, len(src)))]
    docs = src.__getitems__(indices)
    for doc, ids in zip(docs, tokenizer.encode_batch(docs)):
      if len(ids) < prompt_tokens:
        continue
      text = _prefix_text(doc, ids, prompt_tokens, tokenizer)
      if text:
        prompts.append(text)
        if len(prompts) == num:
          return prompts
  if allow_fewer:
    return prompts
  raise ValueError(
      f"Split {split!r} of {name!r} has only {len(prompts)} documents with at least "
      f"prompt_tokens={prompt_tokens} tokens ({len(src)} documents in all); asked for num={num}. "
      "(A prompt must also decode to an exact prefix of its document.)")
