"""Programs end to end on their smoke configs, and the launcher's handling of bad input."""

import json
import re
import os
import subprocess
import sys
import time

import pytest

from configs import benchmark as benchmark_config
from configs import benchmark_sampling as benchmark_sampling_config
from experiments.perf import config as perf_config
from configs import generate as generate_config
from configs import quickstart as quickstart_config
from configs import scale as scale_config
from spec_jax import cli
from spec_jax import testing
from spec_jax.programs import benchmark, benchmark_sampling, cost_model, generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(*args, timeout=300):
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  return subprocess.run([sys.executable, "launch.py", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_generate_smoke(tmp_path):
  config = generate_config.get_config("smoke")
  config.prompts = ("To be", "or not", "to be")
  rows = generate.run(config, str(tmp_path))
  assert [r["prompt"] for r in rows] == ["To be", "or not", "to be"]
  assert all(0 < r["new_tokens"] <= 8 for r in rows)
  saved = [json.loads(l) for l in open(tmp_path / "generations.jsonl")]
  assert saved == rows
  # With a drafter (greedy): the verifier's own text, and each prompt's τ.
  config.method = "sd"
  sd = generate.run(config, str(tmp_path / "sd"))
  assert [r["completion"] for r in sd] == [r["completion"] for r in rows]
  assert all(1.0 <= r["block_efficiency"] <= config.gamma + 1 and r["verifier_calls"] >= 1
             for r in sd)
  # Prompt lookup, alone and over the drafter: the verifier's own text too.
  for method in ("lookup", "sd_lookup"):
    config.method = method
    looked = generate.run(config, str(tmp_path / method))
    assert [r["completion"] for r in looked] == [r["completion"] for r in rows]


def test_generate_prompts_file_and_errors(tmp_path):
  config = generate_config.get_config("smoke")
  config.prompts = ()
  path = tmp_path / "prompts.txt"
  path.write_text("first\\nline\n\nsecond\n")
  config.prompts_file = str(path)
  rows = generate.run(config, str(tmp_path / "out"))
  assert [r["prompt"] for r in rows] == ["first\nline", "second"]
  # The file replaces the config's own prompts (an explicit mix keeps both); JSON lines work.
  from spec_jax.data import prompts as prompts_lib
  config.prompts = ("inline",)
  assert prompts_lib.read_prompts(config, None) == ["first\nline", "second"]
  assert prompts_lib.prompt_source(config) == "file:prompts.txt"
  config.prompts_mix = True
  assert prompts_lib.read_prompts(config, None) == ["inline", "first\nline", "second"]
  config.prompts_mix = False
  jsonl = tmp_path / "prompts.jsonl"
  jsonl.write_text('{"prompt": "a\\nb", "id": 1}\n\n{"prompt": "c"}\n')
  config.prompts_file = str(jsonl)
  assert prompts_lib.read_prompts(config, None) == ["a\nb", "c"]
  for text, message in (("\n  \n", "holds no prompts"), ('{"text": "x"}\n', 'string "prompt"'),
                        ("{oops\n", "line 1 starts with '{' but is not valid JSON"),
                        ('{"prompt": "a"}\n\n{"prompt": ""}\n', 'line 3: the "prompt" is empty')):
    jsonl.write_text(text)
    with pytest.raises(ValueError, match=message):
      prompts_lib.read_prompts(config, None)
  config.prompts_file = ""
  config.prompts = ("x" * 100,)
  with pytest.raises(ValueError, match="Prompt 0 has 100 tokens but generation.max_prompt_tokens=64"):
    generate.run(config, str(tmp_path / "out"))
  config.prompts, config.prompts_file = (), ""
  with pytest.raises(ValueError, match="No prompts"):
    generate.run(config, str(tmp_path / "out"))


def test_benchmark_smoke_writes_rows(tmp_path):
  rows = benchmark.run(benchmark_config.get_config("smoke"), str(tmp_path))
  saved = json.load(open(tmp_path / "results.json"))
  assert saved == rows and [r["batch_size"] for r in rows] == [1, 2]
  for row in rows:
    assert {"method", "batch_size", "new_tokens", "tokens_per_s", "ms_per_token",
            "device"} <= set(row)
    assert (row["preset"], row["dtype"], row["device_kind"]) == (None, "float32", "cpu")
    assert row["xla_flags"] == os.environ.get("XLA_FLAGS", "")
    assert row["tokens_per_s"] > 0
    # Tolerances cover the rows' rounding (ms to 3 decimals, tokens/s to 2), whatever the speed.
    roof = row["roofline_ms_per_step"]
    assert row["ms_per_token"] == pytest.approx(1000 / row["tokens_per_s"], rel=1e-2, abs=1e-3)
    assert row["memory_bandwidth_gb_s"] > 0
    assert row["roofline_ms_per_token"] == pytest.approx(
        row["roofline_ms_per_step"] / row["batch_size"], rel=1e-2)
    assert row["vs_roofline"] == pytest.approx(row["ms_per_step"] / roof, rel=2e-2,
                                               abs=1e-3 + 1e-3 / roof)
    # Prefill (one new token) and the decode steps after it, from calls timed in the same turns.
    assert row["prefill_ms"] > 0
    assert row["ms_per_decode_step"] == pytest.approx(
        (row["ms_per_step"] * row["new_tokens"] - row["prefill_ms"]) / (row["new_tokens"] - 1),
        rel=2e-2, abs=1e-2)
    assert row["decode_vs_roofline"] == pytest.approx(
        row["ms_per_decode_step"] / roof, rel=2e-2, abs=1e-3 + 1e-3 / roof)


def test_a_benchmark_on_a_mesh_bounds_a_step_by_one_devices_share_of_the_weights(tmp_path):
  """Each device reads its own shard of the weights from its own memory: the roofline's bytes
  are one device's (timing.shard_bytes), not the whole model's against one device's bandwidth."""
  import jax  # noqa: PLC0415 (after conftest's fake devices)
  from spec_jax import loading, parallel  # noqa: PLC0415
  from spec_jax.data import tokenizer as tokenizer_lib  # noqa: PLC0415
  from spec_jax.evaluation import timing  # noqa: PLC0415
  config = benchmark_config.get_config("smoke")
  config.mesh.update(data=1, fsdp=2, tensor=2)
  config.benchmark.batch_sizes = (2,)
  (row,) = benchmark.run(config, str(tmp_path))
  assert row["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2}
  _, params = loading.load_model(config.model, tokenizer_lib.get_tokenizer(config.tokenizer),
                                 seed=config.seed)
  placed = parallel.place_params(params, parallel.decode_mesh(config.mesh))
  held = sum(s.data.nbytes for x in jax.tree.leaves(placed) for s in x.addressable_shards
             if s.device == jax.devices()[0])
  assert timing.shard_bytes(placed) == held < timing.param_bytes(params)
  want = timing.decode_read_bytes(placed, timing.shard_bytes)
  assert row["roofline_ms_per_step"] * row["memory_bandwidth_gb_s"] * 1e6 == pytest.approx(
      want, rel=2e-2)


def test_benchmark_sampling_smoke_writes_rows(tmp_path):
  rows = benchmark_sampling.run(benchmark_sampling_config.get_config("smoke"), str(tmp_path))
  assert json.load(open(tmp_path / "results.json")) == rows
  assert [(r["site"], r["batch_size"]) for r in rows] == [
      (site, 2) for site in ("sample", "gumbel_top_k", "law_check")]
  for row in rows:
    assert row["ms"] > 0 and row["baseline_ms"] > 0
    assert row["ratio"] == pytest.approx(row["ms"] / row["baseline_ms"], rel=0.05,
                                         abs=1e-3 + 1e-4 / row["baseline_ms"])


def test_cost_model_smoke_writes_rows(tmp_path, monkeypatch):
  from spec_jax.decoding import generate as generate_lib
  generate, ar_temperatures = generate_lib.generate, set()

  def recording(*args, sampling, **kwargs):
    ar_temperatures.add(float(sampling.temperature))
    return generate(*args, sampling=sampling, **kwargs)

  monkeypatch.setattr(generate_lib, "generate", recording)
  rows = cost_model.run(perf_config.get_config("smoke"), str(tmp_path))
  # Each temperature's speculative row divides by autoregressive decoding at that temperature.
  assert ar_temperatures == {0.0, 1.0}
  assert json.load(open(tmp_path / "results.json")) == rows
  verifier = [r for r in rows if r["model"] == "verifier"]
  assert [(r["batch_size"], r["T"]) for r in verifier] == [(b, t) for b in (1, 2) for t in (1, 2, 5)]
  assert all(r["r"] == 1.0 for r in verifier if r["T"] == 1)
  assert all(r["ms_min"] <= r["ms"] <= r["ms_max"] for r in rows
             if r["model"] in ("verifier", "drafter"))
  for r in verifier:  # ms rounded to 3 decimals: the tolerance covers it at any speed
    one = next(v["ms"] for v in verifier if v["T"] == 1 and v["batch_size"] == r["batch_size"])
    assert r["r"] == pytest.approx(r["ms"] / one, rel=0.02, abs=1e-3 + 1e-3 * (1 + r["ms"]) / one)
  drafter = [r for r in rows if r["model"] == "drafter"]
  assert [r["batch_size"] for r in drafter] == [1, 2] and all(r["c"] > 0 for r in drafter)
  md = open(tmp_path / "results.md").read()
  assert "| T |" in md and (tmp_path / "r_of_t.png").stat().st_size > 0
  # The theory checked against chain SD decoded in the same turns, one row per (γ, T).
  checks = [r for r in rows if r["model"] == "speculative"]
  assert [(r["gamma"], r["temperature"]) for r in checks] == [(2, 0.0), (2, 1.0)]
  for r in checks:
    assert 1.0 <= r["tau"] <= 3.0 and r["d"] == 2 and r["r"] > 0 and r["c"] > 0
    assert r["speedup"] == pytest.approx(r["ar_ms"] / r["ms"], rel=0.02)
    assert r["theoretical_speedup"] == pytest.approx(r["tau"] / (r["r"] + 2 * r["c"]), rel=0.01)
    # The row keeps 4 decimals: at the smoke's tiny ratios (~0.02) that is up to 5e-5 apart.
    assert r["speedup_vs_theory"] == pytest.approx(
        r["speedup"] / r["theoretical_speedup"], rel=0.02, abs=5e-5)
  assert "## The theory against measured speedups: batch 1" in md


def _spells(monkeypatch, reference):
  """Plants a slow spell in the first and the last of every three timings of `timing.round_robin`
  whose calls include `reference(name)`: the reference 1000× slower, every other call 500×,
  memory reads as fast (a shared VM's spells: ~3× and ~2×, scaled up so that no load on the
  machine running the test can make a spelled timing the fastest). Returns the list of timings
  (as the program got them) and the list of pauses slept."""
  from spec_jax.evaluation import timing
  plain, timings, pauses = timing.round_robin, [], []

  def spelled(fns, *args, **kwargs):
    times = plain(fns, *args, **kwargs)
    if not any(reference(k) for k in fns):  # the memory bandwidth's own reads
      return times
    if len(timings) % 3 != 1:
      times = {k: {f: v * (1e3 if reference(k) else 1.0 if "read" in str(k) else 5e2)
                   if f.endswith("_s") else v for f, v in t.items()} for k, t in times.items()}
    timings.append(times)
    return times

  class Clock:  # the timing module's `time`, its pauses recorded instead of slept; the time
    # module itself untouched (other code sleeps too: the compilation cache's file lock polls)
    sleep = staticmethod(pauses.append)

    def __getattr__(self, name):
      return getattr(time, name)

  monkeypatch.setattr(timing, "round_robin", spelled)
  monkeypatch.setattr(timing, "time", Clock())
  return timings, pauses


def test_cost_model_and_benchmark_keep_the_timing_outside_a_slow_spell(tmp_path, monkeypatch):
  """`cost.timings` timings per batch size, `cost.pause_s` apart and doubling, the verifier and
  the drafters timed in turns in each: rows come from the one timing whose verifier one-token
  forward ran fastest. A planted spell slows the first and the last timing: keeping either of
  them, or timing the drafters apart from the verifier, gives other r and c. The same for
  `benchmark.timings`, whose reference is the first batch size's decode."""
  timings, pauses = _spells(monkeypatch, lambda k: k in (("v", 1),) or (
      isinstance(k, tuple) and k[0] == "verifier" and k[-1] == 1))
  config = scale_config.get_config("smoke,cost,check,timings=3")
  config.cost.update(tokens=(1, 3), batch_sizes=(1,), pause_s=2.0)
  rows = cost_model.run(config, str(tmp_path))
  assert len(timings) == 6 and pauses == [2.0, 4.0, 2.0, 4.0]  # the cost timing, the check's
  kept = timings[1]
  v_head = next(r["vocab"] for r in rows if r["model"] == "verifier")
  one = kept["verifier", v_head, 1]["median_s"]
  refs = [t["verifier", v_head, 1]["median_s"] for t in timings[:3]]
  for r in (r for r in rows if r["model"] in ("verifier", "drafter")):
    got = kept[r["model"], r["vocab"], r["T"]]["median_s"]
    assert r["ms"] == round(1e3 * got, 3)
    assert r["r" if r["model"] == "verifier" else "c"] == round(
        got / one, 3 if r["model"] == "verifier" else 4)
    assert (r["timings"], r["reference_spread"]) == (3, round(max(refs) / one, 3))
    assert r["reference_spread"] > 10
  checked = [r for r in rows if r["model"] == "speculative"]
  assert checked and all(r["timings"] == 3 for r in checked)
  for r in checked:
    assert r["r"] == round(timings[4]["v", r["verifier_tokens_per_call"]]["median_s"]
                           / timings[4]["v", 1]["median_s"], 3)
  assert "3 timings at each batch size" in (tmp_path / "results.md").read_text()
  config.cost.timings = 0
  with pytest.raises(ValueError, match=r"^cost.timings=0 must be an integer >= 1 \(timings"):
    cost_model.run(config, "/nonexistent/never-written")
  config.cost.update(timings=2, pause_s=-1.0)
  with pytest.raises(ValueError, match=r"^cost.pause_s=-1.0 must be a number of seconds >= 0"):
    cost_model.run(config, "/nonexistent/never-written")

  monkeypatch.undo()
  timings, pauses = _spells(monkeypatch, lambda k: k == 1)
  config = scale_config.get_config("smoke,timings=3")
  config.benchmark.update(batch_sizes=(1, 2), pause_s=0.5)
  rows = benchmark.run(config, str(tmp_path / "bench"))
  assert len(timings) == 3 and pauses == [0.5, 1.0]
  kept = timings[1]
  for r in rows:
    step = kept[r["batch_size"]]["median_s"] / r["new_tokens"]
    assert r["ms_per_step"] == round(1e3 * step, 3)
    assert (r["timings"], r["reference_spread"]) == (
        3, round(max(t[1]["median_s"] for t in timings) / kept[1]["median_s"], 3))
  config.benchmark.timings = 0
  with pytest.raises(ValueError, match=r"^benchmark.timings=0 must be an integer >= 1"):
    benchmark.run(config, "/nonexistent/never-written")


def test_scale_smoke_random_prompts_feature_drafter_and_theory_rows(tmp_path):
  """configs/scale.py: the benchmark on random prompts (no corpus), and the cost model of a
  random one-block feature drafter (no checkpoint) with the theory at a τ measured elsewhere."""
  config = scale_config.get_config("smoke,batch_sizes=1")
  config.benchmark.batch_sizes = (1,)
  (row,) = benchmark.run(config, str(tmp_path / "bench"))
  assert (row["batch_size"], row["prompt_tokens"], row["new_tokens"], row["loop"]) == (
      1, 8, 4, "fixed")
  config.benchmark.loop = "while"  # the loop that stops on stop tokens, timed instead
  assert benchmark.run(config, str(tmp_path / "bench"))[0]["loop"] == "while"
  config.benchmark.loop = "until"
  with pytest.raises(ValueError, match="benchmark.loop='until': 'fixed'"):
    benchmark.run(config, str(tmp_path / "bench"))
  config = scale_config.get_config("smoke,cost")
  config.cost.update(tokens=(1, 5), batch_sizes=(1,), passes=2)
  rows = cost_model.run(config, str(tmp_path / "cost"))
  assert {r["passes"] for r in rows if r["model"] in ("verifier", "drafter")} == {2}
  # The drafter at the smoke's two vocabularies: all of the verifier's tokens, and 64.
  (verifier_1,) = [r for r in rows if r["model"] == "verifier" and r["T"] == 1]
  drafters = {r["vocab"]: r for r in rows if r["model"] == "drafter" and r["T"] == 1}
  assert sorted(drafters) == [64, verifier_1["vocab"]] and verifier_1["vocab"] > 64
  for d in drafters.values():  # ms kept to 3 decimals and c to 4: the bound holds at any speed
    v_ms = verifier_1["ms"]
    spread = (d["ms"] + 5e-4) / (v_ms - 5e-4) - d["ms"] / v_ms
    assert abs(d["c"] - d["ms"] / v_ms) <= 5e-5 + spread + 1e-9
  theory = [r for r in rows if r["model"] == "theory"]
  r5 = next(r["r"] for r in rows if r["model"] == "verifier" and r["T"] == 5)
  # One row per τ of configs/scale.py (the task suite's, the best in-domain drafter's) and per
  # drafter vocabulary, each with that drafter's c.
  assert [(r["gamma"], r["tau"], r["vocab"], r["r"], r["c"]) for r in theory] == [
      (4, tau, v, r5, drafters[v]["c"]) for tau in (1.34, 2.33)
      for v in (verifier_1["vocab"], 64)]
  for r in theory:
    assert r["theoretical_speedup"] == pytest.approx(r["tau"] / (r5 + 4 * r["c"]), rel=2e-3)
    assert r["break_even_tau"] == pytest.approx(r5 + 4 * r["c"], rel=2e-3, abs=1e-3)
  # configs/scale.py's tree (the smoke's dyn:2-4@4: 5 tokens a verifier call, drafter calls on
  # 1, 2, 2 and 2 tokens) beside the chain at its depth, per drafter vocabulary: its drafting
  # cost sums the drafter's timed calls at those widths.
  trees = [r for r in rows if r["model"] == "tree_theory"]
  assert [(r["method"], r["T"], r["call_widths"], r["vocab"]) for r in trees] == [
      ("dyn:2-4@4", 5, [1, 2, 2, 2], v) for v in (verifier_1["vocab"], 64)]
  drafter_ms = {(r["vocab"], r["T"]): r["ms"] for r in rows if r["model"] == "drafter"}
  for r in trees:
    ms = [drafter_ms[r["vocab"], w] for w in r["call_widths"]]
    v_ms = verifier_1["ms"]
    spread = (sum(ms) + 2e-3) / (v_ms - 5e-4) - sum(ms) / v_ms  # the ms rows' rounding
    assert abs(r["drafter_c"] - sum(ms) / v_ms) <= 5e-5 + spread + 1e-9
    assert (r["r"], r["chain_r"], r["c"]) == (r5, r5, drafters[r["vocab"]]["c"])
    assert r["theoretical_speedup"] == pytest.approx(r["tau"] / (r5 + r["drafter_c"]), rel=2e-3)
    assert r["break_even_tau"] == pytest.approx(r5 + r["drafter_c"], rel=2e-3, abs=1e-3)
    assert r["chain_theoretical_speedup"] == pytest.approx(
        r["chain_tau"] / (r5 + 4 * r["c"]), rel=2e-3)
    assert r["vs_chain"] == pytest.approx(
        r["theoretical_speedup"] / r["chain_theoretical_speedup"], rel=2e-3)
  md = (tmp_path / "cost" / "results.md").read_text()
  assert "at a τ measured elsewhere" in md and "| break-even τ |" in md
  assert "| 1 | dyn:2-4@4 (M = 5) |" in md
  # `check`: the theory against chain SD and the tree on random prompts (the config has no
  # data section), each round's cost r(M) + Σ_w c(w) from forwards timed in the same turns.
  config = scale_config.get_config("smoke,cost,check")
  config.cost.update(tokens=(1, 3), batch_sizes=(1,))
  checks = [r for r in cost_model.run(config, str(tmp_path / "check"))
            if r["model"] == "speculative"]
  assert [(r["method"], r["gamma"], r["verifier_tokens_per_call"], r["d"], r["temperature"],
           r["num_prompts"]) for r in checks] == [("sd@2", 2, 3, 2, 0.0, 2),
                                                  ("dyn:2-4@4", 4, 5, 4, 0.0, 2)]
  for r in checks:
    assert 1.0 <= r["tau"] <= r["gamma"] + 1 and r["drafter_c"] > 0
    assert r["theoretical_speedup"] == pytest.approx(r["tau"] / (r["r"] + r["drafter_c"]),
                                                     rel=2e-3)
  # The chain's calls are one token each: its drafting is γ·c.
  assert checks[0]["drafter_c"] == pytest.approx(2 * checks[0]["c"], rel=1e-3)
  assert "| dyn:2-4@4 | 5 | 0 |" in (tmp_path / "check" / "results.md").read_text()
  config.cost.check.prompts = "corpus"
  with pytest.raises(ValueError, match=r"^cost.check.prompts='corpus' must be 'data'"):
    cost_model.run(config, "/nonexistent/never-written")


def test_quickstart_smoke(tmp_path, capsys):
  """The quickstart's smoke config, dispatched as launch.py does, in this process: it reuses the
  programs the other tests here compiled (the launcher's own handling is tested through it in
  tests/test_console.py and tests/test_multihost.py)."""
  workdir = str(tmp_path / "qs")
  testing.dispatch(quickstart_config.get_config("smoke"), workdir)
  out = capsys.readouterr().out
  summary = json.load(open(os.path.join(workdir, "quickstart.json")))
  assert summary["generate"]["prompts"] == 4
  assert summary["drafter"]["step"] == 20
  # The table's prompts: the suite's math category, written before any work and read by
  # every drafter's evaluate run.
  assert summary["prompts"]["categories"] == ["math"]
  (prompts_file,) = os.listdir(os.path.join(workdir, "prompts"))
  rows = json.load(open(os.path.join(workdir, "evaluate_math", "results.json")))
  assert {r["method"] for r in rows} == {"autoregressive", "sd"}
  assert {r["dataset"] for r in rows} == {f"file:{prompts_file}"}
  assert os.path.isdir(os.path.join(workdir, "drafter", "checkpoints", "20"))
  # The second stage starts from the first: one of its blocks, 64 tokens of its vocabulary.
  assert summary["reduced"]["step"] == 4 and summary["reduced"]["program"] == "distill"
  from spec_jax.training import checkpoints  # noqa: PLC0415
  model = checkpoints.read_meta(os.path.join(workdir, "reduced"))["model"]
  assert model["n_layers"] == 1 and len(model["head_ids"]) == 64
  rows = json.load(open(os.path.join(workdir, "evaluate_reduced_math", "results.json")))
  assert {r["method"] for r in rows} == {"autoregressive", "sd"}
  assert summary["best"]["drafter"] in ("drafter", "reduced")
  assert summary["best_by_category"]["math"] == summary["best"]
  assert "\nmath:\n" in out and "math: best measured speedup" in out


def test_xla_defaults_add_only_flags_the_user_left_unset():
  triton = "--xla_gpu_enable_triton_gemm=false"
  order = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
  env = {}
  assert cli.set_xla_defaults(env) == f"{triton} {order}" == env["XLA_FLAGS"]
  env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
  assert cli.set_xla_defaults(env) == f"--xla_dump_to=/tmp/x {triton} {order}"
  for own in ("--xla_gpu_enable_triton_gemm=true", "--xla_gpu_enable_triton_gemm"):
    env = {"XLA_FLAGS": f"{own} --xla_dump_to=/tmp/x"}
    assert cli.set_xla_defaults(env) == f"{own} --xla_dump_to=/tmp/x {order}"
  assert cli.set_xla_defaults(env) == env["XLA_FLAGS"]  # idempotent
  assert "NPROC" not in env  # one device: XLA's own thread count
  own = "--xla_cpu_enable_concurrency_optimized_scheduler=true"
  env = {"XLA_FLAGS": own}
  assert cli.set_xla_defaults(env) == f"{own} {triton}"
  # Fake devices keep XLA's own order (their collectives share its thread pool).
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  assert cli.set_xla_defaults(env) == f"--xla_force_host_platform_device_count=8 {triton}"


def test_malloc_defaults_fix_glibcs_thresholds_unless_the_user_set_one(monkeypatch):
  """cli.set_malloc_defaults: mallopt(M_MMAP_THRESHOLD = -3, 32 MiB) and (M_TRIM_THRESHOLD = -1,
  256 MiB), glibc's parameter numbers (malloc.h), on glibc only, and nothing where the user set
  a tunable of their own (a fake C library records the calls)."""
  import ctypes  # noqa: PLC0415
  import platform  # noqa: PLC0415
  calls = []

  class Libc:
    def mallopt(self, param, value):
      calls.append((param, value))
      return 1

  monkeypatch.setattr(ctypes, "CDLL", lambda name: Libc())
  monkeypatch.setattr(platform, "libc_ver", lambda: ("glibc", "2.36"))
  assert cli.set_malloc_defaults({}) == ["M_MMAP_THRESHOLD", "M_TRIM_THRESHOLD"]
  assert calls == [(-3, 32 << 20), (-1, 256 << 20)]
  for own in ({"MALLOC_TRIM_THRESHOLD_": "1"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}):
    assert cli.set_malloc_defaults(own) == []
  monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))  # another C library
  assert cli.set_malloc_defaults({}) == [] and len(calls) == 2


def test_fake_cpu_devices_get_threads_for_their_collectives(monkeypatch):
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  cli.set_xla_defaults(env)
  assert env["NPROC"] == str(cli.cpu_threads(8)) and cli.cpu_threads(8) >= 32
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "NPROC": "3"}
  cli.set_xla_defaults(env)
  assert env["NPROC"] == "3"  # the user's own setting wins
  # This test process too (conftest.py: 8 fake devices).
  assert os.environ["NPROC"] == str(cli.cpu_threads(8))
  # Never fewer threads than cores (XLA's default, which also sets its intra-op parallelism).
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
  assert cli.cpu_threads(8) == 64


def test_quickstart_default_is_the_sharegpt_drafter_on_chat_and_code():
  from configs import distill as distill_config  # noqa: PLC0415
  from configs import quickstart as quickstart_config  # noqa: PLC0415
  config = quickstart_config.get_config()
  data = config.drafter.data
  assert (data.name, data.source, data.temperature, data.verifier_batches) == (
      "spec_jax_sharegpt", "verifier", 1.0, 64)
  assert config.drafter.drafter.size == distill_config.FEATURE_DRAFTER
  assert config.drafter.train.num_steps == 400
  # One stage: the feature drafter's vocabulary is reduced from the start.
  assert tuple(config.stages) == ("drafter",)
  assert tuple(config.suite.categories) == ("chat", "code")
  # Shakespeare stays a recipe, with evaluate's own (Shakespeare) prompts.
  shakespeare = quickstart_config.get_config("recipe=shakespeare")
  assert shakespeare.drafter.data.name == "spec_jax_shakespeare"
  assert tuple(shakespeare.suite.categories) == ()
  assert tuple(shakespeare.stages) == ("drafter",)
  assert tuple(quickstart_config.get_config("recipe=vinit").stages) == ("drafter", "reduced")
  assert tuple(quickstart_config.get_config("categories=chat+math").suite.categories) == (
      "chat", "math")


def test_quickstart_checks_pass_for_every_recipe(tmp_path):
  """The checks before the first stage hold for each recipe as shipped (a later stage is
  checked starting from the stage before it, as it runs)."""
  from configs import quickstart as quickstart_config  # noqa: PLC0415
  from spec_jax.programs import quickstart  # noqa: PLC0415
  for recipe in quickstart_config.RECIPES:
    for arg in (f"recipe={recipe}", f"smoke,recipe={recipe}"):
      quickstart.check_config(quickstart_config.get_config(arg), str(tmp_path / arg))


@pytest.mark.parametrize("categories, message", [
    (("chat", "poetry"), r"suite.categories=\('chat', 'poetry'\): 'poetry' is not a category"),
    (("chat_turn2",), "chat_turn2 needs the verifier's first answers"),
])
def test_quickstart_refuses_bad_categories_before_any_work(tmp_path, monkeypatch, categories,
                                                           message):
  from configs import quickstart as quickstart_config  # noqa: PLC0415
  from spec_jax import testing  # noqa: PLC0415
  from spec_jax.programs import quickstart  # noqa: PLC0415
  config = quickstart_config.get_config("smoke")
  config.suite.categories = categories
  monkeypatch.setattr(generate, "run", testing.refuse)
  with pytest.raises(ValueError, match=message):
    quickstart.run(config, str(tmp_path))
  assert not os.path.exists(tmp_path / "prompts")


def test_quickstart_refuses_a_prompt_the_cache_cannot_hold(tmp_path, monkeypatch):
  from configs import quickstart as quickstart_config  # noqa: PLC0415
  from spec_jax import testing  # noqa: PLC0415
  from spec_jax.programs import quickstart  # noqa: PLC0415
  config = quickstart_config.get_config("smoke")
  config.evaluate.eval.max_cache_len = 64
  monkeypatch.setattr(generate, "run", testing.refuse)
  with pytest.raises(ValueError, match=r"evaluate.eval.max_cache_len=64 is too small: .*math "
                                       r"prompt.*Fix: --config.evaluate.eval.max_cache_len="):
    quickstart.run(config, str(tmp_path))


@pytest.mark.parametrize("args, message", [
    (["--config.generation.bogus=1"],
     "Unknown config key 'generation.bogus'.*Known fields there: \\['batch_size'"),
    (["--config.nope=1"], "Unknown config key 'nope'"),
    (["--config.generation.max_new_tokens=many"], "--config.generation.max_new_tokens=many"),
    (["--config.program=fly"], "config.program='fly' is not a program"),
    (["--config.prompts=(1,2)"], r"prompts is a tuple of str"),
])
def test_launcher_rejects_bad_config(tmp_path, args, message):
  result = _launch("--config", "configs/generate.py:smoke", "--workdir", str(tmp_path), *args,
                   timeout=300)
  assert result.returncode != 0
  assert re.search(message, result.stderr), result.stderr[-2000:]


@pytest.mark.parametrize("args, message", [
    (["--config", "configs/evaluate.py:colour=red"], r"FATAL --config=configs/evaluate.py:"
     r"colour=red does not load: ValueError: Unknown config argument 'colour'; known: "),
    (["--config", "configs/evaluate.py:gammas=2+x"],
     r"Config argument 'gammas' must be ints joined by '\+' \(e.g. gammas=1\+2\), got '2\+x'"),
    (["--config=configs/evalute.py"], r"FATAL --config=configs/evalute.py: no such config file\. "
     r"Fix: a path to a config \(`python launch.py --help` lists them\)"),
    ([], r"FATAL --config is required: python launch.py --config configs/<name>.py"),
    (["--config", "configs/evaluate.py", "--num_processes=two"],
     r"FATAL flag --num_processes=two: invalid literal"),
])
def test_a_command_line_the_flags_refuse_ends_with_one_line(tmp_path, args, message):
  """A config file that does not load (an unknown or malformed `:arg`, a mistyped path), a missing
  --config or a malformed flag: one line, no traceback, nothing written; --verbose keeps it."""
  workdir = tmp_path / "w"
  result = _launch(*args, "--workdir", str(workdir), timeout=300)
  assert result.returncode == 1, result.stderr[-2000:]
  assert re.search(message, result.stderr), result.stderr[-2000:]
  assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
  assert not workdir.exists()
  if args:
    verbose = _launch(*args, "--workdir", str(workdir), "--verbose", timeout=300)
    assert verbose.returncode == 1 and "Traceback" in verbose.stderr


def test_a_workdir_that_cannot_hold_results_ends_with_one_line(tmp_path):
  (tmp_path / "file").write_text("")
  # `--workdir --dry_run`: the value left out, the next flag taken for it.
  flag = tmp_path / "--dry_run"
  for workdir, message in ((tmp_path / "file", r"is a file; results go into a directory"),
                           (tmp_path / "file" / "below", r"cannot be created \(Not a directory\)"),
                           (flag, r"looks like a flag, not a folder")):
    result = _launch("--config", "configs/methods.py", "--workdir", str(workdir), timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    assert re.fullmatch(rf"FATAL --workdir='{workdir}' {message}.*Fix: .*\n", result.stderr), (
        result.stderr[-2000:])
  assert not flag.exists()
  result = _launch("--config", "configs/methods.py", "--workdir", str(tmp_path / "w"), "extra",
                   timeout=300)
  assert result.returncode == 1
  assert re.fullmatch(r"FATAL Unexpected arguments: \['extra'\]\. Fix: .*\n", result.stderr)


def test_help_lists_programs_and_configs_and_dry_run_runs_nothing(tmp_path):
  result = _launch("--help", timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  for name in ("train_steering", "evaluate", "configs/quickstart.py",
               "experiments/steering/config.py", "--dry_run"):
    assert name in result.stdout, name
  workdir = tmp_path / "never"
  result = _launch("--config", "configs/evaluate.py:gammas=4", "--config.eval.num_prompts=7",
                   "--dry_run", "--workdir", str(workdir), timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "num_prompts: 7" in result.stdout and "program: evaluate" in result.stdout
  assert not workdir.exists()
  result = _launch("--config", "configs/evaluate.py:smoke", timeout=300)
  assert result.returncode != 0 and "--workdir is required" in result.stderr


@pytest.mark.parametrize("value", ["abc", "(2.5,)", "(2,'x')"])
def test_tuple_overrides_are_type_checked(tmp_path, value):
  result = _launch("--config", "configs/evaluate.py:smoke", "--workdir", str(tmp_path),
                   f"--config.eval.gammas={value}", timeout=300)
  assert result.returncode != 0
  assert re.search(r"eval.gammas is a tuple of int \(default \(1, 3\)\)", result.stderr), (
      result.stderr[-2000:])
  ok = _launch("--config", "configs/evaluate.py:smoke", "--config.eval.gammas=(2,5)",
               "--config.eval.temperatures=(0,0.5)", "--dry_run", timeout=300)
  assert ok.returncode == 0, ok.stderr[-2000:]


def test_bad_input_ends_with_one_line_and_verbose_keeps_the_traceback(tmp_path):
  args = ("--config", "configs/evaluate.py:smoke", "--workdir", str(tmp_path / "w"),
          "--config.eval.temperatures=(0.0,-1.0)")
  result = _launch(*args, timeout=300)
  assert result.returncode == 1
  assert ("Error (ValueError): eval.temperatures has -1.0: a temperature must be >= 0"
          in result.stderr) and "Traceback" not in result.stderr
  assert "num_prompts: 3" not in result.stderr + result.stdout  # no config dump
  assert '"temperatures"' in (tmp_path / "w" / "config.json").read_text()
  # A workdir's record of earlier runs survives a refused one.
  (tmp_path / "w" / "config.json").write_text('{"an": "earlier run"}')
  verbose = _launch(*args, "--verbose", timeout=300)
  assert verbose.returncode == 1 and "Traceback" in verbose.stderr
  assert "num_prompts: 3" in verbose.stderr  # the config, logged
  assert (tmp_path / "w" / "config.json").read_text() == '{"an": "earlier run"}'


def test_config_arg_errors():
  with pytest.raises(ValueError, match="Unknown config argument 'colour'"):
    generate_config.get_config("colour=red")
  with pytest.raises(ValueError, match="'new_tokens' must be int"):
    generate_config.get_config("new_tokens=lots")
  from configs import scale as scale_config  # noqa: PLC0415
  with pytest.raises(ValueError, match=r"'tokens' must be ints joined by '\+'.*got '1\+2\.5'"):
    scale_config.get_config("cost,tokens=1+2.5")
  assert scale_config.get_config("cost,tokens=1+4").cost.tokens == (1, 4)
  # A smoke variant keeps what the argument sets (it used to train FKL whatever was asked).
  from configs import distill as distill_config
  assert distill_config.get_config("smoke,divergence=kl").distill.divergence == "kl"
  assert distill_config.get_config("smoke").distill.divergence == "fkl"


def test_evaluate_smoke_rows_and_report(tmp_path, monkeypatch):
  from configs import evaluate as evaluate_config
  from spec_jax.programs import evaluate
  config = evaluate_config.get_config("smoke")
  config.eval.save_text = True
  rows = evaluate.run(config, str(tmp_path))
  texts = [json.loads(line) for line in open(tmp_path / "texts.jsonl")]
  assert len(texts) == 2 * 2 * 3 and {"prompt", "completion", "gamma", "method"} <= set(texts[0])
  assert len(rows) == 6
  keys = {"method", "gamma", "block_efficiency", "mean_accepted_tokens", "acceptance_rate",
          "empirical_acceptance", "per_position_acceptance", "verifier_calls", "drafter_calls",
          "tokens_per_s", "speedup", "cost_ratio_c", "theoretical_speedup", "speedup_vs_theory",
          "verifier_tokens_per_call", "seed", "identical_to_greedy", "cpu_per_wall"}
  for row in rows:
    assert keys <= set(row), keys - set(row)
    assert row["cpu_per_wall"] > 0  # its timed pass ran (a paused one reads near 0)
    if row["method"] == "sd":
      assert 1.0 <= row["block_efficiency"] <= row["gamma"] + 1
      assert row["verifier_tokens_per_call"] == row["gamma"] + 1
      assert len(row["per_position_acceptance"]) == row["gamma"]
      assert row["drafter_calls"] == row["verifier_calls"] * row["gamma"]
      if row["temperature"] == 0.0:
        assert row["identical_to_greedy"] is True
      # Per-prompt counts, for paired comparisons of rows over the same prompts.
      per_tokens, per_calls = row["prompt_new_tokens"], row["prompt_verifier_calls"]
      assert len(per_tokens) == len(per_calls) == row["num_prompts"] == 3
      assert (sum(per_tokens), sum(per_calls)) == (row["new_tokens"], row["verifier_calls"])
  for name in ("results.json", "results.md", "config.json", "tau_vs_gamma.png",
               "speedup_vs_gamma.png"):
    assert (tmp_path / name).stat().st_size > 0, name
  # A rerun of the same config reads every finished row back; a run cut after its first rows
  # redoes only the rest (and the baseline of the (T, B) they belong to).
  def refuse(*args, **kwargs):
    raise AssertionError("a finished row was decoded again")
  with monkeypatch.context() as m:
    m.setattr(evaluate.timing, "timed_pass", refuse)
    again_config = evaluate_config.get_config("smoke")
    again_config.eval.save_text = True
    assert evaluate.run(again_config, str(tmp_path)) == rows
    # Sweep lists and report fields are not in the rows' digest: a narrower sweep with another
    # title (and an experiment's own fields) reads its rows back too.
    subset = evaluate_config.get_config("smoke")
    subset.title, subset.budgets, subset.eval.temperatures = "another title", (6,), (0.0,)
    assert evaluate.run(subset, str(tmp_path)) == rows[:3]
  lines = (tmp_path / "rows.jsonl").read_text().splitlines()
  (tmp_path / "rows.jsonl").write_text("\n".join(lines[:5]) + '\n{"cut sh')
  passes = []
  real = evaluate.timing.timed_pass
  monkeypatch.setattr(evaluate.timing, "timed_pass",
                      lambda fn, prompts, desc, **kw: passes.append(desc)
                      or real(fn, prompts, desc=desc, **kw))
  again = evaluate.run(again_config, str(tmp_path))
  assert passes == ["T=1 B=2 autoregressive", "T=1 B=2 drafter-only", "T=1 B=2 sd γ=3"]
  assert [(r["method"], r["temperature"], r["gamma"]) for r in again] == [
      (r["method"], r["temperature"], r["gamma"]) for r in rows]
  # Every row carries the baseline its speedup divides by. The read-back T = 1 row divides by
  # the first process's pass, not this table's: it is marked, here and when read back again.
  ar1 = next(r for r in again if r["temperature"] == 1.0 and r["method"] == "autoregressive")
  for r in again:
    earlier = r["temperature"] == 1.0 and r["method"] == "sd" and r["gamma"] != 3
    assert r.get("baseline") == ("earlier" if earlier else None), r
    if r["temperature"] == 1.0 and not earlier:
      assert r["baseline_tokens_per_s"] == ar1["tokens_per_s"]
  # Read back once more: the same rows and marks (the record written after the cut line is kept).
  third = evaluate.run(again_config, str(tmp_path))
  assert [r.get("baseline") for r in third] == [r.get("baseline") for r in again]
  assert [r["tokens_per_s"] for r in third] == [r["tokens_per_s"] for r in again]
  assert "| earlier |" in (tmp_path / "results.md").read_text()
  config.eval.methods = ("sd", "warp")
  with pytest.raises(ValueError, match="eval.methods has 'warp', which is not a method"):
    evaluate.run(config, str(tmp_path))


def test_evaluate_rows_follow_what_the_drafter_checkpoint_holds(tmp_path):
  """The drafter is a path: trained further at that path (a new step, other arrays), its rows
  are not read back, nor the Spec-Bench suite's runs of it; the same checkpoint keeps them."""
  from configs import evaluate as evaluate_config
  from spec_jax.data.tokenizer import ByteTokenizer
  from spec_jax.programs import evaluate, specbench_experiment
  from spec_jax.training import checkpoints
  cfg, params = testing.tiny_model(seed=0)
  config = evaluate_config.get_config("smoke")
  config.drafter.checkpoint = str(tmp_path / "drafter")
  manager = checkpoints.make_manager(config.drafter.checkpoint, async_save=False)

  def save(step, params):
    state = type("State", (), dict(step=step, params=params, opt_state={}))()
    checkpoints.save(manager, step, state, checkpoints.make_meta(cfg, ByteTokenizer()))
    return evaluate.row_digest(config), specbench_experiment.held(config)
  first = save(1, params)
  assert first == (evaluate.row_digest(config), specbench_experiment.held(config))
  import jax  # noqa: PLC0415
  further = save(2, jax.tree.map(lambda x: x + 1, params))
  manager.close()
  assert further[0] != first[0] and further[1] != first[1] and first[1]
  config.drafter.checkpoint = "smollm2"  # a packaged model: named by its path alone
  assert specbench_experiment.held(config) == {}


def test_evaluate_row_digest_covers_what_rows_depend_on():
  from configs import evaluate as evaluate_config
  from spec_jax.evaluation import experiment
  from spec_jax.programs import evaluate
  row_digest = evaluate.row_digest
  base = row_digest(evaluate_config.get_config("smoke"))
  for field, value, same in [("eval.gammas", (1, 2, 3), True), ("eval.methods", ("sd", "rsd_s"), True),
                             ("eval.temperatures", (0.5,), True), ("title", "x", True),
                             ("eval.save_text", True, True), ("seed", 1, False),
                             ("eval.new_tokens", 9, False), ("drafter.checkpoint", "d", False),
                             ("eval.tree_width", 2, False), ("data.name", "other", False),
                             ("prompts_file", "p.txt", False), ("eval.bpd.paths", 4, False),
                             ("eval.timing_repeats", 3, False)]:
    config = evaluate_config.get_config("smoke")
    section, _, name = field.rpartition(".")
    target = config
    for part in filter(None, section.split(".")):
      target = target[part]
    target[name] = value
    assert (row_digest(config) == base) == same, field
  # Rows logged before eval.timing_repeats existed (one pass each) keep their digest.
  config = evaluate_config.get_config("smoke")
  del config.eval["timing_repeats"]
  assert row_digest(config) == base
  # A run's digest (the harness's reuse rule) covers the sweeps: a run that adds a γ is not the
  # same run, though its finished rows are reused from rows.jsonl.
  config = evaluate_config.get_config("smoke")
  config.eval.gammas = (1, 2, 3)
  assert experiment.digest(config, program="evaluate") != experiment.digest(
      evaluate_config.get_config("smoke"), program="evaluate")


@pytest.mark.parametrize("overrides, message", [
    ({"eval.temperatures": (0.0, -1.0)}, r"eval.temperatures has -1.0: a temperature must be >= 0"),
    ({"eval.gammas": (0,)}, r"eval.gammas has 0: a draft length must be >= 1"),
    ({"eval.rule": "lenient", "eval.epsilon": 2.0}, r"eval.epsilon has 2.0: lenience ε"),
    ({"eval.num_prompts": 0}, r"eval.num_prompts=0 must be >= 1"),
    ({"eval.timing_repeats": 0}, r"eval.timing_repeats=0 must be >= 1"),
    ({"eval.timing_pairs": -1}, r"eval.timing_pairs=-1 must be >= 0"),
    ({"eval.top_p": 0.0}, r"eval.top_p must be in \(0, 1\]"),
    ({"eval.max_cache_len": 20}, r"The cache needs 43 slots \(padded prompt 32 tokens \+ "
                                 r"eval.new_tokens=8 \+ 3 for the largest draft\) but "
                                 r"eval.max_cache_len=20"),
])
def test_evaluate_validates_before_loading_any_model(tmp_path, monkeypatch, overrides, message):
  from configs import evaluate as evaluate_config
  from spec_jax import loading
  from spec_jax.programs import evaluate
  monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
  from spec_jax import testing
  config = testing.with_overrides(evaluate_config.get_config("smoke"), overrides)
  with pytest.raises(ValueError, match=message):
    evaluate.run(config, str(tmp_path / "out"))
  afile = tmp_path / "afile"
  afile.write_text("x")
  with pytest.raises(ValueError, match="--workdir=.* is a file"):
    evaluate.run(evaluate_config.get_config("smoke"), str(afile))


@pytest.mark.parametrize("overrides, message", [
    ({"generation.sampling.temperature": -1.0}, r"generation.sampling.temperature must be >= 0"),
    ({"generation.max_new_tokens": 0}, r"generation.max_new_tokens=0 must be >= 1"),
    ({"generation.batch_size": 0}, r"generation.batch_size=0 must be >= 1"),
    ({"method": "sd", "gamma": 0}, r"method='sd': give a draft length >= 1"),
])
def test_generate_validates_before_loading_any_model(tmp_path, monkeypatch, overrides, message):
  from spec_jax import loading, testing
  monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
  config = testing.with_overrides(generate_config.get_config("smoke"), overrides)
  with pytest.raises(ValueError, match=message):
    generate.run(config, str(tmp_path / "out"))


def test_console_filter_drops_expected_library_noise_only():
  import logging
  def record(path, level, msg, args=None):
    return logging.LogRecord("absl", level, path, 1, msg, args, None)
  orbax = "/site-packages/orbax/checkpoint/checkpoint_manager.py"
  assert not cli.quiet_libraries(record(orbax, 30, "Given directory is read only=%s", ("/x",)))
  assert not cli.quiet_libraries(record(orbax, 20, "Saving item"))
  assert cli.quiet_libraries(record(orbax, 30, "Checkpoint is corrupt"))
  assert cli.quiet_libraries(record("/spec_jax/programs/distill.py", 20, "Distilling"))
