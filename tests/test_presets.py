"""Architecture presets (spec_jax/models/presets.py): each equals what the HF import makes of its
repository's config.json, its parameter count (from shapes, nothing allocated) is the published
size, and bad names, dtypes and vocabularies fail with one line naming the field."""

import dataclasses
import os
import pathlib
import subprocess

import pytest

from configs import common
from configs import scale as scale_config
from spec_jax import cli, loading, testing
from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.evaluation import timing
from spec_jax.models import decoder, families, gemma, hf_import, llama, presets
from spec_jax.programs import benchmark, cost_model

# config.json of each repository as published (the fields the import reads; Gemma 3 4B and 27B:
# the `text_config` of the multimodal checkpoint, which transformers completes with
# Gemma3TextConfig's defaults: 8/4 heads, head_dim 256, query_pre_attn_scalar 256, 262,208
# tokens, RoPE 1M global / 10k local, sliding_window_pattern 6).
_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False,
              hidden_act="silu", mlp_bias=False, num_key_value_heads=8, rms_norm_eps=1e-5,
              rope_theta=500000.0, vocab_size=128256)
_LLAMA3_ROPE = dict(high_freq_factor=4.0, low_freq_factor=1.0,
                    original_max_position_embeddings=8192, rope_type="llama3")
_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False,
              head_dim=128, hidden_act="silu", num_key_value_heads=8, rms_norm_eps=1e-6,
              rope_scaling=None, rope_theta=1000000, sliding_window=None,
              use_sliding_window=False, vocab_size=151936)
_GEMMA3 = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
               attention_bias=False, attn_logit_softcapping=None, final_logit_softcapping=None,
               hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
               rope_local_base_freq=10000.0, rope_theta=1000000.0, sliding_window_pattern=6)
HF_CONFIGS = {
    "meta-llama/Llama-3.2-1B": dict(
        _LLAMA, head_dim=64, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
        num_hidden_layers=16, rope_scaling=dict(_LLAMA3_ROPE, factor=32.0),
        tie_word_embeddings=True),
    "meta-llama/Llama-3.2-3B": dict(
        _LLAMA, head_dim=128, hidden_size=3072, intermediate_size=8192, num_attention_heads=24,
        num_hidden_layers=28, rope_scaling=dict(_LLAMA3_ROPE, factor=32.0),
        tie_word_embeddings=True),
    "meta-llama/Llama-3.1-8B": dict(
        _LLAMA, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
        num_hidden_layers=32, rope_scaling=dict(_LLAMA3_ROPE, factor=8.0),
        tie_word_embeddings=False),
    "meta-llama/Llama-3.1-70B": dict(
        _LLAMA, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
        num_hidden_layers=80, rope_scaling=dict(_LLAMA3_ROPE, factor=8.0),
        tie_word_embeddings=False),
    "Qwen/Qwen3-0.6B": dict(
        _QWEN3, hidden_size=1024, intermediate_size=3072, max_window_layers=28,
        num_attention_heads=16, num_hidden_layers=28, tie_word_embeddings=True),
    "Qwen/Qwen3-1.7B": dict(
        _QWEN3, hidden_size=2048, intermediate_size=6144, max_window_layers=28,
        num_attention_heads=16, num_hidden_layers=28, tie_word_embeddings=True),
    "Qwen/Qwen3-8B": dict(
        _QWEN3, hidden_size=4096, intermediate_size=12288, max_window_layers=36,
        num_attention_heads=32, num_hidden_layers=36, tie_word_embeddings=False),
    "google/gemma-3-1b-pt": dict(
        _GEMMA3, head_dim=256, hidden_size=1152, intermediate_size=6912, num_attention_heads=4,
        num_hidden_layers=26, num_key_value_heads=1, query_pre_attn_scalar=256, rope_scaling=None,
        sliding_window=512, vocab_size=262144),
    "google/gemma-3-4b-pt": dict(
        _GEMMA3, head_dim=256, hidden_size=2560, intermediate_size=10240, num_attention_heads=8,
        num_hidden_layers=34, num_key_value_heads=4, query_pre_attn_scalar=256,
        rope_scaling=dict(factor=8.0, rope_type="linear"), sliding_window=1024,
        vocab_size=262208),
    "google/gemma-3-27b-pt": dict(
        _GEMMA3, head_dim=128, hidden_size=5376, intermediate_size=21504, num_attention_heads=32,
        num_hidden_layers=62, num_key_value_heads=16, query_pre_attn_scalar=168,
        rope_scaling=dict(factor=8.0, rope_type="linear"), sliding_window=1024,
        vocab_size=262208),
}


def test_presets_equal_their_hf_configs_through_the_import():
  assert sorted(p.hf_repo for p in presets.PRESETS.values()) == sorted(HF_CONFIGS)
  for name, preset in presets.PRESETS.items():
    for dtype in ("float32", "bfloat16"):
      want = hf_import.config_from_hf(HF_CONFIGS[preset.hf_repo], dtype=dtype, source=name)
      assert presets.config(name, dtype=dtype) == want, name
  # The import really reads what differs: a planted change in the HF dict breaks the equality.
  hf = dict(HF_CONFIGS["google/gemma-3-1b-pt"], sliding_window_pattern=4)
  assert hf_import.config_from_hf(hf) != presets.config("gemma3-1b")


def test_param_counts_from_shapes_match_the_published_sizes():
  for name, preset in presets.PRESETS.items():
    cfg = presets.config(name, dtype="bfloat16")
    count = presets.param_count(cfg)  # eval_shape: a 70B model costs nothing to count
    assert count == cfg.num_params, name
    assert abs(count / preset.params - 1) < 0.02, (name, count, preset.params)
    assert presets.param_bytes(cfg) == 2 * count
  assert presets.param_count(presets.config("llama3.1-70b")) == 70_553_706_496


def test_a_decode_step_reads_an_untied_embedding_by_rows_only():
  """The roofline's bytes: an untied input embedding is gathered (its tokens' rows), a tied one
  is the LM head and read whole; the 8B shape reads its 16.06 GB of weights less the 1.05 GB
  table."""
  for name in ("llama3.1-8b", "qwen3-8b", "llama3.2-1b", "gemma3-1b"):
    cfg = presets.config(name, dtype="bfloat16")
    table = 2 * cfg.vocab_size * cfg.d_model
    want = presets.param_bytes(cfg) - (0 if cfg.tie_embeddings else table)
    assert timing.decode_read_bytes(decoder.param_shapes(cfg)) == want, name
    drafter = presets.block_drafter(cfg)
    assert timing.decode_read_bytes(decoder.param_shapes(drafter)) == (
        presets.param_bytes(drafter) - (0 if cfg.tie_embeddings else table)), name
  cfg = presets.config("llama3.1-8b", dtype="bfloat16")
  assert timing.decode_read_bytes(decoder.param_shapes(cfg)) == 16_060_522_496 - 1_050_673_152


def test_presets_are_model_sizes_with_their_own_vocabulary():
  cfg = families.model_config("llama3.1-8b", vocab_size=259, dtype="bfloat16",
                              param_dtype="float32")
  assert isinstance(cfg, llama.LlamaConfig) and cfg.vocab_size == 128256
  assert (cfg.dtype, cfg.param_dtype) == ("bfloat16", "float32")
  assert isinstance(families.model_config("gemma3-27b"), gemma.GemmaConfig)
  assert "qwen3-8b" in families.variant_names()
  # Through the loader, as `model.size=` with random weights and the byte tokenizer.
  tokenizer = tokenizer_lib.get_tokenizer("bytes")
  got, params = loading.resolve_model(common.model(size="gemma3-1b", dtype="bfloat16"), tokenizer)
  assert params is None and got == presets.config("gemma3-1b", dtype="bfloat16")
  with pytest.raises(ValueError, match=r"^model.size='llama3.2-1b' has a vocabulary of 128256 "
                                       r"tokens but the tokenizer has 200000"):
    presets.config("llama3.2-1b", vocab_size=200_000)


def test_block_drafter_keeps_one_block_and_reads_features():
  cfg = presets.config("gemma3-1b")
  d = presets.block_drafter(cfg)
  assert (d.n_layers, d.feature_width, d.layer_windows) == (1, 1152, (512,))
  assert dataclasses.replace(d, n_layers=26, feature_width=0,
                             layer_windows=cfg.layer_windows) == cfg
  # One block + its own embedding and output head + the fc over [features; embedding].
  assert presets.param_count(d) == d.num_params
  with pytest.raises(ValueError, match=r"^plan.drafter_blocks: a block drafter keeps 1..26 of "
                                       r"the verifier's 26 blocks, got layers \(26,\)"):
    presets.block_drafter(cfg, (26,), "plan.drafter_blocks")


def test_bad_names_and_dtypes_are_one_line_naming_the_field():
  with pytest.raises(ValueError) as e:
    presets.config("llama3-8b")
  assert str(e.value).startswith("model.size='llama3-8b' is not a preset; presets: llama3.2-1b,")
  assert "\n" not in str(e.value) and "gemma3-27b" in str(e.value)
  with pytest.raises(ValueError, match=r"^model.dtype='float64' is not a dtype"):
    presets.config("qwen3-0.6b", dtype="float64")
  with pytest.raises(ValueError, match=r"Unknown model size 'llama3-8b'.*presets: llama3.2-1b"):
    families.model_config("llama3-8b")
  # The speed programs refuse them before loading anything, naming their config field.
  for program, section, field, value, message in (
      (benchmark, "model", "size", "llama3-8b", r"^Unknown model size 'llama3-8b' \(model.size\)"),
      (benchmark, "model", "dtype", "int8", r"^model.dtype='int8' is not a dtype"),
      (cost_model, "verifier", "size", "qwen3-9b", r"^Unknown model size 'qwen3-9b' \(verifier"),
      (cost_model, "drafter", "dtype", "float64", r"^drafter.dtype='float64' is not a dtype"),
      (cost_model, "cost", "passes", -1, r"^cost.passes=-1 must be >= 1 \(forwards"),
      # The drafter's vocabularies: more rows than the verifier's 257 tokens, one twice (0 is
      # all of them), a negative count, or vocabularies for a drafter with its own.
      (cost_model, "cost", "drafter_vocabs", (0, 1000),
       r"^cost.drafter_vocabs: a drafter vocabulary of 1000 tokens exceeds the verifier's 257\. "),
      (cost_model, "cost", "drafter_vocabs", (0, 257), r"^cost.drafter_vocabs=\(0, 257\) names "
                                                       r"one vocabulary twice"),
      (cost_model, "cost", "drafter_vocabs", (-1,), r"^cost.drafter_vocabs=\(-1,\): each is"),
      (cost_model, "drafter", "size", "test-tiny:first=1:features=1:vocab=64",
       r"^cost.drafter_vocabs=\(0, 64\) times a random feature drafter at several"),
      (cost_model, "drafter", "checkpoint", "smollm2",
       r"^cost.drafter_vocabs=\(0, 64\) .* checkpoint 'smollm2'\. Fix: a drafter.size"),
      # A tree's theory: an entry of the wrong length, without its depth, of an unknown method,
      # of a method a feature drafter does not draft, with a τ below 1.
      (cost_model, "cost", "tree_theory", (("dyn:8-32@4", 1.76),),
       r"^cost.tree_theory entry \('dyn:8-32@4', 1.76\) must be \(method entry, τ"),
      (cost_model, "cost", "tree_theory", (("dyn:8-32", 1.76, 1.44),),
       r"^cost.tree_theory entry 'dyn:8-32' needs its depth"),
      (cost_model, "cost", "tree_theory", (("eagle9:8-32@4", 1.76, 1.44),),
       r"^cost.tree_theory has 'eagle9', which is not a method"),
      (cost_model, "cost", "tree_theory", (("lookup@4", 1.76, 1.44),),
       r"^cost.tree_theory entry 'lookup@4': lookup does not draft with a feature drafter"),
      (cost_model, "cost", "tree_theory", (("dyn:8-32@4", 0.5, 1.44),),
       r"^cost.tree_theory entry 'dyn:8-32@4': τ=0.5, chain τ=1.44; each is")):
    config = scale_config.get_config("smoke,cost" if program is cost_model else "smoke")
    config[section][field] = value
    with pytest.raises(ValueError, match=message) as e:
      program.run(config, "/nonexistent/never-written")
    assert "\n" not in str(e.value)


class ChecksPassed(Exception):
  """Raised where a speed program loads its model: every check before it accepted the config."""


@pytest.mark.parametrize("mode", ["presets", "bars", "kernels", "levers", "costs"])
def test_every_step_of_the_gpu_sweep_passes_its_checks(tmp_path, monkeypatch, mode):
  """experiments/scale/gpu.sh runs blind on a lent GPU (minutes, one try): each of its steps'
  configs (configs/scale.py args and overrides, as `LIST=1` prints them) must pass the program's
  checks here, or a check added since the last loan would refuse it there; so must each tile
  sweep's flags and settings (a misspelt setting loses the whole sweep there)."""
  root = pathlib.Path(__file__).resolve().parents[1]
  listed = subprocess.run(["bash", "experiments/scale/gpu.sh", mode], cwd=root, check=True,
                          capture_output=True, text=True,
                          env=dict(os.environ, LIST="1", OUT=str(tmp_path / "out"))).stdout
  steps = [line.split("\t") for line in listed.splitlines()]
  assert len(steps) >= 5, listed
  # The tile sweeps (experiments/scale/pallas_tiles.py): their flags and settings parse.
  from experiments.scale import pallas_tiles  # noqa: PLC0415
  for name, *args in [s for s in steps if s[0].startswith("sweep:")]:
    flags, settings = pallas_tiles.parse_args([*args, "--out", str(tmp_path / name)])
    assert settings and flags.size, name
  steps = [s for s in steps if not s[0].startswith("sweep:")]
  vocab = tmp_path / "vocab49152.json"  # the script writes the same stand-in to /tmp
  vocab.write_text(_word_level(49152))

  def refuse_load(*args, **kwargs):
    raise ChecksPassed()
  monkeypatch.setattr(loading, "load_model", refuse_load)
  # The dispatch comparisons (experiments/scale/forward_dispatch.py): their flags parse and
  # their configs reach the model's loading.
  from experiments.scale import forward_dispatch  # noqa: PLC0415
  for name, *args in [s for s in steps if s[0].startswith("dispatch:")]:
    with pytest.raises(ChecksPassed):
      forward_dispatch.main([a.replace("/tmp/vocab49152.json", str(vocab)) for a in args]
                            + ["--out", str(tmp_path / name)])
  steps = [s for s in steps if not s[0].startswith("dispatch:")]
  for name, args, *overrides in steps:
    overrides = [o.replace("/tmp/vocab49152.json", str(vocab)) for o in overrides]
    cli.check_override_keys(["launch.py", f"--config={root}/configs/scale.py:{args}", *overrides])
    config = scale_config.get_config(args)
    config = testing.with_overrides(config, {
        key: _typed(config, key, text)
        for key, text in (o[len("--config."):].split("=", 1) for o in overrides)})
    with pytest.raises(ChecksPassed):
      testing.dispatch(config, str(tmp_path / name))


def _typed(config, key: str, text: str):
  """An override's text as the field's type, as launch.py's flags parse it (ints, floats,
  strings; the sweep sets no other kind)."""
  node = config
  for name in key.split("."):
    node = node[name]
  return type(node)(text) if isinstance(node, (int, float)) and not isinstance(node, bool) \
      else text


def _word_level(size: int) -> str:
  import tokenizers  # noqa: PLC0415
  vocab = {"<|endoftext|>": 0, **{f"t{i}": i for i in range(1, size)}}
  return tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<|endoftext|>")
                              ).to_str()


def test_collect_recomputes_the_theory_of_every_cost_run(tmp_path):
  """experiments/scale/collect.py: each drafter of a cost run at batch 1 gives r(γ + 1), c, the
  break-even τ and the theory at configs/scale.py's SUITE_TAU; rows without `vocab` (runs from
  before drafters had several vocabularies) timed the whole vocabulary."""
  import json  # noqa: PLC0415
  from experiments.scale import collect  # noqa: PLC0415
  run = tmp_path / "cpu" / "x-cost"
  run.mkdir(parents=True)
  rows = [dict(model="verifier", T=1, batch_size=1, ms=10.0, device_kind="cpu", dtype="float32"),
          dict(model="verifier", T=5, batch_size=1, ms=15.0),
          dict(model="verifier", T=1, batch_size=8, ms=40.0),
          dict(model="drafter", T=1, batch_size=1, ms=2.0, vocab=1000),
          dict(model="drafter", T=1, batch_size=1, ms=0.5, vocab=64),
          # The tree's calls: the verifier on 33 tokens, the drafter on 8 (one vocabulary).
          dict(model="verifier", T=33, batch_size=1, ms=40.0),
          dict(model="drafter", T=8, batch_size=1, ms=3.0, vocab=1000)]
  (run / "results.json").write_text(json.dumps(rows))
  (old := tmp_path / "cpu" / "y-cost").mkdir()
  (old / "results.json").write_text(json.dumps([{k: v for k, v in r.items() if k != "vocab"}
                                                for r in rows[:4]]))
  got = collect.theory_rows(tmp_path)
  assert [(r["run"], r["vocab"], r["r"], r["c"]) for r in got] == [
      ("cpu/x-cost", 1000, 1.5, 0.2), ("cpu/x-cost", 64, 1.5, 0.05), ("cpu/y-cost", None, 1.5, 0.2)]
  assert [r["break_even_tau"] for r in got] == [2.3, 1.7, 2.3]
  taus = [tau for _, tau in scale_config.SUITE_TAU]
  assert [r["theory"] for r in got] == [{tau: round(tau / b, 3) for tau in taus}
                                        for b in (2.3, 1.7, 2.3)]
  table = collect.theory_table(got)
  assert "| cpu/y-cost | cpu | float32 | 10.00 | 1.50 | all | 0.200 | 2.30 | 3.45 |" in table
  # The tree of SUITE_TREE_TAU (dyn:8-32@4: calls on 1, 8, 8, 8 tokens) where the run timed
  # every call it needs: r(33) = 4, Σ c(w) = 0.2 + 3·0.3, beside the chain's r(5) + 4c.
  (entry, tau, chain_tau), = scale_config.SUITE_TREE_TAU
  (tree,) = collect.tree_theory_rows(tmp_path)
  assert (tree["run"], tree["method"], tree["vocab"], tree["tokens"]) == (
      "cpu/x-cost", entry, 1000, 33)
  assert (tree["r"], tree["drafter_c"], tree["break_even_tau"], tree["chain_r"]) == (
      4.0, 1.1, 5.1, 1.5)
  assert (tree["theory"], tree["chain_theory"]) == (round(tau / 5.1, 3),
                                                    round(chain_tau / 2.3, 3))
  assert tree["vs_chain"] == round(tau / 5.1 / (chain_tau / 2.3), 3)
  assert f"| cpu/x-cost | cpu | float32 | {entry} (M = 33) | 1,000 | 4.00 | 1.100 |" in (
      collect.tree_theory_table([tree]))


def test_collect_keeps_the_fastest_run_of_each_shape_per_device_kind():
  """experiments/scale/collect.py's summary: per device kind, shape, dtype and batch size, the
  run whose median decode step over its repeats is fastest (a single fast repeat of a slower run
  does not win), its layout from the model's options, its step over the roofline (at the
  reference bandwidth for a GPU kind that has one), shapes smallest first."""
  from experiments.scale import collect  # noqa: PLC0415
  gpu = next(iter(collect.REFERENCE_GB_S))

  def row(run, model, ms, kind="cpu", batch=1, dtype="float32", roof=10.0, bw=10.0, ratio=None):
    r = dict(run=run, model=model, preset=None, device_kind=kind, dtype=dtype, batch_size=batch,
             ms_per_decode_step=ms, roofline_ms_per_step=roof, memory_bandwidth_gb_s=bw,
             decode_vs_roofline=round(ms / roof, 2))
    return r if ratio is None else {**r, "decode_vs_reference_roofline": ratio}

  rows = [row("cpu/big", "big", 30.0, roof=20.0),
          # `fast` and its repeats: median 22 (one repeat at 12 is faster than `steady`'s 20).
          row("cpu/fast", "big:fused=1", 22.0, roof=20.0),
          row("cpu/fast-r2", "big:fused=1", 12.0, roof=20.0),
          row("cpu/fast-r3", "big:fused=1", 25.0, roof=20.0),
          row("cpu/steady", "big:fused=1:unrolled=1", 20.0, roof=20.0),
          row("cpu/steady-r2", "big:fused=1:unrolled=1", 21.0, roof=20.0),
          row("cpu/small", "small", 5.0, roof=2.0),
          row("cpu/small", "small", 9.0, batch=8, roof=2.0),
          row("g/big", "big", 2.0, kind=gpu, dtype="bfloat16", roof=0.5, bw=1000.0, ratio=4.0)]
  got = collect.fastest_rows(rows)
  assert [(r["device_kind"], r["shape"], r["batch_size"], r["run"], r["layout"]) for r in got] == [
      (gpu, "big", 1, "g/big", "default"),
      ("cpu", "small", 1, "cpu/small", "default"), ("cpu", "small", 8, "cpu/small", "default"),
      ("cpu", "big", 1, "cpu/steady", "fused, unrolled")]
  steady = got[-1]
  assert (steady["ms_per_decode_step"], steady["ms_min"], steady["ms_max"], steady["repeats"],
          steady["runs_compared"], steady["vs_roofline"]) == (20.5, 20.0, 21.0, 2, 3, 1.02)
  assert got[0]["vs_roofline"] == 4.0 and got[0]["tokens_per_s"] == 500.0
  assert got[0]["roofline_at"] == f"{collect.REFERENCE_GB_S[gpu]:,.0f} GB/s"
  tables = collect.fastest_tables(got)
  assert tables.index(f"**{gpu}**") < tables.index("**cpu** (× roofline at the run's read)")
  assert ("| big | float32 | 1 | cpu/steady | fused, unrolled | 20.50 (20.00–21.00, 2 runs) | "
          "1.02 | 48.8 | 3 |") in tables
