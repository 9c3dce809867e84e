r"""Pod plan: Llama 3.1 70B + its one-block feature drafter on 64 devices (fsdp 8 × tensor 8),
Llama 3.1 8B on 8 (tensor 8) and Gemma 3 27B on 32 (fsdp 4 × tensor 8), each with its one-block
feature drafter, batch 32, 4k-slot caches, bfloat16, compiled ahead of time on fake
CPU devices with abstract parameters (nothing allocated), placed as decoding places them
(weights stay put, activations move: spec_jax/parallel.py `decode_param_rule`): per-device
memory against a TPU v5e (16 GiB) and an H100 (80 GB), collectives per round, the roofline's
round-time estimate.

  XLA_FLAGS=--xla_force_host_platform_device_count=64 JAX_PLATFORMS=cpu \
      python launch.py --config configs/pod_plan.py --workdir experiments/scale
  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
      python launch.py --config configs/pod_plan.py:smoke --workdir /tmp/plan  # 1B, 8 devices
  JAX_PLATFORMS=cpu python launch.py --config configs/pod_plan.py:topology=v5e \
      --workdir experiments/scale/v5e   # compiled by XLA:TPU for v5e slices; needs libtpu

Program: spec_jax/programs/pod_plan.py. Writes plan.json (rows: preset, mesh, bytes_per_device,
fits_v5e, fits_h100, weights_per_device, caches_per_device, collectives per round, estimate) and
plan.md. On a real pod slice the same command without the XLA_FLAGS compiles for its devices.
XLA:CPU has no bfloat16 matmul and keeps float32 copies of the weights, so the CPU compile
overstates a bfloat16 plan's memory; `topology=v5e` compiles the same program with XLA:TPU ahead
of time for a v5e slice of each plan's size (jax.experimental.topologies; `pip install
'libtpu==0.0.42.*'` or jax[tpu]; no TPU needed).
Args: plans=PRESET:DxFxT+... (e.g. plans=llama3.1-70b:1x8x8), batch, context, prompt, gamma,
dtype, temperature, topology, must_fit=v5e|h100 (a plan over it is an error).
Time (2 CPU cores): the default ~20 s (compiles: 70B ~10 s, 8B ~9 s), with topology=v5e
~1 min; smoke ~20 s. 1.8 GB of memory at most.
Reference numbers: experiments/scale/results.md (the plan's write-up).
"""

from configs import common


def get_config(arg=None):
  args = common.parse_arg(arg, smoke=False, plans="llama3.1-70b:1x8x8+llama3.1-8b:1x1x8+gemma3-27b:1x4x8",
                          batch=32, context=4096, prompt=512, gamma=4, dtype="bfloat16",
                          temperature=1.0, topology="", must_fit="")
  config = common.base("pod_plan")
  config.config_file = "configs/pod_plan.py" + (f":{arg}" if arg else "")
  config.plan = dict(
      plans=tuple(args.plans.split("+")),  # PRESET:DATAxFSDPxTENSOR, one compile each
      batch_size=args.batch, context=args.context,  # cache slots: prompt + new tokens + γ
      prompt_tokens=args.prompt, gamma=args.gamma,  # chain drafts per round
      drafter_blocks=1,  # the feature drafter: the verifier's last N blocks (presets.block_drafter)
      dtype=args.dtype, temperature=args.temperature,  # 0: greedy rule; > 0: rejection sampling
      topology=args.topology,  # '': JAX's devices; a 2D TPU generation ('v5e'): libtpu compiles
      must_fit=args.must_fit)  # '' (report only), or a chip in pod_plan.CHIPS every plan must fit
  if args.smoke:
    given = common.given(arg)
    config.plan.update(
        plans=config.plan.plans if "plans" in given else ("llama3.2-1b:1x2x4",),
        batch_size=args.batch if "batch" in given else 8,
        context=args.context if "context" in given else 256,
        prompt_tokens=args.prompt if "prompt" in given else 32,
        gamma=args.gamma if "gamma" in given else 2,
        temperature=args.temperature if "temperature" in given else 0.0)
  return config
