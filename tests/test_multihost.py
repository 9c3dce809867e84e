"""Two processes on loopback, 4 fake CPU devices each (`launch.py --distributed` with a local
coordinator), against one process with 8: the same greedy text from `generate` on a data mesh
over all 8 devices, the same trained parameters from `train_lm` (sharded batches, orbax
checkpoints written by both processes, metrics by process 0 only), and the same speculative
completions and rows from `evaluate` with models loaded from checkpoints (results, texts and the
console from process 0 only)."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np

import conftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch_pair(*args, timeout=420, extra=((), ()), ok=True):
  """Run launch.py as processes 0 and 1 of a 2-process job (extra[i]: process i's own extra
  arguments); returns their outputs, asserting success (or, with ok=False, failure)."""
  port = _free_port()
  env = dict(os.environ, PYTHONUNBUFFERED="1",
             XLA_FLAGS="--xla_force_host_platform_device_count=4 " + conftest.TEST_XLA_FLAGS)
  procs = [subprocess.Popen(
      [sys.executable, "launch.py", *args, "--distributed",
       f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}",
       *extra[i]],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(2)]
  outs = []
  for p in procs:
    try:
      outs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
  workdir = args[args.index("--workdir") + 1] if "--workdir" in args else next(
      a.split("=", 1)[1] for a in args if a.startswith("--workdir="))
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert (p.returncode == 0) == ok, out[-4000:]
    # launch.py's log line (in process i's log file): really distributed.
    log = os.path.join(workdir, "log.txt" if i == 0 else f"log.process{i}.txt")
    with open(log, encoding="utf-8") as f:
      text = f.read()
    assert f"process {i}/2" in text, out[-4000:]
    # The launcher adds its XLA defaults to flags that lack them (cli.XLA_DEFAULTS).
    assert f"XLA_FLAGS={env['XLA_FLAGS']} --xla_gpu_enable_triton_gemm=false\n" in text
  return outs


def _run_here(config_module, arg, workdir, **overrides):
  """One process with conftest's 8 fake devices, in this test's own process (what
  `launch.py --config=configs/<module>.py:<arg> --config.<key>=<value>` runs)."""
  import importlib  # noqa: PLC0415
  config = importlib.import_module(f"configs.{config_module}").get_config(arg)
  for key, value in overrides.items():
    node = config
    *parents, leaf = key.split(".")
    for part in parents:
      node = node[part]
    node[leaf] = value
  return importlib.import_module(f"spec_jax.programs.{config.program}").run(config, str(workdir))


def test_two_processes_generate_and_train_like_one(tmp_path):
  gen = ["--config=configs/generate.py:smoke", "--config.mesh.data=-1",
         "--config.generation.batch_size=8"]
  train = ["--config=configs/train_lm.py:smoke", "--config.mesh.data=-1",
           "--config.train.eval_every=0"]
  # One process first (it also prepares the TFDS corpus the two processes then share).
  _run_here("generate", "smoke", tmp_path / "gen1", **{"mesh.data": -1,
                                                       "generation.batch_size": 8})
  _run_here("train_lm", "smoke", tmp_path / "train1", **{"mesh.data": -1,
                                                         "train.eval_every": 0})
  _launch_pair(*gen, f"--workdir={tmp_path / 'gen2'}")
  _launch_pair(*train, f"--workdir={tmp_path / 'train2'}")
  # Both go on for 10 more steps from their checkpoints: orbax restores across the two hosts.
  _run_here("train_lm", "smoke", tmp_path / "train1", **{"mesh.data": -1,
                                                         "train.eval_every": 0,
                                                         "train.num_steps": 30})
  _launch_pair(*train, "--config.train.num_steps=30", f"--workdir={tmp_path / 'train2'}")

  read = lambda d: [json.loads(line) for line in open(tmp_path / d / "generations.jsonl")]  # noqa: E731
  one, two = read("gen1"), read("gen2")
  assert [r["completion"] for r in two] == [r["completion"] for r in one] and len(one) >= 3

  from spec_jax.training import checkpoints  # noqa: PLC0415
  assert [checkpoints._resolve(str(tmp_path / d))[1] for d in ("train1", "train2")] == [30, 30]
  _, p1, _ = checkpoints.load_model(str(tmp_path / "train1"))
  _, p2, _ = checkpoints.load_model(str(tmp_path / "train2"))
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
  # Metrics from process 0 only: the same lines as the one-process run, none twice.
  keys = lambda d: [(r.get("step"), tuple(sorted(r))) for r in  # noqa: E731
                    map(json.loads, open(tmp_path / d / "metrics.jsonl"))]
  assert keys("train2") == keys("train1")


def _save_model(path, cfg, params) -> str:
  """A train_lm-format checkpoint of (cfg, params) with the byte tokenizer, which launch.py's
  `model.checkpoint` loads."""
  import types  # noqa: PLC0415

  from spec_jax.data.tokenizer import ByteTokenizer  # noqa: PLC0415
  from spec_jax.training import checkpoints  # noqa: PLC0415
  manager = checkpoints.make_manager(str(path), async_save=False)
  state = types.SimpleNamespace(step=0, params=params, opt_state={})
  checkpoints.save(manager, 0, state, checkpoints.make_meta(cfg, ByteTokenizer()))
  manager.wait_until_finished()
  return str(path)


def test_two_processes_decode_speculatively_like_one(tmp_path):
  """`evaluate` with chain SD (γ = 3, T = 1, batch 4) on a data 2 × fsdp 2 × tensor 2 mesh over
  both processes, its verifier and drafter loaded from train_lm checkpoints by each process: the
  same completions, τ, α and per-prompt counts as one process with 8 devices (every device runs
  the same per-shard program either way, so the draws agree exactly); rows and texts written by
  process 0 alone, and its table and progress bars shown by process 0 alone (process 1's own
  timings go to its log). The models are sharp, context-dependent tiny ones
  (`testing.tiny_model`) and a perturbed copy that agrees only sometimes; greedy random models
  loop on one byte, which would hide a broken cache or verdict. A checkpoint restored onto
  process 0's device, or a process's own copy of the params put on the global mesh as a
  committed array, fails here (both did)."""
  from spec_jax import testing  # noqa: PLC0415
  v_cfg, v_params = testing.tiny_model(seed=0, sharpness=4.0, context=6.0)
  verifier = _save_model(tmp_path / "verifier", v_cfg, v_params)
  drafter = _save_model(tmp_path / "drafter", v_cfg, testing.perturbed(v_params, 0.3))
  overrides = {"verifier.checkpoint": verifier, "drafter.checkpoint": drafter,
               "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "eval.methods": ("sd",),
               "eval.gammas": (3,), "eval.temperatures": (1.0,), "eval.batch_sizes": (4,),
               "eval.num_prompts": 4, "eval.save_text": True}
  one = _run_here("evaluate", "smoke", tmp_path / "ev1", **overrides)
  outs = _launch_pair("--config=configs/evaluate.py:smoke",
                      *(f"--config.{k}={v}".replace(" ", "") for k, v in overrides.items()),
                      f"--workdir={tmp_path / 'ev2'}")
  two = json.load(open(tmp_path / "ev2" / "results.json"))
  same = ("method", "block_efficiency", "acceptance_rate", "per_position_acceptance",
          "prompt_new_tokens", "prompt_verifier_calls")
  assert [[r[k] for k in same] for r in two] == [[r[k] for k in same] for r in one]
  texts = lambda d: [json.loads(line)["completion"]  # noqa: E731
                     for line in open(tmp_path / d / "texts.jsonl")]
  assert texts("ev2") == texts("ev1")
  completions = texts("ev1")
  assert len(completions) == 4 and len(set(completions)) == 4  # the prompts' own texts
  assert all(len(set(c)) > 2 for c in completions)  # not one repeated byte
  assert any(r["block_efficiency"] > 1.0 for r in one)  # drafts were accepted
  assert all(r["device"].endswith(" per process, 2 processes") for r in two)
  assert len(open(tmp_path / "ev2" / "rows.jsonl").readlines()) == len(two)  # written once
  assert "| autoregressive |" in outs[0] and "| autoregressive |" not in outs[1]
  assert "it/s" in outs[0] and "it/s" not in outs[1]  # progress bars: process 0's alone
  assert "| autoregressive |" in open(tmp_path / "ev2" / "log.process1.txt").read()


def test_processes_that_disagree_on_the_config_are_refused(tmp_path):
  outs = _launch_pair("--config=configs/generate.py:smoke", f"--workdir={tmp_path}",
                      extra=((), ("--config.seed=1",)), ok=False, timeout=240)
  assert any("disagree on the config: process(es) [1]" in out for out in outs), outs[0][-3000:]


SHARD_PROBE = """
import sys
import jax, numpy as np
from jax.sharding import AxisType, Mesh
from spec_jax import parallel
parallel.maybe_initialize_distributed(True, coordinator_address=sys.argv[1], num_processes=2,
                                      process_id=int(sys.argv[2]))
host = np.arange(8, dtype=np.int32) * 10  # the same global batch on both processes
d = jax.devices()  # [p0d0, p0d1, p1d0, p1d1]
layouts = {  # (data, fsdp, tensor) grids of the four devices
    "tensor across the processes": np.array(d).reshape(1, 1, 4),
    "data 2 x tensor 2, tensor across the processes": np.array(
        [[d[0], d[2]], [d[1], d[3]]]).reshape(2, 1, 2),
    "data 4, the processes interleaved": np.array([d[0], d[2], d[1], d[3]]).reshape(4, 1, 1)}
for name, grid in layouts.items():
  mesh = Mesh(grid, parallel.AXES, axis_types=(AxisType.Auto,) * 3)
  rows = parallel.to_host(parallel.shard_batch(host, parallel.batch_sharding(mesh)))
  print(name, rows.tolist(), flush=True)
"""


def test_shard_batch_gives_every_device_its_rows_whatever_the_processes_hold(tmp_path):
  """Two processes of two devices each: a batch axis that does not split the rows into one block
  per process (a tensor axis across processes replicates rows on both; a device order that
  interleaves them, as a TPU torus's can) still reads back as the host batch, in order. A
  process that contributes rows [pid·B/2, (pid+1)·B/2) fails the first two layouts and permutes
  the third's rows silently."""
  port = _free_port()
  env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=2 " + conftest.TEST_XLA_FLAGS)
  procs = [subprocess.Popen([sys.executable, "-c", SHARD_PROBE, f"127.0.0.1:{port}", str(i)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True) for i in range(2)]
  outs = [p.communicate(timeout=240)[0] for p in procs]
  want = str(list(range(0, 80, 10)))
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
    lines = [line for line in out.splitlines() if line.endswith("]")]
    assert lines == [f"{name} {want}" for name in (
        "tensor across the processes", "data 2 x tensor 2, tensor across the processes",
        "data 4, the processes interleaved")], out[-3000:]
