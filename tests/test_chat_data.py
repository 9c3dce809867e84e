"""Chat rows (spec_jax/training/chat_data.py): ShareGPT conversations as prompt + response rows
for distill and train_bpd, in both recipes (the corpus's responses, the verifier's), on a small
synthetic dataset in ShareGPT's format, the byte tokenizer and test-tiny models."""

import dataclasses
import json
import pathlib

import numpy as np
import pytest

from configs import distill as distill_config
from configs import train_bpd as train_bpd_config
from spec_jax import loading, testing
from spec_jax.data import pipeline, sharegpt
from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.data.tokenizer import ByteTokenizer
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.models import hf_export, llama
from spec_jax.programs import distill as distill_program
from spec_jax.programs import train_bpd as train_bpd_program
from spec_jax.training import chat_data, distill_data, metrics as metrics_lib

P, O = 320, 40  # the chat smoke's prompt and response tokens (bytes)
TOPICS = "apple river stone cloud garden window paper music light forest".split()


def _conv(cid, *turns):
  return {"id": cid, "conversations": [{"from": "human" if k % 2 == 0 else "gpt", "value": t}
                                       for k, t in enumerate(turns)]}


def _ids(prefix: str, split: str, count: int) -> list[str]:
  """The first `count` ids prefix0_0, prefix1_0, ... that `sharegpt.split_of_id` puts in split."""
  out, k = [], 0
  while len(out) < count:
    if sharegpt.split_of_id(f"{prefix}{k}_0") == split:
      out.append(f"{prefix}{k}_0")
    k += 1
  return out


def _records() -> list[dict]:
  """Conversations of one or two exchanges (answers of 1-3 sentences: some longer than O), one
  whose first prompt is longer than P, and one without an answer, all in English."""
  records = []
  for split, count in (("train", 16), ("validation", 8), ("test", 2)):
    for k, cid in enumerate(_ids(f"chat{split[0]}", split, count)):
      topic = TOPICS[k % len(TOPICS)]
      answer = " ".join([f"the {topic} is for you {k}."] * (1 + k % 3))
      turns = [f"what is the {topic} for, {split} question {k}?", answer]
      if k % 2 == 0:
        turns += [f"and then {k}?", f"then the {topic} again."]
      records.append(_conv(cid, *turns))
  long_id, lonely_id = _ids("long", "train", 1)[0], _ids("lonely", "train", 1)[0]
  records.append(_conv(long_id, "please tell me about " + "the long river and " * 12, "no."))
  records.append(_conv(lonely_id, "is there anybody out there to answer this?"))
  return records


@pytest.fixture(scope="module")
def chat_dir(data_dir, tmp_path_factory):
  """The module's data dir (Shakespeare prepared) with the fixture's ShareGPT built into it."""
  path = tmp_path_factory.mktemp("sharegpt") / "sharegpt.json"
  path.write_text(json.dumps(_records()), encoding="utf-8")
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(sharegpt, "_source_json", lambda: path)
    for split in sharegpt.SPLITS:
      pipeline.example_source(sharegpt.NAME, split, data_dir=data_dir)
  return data_dir


def _messages(root, split):
  return {cid: m for cid, _, m in map(sharegpt.conversation,
                                      pipeline.example_source(sharegpt.NAME, split,
                                                              data_dir=root))}


# ---------------------------------------------------------------------------------------------
# Rows.


def _expected(conversations, tok, prompt_tokens):
  """(rows {(id, turn)}, skipped answered turns): every answered turn whose prompt, and every
  earlier one of its conversation, fits prompt_tokens, by rendering each with chat_text."""
  rows, skipped = set(), 0
  for cid, messages in conversations.items():
    fits = True
    for i in range(1, len(messages), 2):
      fits = fits and len(tok.encode(tokenizer_lib.chat_text(tok, messages[:i]))) <= prompt_tokens
      if fits:
        rows.add((cid, i))
      else:
        skipped += 1
  return rows, skipped


def test_rows_hold_the_rendered_prompt_then_the_corpus_response(chat_dir):
  tok = ByteTokenizer()
  ex = chat_data.examples(sharegpt.NAME, "train", tok, prompt_tokens=P, response_tokens=O,
                          data_dir=chat_dir)
  conversations = _messages(chat_dir, "train")
  rows, _ = _expected(conversations, tok, P)
  assert set(ex.source) == rows and len(ex.source) == ex.counts["rows"]
  assert {i for _, i in ex.source} == {1, 3}  # first and second answers
  for seq, l, n, (cid, i) in zip(ex.seqs, ex.prompt_lengths, ex.num_new, ex.source):
    messages = conversations[cid]
    prompt = tok.encode(tokenizer_lib.chat_text(tok, messages[:i]))
    response = tok.encode(messages[i]["content"] + "<|im_end|>\n")[:O]
    assert seq[:l].tolist() == prompt and l <= P
    assert seq[l:l + n].tolist() == response and not seq[l + n:].any()
  assert ex.counts["cut_responses"] > 0 and (ex.num_new == O).any() and (ex.num_new < O).any()


@pytest.mark.parametrize("prompt_tokens", [P, P - 60])
def test_a_prompt_longer_than_p_is_skipped_and_counted(chat_dir, prompt_tokens):
  tok = ByteTokenizer()
  ex = chat_data.examples(sharegpt.NAME, "train", tok, prompt_tokens=prompt_tokens,
                          response_tokens=O, data_dir=chat_dir)
  rows, skipped = _expected(_messages(chat_dir, "train"), tok, prompt_tokens)
  assert set(ex.source) == rows and ex.prompt_lengths.max() <= prompt_tokens
  assert ex.counts["too_long"] == skipped >= 1  # the long opening at least
  assert ex.counts["no_answer"] == 1 and ex.counts["conversations"] == 18


def test_the_end_of_turn_token_ends_a_response_that_fits():
  tok = tokenizer_lib.smollm2_tokenizer()
  messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant",
                                                            "content": "Blue."},
              {"role": "user", "content": "Another one, with a long story about it?"},
              {"role": "assistant", "content": "Green, " + "like the grass in spring, " * 20}]
  ex = chat_data.build([("c", messages)], tok, prompt_tokens=96, response_tokens=16)
  im_end = tok.encode("<|im_end|>")
  assert im_end[0] in tok.stop_ids
  (l1, l2), (n1, n2) = ex.prompt_lengths, ex.num_new
  assert ex.seqs[0, :l1].tolist() == tok.encode(tok.chat_text(messages[:1]))
  assert ex.seqs[1, :l2].tolist() == tok.encode(tok.chat_text(messages[:3]))
  assert ex.seqs[0, l1:l1 + n1].tolist() == tok.encode("Blue.") + im_end  # the "\n" after it cut
  assert n2 == 16 and im_end[0] not in ex.seqs[1, l2:l2 + n2]


class _ShoutingTokenizer(ByteTokenizer):
  """A chat template that transforms what it writes (upper case)."""

  def chat_text(self, messages, add_generation_prompt=True):
    return tokenizer_lib.chatml([{**m, "content": m["content"].upper()} for m in messages],
                                add_generation_prompt)


def test_a_template_that_transforms_contents_is_rendered_message_by_message():
  # Planted bug for the renderer's check: the pieces of a placeholder rendering would keep the
  # second conversation's text in lower case.
  tok = _ShoutingTokenizer()
  conversations = [(f"c{k}", [{"role": "user", "content": f"hello {k}"},
                              {"role": "assistant", "content": "hi"}]) for k in range(3)]
  ex = chat_data.build(conversations, tok, prompt_tokens=P, response_tokens=O)
  for seq, l, (cid, _) in zip(ex.seqs, ex.prompt_lengths, ex.source):
    assert tok.decode(seq[:l]).endswith(f"HELLO {cid[1:]}<|im_end|>\n<|im_start|>assistant\n")


def test_batches_are_a_function_of_seed_and_step(chat_dir):
  tok = ByteTokenizer()
  kw = dict(prompt_tokens=P, response_tokens=O, batch_size=4, data_dir=chat_dir)
  first = chat_data.windows(sharegpt.NAME, "train", tok, seed=0, **kw)
  chat_data._EXAMPLES.clear()
  cached = chat_data.windows(sharegpt.NAME, "train", tok, seed=0, **kw)  # from the disk cache
  chat_data._EXAMPLES.clear()
  for path in pathlib.Path(chat_dir, "spec_jax_token_cache").rglob("chat-train-*.npz"):
    path.unlink()
  again = chat_data.windows(sharegpt.NAME, "train", tok, seed=0, **kw)  # rebuilt
  assert list(pathlib.Path(chat_dir, "spec_jax_token_cache").rglob("chat-train-*.npz"))
  other = chat_data.windows(sharegpt.NAME, "train", tok, seed=1, **kw)
  ex = chat_data.examples(sharegpt.NAME, "train", tok, prompt_tokens=P, response_tokens=O,
                          data_dir=chat_dir)
  per_epoch = len(ex.source) // 4
  for s in (0, per_epoch + 1, 2 * per_epoch + 3):  # in the first three epochs
    for key in ("seqs", "prompt_lengths", "num_new"):
      np.testing.assert_array_equal(first[s][key], again[s][key])
      np.testing.assert_array_equal(first[s][key], cached[s][key])
  assert any(not np.array_equal(first[s]["seqs"], other[s]["seqs"]) for s in range(3))
  for e in range(2):  # an epoch: distinct rows, each epoch in its own order
    epoch = [bytes(r) for s in range(e * per_epoch, (e + 1) * per_epoch) for r in first[s]["seqs"]]
    assert len(set(epoch)) == 4 * per_epoch and set(epoch) <= set(map(bytes, ex.seqs))
  assert not np.array_equal(first[0]["seqs"], first[per_epoch]["seqs"])
  with pytest.raises(ValueError, match=r"^data.prompt_tokens=150: only 0 answered turns of "
                     r"spec_jax_sharegpt train have a prompt that fits"):
    chat_data.windows(sharegpt.NAME, "train", tok, seed=0, **{**kw, "prompt_tokens": 150})


# ---------------------------------------------------------------------------------------------
# Both recipes as distill batches.


def _windows(chat_dir, batch_size=4):
  return distill_data.windows(sharegpt.NAME, "train", ByteTokenizer(), prompt_tokens=P,
                              response_tokens=O, batch_size=batch_size, seed=0,
                              data_dir=chat_dir)


def _check_layout(batch, seqs, lengths, num_new):
  """Inputs/targets are the rows shifted; weights are 1 exactly on the response's targets."""
  t = np.arange(P + O - 1)[None]
  expected = (t >= lengths[:, None] - 1) & (t < lengths[:, None] - 1 + num_new[:, None])
  np.testing.assert_array_equal(batch["weights"], expected.astype(np.float32))
  np.testing.assert_array_equal(batch["inputs"], seqs[:, :-1])
  np.testing.assert_array_equal(batch["targets"], seqs[:, 1:])
  for b, (l, n) in enumerate(zip(lengths, num_new)):
    assert 1 <= n <= O and l <= P and not seqs[b, l + n:].any()


def test_fixed_batches_train_on_the_corpus_response(chat_dir):
  windows = _windows(chat_dir)
  spec = distill_data.Spec(source="fixed", prompt_tokens=P, response_tokens=O, batch_size=4)
  data = distill_data.DistillData(spec, windows)
  for s in range(3):
    _check_layout(data.get(s), windows[s]["seqs"], windows[s]["prompt_lengths"],
                  windows[s]["num_new"])
  # Prompts of different lengths in one batch (else the test could not tell l from P).
  assert len(set(windows[0]["prompt_lengths"].tolist())) > 1


def test_held_out_batches_weigh_the_same_targets_as_training_batches(chat_dir, data_dir):
  """The programs build held-out batches with make_batch(*window_rows(window)): the same batch
  as the fixed source's, for chat rows and for corpus windows with P != O."""
  corpus = distill_data.windows("spec_jax_shakespeare", "train", ByteTokenizer(),
                                prompt_tokens=6, response_tokens=9, batch_size=4, seed=0,
                                data_dir=data_dir)
  for windows, p, o in ((_windows(chat_dir), P, O), (corpus, 6, 9)):
    spec = distill_data.Spec(source="fixed", prompt_tokens=p, response_tokens=o, batch_size=4)
    fixed = distill_data.DistillData(spec, windows).get(1)
    held_out = distill_data.make_batch(*chat_data.window_rows(windows[1], p, o))
    for key in ("inputs", "targets", "weights"):
      np.testing.assert_array_equal(held_out[key], fixed[key])
  np.testing.assert_array_equal(held_out["weights"].sum(axis=1), [9] * 4)  # corpus: O each


@pytest.fixture(scope="module")
def verifier():
  return testing.tiny_model(seed=0, sharpness=4.0)


def test_verifier_batches_answer_each_chat_prompt_greedily(chat_dir, verifier, tmp_path):
  v_cfg, v_params = verifier
  windows = _windows(chat_dir)
  spec = distill_data.Spec(source="verifier", prompt_tokens=P, response_tokens=O, batch_size=4,
                           temperature=0.0)

  def gen(prompts, rng):
    return distill_data.generate_responses(v_params, v_cfg, prompts, rng, response_tokens=O,
                                           sampling=sampling_lib.Sampling(0.0),
                                           stop_ids=ByteTokenizer().stop_ids)
  pool = distill_data.VerifierData(gen, windows, num_batches=2, spec=spec, key={"v": "chat"},
                                   cache_dir=str(tmp_path))
  again = distill_data.VerifierData(gen, windows, num_batches=1, spec=spec, key={"v": "chat"},
                                    cache_dir=None)  # regenerated: a function of (seed, s)
  np.testing.assert_array_equal(pool[0][0], again[0][0])
  data = distill_data.DistillData(spec, windows, verifier_data=pool)
  for s in range(2):
    seqs, num_new = pool[s]
    lengths = windows[s]["prompt_lengths"]
    _check_layout(data.get(s), seqs, lengths, num_new)
    # The response is the verifier's greedy continuation of the row's own prompt: every
    # response token is the argmax of the verifier's law one position back.
    greedy = np.argmax(np.asarray(llama.make_apply(v_cfg)(
        v_params, seqs, np.broadcast_to(np.arange(P + O), seqs.shape))[0]), -1)
    for b, (l, n) in enumerate(zip(lengths, num_new)):
      np.testing.assert_array_equal(seqs[b, :l], windows[s]["seqs"][b, :l])
      np.testing.assert_array_equal(seqs[b, l:l + n], greedy[b, l - 1:l + n - 1])
  # Batch 2 is pool batch 0 again: its weights follow batch 0's prompts, not batch 2's.
  assert not np.array_equal(windows[2]["prompt_lengths"], windows[0]["prompt_lengths"])
  np.testing.assert_array_equal(data.get(2)["weights"], data.get(0)["weights"])
  # A mix: on-policy rows first (batch 2's own prompts), then the pool's (batch 0's).
  mix = distill_data.Spec(source="mix", prompt_tokens=P, response_tokens=O, batch_size=4,
                          temperature=0.0, mix_lambda=0.5)
  data = distill_data.DistillData(mix, windows, verifier_data=pool,
                                  drafter_generate=lambda params, prompts, rng: gen(prompts, rng))
  seqs, num_new = data.responses(2)
  lengths = np.concatenate([windows[2]["prompt_lengths"][:2], windows[0]["prompt_lengths"][2:]])
  _check_layout(data.get(2), seqs, lengths, num_new)
  for b in range(2):
    np.testing.assert_array_equal(seqs[b, :lengths[b]], windows[2]["seqs"][b, :lengths[b]])


# ---------------------------------------------------------------------------------------------
# The programs.


@pytest.fixture(scope="module")
def verifier_dir(verifier, tmp_path_factory):
  """The smoke's verifier (test-tiny from seed 0) as an HF checkpoint: a feature drafter is
  built from a checkpoint's blocks."""
  cfg, params = loading.load_model(distill_config.get_config("smoke").verifier, ByteTokenizer())
  return str(hf_export.export_hf(tmp_path_factory.mktemp("verifier"), cfg, params))


def test_distill_trains_a_feature_drafter_on_verifier_chat_responses(chat_dir, verifier_dir,
                                                                    tmp_path):
  config = distill_config.get_config("smoke,data=sharegpt,source=verifier,temp=0")
  assert config.data.name == sharegpt.NAME and config.data.stop_at_eos
  config.mesh.data = 1
  config.data.data_dir = chat_dir
  config.verifier.checkpoint = verifier_dir
  config.drafter.update(size="test-tiny:layers=1:features=1:vocab=96", checkpoint=verifier_dir)
  # Few compiles and runs: one τ temperature, a pool of 2 generated batches, one checkpoint.
  config.eval.update(temperatures=(1.0,), at_start=False)
  config.data.verifier_batches = 2
  config.train.update(num_steps=4, eval_every=2, checkpoint_every=4)
  out = distill_program.run(config, str(tmp_path))
  assert out["step"] == 4 and np.isfinite(out["train_loss"])
  rows = metrics_lib.read_jsonl(str(tmp_path))
  evals = [r for r in rows if "eval/tau_T1" in r]
  assert [r["step"] for r in evals] == [2, 4]  # τ vs steps, on the validation chat prompts
  for r in evals:
    assert 1.0 <= r["eval/tau_T1"] <= 5.0 and np.isfinite(r["eval/fkl"])
  assert any("train/aux_loss" in r for r in rows)  # the feature regression trained
  pool, = (tmp_path / "data_cache").glob("verifier_responses_*.npz")
  with np.load(pool) as f:  # the main job's path: the generation kept the teacher's states
    assert f["hidden_-1"].shape[:2] == f["seqs"].shape[:2] and f["hidden_-1"].any()


def test_train_bpd_on_chat_rows(chat_dir, tmp_path):
  """BPD heads on the corpus's chat responses (the verifier recipe shares distill's data path,
  `distill.train_data`), held out on validation rows."""
  config = train_bpd_config.get_config("smoke,data=sharegpt")
  config.data.data_dir = chat_dir
  config.mesh.data = 1
  config.train.update(num_steps=2, eval_every=2, checkpoint_every=2, log_every=1)
  out = train_bpd_program.run(config, str(tmp_path))
  assert out["step"] == 2 and np.isfinite(out["train_loss"])
  assert 0.0 <= out["eval"]["head1_top1"] <= 1.0


@pytest.mark.parametrize("program, arg, overrides, message", [
    ("distill", "smoke,data=sharegpt", {"data.blend": (("spec_jax_shakespeare", 0.5),)},
     r"^data.blend=\(\('spec_jax_shakespeare', 0.5\),\) mixes packed text windows into the "
     r"chat rows of data.name='spec_jax_sharegpt'. Fix: data.blend=\(\).$"),
    ("distill", "smoke,data=sharegpt,source=verifier", {"data.stop_at_eos": False},
     r"^data.stop_at_eos=False with chat data and data.source='verifier': .* Fix: "
     r"data.stop_at_eos=True.$"),
    ("train_bpd", "smoke,data=sharegpt", {"data.source": "onpolicy"},
     r"^data.source='onpolicy': train_bpd trains on the corpus's responses \('fixed'\) or the "
     r"verifier's"),
    ("train_bpd", "smoke", {"data.source": "verifier"},
     r"^data.source='verifier' needs chat data \(data.name='spec_jax_sharegpt'\)"),
])
def test_bad_chat_config_is_one_line_naming_the_field(tmp_path, program, arg, overrides,
                                                      message):
  configs = {"distill": (distill_config, distill_program),
             "train_bpd": (train_bpd_config, train_bpd_program)}
  config_module, program_module = configs[program]
  config = testing.with_overrides(config_module.get_config(arg), overrides)
  with pytest.raises(ValueError, match=message) as e:
    program_module.run(config, str(tmp_path))
  assert "\n" not in str(e.value)


def test_the_bpd_config_refuses_verifier_responses_without_chat_data():
  with pytest.raises(ValueError, match=r"^source='verifier' needs data=sharegpt"):
    train_bpd_config.get_config("source=verifier")
  assert train_bpd_config.get_config("data=sharegpt,source=verifier,temp=0").data.temperature == 0


def test_the_main_jobs_pool_keeps_its_cache_name():
  """The quickstart's pool of verifier answers is named by a digest of everything its responses
  depend on; fields added to the verifier's config later (feature_layers, fused, unrolled) stay
  out of it at their defaults, so a pool written before them still serves (the name below is
  the one the main job wrote before they existed). A fused verifier is another key."""
  from configs import quickstart
  config = quickstart.get_config().drafter
  tokenizer = tokenizer_lib.get_tokenizer(config.tokenizer)
  spec = distill_data.Spec.from_config(config.data, config.train.batch_size, config.seed)
  v_cfg, _ = loading.resolve_model(config.verifier, tokenizer, field="verifier.checkpoint")
  key = distill_program.pool_key(config, spec, tokenizer, v_cfg)
  assert distill_data.pool_digest(key) == "8ab85437dad92ead"
  fused = distill_program.pool_key(config, spec, tokenizer, dataclasses.replace(v_cfg, fused=True))
  assert distill_data.pool_digest(fused) != "8ab85437dad92ead"


def test_a_verifier_trained_again_at_its_path_answers_anew(tmp_path):
  """A verifier checkpoint's pool is keyed by what it holds, not its path alone: trained further
  at the same path, its responses are generated again instead of read from the cache."""
  import jax  # noqa: PLC0415
  from configs import quickstart
  from spec_jax import testing  # noqa: PLC0415
  from spec_jax.data.tokenizer import ByteTokenizer  # noqa: PLC0415
  from spec_jax.training import checkpoints  # noqa: PLC0415
  config = quickstart.get_config().drafter
  config.verifier.checkpoint = str(tmp_path / "verifier")
  tokenizer = tokenizer_lib.get_tokenizer(config.tokenizer)
  spec = distill_data.Spec.from_config(config.data, config.train.batch_size, config.seed)
  cfg, params = testing.tiny_model(seed=0)
  manager = checkpoints.make_manager(config.verifier.checkpoint, async_save=False)
  keys = []
  for step in (1, 2):
    state = type("State", (), dict(step=step, params=params, opt_state={}))()
    checkpoints.save(manager, step, state, checkpoints.make_meta(cfg, ByteTokenizer()))
    keys.append(distill_data.pool_digest(distill_program.pool_key(config, spec, tokenizer, cfg)))
    params = jax.tree.map(lambda x: x + 1, params)
  manager.close()
  assert keys[0] != keys[1]
