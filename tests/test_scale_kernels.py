"""experiments/scale/kernels.py's count of the kernels one decode step launches, read from a
hand-written optimized-HLO module: nested loops count times their trip counts, a fusion's own
body (and an async fusion's wrapped computation) counts as the one kernel that runs it, the
bookkeeping ops and the done-half of an async pair count nothing, the prefill outside the decode
loop counts nothing. (Compiling for a GPU target needs the CUDA plugin, which CI lacks; the
counting is what can go wrong quietly.) And collect.py, which gathers a loan's rows."""

import pytest

from experiments.scale import kernels

# The entry: a prefill fusion, then the decode loop (63 iterations) whose body runs a loop fusion,
# a copy, a Pallas kernel (a Triton custom call) and the layer loop (30 iterations); each layer runs an input fusion, an async fusion
# (start and done; its wrapped computation holds a dynamic-update-slice) and a cuBLAS call.
HLO = """HloModule m, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%fused_reduce (p0: f32[8]) -> f32[] {
  %p0 = f32[8]{0} parameter(0)
  %z = f32[] constant(0)
  ROOT %r = f32[] reduce(%p0, %z), dimensions={0}, to_apply=%add
}

%add (x: f32[], y: f32[]) -> f32[] {
  ROOT %a = f32[] add(%x, %y)
}

%wrapped (q0: f32[30,8], q1: f32[1,8], q2: s32[]) -> f32[30,8] {
  %zero = s32[] constant(0)
  ROOT %dus = f32[30,8]{1,0} dynamic-update-slice(%q0, %q1, %q2, %zero)
}

%layer_cond (c: (s32[], f32[8])) -> pred[] {
  %n = s32[] constant(30)
  %i = s32[] get-tuple-element(%c), index=0
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%layer (l: (s32[], f32[8])) -> (s32[], f32[8]) {
  %x = f32[8]{0} get-tuple-element(%l), index=1
  %red = f32[] fusion(%x), kind=kInput, calls=%fused_reduce
  %start = ((f32[30,8]{1,0}, f32[1,8]{1,0}, s32[]), f32[30,8]{1,0}, u32[]) fusion-start(%k, %v, %j), kind=kLoop, calls=%wrapped
  %gemm = (f32[8]{0}, s8[64]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm"
  %done = f32[30,8]{1,0} fusion-done(%start)
  %b = f32[2,4]{1,0} bitcast(%x)
  ROOT %t = (s32[], f32[8]) tuple(%i, %x)
}

%decode_cond (d: (s32[], f32[8])) -> pred[] {
  %n = s32[] constant(63)
  %i = s32[] get-tuple-element(%d), index=0
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%decode (d: (s32[], f32[8])) -> (s32[], f32[8]) {
  %h = f32[8]{0} fusion(%y), kind=kLoop, calls=%fused_reduce
  %cp = f32[8]{0} copy(%h)
  %pallas_call.3 = (f32[1,9,64]{2,1,0}, f32[1,6,64]{2,1,0}) custom-call(%h, %cp), custom_call_target="__gpu$xla.gpu.triton", backend_config={"name":"qkv_rope","grid_x":60}
  %q = f32[1,9,64]{2,1,0} get-tuple-element(%pallas_call.3), index=0
  %layers = (s32[], f32[8]) while(%t1), condition=%layer_cond, body=%layer, backend_config={"known_trip_count":{"n":"30"}}
  ROOT %t = (s32[], f32[8]) tuple(%i, %h)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %prefill = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused_reduce
  %loop = (s32[], f32[8]) while(%t0), condition=%decode_cond, body=%decode, backend_config={"known_trip_count":{"n":"63"}}
}
"""


def test_kernels_per_decode_step_are_counted_from_the_hlo():
  got = kernels.kernels_per_iteration(HLO, 63)
  assert dict(got) == {"fusion:kLoop": 1 + 30, "copy": 1, "fusion:kInput": 30,
                       "custom-call:__cublas$gemm": 30, "custom-call:__gpu$xla.gpu.triton": 1}
  assert sum(got.values()) == 93
  with pytest.raises(RuntimeError, match="one loop of 64 iterations"):
    kernels.kernels_per_iteration(HLO, 64)


# XLA's thunk sequence of a decode program, as its dump writes it (abridged): the prefill (a
# command buffer, a cuBLAS call), then the decode loop, whose body launches a command buffer of
# three kernels, the layer loop (each layer: a kernel, an asynchronous copy and its wait, a
# cuBLAS call on a slice of the stacked weights, a command buffer of two kernels), a cuBLAS call
# and a command buffer of one kernel; then two copies after the loop.
THUNKS = """000: kCommandBuffer  [source       | next=002 (1)]
    001: kCustomKernel [source       | sink        ] prefill grid: [1, 1, 1] threads: [64, 1, 1]  shared_memory: 0 bytes
002: kCublasLtMatmul [prev=000 (1) | next=003 (1)] kCublasLtMatmul
003: kWhile          [prev=002 (1) | next=020 (1)]
condition:
    004: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    000: kCommandBuffer  [source       | next=009 (1)]
        005: kCustomKernel [source       | next=006 (1)] a grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
        006: kCustomKernel [prev=005 (1) | next=007 (1)] qkv_rope grid: [15, 4, 1] threads: [128, 1, 1]  shared_memory: 2048 bytes
        007: kCopy         [prev=006 (1) | sink        ] kCopy
    009: kWhile          [prev=000 (1) | next=000 (1)]
condition:
        010: kCustomKernel [source | sink] loop_compare_fusion_1 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      body:
        011: kCustomKernel       [source       | next=012 (1)] norm grid: [1, 1, 1] threads: [64, 1, 1]  shared_memory: 0 bytes
        012: kAsyncStart         [prev=011 (1) | sink        ] stream=computation_stream[2], async_id=12
            013: kCopy [source | sink] kCopy
        014: kDynamicSliceFusion [prev=011 (1) | next=000 (1)] params=2, results=2
            015: kCublasLtMatmul [source | sink] kCublasLtMatmul
        000: kCommandBuffer      [prev=014 (1) | next=018 (1)]
            016: kCustomKernel [source       | next=017 (1)] softmax grid: [3, 1, 1] threads: [1024, 1, 1]  shared_memory: 0 bytes
            017: kCustomKernel [prev=016 (1) | sink        ] add grid: [5, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
        018: kAsyncDone          [source       | sink        ] async_id=12
    019: kCublasLtMatmul [prev=000 (1) | next=000 (1)] kCublasLtMatmul
    000: kCommandBuffer  [prev=019 (1) | sink        ]
        021: kCustomKernel [source       | sink        ] argmax grid: [16, 1, 1] threads: [256, 1, 1]  shared_memory: 0 bytes
020: kCopy           [prev=003 (1) | sink        ] kCopy
021: kCopy           [prev=003 (2) | sink        ] kCopy
"""


def test_host_launches_per_decode_step_are_read_from_the_thunk_sequence():
  """A command buffer (one CUDA graph) is one launch whatever it holds; the layer loop's body
  counts times its trips; an asynchronous copy's wait launches nothing; the prefill and the
  copies after the loop count nothing."""
  got = kernels.host_launches(THUNKS, layer_trips=30)
  assert got == dict(launches=1 + 30 * 4 + 2, graphs=1 + 30 + 1,
                     kernels_in_graphs=3 + 30 * 2 + 1,
                     outside_graphs={"kCustomKernel": 30, "kAsyncStart": 30,
                                     "kDynamicSliceFusion": 30, "kCublasLtMatmul": 1})
  with pytest.raises(RuntimeError, match="no loop"):
    kernels.host_launches(THUNKS.split("003: kWhile")[0], layer_trips=30)


def test_collect_keeps_the_speed_rows_and_leaves_the_tile_sweeps_out(tmp_path, monkeypatch):
  """experiments/scale/collect.py gathers the benchmark rows of every run after a GPU loan; a
  tile sweep's rows (pallas_tiles.py: several layouts a process, no decode-step split) sit
  beside them in the same folder and keep their own results.md, so they are left out instead
  of failing the gathering."""
  import json  # noqa: PLC0415

  from experiments.scale import collect  # noqa: PLC0415
  bench = dict(preset=None, model="smollm2-135m", device="H200", device_kind="NVIDIA H200",
               dtype="float32", batch_size=1, ms_per_step=1.5, ms_per_decode_step=1.4,
               roofline_ms_per_step=0.134, memory_bandwidth_gb_s=4000.0)
  sweep = dict(run="pallas default", batch_size=1, ms_per_step=1.9, roofline_ms_per_step=0.134,
               memory_bandwidth_gb_s=4000.0, device_kind="NVIDIA H200", tiles={"depth": 4})
  for run, rows in (("smollm2-135m-f32-fused", [bench]), ("pallas-float32", [sweep]),
                    ("pallas-tiles", [sweep])):
    (tmp_path / "gpu_bars2" / run).mkdir(parents=True)
    (tmp_path / "gpu_bars2" / run / "results.json").write_text(json.dumps(rows))
  monkeypatch.setattr(collect, "HERE", tmp_path)
  rows = collect.rows()
  assert [r["run"] for r in rows] == ["gpu_bars2/smollm2-135m-f32-fused"]
  assert rows[0]["decode_vs_reference_roofline"] == round(1.4 / rows[0][
      "reference_roofline_ms_per_step"], 2)
