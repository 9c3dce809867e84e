"""Tests for the local TFDS corpora and the input pipeline (spec_jax/data/{corpora,pipeline}.py).

Both corpora are built once per session into a temporary data dir (~3 s together); token streams
use the byte tokenizer except where BPE behaviour is the point.
"""

import collections
import os
import random
import sys
import tempfile
import unicodedata

import numpy as np
import pytest
import tensorflow_datasets as tfds

from spec_jax.data import corpora
from spec_jax.data import pipeline
from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.data.tokenizer import ByteTokenizer

SPLITS = ("train", "validation", "test")
SHAKES = corpora.SHAKESPEARE
STDLIB = corpora.PYSTDLIB


@pytest.fixture(scope="session")
def root(tmp_path_factory):
  """A data dir with both corpora built (first use builds them)."""
  path = str(tmp_path_factory.mktemp("tfds"))
  for name in corpora.NAMES:
    pipeline.text_source(name, "train", data_dir=path)
  return path


def _docs(name, split, root, text_key="text"):
  return list(pipeline.text_source(name, split, data_dir=root, text_key=text_key))


class CountingTokenizer(ByteTokenizer):
  """Byte tokenizer that counts encode_batch calls (own fingerprint: its own token cache)."""

  def __init__(self, fingerprint="bytes-257-counting"):
    self.fingerprint = fingerprint
    self.calls = 0

  def encode_batch(self, texts):
    self.calls += 1
    return super().encode_batch(texts)


# ---------------------------------------------------------------------------------------------
# Corpora.


def test_data_dir_resolution(monkeypatch, tmp_path):
  monkeypatch.setenv("SPEC_JAX_DATA_DIR", str(tmp_path / "env"))
  assert pipeline.data_dir() == str(tmp_path / "env")
  assert pipeline.data_dir(str(tmp_path / "arg")) == str(tmp_path / "arg")
  monkeypatch.delenv("SPEC_JAX_DATA_DIR")
  assert pipeline.data_dir() == os.path.expanduser("~/.cache/spec_jax/tensorflow_datasets")


def test_heldout_blocks_are_contiguous_tails():
  # 100 passages: 90 train, then 5 validation, then 5 test, in text order.
  assert [corpora._split_of_index(i, 100) for i in range(100)] == (
      ["train"] * 90 + ["validation"] * 5 + ["test"] * 5)
  # Short works (the poems) go wholly to train.
  assert {corpora._split_of_index(i, 19) for i in range(19)} == {"train"}


def test_passages_cut_at_blank_lines():
  speech = ["SPEAKER.", "line one", "line two", ""]
  text = "\n\n" + "\n".join(speech * 30) + "\n\n"
  ps = corpora.passages(text)
  assert len(ps) > 1
  for p in ps:
    lines = p.split("\n")
    assert lines[0] == "SPEAKER." and lines[-1] == "line two"  # whole speeches only
    assert corpora.PASSAGE_LINES <= len(lines) <= corpora.PASSAGE_MAX_LINES or p is ps[-1]
  assert "\n\n".join(ps) == "\n".join(speech * 30).strip()


def test_shakespeare_splits(root):
  by_split = {s: pipeline.text_source(SHAKES, s, data_dir=root) for s in SPLITS}
  records = {s: set(zip(_docs(SHAKES, s, root, "source"), _docs(SHAKES, s, root)))
             for s in SPLITS}
  for s in SPLITS:
    assert len(by_split[s]) > 0
  # No passage in two splits.
  assert not records["train"] & records["validation"]
  assert not records["train"] & records["test"]
  assert not records["validation"] & records["test"]
  # Modern spelling only: the Folio duplicates (and metadata.txt) are not read.
  sources = {src for s in SPLITS for src, _ in records[s]}
  assert all(src.endswith("_gut") for src in sources)
  assert len(sources) == len(corpora.shakespeare_files())
  # The built dataset holds exactly what the (deterministic) generator yields.
  expected = corpora.shakespeare_examples()
  assert expected == corpora.shakespeare_examples()
  for s in SPLITS:
    assert records[s] == {(e["source"], e["text"]) for _, e in expected[s]}


def test_pystdlib_splits(root):
  sources = {s: _docs(STDLIB, s, root, "source") for s in SPLITS}
  for s in SPLITS:
    assert sources[s], s
    for path in sources[s]:
      assert corpora.split_of_path(path) == s
      parts = path.split("/")
      assert not {"site-packages", "test", "tests", "idlelib"} & set(parts), path
  # Whole files (all of their chunks) stay in one split.
  sets = {s: set(v) for s, v in sources.items()}
  assert not sets["train"] & sets["validation"]
  assert not sets["train"] & sets["test"]
  assert not sets["validation"] & sets["test"]
  assert "collections/__init__.py" in sets["train"] | sets["validation"] | sets["test"]
  # The stdlib differs across versions: the builder says which one it read.
  info = tfds.builder(STDLIB, data_dir=root).info
  assert f"{sys.version_info.major}.{sys.version_info.minor}." in info.description
  assert info.config_name == f"py{sys.version_info.major}{sys.version_info.minor}"
  # Examples respect the size cap; big files are chunked (reassembly: test_source_chunks_roundtrip).
  docs = _docs(STDLIB, "train", root)
  assert max(len(d) for d in docs) <= corpora.MAX_SOURCE_CHARS
  counts = collections.Counter(sources["train"])
  assert counts.most_common(1)[0][1] > 1  # some file was chunked


def test_source_chunks_roundtrip():
  text = ("import os\n\n\n" + "".join(f"def f{i}():\n  return {i}\n\n\n" for i in range(400))
          + "x = '" + "a" * 3000 + "'\n")
  chunks = corpora.source_chunks(text, max_chars=1000)
  assert "".join(chunks) == text
  assert all(len(c) <= 1000 for c in chunks)
  # Cuts fall at top-level statements where possible.
  assert all(c.startswith(("import", "def ", "x = ", "a")) for c in chunks)
  assert corpora.source_chunks("short", max_chars=1000) == ["short"]


# ---------------------------------------------------------------------------------------------
# Token streams.


def test_token_stream_content_and_cache(root):
  tok = CountingTokenizer()
  stream = pipeline.token_stream(SHAKES, "validation", tok, data_dir=root)
  assert stream.dtype == np.int32 and stream.ndim == 1
  expected = [t for d in _docs(SHAKES, "validation", root) for t in (*tok.encode(d), tok.eos_id)]
  np.testing.assert_array_equal(stream, expected)
  calls = tok.calls
  assert calls > 0
  again = pipeline.token_stream(SHAKES, "validation", tok, data_dir=root)
  assert tok.calls == calls  # served from the .npy cache, not re-tokenized
  np.testing.assert_array_equal(again, stream)
  # Another tokenizer (fingerprint) gets its own cache.
  other = CountingTokenizer("bytes-257-other")
  pipeline.token_stream(SHAKES, "validation", other, data_dir=root)
  assert other.calls > 0
  # So does one of the same vocabulary that ends documents with another EOS (an HF directory
  # whose eos_token differs), and its stream carries that EOS.
  eos_255 = CountingTokenizer()
  eos_255.eos_id = 255
  again = pipeline.token_stream(SHAKES, "validation", eos_255, data_dir=root)
  assert eos_255.calls > 0 and (again == 255).sum() > (stream == 255).sum()
  # A chat template keys chat rows' caches too (`tokenizer.cache_key`).
  templated = CountingTokenizer()
  templated.chat_template = "{{ messages }}"
  assert len({tokenizer_lib.cache_key(t) for t in (tok, eos_255, templated)}) == 3


# ---------------------------------------------------------------------------------------------
# LM batches.


def _batches(root, seed=0, **kw):
  kw = {"seq_len": 127, "batch_size": 4, **kw}
  return pipeline.lm_batches(SHAKES, "validation", ByteTokenizer(), seed=seed, data_dir=root, **kw)


def test_lm_batches_shapes_and_shift(root):
  ds = _batches(root, seq_len=31, batch_size=3)
  stream = np.asarray(pipeline.token_stream(SHAKES, "validation", ByteTokenizer(), data_dir=root))
  windows = stream[: len(stream) // 32 * 32].reshape(-1, 32)
  by_content = {w.tobytes(): i for i, w in enumerate(windows)}
  for s in (0, 5):
    b = ds[s]
    assert set(b) == {"inputs", "targets", "weights"}
    for k, dtype in (("inputs", np.int32), ("targets", np.int32), ("weights", np.float32)):
      assert b[k].shape == (3, 31) and b[k].dtype == dtype, k
    np.testing.assert_array_equal(b["weights"], 1.0)
    np.testing.assert_array_equal(b["targets"][:, :-1], b["inputs"][:, 1:])
    for row in range(3):  # each row is one aligned window of T+1 stream tokens
      window = np.concatenate([b["inputs"][row], b["targets"][row, -1:]])
      assert window.tobytes() in by_content


def test_lm_batches_deterministic_and_resumable(root):
  a, b = _batches(root, seed=3), _batches(root, seed=3)
  assert len(a) == sys.maxsize  # num_epochs=None repeats forever
  for s in (0, 1, 17, 10_000):  # a fresh pipeline (a resumed run) reads the same batch s
    np.testing.assert_array_equal(a[s]["inputs"], b[s]["inputs"])
  c = _batches(root, seed=4)
  assert not np.array_equal(a[0]["inputs"], c[0]["inputs"])


def test_lm_batches_epochs_reshuffled(root):
  ds = _batches(root, seq_len=255, batch_size=8, num_epochs=2)
  n_tokens = len(pipeline.token_stream(SHAKES, "validation", ByteTokenizer(), data_dir=root))
  per_epoch = n_tokens // 256 // 8
  assert len(ds) == 2 * per_epoch
  epochs = [[row.tobytes() for s in range(e * per_epoch, (e + 1) * per_epoch)
             for row in ds[s]["inputs"]] for e in range(2)]
  for rows in epochs:
    assert len(set(rows)) == len(rows)  # no window twice within an epoch
  assert epochs[0] != epochs[1]  # a new order each epoch
  # Same windows (all but the dropped remainder) in both epochs.
  assert len(set(epochs[0]) & set(epochs[1])) >= len(epochs[0]) - 8


# ---------------------------------------------------------------------------------------------
# Prompts.


def test_load_prompts_bytes(root):
  kw = dict(num=6, prompt_tokens=80, data_dir=root)
  tok = ByteTokenizer()
  p1 = pipeline.load_prompts(STDLIB, "test", tok, seed=1, **kw)
  assert p1 == pipeline.load_prompts(STDLIB, "test", tok, seed=1, **kw)
  assert p1 != pipeline.load_prompts(STDLIB, "test", tok, seed=2, **kw)
  assert len(p1) == 6
  docs = _docs(STDLIB, "test", root)
  for p in p1:
    assert len(tok.encode(p)) == 80
    assert any(d.startswith(p) for d in docs)


def test_prompt_cut_inside_a_multibyte_character():
  tok = ByteTokenizer()
  doc = "héllo"  # 'é' is two bytes: a 2-token prefix would end mid-character
  assert pipeline._prefix_text(doc, tok.encode(doc), 2, tok) == "h"
  assert pipeline._prefix_text(doc, tok.encode(doc), 3, tok) == "hé"


def test_load_prompts_smollm2(root):
  from spec_jax.data.tokenizer import smollm2_tokenizer
  tok = smollm2_tokenizer()
  prompts = pipeline.load_prompts(SHAKES, "test", tok, num=8, prompt_tokens=48, seed=0,
                                  data_dir=root)
  docs = _docs(SHAKES, "test", root)
  assert len(set(prompts)) == 8
  for p in prompts:
    assert 40 <= len(tok.encode(p)) <= 48
    assert any(d.startswith(p) for d in docs)


def test_load_prompts_skips_short_documents(root):
  # Test passages are at most 80 lines (~4 KB): none has 10k bytes.
  with pytest.raises(ValueError, match="prompt_tokens=10000"):
    pipeline.load_prompts(SHAKES, "test", ByteTokenizer(), num=1, prompt_tokens=10_000, seed=0,
                          data_dir=root)


# ---------------------------------------------------------------------------------------------
# Datasets other than ours, and errors.


class SpecJaxTestForeign(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Stands in for a user's TFDS dataset (lm1b, ...): not registered by spec_jax, so it can only
  be found through its prepared files."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
        {"sentence": tfds.features.Text(), "label": np.int64}))

  def _split_generators(self, dl_manager):
    return {"train": self._generate_examples(40), "test": self._generate_examples(5)}

  def _generate_examples(self, n):
    for i in range(n):
      yield i, {"sentence": f"Sentence number {i} of the stand-in corpus.", "label": i}


def test_prepared_foreign_dataset_by_name(tmp_path):
  SpecJaxTestForeign(data_dir=str(tmp_path), file_format="array_record").download_and_prepare(
      download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  name = "spec_jax_test_foreign"
  src = pipeline.text_source(name, "test", data_dir=str(tmp_path), text_key="sentence")
  assert sorted(src) == [f"Sentence number {i} of the stand-in corpus." for i in range(5)]
  ds = pipeline.lm_batches(name, "train", ByteTokenizer(), seq_len=16, batch_size=2, seed=0,
                           data_dir=str(tmp_path), text_key="sentence")
  assert ds[0]["inputs"].shape == (2, 16)
  with pytest.raises(ValueError, match=r"text_key='label'.*not a scalar text feature"):
    pipeline.text_source(name, "test", data_dir=str(tmp_path), text_key="label")


def test_errors(root, tmp_path):
  tok = ByteTokenizer()
  with pytest.raises(ValueError, match=r"Unknown dataset name 'no_such_corpus'.*"
                     r"spec_jax_shakespeare.*array_record"):
    pipeline.text_source("no_such_corpus", "train", data_dir=root)
  # A TFDS catalogue dataset that nobody prepared: say how, never download.
  with pytest.raises(FileNotFoundError, match=r"'lm1b' is not prepared.*tfds build lm1b"):
    pipeline.text_source("lm1b", "train", data_dir=str(tmp_path))
  with pytest.raises(ValueError, match=r"(?s)py2'.*configs \['py3\d+'\]"):
    pipeline.text_source(f"{STDLIB}/py2", "train", data_dir=root)
  with pytest.raises(ValueError, match=r"Unknown split 'dev'") as e:
    pipeline.text_source(SHAKES, "dev", data_dir=root)
  assert all(f"'{s}'" in str(e.value) for s in SPLITS)
  with pytest.raises(ValueError, match=r"text_key='content' is not a feature") as e:
    pipeline.text_source(SHAKES, "train", data_dir=root, text_key="content")
  assert "'text'" in str(e.value) and "'source'" in str(e.value)
  for field, kw in (("seq_len", dict(seq_len=0, batch_size=2)),
                    ("batch_size", dict(seq_len=8, batch_size=0))):
    with pytest.raises(ValueError, match=f"{field} must be an integer >= 1, got 0"):
      pipeline.lm_batches(SHAKES, "validation", tok, seed=0, data_dir=root, **kw)
  with pytest.raises(ValueError, match="num_epochs must be"):
    pipeline.lm_batches(SHAKES, "validation", tok, seq_len=8, batch_size=2, seed=0,
                        data_dir=root, num_epochs=0)
  n = len(pipeline.token_stream(SHAKES, "validation", tok, data_dir=root))
  with pytest.raises(ValueError, match=rf"has {n} tokens.*batch_size = 4"):
    pipeline.lm_batches(SHAKES, "validation", tok, seq_len=n // 4, batch_size=4, seed=0,
                        data_dir=root)


def test_a_builder_of_an_unprepared_dataset_leaves_no_temp_folder(monkeypatch, tmp_path):
  """TFDS's DatasetInfo.initialize_from_bucket makes a temp folder, then finds GCS off and leaves
  it behind empty; `pipeline._install_bucket_skip` skips the call while GCS is off. TFDS's own
  call, run here too, shows that the count sees such a folder."""
  temp = tmp_path / "temp"
  temp.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(temp))
  with pytest.raises(FileNotFoundError, match="'lm1b' is not prepared"):
    pipeline.check_dataset("lm1b", data_dir=str(tmp_path / "data"))
  builder = tfds.builder(SHAKES, data_dir=str(tmp_path / "data"), file_format="array_record")
  assert not builder.is_prepared()
  assert os.listdir(temp) == []
  tfds.core.dataset_info.DatasetInfo.initialize_from_bucket.__wrapped__(builder.info)
  assert [name.endswith("tfds") for name in os.listdir(temp)] == [True]


def test_portable_repr_is_reprs_text_with_unicode_3_2s_printable_characters():
  """The fingerprint's writing of a token: Python's repr wherever Unicode 3.2 and this interpreter
  agree on the characters (quotes, backslashes, controls, every plane), and an escape for a
  character assigned after 3.2 that this interpreter prints, so no Python's Unicode version
  changes it."""
  portable = tokenizer_lib._portable_repr  # noqa: SLF001
  rng = random.Random(0)
  checked = 0
  for _ in range(20_000):
    text = "".join(chr(rng.choice((rng.randrange(0x80), rng.randrange(0x80, 0x3000),
                                   rng.randrange(0x3000, 0x110000))))
                   for _ in range(rng.randrange(6)))
    if all(unicodedata.category(c) == unicodedata.ucd_3_2_0.category(c) for c in text):
      assert portable(text) == repr(text), ascii(text)
      checked += 1
  assert checked > 5_000
  for text in ("it's", 'say "hi"', "both ' and \"", "back\\slash", "\t\n\r\x00\x7f", "é\xa0\u2028"):
    assert portable(text) == repr(text)
  smiley = "\U0001f600"  # Unicode 6.1: printed by repr, escaped here
  assert repr(smiley) == f"'{smiley}'" and portable(smiley) == "'\\U0001f600'"
  # A vocabulary: each token so written (Python's repr for the tokens without such a character).
  items = [("a", 0), ("it's", 1), ("é", 2), (f"x{smiley}", 3), ("\u0120the", 4)]
  want = "[" + ", ".join(f"({portable(t)}, {i})" for t, i in items) + "]"
  assert tokenizer_lib._portable_list_repr(items) == want != repr(items)  # noqa: SLF001
  assert tokenizer_lib._portable_list_repr(items[:3]) == repr(items[:3])  # noqa: SLF001


def test_a_bad_gguf_tokenizer_names_its_path(tmp_path):
  from spec_jax.data import tokenizer as tokenizer_lib
  fake = tmp_path / "fake.gguf"
  fake.write_bytes(b"not a gguf")
  with pytest.raises(ValueError, match=r"tokenizer='.*fake.gguf' is not a readable GGUF file"):
    tokenizer_lib.get_tokenizer(str(fake))
  with pytest.raises(FileNotFoundError, match=r"tokenizer='.*missing.gguf': no such GGUF file"):
    tokenizer_lib.get_tokenizer(str(tmp_path / "missing.gguf"))
