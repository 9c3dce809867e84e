"""Program `benchmark_hf`: spec_jax against HF transformers on the same weights (peer benchmark).

1. Export the verifier and the drafter (any `model.checkpoint` source: SmolLM2's GGUF, a train_lm
   workdir) to HF directories under `workdir/hf/`, then load both systems from those directories:
   transformers with `from_pretrained` (float32, eval, no_grad), spec_jax with `hf_import`. The
   weights are therefore the same bits on both sides.
2. The same prompts (token ids, cut to exactly `prompt_tokens`) and the same number of new tokens,
   greedy, with EOS stopping off on both sides so every row emits exactly `new_tokens`, through
     transformers  greedy `generate`, batch 1 and the largest batch;
                   assisted generation (`assistant_model=drafter`), batch 1 only (transformers
                   supports no more), with its default schedule (up to 20 drafts, drafting stops
                   when the drafter's top probability < 0.4) and with a constant γ like ours;
     spec_jax      autoregressive (`generate.generate`) and speculative decoding
                   (`loop.speculative_generate`), every batch size in `batch_sizes`.
3. Rows in `workdir/results.json`: system, method, batch_size, gamma, tokens_per_s, ms_per_token,
   identical_to_greedy (every prompt's tokens equal transformers' greedy batch-1 output: the
   common reference), identical_to_own_greedy (equal to the same system's greedy batch-1
   output, so float differences between the systems are told apart from algorithm errors), and
   diagnostics; `summary.json` holds the speedups; `results.md` the table.

Timing (`hf_bench.measure`): one process; every method is warmed up untimed first (compilation
for spec_jax), then the methods take turns one batch at a time, so that on a machine shared with
other jobs a slow spell is spread over all of them. Calls never overlap: torch runs on all cores
(torch_threads) while XLA idles, and the reverse. Prefill is included; a row's time is the sum
over its batches.
"""

from __future__ import annotations

import json
import os

import jax

from spec_jax import checks, loading
from spec_jax.data import prompts as prompts_lib
from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.decoding import loop
from spec_jax.decoding import verifier as verifier_lib
from spec_jax.decoding.drafters import lm
from spec_jax.decoding.drafters import trees
from spec_jax.evaluation import hf_bench, report
from spec_jax.models import hf_import
from spec_jax.programs import export_hf

QUICKSTART_HINT = ("run the quickstart first (python launch.py --config configs/quickstart.py "
                   "--workdir runs/quickstart), or point --config.drafter.checkpoint to a trained "
                   "drafter")


def _import_torch():
  try:
    import torch
    import transformers
  except ImportError as e:
    raise ImportError("benchmark_hf compares against HF transformers, a test-only dependency: "
                      "pip install -r requirements-test.txt") from e
  transformers.utils.logging.set_verbosity_error()
  transformers.utils.logging.disable_progress_bar()
  return torch, transformers


def _check_source(model_cfg, field: str) -> None:
  ckpt = model_cfg.checkpoint
  if (ckpt and ckpt not in loading.PACKAGED and not ckpt.startswith("hf:")
      and not os.path.exists(ckpt)):
    raise FileNotFoundError(f"{field}={ckpt!r} does not exist: {QUICKSTART_HINT}.")


def prompt_ids(config, tokenizer) -> list[list[int]]:
  """`num_prompts` prompts as token ids, each cut to exactly `benchmark.prompt_tokens`, so that
  batches need no padding on either side."""
  b = config.benchmark
  ids = [tokenizer.encode(t)[:b.prompt_tokens]
         for t in prompts_lib.read_prompts(config, tokenizer)][:b.num_prompts]
  short = [i for i, x in enumerate(ids) if len(x) < b.prompt_tokens]
  if len(ids) < b.num_prompts or short:
    raise ValueError(f"benchmark.prompt_tokens={b.prompt_tokens} and num_prompts={b.num_prompts} "
                     f"need that many prompts of at least that many tokens; got {len(ids)} "
                     f"prompts, prompts {short} shorter. Lower benchmark.prompt_tokens or give "
                     "longer prompts (data_prompt_tokens, prompts_file).")
  return ids


def _batches(ids: list[list[int]], batch_size: int) -> list[list[list[int]]]:
  if len(ids) % batch_size:
    raise ValueError(f"benchmark.num_prompts={len(ids)} must be a multiple of every batch size "
                     f"({batch_size}), so that every row is a real prompt.")
  return [ids[i:i + batch_size] for i in range(0, len(ids), batch_size)]


def _transformers_methods(torch, transformers, dirs, ids, b, gamma) -> list[hf_bench.Method]:
  """transformers greedy (batch 1 and the largest) and assisted generation (batch 1); extra: the
  verifier's forward calls."""
  device, dtype = b.get("torch_device", "cpu"), getattr(torch, b.get("torch_dtype", "float32"))
  load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(  # noqa: E731
      d, dtype=dtype).to(device).eval()
  model = load(dirs["verifier"])
  model.generation_config.eos_token_id = None  # every row emits exactly new_tokens, as ours
  calls = [0]
  model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))

  def gen(new_tokens=b.new_tokens, **kwargs):
    def fn(batch):
      x = torch.tensor(batch, device=device)
      start = calls[0]
      with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=new_tokens, **kwargs)
      return out[:, x.shape[1]:].tolist(), calls[0] - start
    return fn

  methods = [hf_bench.Method(hf_bench.PEER, "greedy", size, None, None, gen(), gen(8),
                             _batches(ids, size)) for size in sorted({1, max(b.batch_sizes)})]
  # transformers' defaults (GenerationConfig._get_default_generation_params), and γ as ours. Each
  # schedule gets its own assistant: the schedule lives in the assistant's generation_config.
  schedules = {"default": dict(num_assistant_tokens=20, num_assistant_tokens_schedule="constant",
                               assistant_confidence_threshold=0.4),
               "constant": dict(num_assistant_tokens=gamma,
                                num_assistant_tokens_schedule="constant",
                                assistant_confidence_threshold=0.0)}
  for name in b.assisted_schedules:
    if name not in schedules:
      raise ValueError(f"benchmark.assisted_schedules has {name!r}; known: {list(schedules)}.")
    drafter = load(dirs["drafter"])
    drafter.generation_config.eos_token_id = None
    drafter.generation_config.update(**schedules[name])
    methods.append(hf_bench.Method(
        hf_bench.PEER, "assisted", 1, schedules[name]["num_assistant_tokens"], name,
        gen(assistant_model=drafter), gen(8, assistant_model=drafter), _batches(ids, 1),
        drafts=True, label=f"assisted ({name})",
        # A confidence threshold stops drafting early: γ is then only an upper bound.
        gamma_bound=schedules[name]["assistant_confidence_threshold"] > 0))
  return methods


def _argmax_loop(torch, model_dir, transformers, prompt, n) -> list[int]:
  """Ground truth: n greedy tokens by full forward passes (no cache, no generate())."""
  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
  seq = torch.tensor([prompt])
  with torch.no_grad():
    for _ in range(n):
      seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
  return seq[0, len(prompt):].tolist()


def _spec_jax_methods(config, tokenizer, dirs, ids, b, gamma) -> list[hf_bench.Method]:
  """spec_jax autoregressive and speculative decoding, params read from the HF directories;
  extra: verifier calls (AR), or (the loop's output, verifier calls) (SD)."""
  v_cfg, v_params = loading.load_model(
      _model_section(config.verifier, dirs["verifier"]), tokenizer, field="verifier.checkpoint")
  d_cfg, d_params = loading.load_model(
      _model_section(config.drafter, dirs["drafter"]), tokenizer, field="drafter.checkpoint")
  greedy = sampling_lib.Sampling()
  verifier = verifier_lib.lm_verifier(v_cfg)
  drafter = lm.LMDrafter(d_cfg, trees.chain(gamma))
  rng = jax.random.key(config.seed)

  def ar(batch):
    prompts = generate_lib.pad_prompts(batch, b.prompt_tokens, tokenizer.pad_id)
    out = generate_lib.generate(v_params, prompts, rng, cfg=v_cfg, sampling=greedy,
                                max_new_tokens=b.new_tokens)
    return out.new_tokens(), int(out.steps)  # new_tokens() waits for the result

  def sd(batch):
    prompts = generate_lib.pad_prompts(batch, b.prompt_tokens, tokenizer.pad_id)
    out = loop.speculative_generate(
        v_params, d_params, prompts, rng, verifier=verifier, drafter=drafter, sampling=greedy,
        max_new_tokens=b.new_tokens)
    return out.new_tokens(), (jax.device_get(out), int(out.rounds) + 1)

  methods = []
  for size in b.batch_sizes:  # warm-up = compilation, so it runs the full shapes
    batches = _batches(ids, size)
    methods += [
        hf_bench.Method(hf_bench.OURS, "autoregressive", size, None, None, ar, ar, batches),
        hf_bench.Method(hf_bench.OURS, "speculative", size, gamma, "constant", sd, sd, batches,
                        drafts=True, speculative=True)]
  return methods


def _model_section(section, directory):
  out = section.copy_and_resolve_references()
  out.checkpoint = directory
  return out


TORCH_DTYPES = ("float32", "bfloat16", "float16")


def run(config, workdir: str) -> dict:
  b = config.benchmark
  if 1 not in b.batch_sizes:
    raise ValueError(f"benchmark.batch_sizes={tuple(b.batch_sizes)} must include 1: "
                     "transformers assisted generation runs at batch 1 only, and the systems are "
                     "compared there.")
  checks.integer(b.torch_threads, "benchmark.torch_threads", 0, " (0 = one a core)")
  checks.integer(b.num_prompts, "benchmark.num_prompts")
  if b.get("torch_dtype", "float32") not in TORCH_DTYPES:
    raise ValueError(f"benchmark.torch_dtype={b.torch_dtype!r}: transformers runs in one of "
                     f"{list(TORCH_DTYPES)}.")
  if str(b.get("torch_device", "cpu")).split(":")[0] not in ("cpu", "cuda"):
    raise ValueError(f"benchmark.torch_device={b.torch_device!r}: 'cpu' or 'cuda' (or "
                     "'cuda:N').")
  _check_source(config.verifier, "verifier.checkpoint")
  _check_source(config.drafter, "drafter.checkpoint")
  torch, transformers = _import_torch()
  torch.set_num_threads(b.torch_threads or os.cpu_count())
  tokenizer = tokenizer_lib.get_tokenizer(config.tokenizer)
  ids = prompt_ids(config, tokenizer)
  gamma = int(b.gamma)

  dirs, exports = {}, {}
  for role, seed in (("verifier", config.seed), ("drafter", config.seed + 1)):
    dirs[role] = os.path.join(workdir, "hf", role)
    print(f"[benchmark_hf] exporting the {role} ({config[role].checkpoint or 'random'}) to "
          f"{dirs[role]}", flush=True)
    exports[role] = export_hf.export_model(config[role], tokenizer, dirs[role], seed=seed,
                                           field=f"{role}.checkpoint")
  loop.check_pair(
      verifier_lib.lm_verifier(hf_import.config_from_hf(hf_import.read_config(dirs["verifier"]))),
      lm.LMDrafter(hf_import.config_from_hf(hf_import.read_config(dirs["drafter"]))))
  methods = (_transformers_methods(torch, transformers, dirs, ids, b, gamma)
             + _spec_jax_methods(config, tokenizer, dirs, ids, b, gamma))
  print(f"[benchmark_hf] timing {len(methods)} methods, {len(ids)} prompts, round-robin",
        flush=True)
  hf_bench.measure(methods)
  argmax = _argmax_loop(torch, dirs["verifier"], transformers, ids[0], b.new_tokens)
  return _report(config, workdir, methods, ids, argmax, exports)


def _report(config, workdir, methods: list[hf_bench.Method], ids, argmax, exports) -> dict:
  b = config.benchmark
  rows = hf_bench.make_rows(methods, num_prompts=len(ids), new_tokens=b.new_tokens,
                            prompt_tokens=b.prompt_tokens)
  summary = hf_bench.summarize(methods, rows, argmax=argmax, exports=exports,
                               note=config.get("note", ""))
  report.write_results(workdir, rows)
  with open(os.path.join(workdir, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2)
  table = hf_bench.markdown(methods, rows, summary)
  with open(os.path.join(workdir, "results.md"), "w", encoding="utf-8") as f:
    f.write(table)
  print(table)
  return dict(rows=rows, summary=summary)
