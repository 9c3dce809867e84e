"""DistillSpec: distill the SmolLM2 verifier into a drafter (program: distill).

  python launch.py --config configs/distill.py --workdir runs/distill_jsd_fixed
  python launch.py --config configs/distill.py:divergence=tvd,source=onpolicy \
      --workdir runs/distill_tvd_onpolicy \
      --config.drafter.checkpoint=runs/quickstart_scratch/drafter
  python launch.py --config configs/distill.py:smoke --workdir /tmp/distill   # tiny, for tests
Arguments (`:key=value,...`): divergence (fkl, rkl, jsd, tvd, or xent = no teacher), beta
(JSD[β], β weights the verifier), source (fixed, verifier, onpolicy, mix), lam (on-policy
fraction of a mix), temp (data.temperature: generated responses, 0 = greedy), steps, batch,
drafter (a train_lm/distill workdir, '' = from scratch), size, data (TFDS name, or sharegpt),
smoke. Any field can also be overridden: --config.distill.temperature=0.7.
Re-running the same command resumes from the newest checkpoint in the workdir.

ShareGPT (`data=sharegpt`: data.name=spec_jax_sharegpt, rows of one conversation turn each,
spec_jax/training/chat_data.py): the feature drafter smollm2-135m:layers=29:features=1:vocab=8192
(from the verifier's checkpoint) by default, 500 steps, rows of a chat prompt of <= 128 tokens
(longer ones skipped and counted in the log) and the first 128 tokens of its response, either
the corpus's (source=fixed) or the verifier's own, sampled at temp = 0 or 1 (source=verifier,
one batch per step, generated 8 batches per call, cached in data.cache_dir):
  python launch.py --config configs/distill.py:data=sharegpt --workdir runs/sharegpt_fixed
  python launch.py --config configs/distill.py:data=sharegpt,source=verifier,temp=0 \
      --workdir runs/sharegpt_verifier_t0
  python launch.py --config configs/distill.py:data=sharegpt,source=verifier,temp=1 \
      --workdir runs/sharegpt_verifier_t1
EAGLE-3's variant (verifier depths 2, 15, 27 through one fc; three training-time-test passes):
  python launch.py --config configs/distill.py:data=sharegpt,size=smollm2-135m:layers=29:\
features=2+15+27:vocab=8192 --config.distill.feature_passes=3 --config.distill.pass_decay=0.8 \
      --workdir runs/sharegpt_eagle3
Every steps/10 steps metrics.jsonl logs eval/tau_T0 and eval/tau_T1 (γ = 4, 16 prompts of the
validation split's chat rows, 64 new tokens) beside the held-out divergences (4 batches of
validation rows with the corpus's responses): τ vs training steps. Time: a step is dominated by
the verifier's forward over 8 × 256 tokens (~0.55 TFLOP); 12 s per step on 2 idle cores of a
VM that multiplies float32 matrices at ~67 GFLOP/s, where the quickstart's feature step (8 × 128
tokens) takes 5.5 s, so ~2.3 s on a VM where that one takes 1.05 s; one H100 not measured
(~10 steps/s expected). The rows of ShareGPT's train split are built once (~2 min on 2 CPU
cores, then cached beside the token caches); verifier responses cost 500 × 8 × <= 128
generated tokens (~30-40 min on 2 CPU cores: there, --config.data.verifier_batches=64 cycles
a pool of 64 batches, ~22 min on that VM; ~1 min on one H100). The generation keeps the
verifier's hidden states over the pool, and every step reuses them (data.teacher_cache_gib):
3.5 s per step there instead of 13 (experiments/specbench/notes.md); a pool file written
without them costs one teacher pass per pool batch.

Evaluate the result with
  python launch.py --config configs/evaluate.py --workdir runs/eval_distilled \
      --config.drafter.checkpoint=runs/distill_jsd_fixed

Expected time on 2 idle CPU cores: one step of drafter-s (the scratch quickstart drafter,
`:drafter=runs/quickstart_scratch/drafter`) with the SmolLM2 verifier at batch 8 ×
(32 prompt + 48 response) tokens ~2.4 s on fixed data and ~2.8 s with on-policy generation
(40 steps: ~2 min, plus ~1 min of loading and compiling). Verifier-generated data costs one
verifier generation per batch, once (cached in data.cache_dir; ~15 min for 40 batches of 8 × 48
tokens). A pool sampled in larger calls is ~2× faster per token:
`--config.data.verifier_batches=64 --config.data.generate_batch=32` (64 batches, cycled; 32 rows
per call; ~10 s for 64 batches of 8 × 112 tokens on one H100).
One H100: 2000 steps of a 4-block verifier-initialised drafter (8k vocabulary) at batch 8 ×
(32 + 48) tokens in ~1 min with compilation; the quickstart's feature drafter at ~20 steps/s.
Measured runs: experiments/distillspec/notes.md, experiments/gpu/results.md.
Reference (drafter-s from the scratch quickstart drafter, `:drafter=runs/quickstart_scratch/drafter`,
40 steps, lr 1e-3, 16 held-out prompts, γ = 4, T = 1): JSD[0.5] on fixed data moves SD's α from
0.28 (40 steps of cross-entropy instead) to 0.37 and τ from 1.39 to 1.55 (+11.5%);
experiments/distillspec/results.md has the full {FKL, RKL, JSD, TVD} × {fixed, verifier,
on-policy, mix} grid.

Smoke (CPU tests, seconds): test-tiny verifier and drafter, byte tokenizer, 6 steps of FKL on
8 × (8 + 8) tokens of on-policy data refreshed every 2 steps (`smoke,data=sharegpt`: chat rows
of 320 + 40 bytes).
"""

from configs import common

SHAREGPT = "spec_jax_sharegpt"  # chat rows (spec_jax/training/chat_data.py), `data=sharegpt`
FEATURE_DRAFTER = "smollm2-135m:layers=29:features=1:vocab=8192"


def get_config(arg: str | None = None):
  arg_string = arg
  # Defaults: the best cheap setting of experiments/distillspec (JSD[0.5] on the dataset's own
  # continuations: no generation cost, and the highest τ at T = 1 there).
  arg = common.parse_arg(arg, divergence="jsd", beta=0.5, source="fixed", lam=0.5, steps=40,
                         batch=8, drafter="runs/quickstart/drafter", size="drafter-s",
                         data="spec_jax_shakespeare", lr=1e-3, temp=1.0, smoke=False)
  explicit = common.given(arg_string)
  chat = arg.data in ("sharegpt", SHAREGPT)
  if chat and not arg.smoke:  # the ShareGPT recipe's defaults (module docstring)
    defaults = dict(drafter="smollm2", size=FEATURE_DRAFTER, steps=500, lr=3e-3)
    for key, value in defaults.items():
      if key not in explicit:
        arg[key] = value
  config = common.base("distill")
  config.verifier = common.model(size="smollm2-135m", checkpoint="smollm2")
  config.drafter = common.model(size=arg.size, checkpoint=arg.drafter)
  config.data = common.data(name=SHAREGPT if chat else arg.data)
  del config.data["seq_len"]  # a distillation row is prompt_tokens + response_tokens
  config.data.update(
      source=arg.source,        # fixed | verifier | onpolicy | mix (spec_jax.training.distill_data)
      prompt_tokens=32, response_tokens=48,
      temperature=arg.temp,     # sampling temperature of generated responses (0 = greedy)
      refresh_every=1,          # on-policy responses regenerated every N steps
      mix_with="verifier",      # a mix's non-on-policy rows: fixed | verifier
      mix_lambda=arg.lam,       # on-policy fraction of every batch in a mix (GKD's λ)
      # source = verifier: a pool of this many generated batches, cycled (0 = one per step);
      # the share of each batch's rows taken from it (the rest: the corpus's text); rows per
      # generation call (0 = one batch's; 64 samples ~2x faster than 8 on 2 CPU cores).
      verifier_batches=0, verifier_share=1.0, generate_batch=0,
      # Host memory for the verifier's hidden states over a cycled pool (verifier_share = 1):
      # the pool's generation keeps them and every step reuses them (0 = run the teacher's
      # pass every step; training/distill.py TeacherCache).
      teacher_cache_gib=4.0,
      stop_at_eos=False,        # False: responses always have response_tokens tokens
      cache_dir="",             # verifier responses; '' = <workdir>/data_cache
      # (name, fraction) pairs: round(fraction·B) rows of every training batch come from each
      # of these datasets' train_split, the rest from `name` (which alone serves the held-out
      # eval); a reduced vocabulary is counted on the blend. E.g. (("spec_jax_general/...",
      # 0.5),) for general-domain data beside the corpus.
      blend=())
  config.distill = dict(
      divergence=arg.divergence, beta=arg.beta,
      # Both laws get this transform (as at decoding time); temperature must be > 0.
      temperature=1.0, top_k=0, top_p=1.0,
      # A feature drafter (size '...:features=1') also regresses its final residual onto the
      # verifier's with this weight (EAGLE's feature loss; training/features.py).
      feature_weight=1.0,
      # ... and trains on its own predicted features: pass k + 1 reads what pass k predicted.
      feature_passes=1,
      # Pass j's losses weigh pass_decay**j (normalised; 1 = every pass alike, EAGLE-3: 0.8).
      # A multi-layer drafter (size '...:features=2+15+27', EAGLE-3) trains on the laws alone
      # (feature_weight ignored) and needs feature_passes >= 2.
      pass_decay=1.0,
      # Top-level drafter params kept as loaded, '+'-separated (e.g. 'embed': EAGLE's frozen
      # token embedding); '' trains every param.
      freeze="")
  config.train = common.train(num_steps=arg.steps, batch_size=arg.batch)
  config.train.update(lr=arg.lr, warmup_steps=max(min(10, arg.steps // 10), 1), log_every=5,
                      eval_every=arg.steps, checkpoint_every=20, keep_checkpoints=1)
  del config.train["eval_batches"]  # held-out batches are eval.batches here
  config.eval = dict(
      batches=4,                # held-out windows for eval/{fkl,...,alpha}
      at_start=True,            # also evaluate the initial drafter (logged at step 0)
      gamma=4, temperatures=(0.0, 1.0), num_prompts=8, new_tokens=48)
  if chat:
    # A chat prompt (<= P tokens, right-padded) and its response; generated ones end their turn.
    config.data.update(prompt_tokens=128, response_tokens=128, stop_at_eos=True,
                       generate_batch=64)
    config.train.update(eval_every=max(arg.steps // 10, 1), checkpoint_every=50, log_every=10)
    config.eval.update(num_prompts=16, new_tokens=64)
  if arg.smoke:
    config.tokenizer = "bytes"
    config.verifier = common.model(size="test-tiny")
    config.drafter = common.model(size="test-tiny")
    config.drafter.checkpoint = ""
    # FKL on on-policy data: the smoke exercises generation, refresh and resume (other
    # settings: --config.data.source=..., --config.distill.divergence=...).
    config.data.update(prompt_tokens=320 if chat else 8, response_tokens=40 if chat else 8,
                       refresh_every=2, generate_batch=0)
    if "source" not in explicit:
      config.data.source = "onpolicy"
    if "divergence" not in explicit:
      config.distill.divergence = "fkl"
    config.train.update(num_steps=6, batch_size=8, warmup_steps=1, log_every=1, eval_every=3,
                        checkpoint_every=2, lr=3e-3)
    config.eval.update(batches=2, num_prompts=2, new_tokens=8)
  return config
