#!/usr/bin/env bash
# One prepared run of perfx's GPU checks on the GPU machine (about 9 minutes), the full selftest among them, and
# issue 43's batched decode.
# Adapted from ../shared/device/gpu-check.sh: the full selftest runs as one command in the time left (--budget),
# its builds in 12 worker processes; an unfinished one leaves its progress in $OUT/selftest-progress, which the
# next run resumes from when copied into .whl/selftest-progress first. A short measure of the driver's builds at
# once (threads against worker processes) comes before it.
# Here, in the project's root (the perfx wheel itself too, since kernels/ and tuning/ install as perfx.kernels
# and perfx.tuning):   ../shared/device/prepare-wheels.sh gguf pyyaml tqdm && python3 -m pip wheel -q --no-deps -w .whl . && cp ../shared/device/gpu-env.sh benchmarks/gpu-check.sh .whl/
#   (to resume an unfinished selftest: mkdir -p .whl/selftest-progress && cp <fetched $OUT>/selftest-progress/*.json .whl/selftest-progress/)
# There (carry .whl and benchmarks, timeout ~590 s):   bash .whl/gpu-check.sh
# Everything it prints also lands in $OUT/gpu-check.log, and each JSON in $OUT/.
set -u
source .whl/gpu-env.sh || { echo "gpu-env failed"; exit 1; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M7=synthetic:llama-2-7b
END_S=${END_S:-540}   # the whole script's seconds; the selftest takes what the steps before it leave
SECONDS=0
{
  date -u; nvidia-smi --query-gpu=name,memory.total,clocks.max.mem --format=csv 2>/dev/null
  python3 -m perfx info --json > "$OUT/info.json" && python3 -m perfx info | head -30
  # correctness first: every family at its defaults
  timeout 60 python3 -m perfx selftest --quick --json > "$OUT/selftest-quick.json"; echo "selftest --quick exit $?"
  # the decode GEMVs at 7B shapes, each against copy and the read-only stream
  timeout 100 python3 -m perfx bench --model $M7 --kernels gemv_q4,gemv_q8,rmsnorm,attention_decode --max-m 1 --json > "$OUT/bench-7b-decode.json"; echo "bench decode exit $?"
  python3 - "$OUT/bench-7b-decode.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
c = d["ceilings"]
print(f"ceilings: copy {c['copy_gb_per_s']:.1f} GB/s, read {c['read_gb_per_s']:.1f} GB/s, "
      f"peak {c['peak_gflop_per_s']:.0f} GFLOP/s")
for r in d["kernels"]:
    if "time_s" in r:
        print(f"  {r['family']} {r['label']} {r['description']}: {r['time_s'] * 1e6:.1f} us, "
              f"{r['percent_of_ceiling']:.0f}% copy, {r['percent_of_read']:.0f}% read")
PY
  # end to end: decode tok/s, host ms a token, launches a token; a 64-token prompt
  timeout 100 python3 -m perfx bench --model $M7 --e2e --no-fuse --max-m 64 --json > "$OUT/bench-7b-e2e.json"; echo "bench e2e 7B exit $?"
  # the same with the norms as GEMV tails (5 launches a dense layer against 8); the default follows the compiler
  # (tails where it orders their hand-off: perfx.step.fuse_asked), so both runs name theirs
  timeout 100 python3 -m perfx bench --model $M7 --e2e --fuse --max-m 64 --json > "$OUT/bench-7b-e2e-fused.json"; echo "bench e2e 7B fused exit $?"
  timeout 50 python3 -m perfx bench --model synthetic:gemma-3-270m --e2e --json > "$OUT/bench-gemma-e2e.json"; echo "bench e2e gemma exit $?"
  # issue 43's batched decode: N sequences' aggregate decode rate over one's, where a step reads the weights once
  # (bound by memory on a GPU, so N rows should cost about one row's step), then each matrix's GEMM over N rows
  [ -f benchmarks/batch_throughput.py ] && timeout 100 python3 benchmarks/batch_throughput.py --model $M7 --parallel 2 4 8 --rounds 2 --steps 16 > "$OUT/batch-7b.txt" 2>&1; echo "batched decode 7B exit $?"; tail -6 "$OUT/batch-7b.txt"
  [ -f benchmarks/batch_throughput.py ] && timeout 80 python3 benchmarks/batch_throughput.py --model $M7 --ops --parallel 1 4 --rounds 1 > "$OUT/batch-7b-ops.txt" 2>&1; echo "batched decode 7B ops exit $?"; grep "^N =" "$OUT/batch-7b-ops.txt"
  # the step launch by launch: device time per kernel and the gaps the host leaves
  [ -f benchmarks/launch_profile.py ] && timeout 50 python3 benchmarks/launch_profile.py --model $M7 --json > "$OUT/launches-7b.json"; echo "launch profile exit $?"
  # does NVIDIA's driver build two programs at once from threads of one process? (against worker processes)
  [ -f benchmarks/builds_at_once.py ] && timeout 90 python3 benchmarks/builds_at_once.py --sets 8 --rounds 1 --json > "$OUT/builds-at-once.json"; echo "builds at once exit $?"
  # the full selftest, as one command, in the time left; resumed from a carried progress file where there is one
  progress=$(python3 -c 'from perfx.resources import cache_dir; print(cache_dir() / "selftest")')
  if ls .whl/selftest-progress/*.json >/dev/null 2>&1; then mkdir -p "$progress" && cp .whl/selftest-progress/*.json "$progress/"; fi
  left=$(( END_S - SECONDS - 15 )); [ "$left" -lt 60 ] && left=60
  echo "full selftest: $left s"
  PERFX_BUILD_PROCESSES=1 PERFX_BUILD_WORKERS=12 timeout $(( left + 30 )) python3 -m perfx selftest --budget "$left" --json > "$OUT/selftest.json"
  status=$?; echo "selftest exit $status (0 all passed, 1 a failure, 3 unfinished: its progress is in \$OUT/selftest-progress)"
  if ls "$progress"/*.json >/dev/null 2>&1; then mkdir -p "$OUT/selftest-progress" && cp "$progress"/*.json "$OUT/selftest-progress/"; fi
  python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print({k: d.get(k) for k in ("planned","resumed","passed","failed","refused","complete","seconds","peak_rss_bytes","build_workers_peak_rss_bytes")})' "$OUT/selftest.json"
} 2>&1 | tee "$OUT/gpu-check.log"
