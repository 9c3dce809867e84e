"""Device mesh and shardings from the config (docs/design.md §5).

Mesh axes are ('data', 'fsdp', 'tensor'):
  * batches shard their leading (batch) dim over ('data', 'fsdp');
  * for training, params (and optimizer moments, which share their shapes) shard over 'fsdp'
    along their largest evenly divisible dim, and over 'tensor' along the next largest one (see
    `param_sharding_rule`); everything else is replicated. Any placement is *correct* (GSPMD
    inserts the collectives); the rule only decides memory and communication;
  * for decoding, weights stay where they are and activations move (`decode_param_rule`,
    `decoding_layout`): each kernel's model-width dim over 'fsdp', its heads, feed-forward or
    vocabulary dim over 'tensor', so a decode round gathers no weight.

Multi-host: `maybe_initialize_distributed` must run before anything touches `jax.devices()`;
`shard_batch` builds a global array from each process's rows of a host batch.

Known trap (docs/design.md §5): on CPU, a loop that keeps dispatching cross-device collectives
without waiting can hang after ~40 calls. Loops here block on each step's (or the previous
step's) results.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Sequence

from absl import logging
import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
import numpy as np

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def _mesh_shape(mesh_cfg, num_devices: int) -> tuple[int, int, int]:
  """Resolve the at most one -1 in (data, fsdp, tensor) against `num_devices`."""
  sizes = [int(mesh_cfg[a]) for a in AXES]
  spec = ", ".join(f"{a}={s}" for a, s in zip(AXES, sizes))
  if sizes.count(-1) > 1:
    raise ValueError(f"Mesh ({spec}): at most one axis may be -1 (take the remaining devices).")
  if any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"Mesh ({spec}): axis sizes must be >= 1 or -1.")
  fixed = math.prod(s for s in sizes if s != -1)
  if num_devices % fixed:
    raise ValueError(
        f"Mesh ({spec}) needs a multiple of {fixed} devices but there are {num_devices}. Fix: "
        f"choose sizes whose product divides {num_devices}, e.g. --config.mesh.data=-1 "
        "--config.mesh.fsdp=1 --config.mesh.tensor=1.")
  if -1 in sizes:
    sizes[sizes.index(-1)] = num_devices // fixed
  return tuple(sizes)


def make_mesh(mesh_cfg, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A Mesh over `devices` (default: all) with axes ('data', 'fsdp', 'tensor').

  mesh_cfg: anything indexable by 'data', 'fsdp', 'tensor' (ConfigDict or dict); one size may be
  -1, meaning the remaining devices. The product of the sizes must divide the device count; a
  product smaller than it uses the first devices (with a warning).
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = _mesh_shape(mesh_cfg, len(devices))
  if math.prod(shape) < len(devices):
    # Allowed (a product dividing the device count), e.g. a 1-device mesh for a debugging run,
    # but never silent: idle devices usually mean a forgotten -1.
    logging.warning("Mesh %s uses %d of %d devices; set one axis to -1 to use them all.",
                    dict(zip(AXES, shape)), math.prod(shape), len(devices))
    devices = devices[:math.prod(shape)]
  if len(devices) == len(jax.devices()):
    # create_device_mesh orders devices so that inner axes (tensor, fsdp) land on the
    # best-connected devices (same host / ICI ring) on real accelerators.
    from jax.experimental import mesh_utils
    grid = mesh_utils.create_device_mesh(shape, devices)
  else:
    grid = np.asarray(devices).reshape(shape)
  # Auto axes: shardings are annotations and GSPMD propagates them (our jitted steps rely on
  # in/out_shardings, not on explicit-sharding types).
  return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) dim over ('data', 'fsdp'); the other dims replicated."""
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def _path_keys(path) -> list[str]:
  return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def param_sharding_rule(shape: Sequence[int], fsdp: int, tensor: int, *,
                        skip_leading: bool = False) -> P:
  """PartitionSpec for one array of `shape`.

  'fsdp' takes the largest dim divisible by the fsdp size; 'tensor' the largest remaining dim
  divisible by the tensor size, for arrays with >= 2 dims only (kernels and embeddings: vectors
  are too small to be worth splitting). Ties go to the later dim (the output features of a
  kernel). With `skip_leading` the first dim is never sharded: it is the layer axis that
  `nn.scan` slices each iteration, and slicing a sharded axis would all-gather every layer.
  """
  spec: list[Any] = [None] * len(shape)
  candidates = list(range(1 if skip_leading else 0, len(shape)))

  def take(size: int, axis: str):
    if size <= 1:
      return
    dims = [d for d in candidates if spec[d] is None and shape[d] % size == 0 and shape[d] >= size]
    if dims:
      best = max(dims, key=lambda d: (shape[d], d))
      spec[best] = axis

  take(fsdp, "fsdp")
  if len(shape) >= 2:
    take(tensor, "tensor")
  return P(*spec)


# Decoding placement: per weight product (the module's name), the mesh axis of each of its
# kernel's trailing dims. D (the model width) goes over 'fsdp', heads / F / V over 'tensor'.
DECODE_ROLES = {
    "q": ("fsdp", "tensor", None),        # [D, N, H]
    "k": ("fsdp", "tensor", None),        # [D, K, H]
    "v": ("fsdp", "tensor", None),
    "qkv": ("fsdp", "tensor", None),      # [D, N+2K, H]
    "o": ("tensor", None, "fsdp"),        # [N, H, D]
    "gate": ("fsdp", "tensor"),           # [D, F]
    "up": ("fsdp", "tensor"),
    "gate_up": ("fsdp", None, "tensor"),  # [D, 2, F]
    "down": ("tensor", "fsdp"),           # [F, D]
    "fc": ("fsdp", "tensor"),             # [2D, D] (a feature drafter's input layer)
    # The vocabulary over every model-parallel device: the lookup is a masked gather plus an
    # all-reduce of [B, T, D], the logits come out split over V.
    "lm_head": (None, ("fsdp", "tensor")),  # [D, V]
    "embed": (("fsdp", "tensor"), None),    # [V, D]
}
# BPD heads (models/bpd_heads.py), stacked on a leading head axis A under a drafter's "heads"
# key: A over 'tensor', so each device evaluates its own heads (a parallel map over the stack),
# and D over 'fsdp' like the products above (an own projection's V over 'fsdp', as lm_head's).
HEAD_ROLES = {
    "w1": ("tensor", "fsdp", None),   # [A, D, F]
    "b1": ("tensor", None),           # [A, F]
    "w2": ("tensor", None, "fsdp"),   # [A, F, D]
    "out": ("tensor", None, "fsdp"),  # [A, D, V]
}


def decode_param_rule(path_keys: Sequence[str], shape: Sequence[int], fsdp: int,
                      tensor: int) -> P:
  """PartitionSpec of one parameter for decoding (`decode_param_shardings`).

  A decode step multiplies a few rows by every weight once, so moving weights costs far more
  than moving activations: gathering a 70B verifier's fsdp-sharded weights is ~6 GiB per chip
  per round on a 64-chip mesh (experiments/scale/results.md, "Pod plan"). Here the kernels of
  the products `DECODE_ROLES` names put their model-width dim over 'fsdp' and their heads,
  feed-forward or vocabulary dim over 'tensor', and the activations around them are laid out
  to match (`decoding_layout`): each device multiplies by its own shard and only activations
  cross the mesh. Stacked BPD heads split their head axis over 'tensor' (`HEAD_ROLES`).
  Vectors (norm gains, q/k norms) are replicated, biases split their heads like their kernels;
  any other parameter follows the training rule. A dim that does not divide over its axis
  stays whole (one meant for both axes takes 'fsdp' alone if that divides it)."""
  keys = [str(k) for k in path_keys]
  module = keys[-2] if len(keys) >= 2 else ""
  leaf = keys[-1] if keys else ""
  roles = DECODE_ROLES.get(module)
  if module == "heads" and leaf in HEAD_ROLES and len(shape) == len(HEAD_ROLES[leaf]):
    roles = HEAD_ROLES[leaf]
  elif roles is not None and leaf == "bias" and module in ("q", "k", "v", "qkv"):
    roles = roles[1:]  # [N, H]: split the heads as the kernel does
  elif roles is None or leaf not in ("kernel", "embedding") or len(shape) < len(roles):
    if len(shape) - ("layers" in keys) <= 1:
      return P()  # vectors: replicated
    return param_sharding_rule(shape, fsdp, tensor, skip_leading="layers" in keys)
  sizes = {"fsdp": fsdp, "tensor": tensor}
  spec = [None] * (len(shape) - len(roles))
  for dim, axes in zip(shape[len(shape) - len(roles):], roles):
    # A dim over several axes, else over as many of them, in order, as divide it.
    axes = tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ()) if sizes[a] > 1)
    while axes and dim % math.prod(sizes[a] for a in axes):
      axes = axes[:-1]
    spec.append(axes[0] if len(axes) == 1 else (axes or None))
  return P(*spec)


def decode_param_shardings(mesh: Mesh, param_shapes: Any) -> Any:
  """NamedShardings for a pytree of parameters (arrays or ShapeDtypeStructs) that decode on
  `mesh`, by `decode_param_rule`."""
  fsdp, tensor = mesh.shape["fsdp"], mesh.shape["tensor"]
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: NamedSharding(mesh, decode_param_rule(
          _path_keys(path), tuple(getattr(leaf, "shape", ())), fsdp, tensor)), param_shapes)


def param_shardings(mesh: Mesh, param_shapes: Any) -> Any:
  """NamedShardings for a pytree of arrays or ShapeDtypeStructs (params, optimizer state or a
  whole train state), by `param_sharding_rule`. Leaves under a 'layers' key are stacked over
  layers by `nn.scan`, so their leading dim is never sharded."""
  fsdp, tensor = mesh.shape["fsdp"], mesh.shape["tensor"]

  def one(path, leaf):
    shape = tuple(getattr(leaf, "shape", ()))
    skip = "layers" in _path_keys(path)
    return NamedSharding(mesh, param_sharding_rule(shape, fsdp, tensor, skip_leading=skip))

  return jax.tree_util.tree_map_with_path(one, param_shapes)


def shard_batch(batch: Any, sharding: NamedSharding) -> Any:
  """Host batch (numpy, same global batch on every process) -> global jax.Arrays.

  Each device of this process takes its own slice of the global batch, the rows its place in
  the mesh gives it (`jax.make_array_from_callback`), so a multi-host run reads the same global
  batch as a single-host run whatever the processes' share of the mesh: rows replicated over a
  tensor axis that spans processes, or a device order that interleaves the processes (a TPU
  torus's) included. B must divide evenly over the batch axes.
  """
  mesh_batch = math.prod(sharding.mesh.shape[a] for a in BATCH_AXES)

  def one(x):
    x = np.asarray(x)
    if x.shape[0] % mesh_batch:
      raise ValueError(
          f"Batch size {x.shape[0]} does not divide over the mesh's batch axes data*fsdp = "
          f"{mesh_batch}. Fix: make train.batch_size a multiple of {mesh_batch}.")
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

  return jax.tree.map(one, batch)


def maybe_initialize_distributed(config, *, coordinator_address: str | None = None,
                                 num_processes: int | None = None,
                                 process_id: int | None = None) -> bool:
  """Call `jax.distributed.initialize()` (multi-host) when `config.distributed` (or `config`
  itself, a bool) is true.

  Coordinator address, process count and id: the arguments when given, else the environment
  (JAX_COORDINATOR_ADDRESS; TPU pods, SLURM and Kubernetes are auto-detected by JAX). On CPU the
  processes exchange collectives over gloo (loopback or a network). Must run before the first
  `jax.devices()`. Returns whether it initialized; a second call is a no-op.
  """
  wanted = bool(config.get("distributed", False)) if hasattr(config, "get") else bool(config)
  if not wanted:
    return False
  if jax.distributed.is_initialized():
    return False
  # CPU devices need a cross-process collectives backend; accelerators ignore this setting.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator_address or None,
                             num_processes=num_processes, process_id=process_id)
  logging.info("jax.distributed: process %d of %d, %d local / %d global devices.",
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count())
  return True


def is_writer() -> bool:
  """True on the one process that writes results, reports, plots and metrics (process 0)."""
  return jax.process_index() == 0


# ---------------------------------------------------------------------------------------------
# Decoding on a mesh: parameters placed by `decode_param_rule`, batches over ('data', 'fsdp'), KV
# caches over the batch and their key/value heads over 'tensor', activations by `ACTIVATIONS`.
# The decoding loops are jitted with these as inputs and as constraints on their caches and
# activations, so GSPMD partitions the whole loop (one compiled program, no host round trips)
# and inserts the collectives.

def decode_mesh(mesh_cfg) -> Mesh | None:
  """The Mesh decoding programs run on, or None for a single device (mesh sizes all 1)."""
  sizes = _mesh_shape(mesh_cfg, jax.device_count())
  if math.prod(sizes) == 1:
    return None
  return make_mesh(mesh_cfg)


def check_decode_mesh(mesh: Mesh, batch_size: int, kv_heads: dict[str, int | None],
                      batch_field: str = "the batch size") -> None:
  """ValueError naming the axis and the fix unless `batch_size` divides over data * fsdp and
  every model's key/value head count (name → count; None: not a KV-cache model) over tensor."""
  rows = math.prod(mesh.shape[a] for a in BATCH_AXES)
  if batch_size % rows:
    raise ValueError(
        f"{batch_field} = {batch_size} does not divide over the mesh's batch axes data*fsdp = "
        f"{mesh.shape['data']}*{mesh.shape['fsdp']} = {rows}. Fix: a batch size that is a "
        f"multiple of {rows}, or smaller --config.mesh.data / --config.mesh.fsdp.")
  tensor = mesh.shape["tensor"]
  for name, heads in kv_heads.items():
    if heads is not None and heads % tensor:
      raise ValueError(
          f"The {name} has {heads} key/value heads, which do not divide over mesh.tensor = "
          f"{tensor} (the KV cache shards its heads over 'tensor'). Fix: --config.mesh.tensor "
          f"= a divisor of {heads}.")


def check_kernels_on_mesh(mesh: Mesh, models: dict[str, Any]) -> None:
  """ValueError unless every model (name → config; None or a config without `pallas` skips)
  running its layers or its attention on hand-written GPU kernels (`LlamaConfig.pallas`,
  `LlamaConfig.attn_kernel`) decodes on one device: a Pallas kernel has no partitioning rule,
  so on a mesh XLA would gather its sharded weights or cache to every device on every call;
  nor a fused q/k/v weight (`LlamaConfig.fused`) on a mesh with a tensor axis, whose heads split
  out of line with their query groups; nor output-major o and down weights
  (`LlamaConfig.out_major`) on a mesh with model-parallel axes, whose placement
  (`DECODE_ROLES`) reads their axes in the usual order."""
  if mesh.size == 1:
    return
  for name, cfg in models.items():
    if getattr(cfg, "fused", False) and mesh.shape["tensor"] > 1:
      raise ValueError(
          f"The {name}'s q/k/v are one fused weight (model.size ...:fused=1), [D, N+2K, H], "
          f"whose N+2K heads split over tensor={mesh.shape['tensor']} out of line with their "
          "groups (one device holds query heads, another the keys), so every layer would "
          "reshuffle them between devices. Fix: drop :fused=1 from the size on a tensor-parallel "
          "mesh, or --config.mesh.tensor=1.")
    model_parallel = mesh.shape["fsdp"] * mesh.shape["tensor"]
    if getattr(cfg, "out_major", False) and model_parallel > 1:
      raise ValueError(
          f"The {name}'s o and down weights are stored output axis first (model.size "
          f"...:out_major=1), a layout for weights held whole on each device, but the decoding "
          f"mesh splits weights over fsdp × tensor = {model_parallel} devices by the usual "
          "layout's axes. Fix: drop :out_major=1 from the size, or --config.mesh.fsdp=1 "
          "--config.mesh.tensor=1.")
    for option, what in (("pallas", "its layers"), ("attn_kernel", "its attention")):
      if getattr(cfg, option, False):
        raise ValueError(
            f"The {name} runs {what} on hand-written kernels (model.size ...:{option}=1), "
            f"which run on one device, but the decoding mesh has {mesh.size}. Fix: "
            "--config.mesh.data=1 --config.mesh.fsdp=1 --config.mesh.tensor=1, or drop "
            f":{option}=1 from the size.")


def cache_sharding(mesh: Mesh) -> NamedSharding:
  """k, v [L, B, S, K, H]: rows over the batch axes, key/value heads over 'tensor'."""
  return NamedSharding(mesh, P(None, BATCH_AXES, None, "tensor", None))


def put(tree: Any, shardings: Any) -> Any:
  """jax.device_put(tree, shardings) for parameters every process holds alike (loaded from the
  same checkpoint, or initialised from the same seed). Multi-host: a process's own copy of a
  leaf (a loaded checkpoint sits on the process's first device) goes in as host data, since
  device_put cannot move a committed array across hosts."""
  if jax.process_count() > 1:
    tree = jax.tree.map(
        lambda x: np.asarray(x) if getattr(x, "is_fully_addressable", False) else x, tree)
  return jax.device_put(tree, shardings)


def place_params(params: Any, mesh: Mesh) -> Any:
  """Parameters that decode on `mesh`, placed by `decode_param_rule` (`put`)."""
  return put(params, decode_param_shardings(mesh, params))


def constrain_caches(tree: Any, mesh: Mesh | None) -> Any:
  """`tree` with every Llama-family KV cache in it constrained to `cache_sharding` (inside jit);
  other leaves (a drafter's own state, a table cache) are left to GSPMD. No-op without a mesh."""
  if mesh is None:
    return tree
  from spec_jax.models import llama  # noqa: PLC0415 (parallel stays importable without models)
  sharding = cache_sharding(mesh)

  def one(x):
    if isinstance(x, llama.KVCache):
      pos = None if x.pos is None else jax.lax.with_sharding_constraint(
          x.pos, batch_sharding(mesh))
      return llama.KVCache(k=jax.lax.with_sharding_constraint(x.k, sharding),
                           v=jax.lax.with_sharding_constraint(x.v, sharding), pos=pos)
    return x

  return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, llama.KVCache))


# Activations inside a decoding program on a mesh (`decoding_layout`), by what they are:
ACTIVATIONS = {
    # the residual stream and the sublayers' inputs [B, T, D]: D over 'fsdp', as every weight
    # product's contracting rows are, so each device multiplies its own slice of x by its own
    # weight shard and the partial sums are all-reduced (2D weight-stationary);
    "stream": P("data", None, "fsdp"),
    # a product's output [B, T, F|D] as a weight with that dim over 'tensor' leaves it
    # (gate, up, a feature drafter's fc), and gate_up's [B, T, 2, F];
    "hidden": P("data", None, "tensor"),
    "hidden_pair": P("data", None, None, "tensor"),
    # logits [B, T, V] as the output layer leaves them;
    "vocab": P("data", None, ("fsdp", "tensor")),
    # q, k, v [B, T, N|K, H] as their products leave them, and the attention's output entering
    # the o product: every row, heads over 'tensor';
    "heads_rows": P("data", None, "tensor", None),
    # q and the new k/v entering the attention: rows and heads as the KV cache holds them
    # (`cache_sharding`), so each device attends over its own rows of the cache;
    "heads": P(BATCH_AXES, None, "tensor", None),
    # a feature drafter's [features; embeddings] [B, T, 2D] entering its fc: whole rows;
    "whole": P("data", None, None),
    # token ids [B, T] entering the embedding: rows over 'data' only.
    "ids": P("data", None),
}


@contextlib.contextmanager
def decoding_layout(mesh: Mesh | None):
  """While tracing a decoding program for `mesh` (None or one device: nothing changes), the
  models lay their activations out as `ACTIVATIONS` says (`layers.constrain`); outside it
  they leave them to GSPMD (training)."""
  if mesh is None or mesh.size == 1:
    yield
    return
  from spec_jax.models import layers  # noqa: PLC0415 (parallel stays importable without models)
  with layers.activation_shardings({kind: NamedSharding(mesh, spec)
                                    for kind, spec in ACTIVATIONS.items()}):
    yield


def laid_out(fn):
  """fn(..., mesh=...), a decoding program, traced inside `decoding_layout(mesh)`."""
  @functools.wraps(fn)
  def traced(*args, mesh=None, **kwargs):
    with decoding_layout(mesh):
      return fn(*args, mesh=mesh, **kwargs)
  return traced


def to_host(x: Any) -> np.ndarray:
  """A (possibly multi-host) array as numpy on this process: all of it, gathered if needed."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils  # noqa: PLC0415
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))
