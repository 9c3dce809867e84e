"""Model families (Llama 3.x RoPE scaling, Qwen3, Gemma 2, Gemma 3) against transformers: tiny
random HF models built here, imported → same logits and greedy tokens, exported → transformers
loads the same logits; speculative decoding (chain and tree) on a sliding-window model equals the
verifier's greedy output."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from spec_jax.decoding import generate as generate_lib  # noqa: E402
from spec_jax.decoding import loop  # noqa: E402
from spec_jax.decoding import verifier as verifier_lib  # noqa: E402
from spec_jax.decoding.drafters import lm, standard, trees  # noqa: E402
from spec_jax.decoding.sampling import Sampling  # noqa: E402
from spec_jax.models import gemma, hf_export, hf_import, layers, llama  # noqa: E402

torch.set_num_threads(1)
transformers.utils.logging.set_verbosity_error()
VOCAB = 300
PROMPT_LEN, NEW = 12, 8
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
# Each case: (HF config class, its fields, what our config must say). Windows (4, 5 tokens) are
# shorter than prompt + new tokens (20), so a window term that is wrong or missing shows.
CASES = {
    "llama3.2-rope-llama3-tied": (
        transformers.LlamaConfig,
        dict(tie_word_embeddings=True, rope_theta=5e5, rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=16)),
        dict(rope_scaling="llama3", rope_factor=8.0, rope_original_max_positions=16,
             tie_embeddings=True)),
    "llama-rope-linear-untied": (
        transformers.LlamaConfig,
        dict(tie_word_embeddings=False, rope_scaling=dict(rope_type="linear", factor=4.0)),
        dict(rope_scaling="linear", rope_factor=4.0, tie_embeddings=False)),
    "qwen3-qk-norm-head-dim-window": (
        transformers.Qwen3Config,
        dict(head_dim=24, tie_word_embeddings=False, use_sliding_window=True, sliding_window=5,
             max_window_layers=1),
        dict(qk_norm=True, head_dim=24, qkv_bias=False, layer_windows=(0, 5, 5))),
    "gemma3-local-global-window": (
        transformers.Gemma3TextConfig,
        dict(head_dim=24, query_pre_attn_scalar=20, sliding_window=4, rope_theta=1e6,
             rope_local_base_freq=1e4, rope_scaling=dict(rope_type="linear", factor=8.0),
             layer_types=["sliding_attention", "full_attention", "sliding_attention"],
             final_logit_softcapping=3.0),
        dict(family="gemma", qk_norm=True, query_pre_attn_scalar=20.0, layer_windows=(4, 0, 4),
             rope_local_theta=1e4, rope_scaling="linear", final_logit_softcap=3.0)),
    "gemma2-softcap-window": (
        transformers.Gemma2Config,
        dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=4, attn_logit_softcapping=0.5,
             final_logit_softcapping=2.0),
        dict(family="gemma", qk_norm=False, layer_windows=(4, 0, 4), attn_logit_softcap=0.5,
             final_logit_softcap=2.0)),
}


def _hf_model(case, seed=0):
  cls, kw, _ = CASES[case]
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(
      cls(**{**BASE, **kw}), attn_implementation="eager").eval()
  with torch.no_grad():  # non-trivial norms, so a swapped, dropped or un-offset one shows
    for name, p in model.named_parameters():
      if "norm" in name:
        p.add_(0.2 * torch.randn_like(p))
  return model


def _hf_logits(model, ids):
  with torch.no_grad():
    return model(torch.tensor(ids)).logits.numpy()


def _logits(cfg, params, ids, cached=False):
  """Logits of one forward over ids; cached: as a decoding call, writing an empty cache (its
  norms' row scaling deferred past the products, `layers.RMSNorm`)."""
  ids = jnp.asarray(ids)
  cache = layers.init_cache(cfg, ids.shape[0], ids.shape[1]) if cached else None
  return np.asarray(jax.jit(llama.make_apply(cfg))(
      params, ids, jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape), cache)[0])


@pytest.fixture(scope="module", params=list(CASES))
def imported(request, tmp_path_factory):
  case = request.param
  model = _hf_model(case)
  path = tmp_path_factory.mktemp(case)
  model.save_pretrained(path)
  cfg, params = hf_import.read_hf(path)
  return case, model, cfg, params, path


def test_import_matches_transformers(imported):
  case, model, cfg, params, _ = imported
  for field, value in CASES[case][2].items():
    assert getattr(cfg, field) == value, field
  assert isinstance(cfg, gemma.GemmaConfig) == case.startswith("gemma")
  ids = np.random.default_rng(0).integers(0, VOCAB, (2, PROMPT_LEN + NEW))
  np.testing.assert_allclose(_logits(cfg, params, ids), _hf_logits(model, ids), atol=2e-5)
  np.testing.assert_allclose(_logits(cfg, params, ids, cached=True), _hf_logits(model, ids),
                             atol=2e-5)
  # Greedy with the cache (windows cut in after 4-5 tokens): transformers' generate, EOS off.
  prompts = ids[:, :PROMPT_LEN]
  model.generation_config.eos_token_id = None
  with torch.no_grad():
    want = model.generate(torch.tensor(prompts), do_sample=False, max_new_tokens=NEW,
                          attention_mask=torch.ones_like(torch.tensor(prompts)))
  out = generate_lib.generate(params, generate_lib.pad_prompts(prompts.tolist(), PROMPT_LEN, 0),
                              jax.random.key(0), cfg=cfg, sampling=Sampling(),
                              max_new_tokens=NEW)
  assert out.new_tokens() == want[:, PROMPT_LEN:].tolist()


def test_fused_and_unrolled_layouts_match_transformers(imported):
  """Each family's imported weights in the fused layout (`LlamaConfig.fused`), the unrolled one
  (`unrolled`: per-layer params, per-layer windows and RoPE), both, and the out-major one
  (`out_major`: o and down stored output axis first) give transformers' logits, and export to
  the same tensors as the scanned, unfused layout."""
  case, model, cfg, params, _ = imported
  ids = np.random.default_rng(2).integers(0, VOCAB, (2, PROMPT_LEN))
  want = hf_export.params_to_hf(cfg, params)
  for fused, unrolled, out_major in ((True, False, False), (False, True, False),
                                     (True, True, False), (False, False, True)):
    new_cfg = dataclasses.replace(cfg, fused=fused, unrolled=unrolled, out_major=out_major)
    new = layers.fuse_params(params) if fused else params
    new = layers.unstack_layers(new, cfg.n_layers) if unrolled else new
    new = layers.out_major_params(new) if out_major else new
    np.testing.assert_allclose(_logits(new_cfg, new, ids), _hf_logits(model, ids), atol=2e-5)
    got = hf_export.params_to_hf(new_cfg, new)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
      np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_export_round_trip_and_transformers_loads_it(imported, tmp_path):
  case, model, cfg, params, _ = imported
  hf_export.export_hf(tmp_path, cfg, params)
  cfg2, params2 = hf_import.read_hf(tmp_path)
  assert cfg2 == cfg
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  back = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
  assert type(back) is type(model)
  ids = np.random.default_rng(1).integers(0, VOCAB, (1, PROMPT_LEN + NEW))
  np.testing.assert_allclose(_hf_logits(back, ids), _hf_logits(model, ids), atol=1e-6)


@pytest.mark.parametrize("case", ["gemma3-local-global-window", "qwen3-qk-norm-head-dim-window"])
def test_speculative_on_sliding_window_model_equals_greedy(case, tmp_path):
  """Chain SD and an RSD tree with a windowed verifier and a windowed drafter (the cache keeps
  slot positions, tree nodes sit at slots that are not their positions) equal the verifier's
  greedy tokens, far past the window."""
  _hf_model(case, seed=0).save_pretrained(tmp_path / "v")
  _hf_model(case, seed=1).save_pretrained(tmp_path / "d")
  v_cfg, v_params = hf_import.read_hf(tmp_path / "v")
  d_cfg, d_params = hf_import.read_hf(tmp_path / "d")
  prompts = generate_lib.pad_prompts([[5, 6, 7, 8, 9, 10, 11], [40], [100, 101, 102]], 8, 0)
  n = 16
  ar = generate_lib.generate(v_params, prompts, jax.random.key(0), cfg=v_cfg,
                             sampling=Sampling(), max_new_tokens=n)
  for spec in (trees.chain(3), standard.tree("rsd_c", depth=3, branching=(2, 2))):
    for drafter_cfg, drafter_params in ((d_cfg, d_params), (v_cfg, v_params)):
      out = loop.speculative_generate(
          v_params, drafter_params, prompts, jax.random.key(0),
          verifier=verifier_lib.lm_verifier(v_cfg), drafter=lm.LMDrafter(drafter_cfg, spec),
          decode=loop.DecodeConfig("auto"), sampling=Sampling(), max_new_tokens=n)
      assert out.new_tokens() == ar.new_tokens()


LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}"
                  r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")


def test_llama3_tokenizer_bos_chat_template_and_stops(tmp_path):
  """A Llama-3-style tokenizer directory (tiktoken-like byte BPE, BOS from the post-processor,
  the Llama 3 chat template, two stop tokens) reads as transformers reads it."""
  import json

  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, processors, trainers

  from spec_jax.data import tokenizer as tokenizer_lib
  specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
              "<|eot_id|>"]
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(LLAMA3_PATTERN), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  text = "ROMEO. But, soft! what light through yonder window breaks? 1234 café\n\n  def f(x):\n"
  tok.train_from_iterator([text] * 4, trainers.BpeTrainer(
      vocab_size=VOCAB, special_tokens=specials, show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.post_processor = processors.TemplateProcessing(
      single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)])
  tok.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(
      tokenizer_class="PreTrainedTokenizerFast", bos_token="<|begin_of_text|>",
      eos_token="<|eot_id|>", chat_template=LLAMA3_TEMPLATE)))
  (tmp_path / "generation_config.json").write_text(json.dumps(dict(eos_token_id=[1, 4])))
  ours = tokenizer_lib.get_tokenizer(str(tmp_path))
  hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
  for t in (text, "Hello world", " leading space"):
    assert ours.encode(t) == hf(t)["input_ids"] and ours.encode(t)[0] == 0
    assert ours.decode(ours.encode(t)) == t
  messages = [{"role": "user", "content": "What light?"}]
  prompt = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  assert ours.chat_prompt("What light?") == prompt
  assert ours.encode(prompt) == hf(prompt, add_special_tokens=False)["input_ids"]  # one BOS
  assert set(ours.stop_ids) == {1, 4} and ours.eos_id == 4


def _write_gguf(path, arch, tensors, **meta):
  import gguf
  w = gguf.GGUFWriter(str(path), arch)
  for key, value in meta.items():
    (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"{arch}.{key}", value)
  for name, (arr, qtype) in tensors.items():
    w.add_tensor(name, arr, raw_dtype=qtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def test_bad_gguf_files_fail_clearly(tmp_path):
  """An architecture we do not read, a quantization type gguf-py cannot dequantize and a
  truncated file: errors naming the file and the problem, never wrong weights."""
  import gguf

  from spec_jax.models import gguf_import
  f32 = lambda *shape: (np.ones(shape, np.float32), None)  # noqa: E731
  _write_gguf(tmp_path / "gpt2.gguf", "gpt2", {"token_embd.weight": f32(8, 4)})
  with pytest.raises(ValueError, match="gpt2.gguf: GGUF architecture 'gpt2' is not supported; "
                                       "supported: 'llama' .* and 'gemma3'"):
    gguf_import.read_gguf(tmp_path / "gpt2.gguf")
  # A one-layer Gemma 3 whose q projection is Q8_1 (blocks of 32 values in 40 bytes).
  d, f, hd = 32, 64, 16
  names = {"attn_q.weight": (2 * hd, d), "attn_k.weight": (hd, d), "attn_v.weight": (hd, d),
           "attn_output.weight": (d, 2 * hd), "attn_q_norm.weight": (hd,),
           "attn_k_norm.weight": (hd,), "attn_norm.weight": (d,), "post_attention_norm.weight": (d,),
           "ffn_norm.weight": (d,), "post_ffw_norm.weight": (d,), "ffn_gate.weight": (f, d),
           "ffn_up.weight": (f, d), "ffn_down.weight": (d, f)}
  tensors = {f"blk.0.{n}": f32(*s) for n, s in names.items()}
  tensors["blk.0.attn_q.weight"] = (np.zeros((2 * hd, d // 32 * 40), np.uint8),
                                    gguf.GGMLQuantizationType.Q8_1)
  tensors.update({"token_embd.weight": f32(VOCAB, d), "output_norm.weight": f32(d)})
  meta = dict(block_count=1, embedding_length=d, feed_forward_length=f, **{
      "attention.head_count": 2, "attention.head_count_kv": 1, "attention.key_length": hd,
      "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1e6,
      "attention.sliding_window": 4})
  _write_gguf(tmp_path / "q81.gguf", "gemma3", tensors, **meta)
  with pytest.raises(ValueError, match="tensor 'blk.0.attn_q.weight' is stored as Q8_1, which "
                                       "gguf-py cannot dequantize"):
    gguf_import.read_gguf(tmp_path / "q81.gguf")
  # The same file with F32 weights reads, with the Gemma 3 defaults llama.cpp assumes.
  tensors["blk.0.attn_q.weight"] = f32(2 * hd, d)
  _write_gguf(tmp_path / "ok.gguf", "gemma3", tensors, **meta)
  cfg, params = gguf_import.read_gguf(tmp_path / "ok.gguf")
  assert isinstance(cfg, gemma.GemmaConfig) and cfg.layer_windows == (4,)
  assert cfg.query_pre_attn_scalar == hd and cfg.rope_local_theta == 1e4
  np.testing.assert_array_equal(params["final_norm"]["scale"], 0.0)  # llama.cpp's 1 + w, undone
  data = (tmp_path / "ok.gguf").read_bytes()
  (tmp_path / "cut.gguf").write_bytes(data[:len(data) - 100])
  with pytest.raises(ValueError, match="cut.gguf is not a readable GGUF file .*truncated"):
    gguf_import.read_gguf(tmp_path / "cut.gguf")
