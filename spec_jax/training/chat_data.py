"""Chat rows for drafter training: ShareGPT conversations as prompt + response rows.

Shapes: N rows of a split, B batch, P prompt tokens, O response tokens (data.prompt_tokens,
data.response_tokens), V vocabulary.

A row is one answered assistant turn of a `spec_jax_sharegpt` conversation
(`sharegpt.conversation`):
  prompt    the conversation before that turn in the tokenizer's chat template, ending with the
            assistant header (`tokenizer_lib.chat_text(..., add_generation_prompt=True)`), as
            the verifier is prompted at decoding time: l <= P tokens;
  response  the corpus's assistant turn as the template writes it (its text, then the template's
            end-of-turn text), cut after its first stop token (the end of turn, kept) or at O
            tokens: n <= O tokens. This is the `fixed` recipe; the `verifier` recipe keeps the
            prompt and replaces the response by the verifier's own generation from it
            (`distill_data.VerifierData`, generated once and cached).
Every answered turn whose prompt fits is a row, with the whole conversation before it as
context. A conversation's prompts only grow turn by turn, so the first prompt over P tokens ends
it: that turn and the conversation's later answered turns are skipped and counted (`too_long`).
A conversation with no answer (a single user turn) gives no row (`no_answer`). The counts are
logged and kept in `ChatExamples.counts`. Long texts are not tokenized whole: with M the longest
token's length in bytes, a prompt over P·M bytes has over P tokens (skipped untokenized), and a
response is tokenized from its first (O + 16)·M bytes, more than O + 16 tokens, so the cut moves
none of its first O tokens (BPE re-merges only around the cut).
A split's rows are built once per (dataset version, split, tokenizer, P, O) and cached beside
the token caches (`<data_dir>/spec_jax_token_cache/`): reading and tokenizing ShareGPT's train
split takes minutes on 2 CPU cores.

Layout: a row is int32[P+O] with the prompt at [0, l), the response at [l, l+n) and zeros after,
so a token's position is its index, as in corpus windows, and the verifier's hidden states over
the row (a feature drafter's features) are those of the real conversation; the causal mask keeps
the trailing zeros out of every earlier position. A batch of `windows` is
  {"seqs": int32[B, P+O], "prompt_lengths": int32[B], "num_new": int32[B]}
(num_new: the corpus response's n), which `distill_data` turns into training batches with
weights 1 exactly on the response's targets.

Order: batch s of `windows` is rows shuffled by (seed, epoch), a pure function of (seed, s) as
`pipeline.lm_batches` is, so a resumed run reads the batches an uninterrupted run would have.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import os
from typing import Sequence

from absl import logging
import grain
import numpy as np

from spec_jax.data import pipeline, sharegpt
from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.decoding import generate as generate_lib

NAME = sharegpt.NAME
# The rules above: part of the keys of the rows' cache and of the verifier-response cache.
VERSION = 1
_ROLES = ("user", "assistant")
_MARGIN = 16  # tokens past O that a response's byte cut keeps (see the module docstring)


def is_chat(name: str) -> bool:
  """Whether data.name names the chat dataset (rows of this module, not packed text windows)."""
  return name.split("/")[0].split(":")[0] == NAME


def check_config(data_cfg, generated: bool) -> None:
  """Before any work, for chat data: no data.blend (packed text windows are not chat rows), and
  with generated responses (`generated`: verifier or on-policy data) data.stop_at_eos, or the
  model would go on past its end of turn to write the next user turn."""
  if not is_chat(str(data_cfg.name)):
    return
  if data_cfg.get("blend", ()):
    raise ValueError(f"data.blend={tuple(data_cfg.blend)!r} mixes packed text windows into the "
                     f"chat rows of data.name={data_cfg.name!r}. Fix: data.blend=().")
  if generated and not data_cfg.get("stop_at_eos", True):
    raise ValueError(f"data.stop_at_eos=False with chat data and data.source="
                     f"{data_cfg.source!r}: generated responses would run past the end of the "
                     "turn. Fix: data.stop_at_eos=True.")


# ---------------------------------------------------------------------------------------------
# Rendering.


class _Renderer:
  """`tokenizer_lib.chat_text` at one template rendering per conversation shape.

  A Jinja chat template is compiled at every `chat_text` call (~10 ms on 2 CPU cores): minutes
  for a split's tens of thousands of prompts. The templates used here (ChatML, SmolLM2's,
  Gemma 3's) write each message's content once, verbatim (Gemma's trims it; `sharegpt.normalize`
  has already stripped every turn), between pieces that depend only on the roles and the
  generation header. So each shape (roles, add_generation_prompt) is rendered once with
  placeholder contents, and a conversation is its pieces around its contents. The first
  conversation of each shape is also rendered with `chat_text`; a shape whose pieces do not
  reproduce it (a template that transforms contents) is always rendered with `chat_text`.
  """

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self._pieces: dict[tuple, list[str] | None] = {}

  def _split(self, roles: tuple[str, ...], gen: bool) -> list[str] | None:
    marks = [f"\x00{k}\x00" for k in range(len(roles))]
    text = tokenizer_lib.chat_text(
        self.tokenizer, [{"role": r, "content": m} for r, m in zip(roles, marks)], gen)
    pieces = []
    for mark in marks:
      head, found, text = text.partition(mark)
      if not found:
        return None
      pieces.append(head)
    pieces.append(text)
    return None if any("\x00" in p for p in pieces) else pieces

  def __call__(self, messages: Sequence[dict[str, str]], gen: bool) -> str:
    key = (tuple(m["role"] for m in messages), gen)
    if key not in self._pieces:
      pieces = self._split(*key)
      real = tokenizer_lib.chat_text(self.tokenizer, messages, gen)
      self._pieces[key] = pieces if pieces and self._join(pieces, messages) == real else None
      return real
    pieces = self._pieces[key]
    if pieces is None:
      return tokenizer_lib.chat_text(self.tokenizer, messages, gen)
    return self._join(pieces, messages)

  @staticmethod
  def _join(pieces: list[str], messages) -> str:
    out = [pieces[0]]
    for m, piece in zip(messages, pieces[1:]):
      out += [m["content"], piece]
    return "".join(out)

  def end_of_turn(self) -> str:
    """The text the template writes after an assistant turn's content (ChatML: '<|im_end|>\\n')."""
    text = tokenizer_lib.chat_text(self.tokenizer, [{"role": "user", "content": "?"},
                                                    {"role": "assistant", "content": "\x00"}],
                                   False)
    return text.rpartition("\x00")[2]


@functools.lru_cache(maxsize=8)
def _max_token_bytes(tokenizer) -> int:
  """M: the most UTF-8 bytes any one token decodes to (81 for SmolLM2: a run of spaces), so a
  text of b bytes has at least b / M tokens."""
  return max(len(tokenizer.decode([i]).encode("utf-8")) for i in range(tokenizer.vocab_size))


def _head(text: str, max_bytes: int) -> str:
  """The longest prefix of `text` of at most max_bytes UTF-8 bytes."""
  return text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")


def _encode(tokenizer, texts: list[str], *, bos: bool) -> list[list[int]]:
  """Token ids of each text; bos=False drops the BOS a tokenizer with add_bos (Gemma) prepends:
  a response continues its prompt."""
  ids = tokenizer.encode_batch(texts) if texts else []
  if not bos and getattr(tokenizer, "add_bos", False):
    ids = [x[1:] for x in ids]
  return ids


# ---------------------------------------------------------------------------------------------
# Rows of a split.


@dataclasses.dataclass(frozen=True)
class ChatExamples:
  """Every row of a split, in (conversation, turn) order.

  seqs            int32[N, P+O]: prompt at [0, l), the corpus's response at [l, l+n), 0 after
  prompt_lengths  int32[N]: l
  num_new         int32[N]: n
  source          (conversation id, assistant turn index) of each row
  counts          conversations, rows, too_long, no_answer, cut_responses (longer than O)
  """
  seqs: np.ndarray
  prompt_lengths: np.ndarray
  num_new: np.ndarray
  source: tuple[tuple[str, int], ...]
  counts: dict[str, int]


def build(conversations: Sequence[tuple[str, Sequence[dict[str, str]]]], tokenizer, *,
          prompt_tokens: int, response_tokens: int) -> ChatExamples:
  """The rows of (id, messages) conversations (messages alternate user, assistant, ... from a
  user turn, as `sharegpt.conversation` gives them). Turn by turn over all conversations at
  once, so each round is one batched tokenizer call."""
  p, o = prompt_tokens, response_tokens
  render = _Renderer(tokenizer)
  end = render.end_of_turn()
  stops = set(int(i) for i in tokenizer.stop_ids)
  counts = collections.Counter(conversations=len(conversations))
  rows: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
  live = []  # (conversation, index of the assistant turn whose prompt is tried next)
  for c, (_, messages) in enumerate(conversations):
    if len(messages) > 1:
      live.append((c, 1))
    else:
      counts["no_answer"] += 1
  m = _max_token_bytes(tokenizer)
  while live:
    texts = [render(conversations[c][1][:i], True) for c, i in live]
    # Over P·M bytes means over P tokens: not worth tokenizing (some prompts are whole books).
    short = [k for k, t in enumerate(texts) if len(t.encode("utf-8")) <= p * m]
    ids = dict(zip(short, _encode(tokenizer, [texts[k] for k in short], bos=True)))
    fit = []
    for k, (c, i) in enumerate(live):
      if k in ids and len(ids[k]) <= p:
        fit.append((c, i, ids[k]))
      else:  # this answered turn and every later one (their prompts are longer still)
        counts["too_long"] += (len(conversations[c][1]) - i + 1) // 2
    responses = _encode(tokenizer, [_head(conversations[c][1][i]["content"] + end,
                                          (o + _MARGIN) * m) for c, i, _ in fit], bos=False)
    for (c, i, ids_), response in zip(fit, responses):
      stop = next((k for k, t in enumerate(response) if t in stops), len(response))
      response = response[:stop + 1]
      counts["cut_responses"] += len(response) > o
      rows[(c, i)] = ids_, response[:o]
    live = [(c, i + 2) for c, i, _ in fit if i + 2 < len(conversations[c][1])]
  keys = sorted(rows)
  seqs = np.zeros((len(keys), p + o), np.int32)
  lengths = np.zeros((len(keys),), np.int32)
  num_new = np.zeros((len(keys),), np.int32)
  for k, key in enumerate(keys):
    prompt, response = rows[key]
    seqs[k, :len(prompt)] = prompt
    seqs[k, len(prompt):len(prompt) + len(response)] = response
    lengths[k], num_new[k] = len(prompt), len(response)
  counts["rows"] = len(keys)
  return ChatExamples(seqs, lengths, num_new,
                      tuple((conversations[c][0], i) for c, i in keys), dict(counts))


_EXAMPLES: dict[tuple, ChatExamples] = {}


def _cache_path(root: str, src, split: str, tokenizer, p: int, o: int) -> str:
  full_name = src.dataset_info.full_name  # name/version: a rebuilt dataset gets new files
  key = repr((VERSION, full_name, split, len(src), tokenizer_lib.cache_key(tokenizer), p, o))
  digest = hashlib.sha256(key.encode()).hexdigest()[:12]
  return os.path.join(root, "spec_jax_token_cache", full_name, f"chat-{split}-{p}-{o}-{digest}.npz")


def _save(path: str, ex: ChatExamples) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f"{path}.{os.getpid()}.tmp.npz"  # atomic: a killed run leaves no truncated cache
  np.savez(tmp, seqs=ex.seqs, prompt_lengths=ex.prompt_lengths, num_new=ex.num_new,
           ids=np.asarray([i for i, _ in ex.source], str),
           turns=np.asarray([t for _, t in ex.source], np.int32), counts=json.dumps(ex.counts))
  os.replace(tmp, path)


def _load(path: str) -> ChatExamples:
  with np.load(path) as f:
    return ChatExamples(f["seqs"], f["prompt_lengths"], f["num_new"],
                        tuple(zip(f["ids"].tolist(), f["turns"].tolist())),
                        json.loads(str(f["counts"])))


def examples(name: str, split: str, tokenizer, *, prompt_tokens: int, response_tokens: int,
             data_dir: str | None = None) -> ChatExamples:
  """The rows of a split of the chat dataset: from the process's memory (a run reads its eval
  split twice), else the disk cache, else built and cached."""
  root = pipeline.data_dir(data_dir)
  key = (name, split, tokenizer_lib.cache_key(tokenizer), prompt_tokens, response_tokens, root)
  if key in _EXAMPLES:
    return _EXAMPLES[key]
  src = pipeline.example_source(name, split, data_dir=root)
  path = _cache_path(root, src, split, tokenizer, prompt_tokens, response_tokens)
  if os.path.exists(path):
    out = _load(path)
  else:
    conversations = [(cid, messages) for cid, _, messages in map(sharegpt.conversation, src)]
    for cid, messages in conversations:
      roles = [m["role"] for m in messages]
      if roles != [_ROLES[k % 2] for k in range(len(roles))]:
        raise ValueError(f"{name} {split}: conversation {cid!r} has roles {roles}, not user, "
                         "assistant, ... from a user turn. Fix: rebuild the dataset "
                         f"(delete {root}/{NAME}).")
    out = build(conversations, tokenizer, prompt_tokens=prompt_tokens,
                response_tokens=response_tokens)
    _save(path, out)
  c = out.counts
  logging.info(
      "%s %s: %d rows from %d conversations; %d answered turns skipped with a prompt over "
      "data.prompt_tokens=%d tokens, %d conversations without an answer, %d responses cut at "
      "data.response_tokens=%d.", name, split, c["rows"], c["conversations"],
      c.get("too_long", 0), prompt_tokens, c.get("no_answer", 0), c.get("cut_responses", 0),
      response_tokens)
  _EXAMPLES[key] = out
  return out


class _Gather:
  """Row indices int[B] -> a batch of rows (a class, not a lambda, so grain can pickle it)."""

  def __init__(self, ex: ChatExamples):
    self.ex = ex

  def __call__(self, rows: np.ndarray) -> dict[str, np.ndarray]:
    rows = np.asarray(rows)
    return {"seqs": self.ex.seqs[rows], "prompt_lengths": self.ex.prompt_lengths[rows],
            "num_new": self.ex.num_new[rows]}


def _seed(seed: int) -> int:
  """A 32-bit shuffle seed; hashed so that seeds s and s + 1 (grain adds the epoch) decorrelate."""
  return int.from_bytes(hashlib.sha256(f"chat_rows:{int(seed)}".encode()).digest()[:4], "little")


def windows(name: str, split: str, tokenizer, *, prompt_tokens: int, response_tokens: int,
            batch_size: int, seed: int, data_dir: str | None = None,
            num_epochs: int | None = None) -> grain.MapDataset:
  """Index-addressable batches of rows (module docstring): each epoch a fresh order drawn from
  (seed, epoch), floor(N / B) full batches; len = num_epochs × that (None: forever). ValueError
  naming data.prompt_tokens when fewer than B rows fit."""
  ex = examples(name, split, tokenizer, prompt_tokens=prompt_tokens,
                response_tokens=response_tokens, data_dir=data_dir)
  n = len(ex.prompt_lengths)
  if n < batch_size:
    c = ex.counts
    raise ValueError(
        f"data.prompt_tokens={prompt_tokens}: only {n} answered turns of {name} {split} have a "
        f"prompt that fits ({c.get('too_long', 0)} do not), fewer than one batch of "
        f"{batch_size}. Fix: a larger data.prompt_tokens, or a smaller batch.")
  ds = grain.MapDataset.range(n).shuffle(seed=_seed(seed))
  return ds.batch(batch_size, drop_remainder=True).map(_Gather(ex)).repeat(num_epochs)


def token_counts(name: str, split: str, tokenizer, *, prompt_tokens: int,
                 response_tokens: int, data_dir: str | None = None) -> np.ndarray:
  """float64[V]: how often each token occurs in the split's rows (prompts and the corpus's
  responses): what a reduced vocabulary (`drafter.size=...:vocab=N`) keeps the top of."""
  ex = examples(name, split, tokenizer, prompt_tokens=prompt_tokens,
                response_tokens=response_tokens, data_dir=data_dir)
  valid = np.arange(ex.seqs.shape[1])[None] < (ex.prompt_lengths + ex.num_new)[:, None]
  return np.bincount(ex.seqs[valid], minlength=tokenizer.vocab_size).astype(np.float64)


# ---------------------------------------------------------------------------------------------
# Batches of windows, corpus or chat (what `distill_data` reads).


def window_rows(window, prompt_tokens: int, response_tokens: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(seqs int32[B, P+O], num_new int32[B], prompt_lengths int32[B]) of a window batch, in
  `distill_data.make_batch`'s order: corpus windows (`distill_data.windows`, an array) are
  whole rows of P prompt and O response tokens; chat rows carry their own lengths."""
  if isinstance(window, dict):
    return tuple(np.asarray(window[k], np.int32) for k in ("seqs", "num_new", "prompt_lengths"))
  seqs = np.asarray(window, np.int32)
  return (seqs, np.full((len(seqs),), response_tokens, np.int32),
          np.full((len(seqs),), prompt_tokens, np.int32))


def prompts_of(windows: list, rows: int, prompt_tokens: int):
  """The prompts of the first `rows` rows of each window batch, stacked: int32[R, P] for corpus
  windows, right-padded `generate.Prompts` (zeros past each length) for chat rows."""
  if not isinstance(windows[0], dict):
    return np.concatenate([np.asarray(w)[:rows, :prompt_tokens] for w in windows])
  tokens, lengths = (np.concatenate([np.asarray(w[k])[:rows] for w in windows])
                     for k in ("seqs", "prompt_lengths"))
  tokens = np.where(np.arange(prompt_tokens) < lengths[:, None], tokens[:, :prompt_tokens], 0)
  return generate_lib.Prompts(tokens.astype(np.int32), lengths.astype(np.int32))
