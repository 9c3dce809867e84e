"""Prompt buckets: each batch padded to the smallest of a few widths (generate.bucket_widths),
the same tokens as padding to max_prompt_tokens, every width compiled before any timed call;
and the chat template compiled once per template string."""

import contextlib

import jax
import pytest

from configs import evaluate as evaluate_config
from spec_jax import loading, testing
from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding.sampling import Sampling
from spec_jax.evaluation import bench, timing
from spec_jax.programs import evaluate

# Ragged prompts (bytes-tokenizer ids): PROMPTS fit a bucket of 16 (longest 11), SHORT one of 8.
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40] * 5, [3, 9]]
SHORT = [[7, 1], [2, 2, 2, 2, 2, 2], [9], [4, 4, 4]]
NEW = 7  # new tokens of the decoding tests: the identity test compiles what bench reuses


def test_bucket_widths_double_up_to_the_cap():
  assert generate_lib.bucket_widths(96, 32) == (32, 64, 96)
  assert generate_lib.bucket_widths(256, 32) == (32, 64, 128, 256)
  assert generate_lib.bucket_widths(300, 16) == (16, 32, 64, 128, 256, 300)
  assert generate_lib.bucket_widths(32, 32) == (32,)
  assert generate_lib.bucket_widths(20, 32) == (20,)
  assert generate_lib.bucket_widths(96, 0) == (96,)  # 0: one width, max_prompt_tokens
  for bad in (-1, True, 2.5, "32", None):
    with pytest.raises(ValueError, match=r"^eval.prompt_buckets=.* Fix: set it to the smallest"):
      generate_lib.bucket_widths(96, bad)


def test_pad_prompts_takes_the_smallest_bucket_that_holds_the_longest():
  assert generate_lib.pad_prompts(PROMPTS, 96, 0).tokens.shape == (4, 96)  # buckets=0: as ever
  assert generate_lib.pad_prompts(PROMPTS, 96, 0, buckets=4).tokens.shape == (4, 16)
  assert generate_lib.pad_prompts(PROMPTS, 96, 0, buckets=11).tokens.shape == (4, 11)
  assert generate_lib.pad_prompts(PROMPTS, 12, 0, buckets=8).tokens.shape == (4, 12)  # the cap
  short = generate_lib.pad_prompts(PROMPTS, 96, 7, buckets=4)
  full = generate_lib.pad_prompts(PROMPTS, 96, 7)
  assert (short.tokens == full.tokens[:, :16]).all() and (short.lengths == full.lengths).all()
  # The too-long error still names max_prompt_tokens; a bad bucket value names its sibling field.
  with pytest.raises(ValueError, match=r"Prompt 1 has 11 tokens but eval.max_prompt_tokens=10"):
    generate_lib.pad_prompts(PROMPTS, 10, 0, "eval.max_prompt_tokens", buckets=4)
  with pytest.raises(ValueError, match=r"^generation.prompt_buckets=-2 is not a width"):
    generate_lib.pad_prompts(PROMPTS, 96, 0, buckets=-2)


@pytest.fixture(scope="module")
def pair():
  """A tiny verifier and an unrelated tiny drafter (low acceptance: many corrections)."""
  return (*testing.tiny_model(seed=0), *testing.tiny_model(seed=1))


def test_two_widths_decode_the_same_tokens_greedy(pair):
  """The same prompts right-padded to 16 and to 32 columns: the extra pad columns change no
  token, autoregressive or speculative (greedy), and speculative equals autoregressive."""
  v_cfg, v_params, d_cfg, d_params = pair
  got = {}
  for width in (16, 32):
    prompts = generate_lib.pad_prompts(PROMPTS, width, 0)
    ar = generate_lib.generate(v_params, prompts, jax.random.key(0), cfg=v_cfg,
                               sampling=Sampling(0.0), max_new_tokens=NEW)
    sd = testing.lm_speculative(v_cfg, v_params, d_cfg, d_params, prompts, jax.random.key(0),
                                gamma=3, sampling=Sampling(0.0), max_new_tokens=NEW)
    got[width] = ar.new_tokens(), sd.new_tokens()
  assert got[16][0] == got[32][0]  # autoregressive
  assert got[16][1] == got[32][1]  # speculative
  assert got[16][0] == got[16][1] and all(len(row) == NEW for row in got[16][0])


@contextlib.contextmanager
def _compiles_in_timed_calls(monkeypatch):
  """A list that receives an entry per XLA compilation inside a timed call of timing.timed_pass."""
  inside, seen = [False], []
  real = timing.timed

  def timed(fn, **kw):
    inside[0] = True
    try:
      return real(fn, **kw)
    finally:
      inside[0] = False

  def listen(event, duration, **kw):
    del duration, kw
    if inside[0] and event.endswith("backend_compile_duration"):
      seen.append(event)

  monkeypatch.setattr(timing, "timed", timed)
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield seen
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


def _workload(*batches):
  """A greedy workload of NEW tokens over `batches` (Prompts of four rows each)."""
  return bench.Workload([(p, 4) for p in batches], Sampling(0.0), NEW)


def test_bench_compiles_every_width_before_timing(pair, monkeypatch):
  """Batches padded to 16 and to 8 columns (buckets of 8 under a cap of 32): timed_pass compiles
  on the first, so the 8-wide one is the program bench must compile before timing."""
  v_cfg, v_params, _, _ = pair
  work = _workload(*(generate_lib.pad_prompts(ids, 32, 0, buckets=8) for ids in (PROMPTS, SHORT)))
  assert [p.tokens.shape[1] for p in work.prompts] == [16, 8] and work.widths == [8, 16]
  with _compiles_in_timed_calls(monkeypatch) as compiles:
    outputs, _ = bench._ar_pass(v_cfg, v_params, work, None)
  assert compiles == [] and [o.tokens.shape[1] for o in outputs] == [16 + NEW, 8 + NEW]
  base = bench.autoregressive(v_cfg, v_params, work)
  row = bench.baseline_row(base, work, device="cpu")
  assert row.prompt_widths == [8, 16]
  # Verifier calls in the speculative rows' units: per prompt, one per emitted token (τ = 1),
  # not the two batches' forward counts (2 × NEW).
  assert row.verifier_calls == row.new_tokens == 8 * NEW and row.block_efficiency == 1.0
  # Planted bug: timing.timed_pass alone compiles the first batch's width only, so a width no
  # test has compiled yet (12) compiles inside a timed call, and the check above sees it.
  monkeypatch.setattr(bench, "_timed_pass", lambda fn, work, desc, usage: timing.timed_pass(
      fn, work.prompts, desc=desc, compile_only=True, usage=usage, repeats=work.repeats))
  planted = _workload(generate_lib.pad_prompts(PROMPTS, 16, 0), generate_lib.pad_prompts(
      SHORT, 12, 0))
  with _compiles_in_timed_calls(monkeypatch) as compiles:
    bench._ar_pass(v_cfg, v_params, planted, None)
  assert compiles


def _inline_config(buckets, **eval_overrides):
  """evaluate's smoke config on three inline prompts of 5, 12 and 20 bytes, in batches of 1."""
  config = evaluate_config.get_config("smoke")
  config.prompts = ("x" * 5, "y" * 12, "z" * 20)
  config.num_data_prompts = 0
  config.eval.update(batch_sizes=(1,), num_prompts=3, prompt_buckets=buckets, **eval_overrides)
  return config


def test_evaluate_pads_each_batch_to_its_bucket_and_checks_room_on_them():
  tokenizer = tokenizer_lib.get_tokenizer("bytes")
  config = _inline_config(8)
  entries = evaluate.method_runs(config.eval)
  _, batches = evaluate.prompt_batches(config, tokenizer, entries)
  assert [p.tokens.shape[1] for p, _ in batches[1]] == [8, 16, 32]
  _, batches = evaluate.prompt_batches(_inline_config(0), tokenizer, entries)
  assert [p.tokens.shape[1] for p, _ in batches[1]] == [32, 32, 32]  # one width, as before
  # The room check reads the widest batch: 20 bytes in a 32 bucket (of a 64 cap) fit 32 + 8 + 3.
  config = _inline_config(8, max_prompt_tokens=64, max_cache_len=43)
  evaluate.prompt_batches(config, tokenizer, evaluate.method_runs(config.eval))
  config = _inline_config(0, max_prompt_tokens=64, max_cache_len=43)
  with pytest.raises(ValueError, match=r"The cache needs 75 slots \(padded prompt 64 tokens"):
    evaluate.prompt_batches(config, tokenizer, evaluate.method_runs(config.eval))


def test_evaluate_rejects_a_bad_bucket_value_before_loading_any_model(tmp_path, monkeypatch):
  monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
  config = _inline_config(-1)
  with pytest.raises(ValueError, match=r"^eval.prompt_buckets=.* Fix: set it to the smallest"):
    evaluate.run(config, str(tmp_path / "out"))


def test_a_config_without_the_field_pads_to_buckets_of_the_default():
  config = _inline_config(8)
  del config.eval["prompt_buckets"]
  assert evaluate._buckets(config.eval) == generate_lib.SMALLEST_BUCKET == \
      evaluate_config.get_config().eval.prompt_buckets


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
          "{% if messages[0]['role'] == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}")


def test_chat_template_compiles_once_per_template_and_renders_the_same():
  render = tokenizer_lib.render_chat_template
  tokenizer_lib._compiled_chat_template.cache_clear()
  messages = [{"role": "user", "content": "hi"}]
  want = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
  assert render(CHATML, messages) == want
  assert render(CHATML, messages) == want
  assert render(CHATML, messages, add_generation_prompt=False) == want[:-len(
      "<|im_start|>assistant\n")]
  info = tokenizer_lib._compiled_chat_template.cache_info()
  assert (info.misses, info.hits) == (1, 2)
  with pytest.raises(ValueError, match="The chat template refused the messages: no bad roles"):
    render(CHATML, [{"role": "bad", "content": "x"}])


def test_paired_passes_time_both_methods_on_every_batch_compiled_before(tmp_path, monkeypatch):
  """eval.timing_pairs: each speculative row gets that many speedups from passes of it and of
  autoregressive decoding over every batch (three widths here), all compiled beforehand; the
  baseline row has none, and a run without the field has none."""
  calls, compiles = [], []
  real = timing.paired_passes

  def listen(event, duration, **kw):
    del duration, kw
    if event.endswith("backend_compile_duration"):
      compiles.append(event)

  def paired(a, b, inputs, repeats, **kw):
    calls.append(([p.tokens.shape[1] for p in inputs], repeats))
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
      return real(a, b, inputs, repeats, **kw)
    finally:
      jax.monitoring.unregister_event_duration_listener(listen)

  monkeypatch.setattr(timing, "paired_passes", paired)
  rows = evaluate.run(_inline_config(8, temperatures=(0.0,), gammas=(3,), timing_pairs=2),
                      str(tmp_path / "paired"))
  assert calls == [([8, 16, 32], 2)] and compiles == []
  ar, sd = rows
  assert ar["paired_speedups"] is None and ar.get("paired_speedup") is None
  assert len(sd["paired_speedups"]) == 2 and all(s > 0 for s in sd["paired_speedups"])
  assert abs(sd["paired_speedup"] - sum(sd["paired_speedups"]) / 2) < 1e-4  # the median of two
  assert sd["identical_to_greedy"] is True
  rows = evaluate.run(_inline_config(8, temperatures=(0.0,), gammas=(3,)), str(tmp_path / "one"))
  assert rows[1]["paired_speedups"] is None and len(calls) == 1


def test_paired_speedups_divide_the_methods_tokens_per_second(monkeypatch):
  """Each paired pass's speedup is (method's tokens / its seconds) / (baseline's tokens / the
  autoregressive seconds of the same pass), on fixed pass times."""
  monkeypatch.setattr(timing, "paired_passes",
                      lambda a, b, inputs, repeats, **kw: [(2.0, 1.0), (3.0, 4.0)][:repeats])
  work = bench.Workload([(generate_lib.pad_prompts(PROMPTS, 16, 0), 4)], Sampling(0.0), NEW,
                        pairs=2)
  base = bench.Baseline(outputs=[], seconds=1.0, tokens=[], emitted=20, tokens_per_s=20.0,
                        steps_s=0.1, cpu_per_wall=None, verifier_calls=0, verifier_loglik=0.0)
  # Method 30 tokens: (30 / 1) / (20 / 2) = 3; (30 / 4) / (20 / 3) = 1.125.
  assert bench.paired_speedups(None, None, None, work, base, 30) == [3.0, 1.125]
