"""The pod plan (spec_jax/programs/pod_plan.py) on the 8 fake CPU devices of conftest.py: a
1B-shaped plan compiles ahead of time from abstract parameters, its per-device bytes sit within
bounds of a hand computation, the collectives are counted per round from the compiled HLO, and
bad plans are refused with one line naming the field before anything compiles."""

import contextlib
import json

import jax
import pytest

from configs import pod_plan as pod_plan_config
from spec_jax import parallel
from spec_jax.models import presets
from spec_jax.programs import pod_plan

# A hand-written module: the entry runs an all-gather once (prefill), then the decode loop (no
# trip count) whose body runs an all-reduce f32[4,8] in a loop XLA knows runs 3 times, an
# all-gather f32[2,2] in a loop whose condition says `i < 2` (XLA:TPU's form: no annotation) and
# a collective-permute bf16[16] once; the condition's all-reduce pred[2] runs once per round.
# Then the asynchronous forms, once each: an all-reduce of two arrays merged by XLA's combiner
# (its start's type: the results, 16 + 32 bytes), a combined all-gather (the start's type:
# (operands, results): 16 + 24 bytes delivered), a collective-permute (operand, result, context),
# and a reduce-scatter f32[4] wrapped in an async pair whose done names the computation too.
HLO = """HloModule m, entry_computation_layout={(f32[4,8]{1,0})->f32[4,8]{1,0}}

%add (x: f32[], y: f32[]) -> f32[] {
  ROOT %a = f32[] add(%x, %y)
}

%inner (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %ar = f32[4,8]{1,0} all-reduce(%g), channel_id=1, replica_groups={{0,1}}, to_apply=%add
}

%inner2 (p: (s32[], f32[2,2])) -> (s32[], f32[2,2]) {
  %ag2 = f32[2,2]{1,0:T(2,128)} all-gather(%h), channel_id=5, dimensions={0}
}

%lt2 (p: (s32[], f32[2,2])) -> pred[] {
  %two = u32[]{:T(128)} constant(2)
  %i = u32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %two), direction=LT
}

%rs (q: f32[8]) -> f32[4] {
  ROOT %r = f32[4]{0} reduce-scatter(%q), channel_id=9, dimensions={0}, to_apply=%add
}

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %w = s32[] while(%t), condition=%c, body=%inner, backend_config={"known_trip_count":{"n":"3"}}
  %w2 = s32[] while(%t2), condition=%lt2, body=%inner2
  %cp = bf16[16]{0} collective-permute(%x), channel_id=2, source_target_pairs={{0,1},{1,0}}
  %ars = (f32[4]{0}, f32[8]{0}) all-reduce-start(%u, %v), channel_id=6, to_apply=%add
  %ard = (f32[4]{0}, f32[8]{0}) all-reduce-done(%ars)
  %ags = ((f32[2]{0}, f32[3]{0}), (f32[4]{0}, f32[6]{0})) all-gather-start(%u, %v), channel_id=7
  %agd = (f32[4]{0}, f32[6]{0}) all-gather-done(%ags)
  %cps = (bf16[16]{0}, bf16[16]{0}, u32[], u32[]) collective-permute-start(%y), channel_id=8
  %cpd = bf16[16]{0} collective-permute-done(%cps)
  %rss = ((f32[8]{0}), f32[4]{0}) async-start(%z), calls=%rs
  %rsd = f32[4]{0} async-done(%rss), calls=%rs
}

%cond (p: (s32[], f32[4,8])) -> pred[] {
  %any = pred[2]{0} all-reduce(%d), channel_id=3, replica_groups={{0,1}}, to_apply=%add
  ROOT %not = pred[] not(%any)
}

ENTRY %main (a: f32[4,8]) -> f32[4,8] {
  %ag = f32[8,8]{1,0} all-gather(%a), channel_id=4, dimensions={0}
  %loop = (s32[], f32[4,8]) while(%t0), condition=%cond, body=%body
}
"""


def test_collectives_are_counted_per_round_from_the_hlo():
  got = pod_plan.collectives_per_round(HLO)
  assert got["all-reduce"] == {"count": 5, "bytes": 3 * 4 * 8 * 4 + 2 + 48, "largest": 4 * 8 * 4}
  assert got["collective-permute"] == {"count": 2, "bytes": 32 + 32, "largest": 32}
  # The entry's all-gather is prefill, not a round; the condition-bounded loop's runs twice.
  assert got["all-gather"] == {"count": 3, "bytes": 2 * 16 + 40, "largest": 40}
  assert got["reduce-scatter"] == {"count": 1, "bytes": 16, "largest": 16}
  assert got["unknown_trip_counts"] == 0


def test_1b_plan_compiles_and_its_bytes_match_a_hand_computation(tmp_path):
  config = pod_plan_config.get_config("smoke")
  p = config.plan
  assert p.plans == ("llama3.2-1b:1x2x4",) and jax.device_count() == 8
  (row,) = pod_plan.run(config, str(tmp_path))
  assert json.load(open(tmp_path / "plan.json")) == [row]
  assert "| llama3.2-1b | data=1,fsdp=2,tensor=4 |" in (tmp_path / "plan.md").read_text()
  # By hand: bfloat16 weights of the verifier and its one-block feature drafter, split over 8
  # devices but for the norms (vectors: replicated); KV caches [L, B, S, K, H] with B over fsdp=2
  # and K over tensor=4.
  v_cfg = presets.config("llama3.2-1b", dtype="bfloat16")
  d_cfg = presets.block_drafter(v_cfg)
  weights = 2 * (presets.param_count(v_cfg) + presets.param_count(d_cfg)) / 8
  assert row["weights_per_device"] == pytest.approx(weights, rel=1e-3)
  caches = 2 * 2 * (v_cfg.n_layers + 1) * (8 // 2) * p.context * (8 // 4) * 64
  assert row["caches_per_device"] == caches
  assert row["memory"]["argument"] == pytest.approx(row["weights_per_device"], rel=1e-3)
  # Compiled: at least the weights and caches; at most those plus the two float32 copies of
  # every weight XLA:CPU keeps for its bfloat16 matmuls (two layouts) and 64 MiB of activations.
  floor = row["weights_per_device"] + row["caches_per_device"]
  assert floor <= row["bytes_per_device"] <= floor + 4 * row["weights_per_device"] + 2**26
  assert row["fits_v5e"] and row["fits_h100"]
  # Tensor-parallel matmuls all-reduce in every verifier layer (attention out, MLP down).
  assert row["collectives"]["all-reduce"]["count"] >= 2 * v_cfg.n_layers
  assert row["estimate"]["v5e"]["hbm_ms"] == pytest.approx(
      1e3 * row["hbm_bytes_per_round"] / pod_plan.CHIPS["v5e"].hbm_bytes_per_s, rel=1e-3)
  assert row["estimate"]["h100"]["ms"] < row["estimate"]["v5e"]["ms"]


def test_a_round_reads_an_untied_embedding_by_rows_only():
  """An 8B plan on tensor 8 (prepared, not compiled): a round reads each model's weights less its
  untied input embedding (gathered by rows), the verifier's once and the drafter's γ times, plus
  the caches; the embeddings still count in the bytes held."""
  p = pod_plan_config.get_config("smoke").plan
  plan = pod_plan.prepare("llama3.1-8b:1x1x8", p)
  v_params, d_params = plan["params"]
  tables = [pod_plan.shard_bytes(t["embed"]) for t in (v_params, d_params)]
  assert min(tables) > 0
  assert plan["weights"] == pod_plan.shard_bytes(v_params) + pod_plan.shard_bytes(d_params)
  v_cfg = presets.config("llama3.1-8b", dtype=p.dtype)
  d_cfg = presets.block_drafter(v_cfg)
  v_cache, d_cache = (pod_plan.cache_bytes(c, p.batch_size, p.context, plan["sizes"])
                      for c in (v_cfg, d_cfg))
  assert plan["read"] == (pod_plan.shard_bytes(v_params) - tables[0] + v_cache
                          + p.gamma * (pod_plan.shard_bytes(d_params) - tables[1] + d_cache))


@pytest.mark.parametrize("bug", [None, "the training placement", "no activation layout"])
def test_a_decode_round_moves_activations_not_weights(bug, tmp_path, monkeypatch, request):
  """Decoding on the mesh keeps every weight on its devices (`parallel.decode_param_rule`,
  `parallel.decoding_layout`): a round's all-gathers move activations only, each under a
  sixteenth of one layer's weights per device, and all of them under a sixteenth of the
  weights. Planted bugs: the weights placed by the training rule (gathered over 'fsdp' every
  round), or placed for decoding with the activations left to GSPMD (which then gathers weights
  to meet the batch-sharded activations)."""
  if bug:  # the layout is no jit cache key: trace the program anew (`fresh_programs`)
    request.getfixturevalue("fresh_programs")
  if bug == "the training placement":
    monkeypatch.setattr(parallel, "decode_param_shardings", parallel.param_shardings)
  elif bug:
    monkeypatch.setattr(parallel, "decoding_layout", lambda mesh: contextlib.nullcontext())
  (row,) = pod_plan.run(pod_plan_config.get_config("smoke"), str(tmp_path))
  cfg = presets.config("llama3.2-1b", dtype="bfloat16")
  d, f, heads = cfg.d_model, cfg.d_ff, (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim
  layer = 2 * (2 * d * heads + 3 * d * f) / 8  # bfloat16 q, k, v, o, gate, up, down on 8 devices
  gathers = row["collectives"]["all-gather"]
  stationary = gathers["largest"] < layer / 16 and gathers["bytes"] < row["weights_per_device"] / 16
  assert stationary == (bug is None), (gathers, layer, row["weights_per_device"])


@pytest.mark.parametrize("arg, message", [
    ("plans=llama3.2-1b:1x2x3", r"^plan.plans entry 'llama3.2-1b:1x2x3': tensor=3 does not "
                                r"divide the verifier's 32 query heads"),
    ("batch=5", r"^plan.batch_size=5 does not divide over data\*fsdp = 2"),
    ("plans=llama3.1-70b:1x8x8", r"^plan.plans entry 'llama3.1-70b:1x8x8' needs 64 devices but "
                                 r"there are 8. Fix: start with XLA_FLAGS="),
    ("must_fit=a100", r"^plan.must_fit='a100' is not a chip; choose one of v5e, h100"),
    ("plans=llama9:1x1x1", r"^plan.plans='llama9' is not a preset; presets: llama3.2-1b"),
    ("plans=llama3.2-1b:2x2", r"^plan.plans entry 'llama3.2-1b:2x2' is not "
                              r"PRESET:DATAxFSDPxTENSOR"),
    ("dtype=float64", r"^plan.dtype='float64' is not a dtype"),
    ("context=32", r"^plan.context=32 leaves no room for new tokens after plan.prompt_tokens=32"),
    ("plans=llama3.1-70b:1x1x8,batch=8,must_fit=v5e",
     r"^plan.must_fit='v5e': plan 'llama3.1-70b:1x1x8' needs 1[78]\.\d\d GiB per device \(weights "
     r"and caches alone, before compiling\), [12]\.\d\d GiB over v5e's 16.00 GiB"),
])
def test_bad_plans_are_refused_in_one_line_before_compiling(arg, message, tmp_path, monkeypatch):
  monkeypatch.setattr(pod_plan, "compile_plan", lambda *a: pytest.fail("compiled a bad plan"))
  with pytest.raises(ValueError, match=message) as e:
    pod_plan.run(pod_plan_config.get_config("smoke," + arg), str(tmp_path))
  assert "\n" not in str(e.value)
