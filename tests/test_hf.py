"""HF interop: import HF Llama/Mistral/Qwen2 checkpoints, export ours, parity with transformers.

transformers and torch are test-only dependencies (requirements-test.txt); the models are tiny
random ones built here, so nothing is downloaded.
"""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from configs import benchmark_hf as benchmark_hf_config  # noqa: E402
from configs import common  # noqa: E402
from configs import export_hf as export_hf_config  # noqa: E402
from spec_jax import loading, testing  # noqa: E402
from spec_jax.data import tokenizer as tokenizer_lib  # noqa: E402
from spec_jax.decoding import generate as generate_lib  # noqa: E402
from spec_jax.decoding import sampling as sampling_lib  # noqa: E402
from spec_jax.models import hf_export, hf_import, llama  # noqa: E402
from spec_jax.programs import benchmark_hf, export_hf  # noqa: E402
from spec_jax.training import checkpoints  # noqa: E402

torch.set_num_threads(1)
transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
VOCAB = 300
TEXT = ("ROMEO. But, soft! what light through yonder window breaks? It is the east, and Juliet is "
        "the sun. Arise, fair sun, and kill the envious moon, who is already sick and pale with "
        "grief. def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n")
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Tiny HF models covering the cases. Mistral's default 4096-token sliding window exceeds
# max_position_embeddings=128, so it is full attention (as spec_jax computes).
CASES = {
    "llama-gqa-tied": (transformers.LlamaConfig, dict(tie_word_embeddings=True)),
    "qwen2-bias-untied-theta": (transformers.Qwen2Config,
                                dict(tie_word_embeddings=False, rope_theta=1e6)),
    "mistral-mha-untied": (transformers.MistralConfig,
                           dict(num_key_value_heads=4, sliding_window=4096)),
}


def _hf_model(case, seed=0):
  cls, kw = CASES[case]
  torch.manual_seed(seed)
  kw = dict(dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128), **kw)
  model = transformers.AutoModelForCausalLM.from_config(cls(**kw)).eval()
  with torch.no_grad():  # non-trivial norms and biases, so a swapped or dropped one shows
    for name, p in model.named_parameters():
      if "norm" in name or "bias" in name:
        p.add_(0.2 * torch.randn_like(p))
  return model


def _hf_logits(model, ids):
  with torch.no_grad():
    return model(torch.tensor(ids)).logits.numpy()


def _jax_logits(cfg, params, ids):
  ids = jnp.asarray(ids)
  return np.asarray(jax.jit(llama.make_apply(cfg))(
      params, ids, jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape))[0])


def _same_params(a, b):
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
      x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def bpe():
  """A real byte-level BPE tokenizer with VOCAB tokens, ChatML specials and a chat template."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator([TEXT] * 4, trainers.BpeTrainer(
      vocab_size=VOCAB, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  assert tok.get_vocab_size() == VOCAB
  return tokenizer_lib.HFTokenizer(tok, name="tiny-bpe", eos_token="<|endoftext|>",
                                   stop_tokens=["<|im_end|>"], chat_template=CHATML)


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
  """The tied GQA Llama saved in ~10 shards (model.safetensors.index.json)."""
  path = tmp_path_factory.mktemp("sharded")
  _hf_model("llama-gqa-tied").save_pretrained(path, max_shard_size="40KB")
  assert (path / hf_import.INDEX_FILE).is_file()
  return path


@pytest.mark.parametrize("case", list(CASES))
def test_import_matches_transformers_logits_and_greedy(case, tmp_path, sharded_dir):
  model = _hf_model(case)
  path = sharded_dir if case == "llama-gqa-tied" else tmp_path
  if path is tmp_path:
    model.save_pretrained(path)
  cfg, params = hf_import.read_hf(path)
  assert (cfg.n_kv_heads < cfg.n_heads) == (case != "mistral-mha-untied")
  assert cfg.tie_embeddings == (case == "llama-gqa-tied")
  assert cfg.qkv_bias == case.startswith("qwen2")
  assert cfg.rope_theta == (1e6 if case.startswith("qwen2") else 1e4)
  ids = np.random.default_rng(0).integers(0, VOCAB, (2, 12))
  np.testing.assert_allclose(_jax_logits(cfg, params, ids), _hf_logits(model, ids), atol=1e-5)
  # Greedy: transformers' generate (EOS off) against spec_jax's jitted loop, token for token.
  model.generation_config.eos_token_id = None
  with torch.no_grad():
    want = model.generate(torch.tensor(ids), attention_mask=torch.ones(2, 12, dtype=torch.long),
                          do_sample=False, max_new_tokens=8)[:, 12:].tolist()
  out = generate_lib.generate(params, generate_lib.pad_prompts(ids.tolist(), 12, 0),
                              jax.random.key(0), cfg=cfg, sampling=sampling_lib.Sampling(),
                              max_new_tokens=8)
  assert out.new_tokens() == want
  # Export -> import is exact, and the export is what transformers loads.
  hf_export.export_hf(tmp_path / "export", cfg, params)
  cfg2, params2 = hf_import.read_hf(tmp_path / "export")
  assert cfg2 == cfg and _same_params(params, params2)


@pytest.mark.parametrize("overrides, dtype", [
    (dict(qkv_bias=True, tie_embeddings=False, n_kv_heads=1, rope_theta=5e5), "float32"),
    ({}, "bfloat16")])
def test_export_loads_in_transformers_with_same_logits(tmp_path, overrides, dtype):
  cfg, params = testing.tiny_model(seed=3, vocab_size=VOCAB, **overrides)
  rng = np.random.default_rng(3)
  params = jax.tree_util.tree_map_with_path(  # random biases and norms, so they matter
      lambda p, x: np.asarray(x) + 0.1 * rng.standard_normal(x.shape, np.float32)
      if "bias" in jax.tree_util.keystr(p) or "scale" in jax.tree_util.keystr(p) else x, params)
  as_dtype = lambda tree, name: jax.tree.map(  # noqa: E731  (numpy casts: no compiles)
      lambda x: np.asarray(x).astype(hf_import.np_dtype_of(name)), tree)
  cfg, params = dataclasses.replace(cfg, dtype=dtype, param_dtype=dtype), as_dtype(params, dtype)
  hf_export.export_hf(tmp_path, cfg, params)
  back_cfg, back = hf_import.read_hf(tmp_path, dtype=dtype)
  assert back_cfg == cfg and _same_params(params, back)
  expected = json.loads((tmp_path / "config.json").read_text())
  assert expected["architectures"] == [
      "Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM"]
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
  ids = np.random.default_rng(1).integers(0, VOCAB, (2, 10))
  f32_cfg = dataclasses.replace(cfg, dtype="float32", param_dtype="float32")
  np.testing.assert_allclose(_hf_logits(model, ids),
                             _jax_logits(f32_cfg, as_dtype(params, "float32"), ids), atol=1e-5)


def test_exported_drafter_checkpoint_with_tokenizer(tmp_path, bpe):
  """A train_lm-style orbax checkpoint -> export_hf program -> transformers: same logits, and the
  tokenizer files load in transformers (same ids, same chat prompt) and back in spec_jax."""
  cfg, params = testing.tiny_model(seed=4, vocab_size=VOCAB)
  manager = checkpoints.make_manager(str(tmp_path / "drafter"), async_save=False)
  state = type("State", (), dict(step=0, params=params, opt_state={}))()
  checkpoints.save(manager, 0, state, checkpoints.make_meta(cfg, bpe))
  manager.close()
  bpe.save_hf(tmp_path / "tokenizer")
  config = export_hf_config.get_config()
  config.tokenizer = str(tmp_path / "tokenizer")  # an HF tokenizer directory
  config.model.checkpoint = str(tmp_path / "drafter")
  out = tmp_path / "hf"
  summary = export_hf.run(config, str(out))
  assert summary["round_trip_exact"] and {"tokenizer.json", "config.json"} <= set(summary["files"])
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  ids = np.asarray([bpe.encode(TEXT)[:16]])
  np.testing.assert_allclose(_hf_logits(model, ids), _jax_logits(cfg, params, ids), atol=1e-5)
  hf_tok = transformers.AutoTokenizer.from_pretrained(out)
  assert hf_tok(TEXT, add_special_tokens=False)["input_ids"] == bpe.encode(TEXT)
  assert hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                    add_generation_prompt=True) == bpe.chat_prompt("hi")
  mine = tokenizer_lib.get_tokenizer(str(out))
  assert (mine.fingerprint, mine.eos_id, mine.stop_ids) == (bpe.fingerprint, bpe.eos_id,
                                                           bpe.stop_ids)
  assert mine.chat_prompt("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
  # The export is a model.checkpoint like any other; its tokenizer must be the config's.
  loaded_cfg, loaded = loading.load_model(common.model(checkpoint=str(out)), mine)
  assert loaded_cfg == cfg and _same_params(params, loaded)
  with pytest.raises(ValueError, match="ships its own tokenizer.*Fix: --config.tokenizer="):
    loading.load_model(common.model(checkpoint=f"hf:{out}"), tokenizer_lib.ByteTokenizer())


def _edit_config(path, **changes):
  config = json.loads((path / "config.json").read_text())
  config.update(changes)
  (path / "config.json").write_text(json.dumps(config))


def _drop_tensor(path, name):
  file = path / hf_import.SINGLE_FILE
  tensors = {k: np.array(v) for k, v in hf_import.read_safetensors(file).items() if k != name}
  hf_export.write_safetensors(file, tensors)


def _add_tensor(path, name):
  file = path / hf_import.SINGLE_FILE
  tensors = {k: np.array(v) for k, v in hf_import.read_safetensors(file).items()}
  hf_export.write_safetensors(file, {**tensors, name: np.zeros(4, np.float32)})


def _mismatch_shard(path):
  index = json.loads((path / hf_import.INDEX_FILE).read_text())
  files = sorted(set(index["weight_map"].values()))
  name = next(k for k, v in index["weight_map"].items() if v == files[0])
  index["weight_map"][name] = files[1]
  (path / hf_import.INDEX_FILE).write_text(json.dumps(index))


def _to_bin(path):
  (path / hf_import.SINGLE_FILE).rename(path / "pytorch_model.bin")


@pytest.mark.parametrize("edit, message", [
    (lambda p: _edit_config(p, rope_scaling={"rope_type": "dynamic", "factor": 8.0}),
     "rope_scaling.rope_type='dynamic' is not implemented; spec_jax supports RoPE types "
     "'default', 'linear' and 'llama3' .'yarn', 'dynamic', 'longrope'"),
    (lambda p: _edit_config(p, model_type="gemma3", architectures=None),
     "model_type='gemma3' is the multimodal Gemma3ForConditionalGeneration"),
    (lambda p: _edit_config(p, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}),
     "rope_parameters.rope_type='yarn'"),
    (lambda p: _edit_config(p, model_type="gpt2"),
     "model_type='gpt2' is not supported. Supported: llama .LlamaForCausalLM., mistral"),
    (lambda p: _edit_config(p, mlp_bias=True), "mlp_bias=true is not implemented"),
    (lambda p: _edit_config(p, attention_bias=True), "attention_bias=true gives llama's o_proj"),
    (lambda p: _edit_config(p, hidden_act="gelu"), "hidden_act='gelu' is not implemented"),
    (lambda p: _edit_config(p, layer_types=["sliding_attention"] * 2),
     "layer_types has sliding-window layers but sliding_window=None"),
    (lambda p: _edit_config(p, num_hidden_layers=3),
     "tensor 'model.layers.2.input_layernorm.weight' .and 8 more. is missing"),
    (lambda p: _drop_tensor(p, "model.norm.weight"), "tensor 'model.norm.weight' .and 0 more"),
    (lambda p: _add_tensor(p, "model.layers.0.self_attn.o_proj.bias"),
     "unexpected tensor 'model.layers.0.self_attn.o_proj.bias' in model.safetensors"),
    (lambda p: _edit_config(p, intermediate_size=64),
     "tensor 'model.layers.0.mlp.gate_proj.weight' has shape .96, 64., but config.json "
     "implies .64, 64."),
    (_to_bin, "neither model.safetensors nor.*pytorch_model.bin.*only safetensors is read"),
])
def test_bad_checkpoints_fail_clearly(tmp_path, sharded_dir, edit, message):
  cfg, params = hf_import.read_hf(sharded_dir)
  hf_export.export_hf(tmp_path, cfg, params)
  edit(tmp_path)
  with pytest.raises(hf_import.HFCheckpointError, match=message):
    hf_import.read_hf(tmp_path)


def test_bad_shards_fail_clearly(tmp_path, sharded_dir):
  shutil.copytree(sharded_dir, tmp_path / "a")
  shard = sorted((tmp_path / "a").glob("model-*.safetensors"))[2]
  shard.unlink()
  with pytest.raises(hf_import.HFCheckpointError,
                     match=f"shard files named by model.safetensors.index.json are missing: "
                           f"{shard.name} .holds"):
    hf_import.read_hf(tmp_path / "a")
  shutil.copytree(sharded_dir, tmp_path / "b")
  _mismatch_shard(tmp_path / "b")
  with pytest.raises(hf_import.HFCheckpointError, match="maps tensor .* but .* does not contain"):
    hf_import.read_hf(tmp_path / "b")
  shutil.copytree(sharded_dir, tmp_path / "c")
  sorted((tmp_path / "c").glob("model-*.safetensors"))[0].write_bytes(b"\x10\x00")
  with pytest.raises(hf_import.HFCheckpointError, match="not a safetensors file"):
    hf_import.read_hf(tmp_path / "c")


def test_a_gemma_config_must_state_what_transformers_would_default():
  """A Gemma config.json without its query scale (and Gemma 3's local RoPE base, Gemma 2's
  soft-caps) is refused naming them: transformers fills them from its config class (256, 1e4,
  50 / 30), where this import had other fallbacks (head_dim, the global base, no caps). With
  them written out, as transformers' own config of the same dict has them, it loads."""
  minimal = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8)
  for model_type, keys in (("gemma3_text", "'query_pre_attn_scalar', 'rope_local_base_freq'"),
                           ("gemma2", "'query_pre_attn_scalar', 'attn_logit_softcapping', "
                                      "'final_logit_softcapping'")):
    with pytest.raises(hf_import.HFCheckpointError, match=rf"does not state \[{keys}\]"):
      hf_import.config_from_hf(dict(minimal, model_type=model_type))
    full = transformers.AutoConfig.for_model(model_type, **minimal).to_dict()
    cfg = hf_import.config_from_hf(full)
    assert cfg.query_pre_attn_scalar == 256.0
    if model_type == "gemma2":
      assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (50.0, 30.0)
    else:
      assert cfg.rope_local_theta == 1e4


def test_mistral_sliding_window_loads_as_a_window(tmp_path, sharded_dir):
  cfg, params = hf_import.read_hf(sharded_dir)
  hf_export.export_hf(tmp_path, cfg, params)
  _edit_config(tmp_path, model_type="mistral", architectures=["MistralForCausalLM"],
               sliding_window=64)
  assert hf_import.read_hf(tmp_path)[0] == dataclasses.replace(cfg, layer_windows=(64, 64))


def test_benchmark_hf_smoke(tmp_path):
  """The peer benchmark end to end on tiny random models: every system and method runs, emits
  exactly new_tokens per prompt, and greedy outputs agree across systems."""
  config = benchmark_hf_config.get_config("smoke")
  result = benchmark_hf.run(config, str(tmp_path))
  rows = json.loads((tmp_path / "results.json").read_text())
  assert rows == result["rows"]
  got = {(r["system"], r["method"], r["batch_size"], r["schedule"]) for r in rows}
  assert got == {("transformers", "greedy", 1, None), ("transformers", "assisted", 1, "default"),
                 ("transformers", "assisted", 1, "constant"),
                 ("spec_jax", "autoregressive", 1, None),
                 ("spec_jax", "speculative", 1, "constant")}
  for r in rows:
    assert r["new_tokens"] == 2 * 6 and r["tokens_per_s"] > 0
    # ms_per_token is rounded to 2 decimals: allow that rounding plus tokens_per_s's own.
    assert r["ms_per_token"] == pytest.approx(1000 / r["tokens_per_s"], rel=1e-3, abs=5.1e-3)
    assert r["identical_to_greedy"] and r["identical_to_own_greedy"]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["transformers_greedy_equals_argmax_loop"]
  assert set(summary["speedup_sd_vs_assisted"]) == {"default", "constant"}
  assert (tmp_path / "hf" / "verifier" / "model.safetensors").is_file()
  assert "| spec_jax | speculative | 1 | 2 |" in (tmp_path / "results.md").read_text()


def test_benchmark_hf_missing_drafter_says_run_quickstart(tmp_path):
  config = benchmark_hf_config.get_config("smoke")
  config.drafter.checkpoint = str(tmp_path / "nope")
  with pytest.raises(FileNotFoundError, match="run the quickstart first"):
    benchmark_hf.run(config, str(tmp_path))
