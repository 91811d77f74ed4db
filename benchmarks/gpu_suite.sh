#!/usr/bin/env bash
# Every GPU figure the issues ask for, each benchmark under its own time limit so one slow part
# cannot eat the rest. On an H200 the throughput part alone took 230 s, and tenants and accel ran
# past 90 s and 150 s. The limits add up to about 25 minutes, more than a 10-minute device call
# or a 15-minute lease: pick parts with ONLY=. Not yet measured on a GPU (2026-12-04), in order:
# ONLY="throughput whole" (460 s: continuous batching against whole calls, issue 53), then
# ONLY="tenants latency abort lora" (420 s at most), then ONLY="models accel" (420 s); for issue
# 54, ONLY=fast (360 s), then FLUX_FAST_ARGS="--model builtin:flux-arch --device cuda" ONLY=flux_fast.
#
#   bash benchmarks/gpu_suite.sh [OUTDIR]          # default OUTDIR: $OUT, else benchmarks/results/gpu
#
# On a GPU host that has torch (CUDA), transformers and peft but no Ray or diffusers, build an
# offline wheelhouse here first and carry it over (see README, "Benchmarks on a GPU"):
#   ../shared/tools/gpu-wheelhouse.sh .whl 'ray[serve]==2.60.0' 'diffusers==0.42.1'
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   chmod -R a+x /tmp/site/ray/core     # the slimmed wheel loses the execute bits of Ray's binaries
#   export PYTHONPATH=/tmp/site:$PWD
# A CPU smoke run of the same script (checks that it runs, not the figures):
#   MODEL_ARGS="--model builtin:tiny-sd --device cpu" CACHE_MODELS=builtin:tiny-sd SIZE=32 STEPS=2 bash benchmarks/gpu_suite.sh /tmp/suite
set -uo pipefail
out=${1:-${OUT:-benchmarks/results/gpu}}
mkdir -p "$out"
read -r -a M <<< "${MODEL_ARGS:---model builtin:sd15-arch --device cuda}"
size=${SIZE:-512}
steps=${STEPS:-20}
export RAY_USAGE_STATS_ENABLED=0
PY=${PYTHON:-python3}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
  $PY -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__)'; } > "$out/host.txt"
cat "$out/host.txt"

run() {  # run NAME LIMIT_S SCRIPT ARGS...: its output to NAME.log, its tail here
    local name=$1 limit=$2; shift 2
    [[ -z "${ONLY:-}" || " $ONLY " == *" $name "* ]] || return 0  # ONLY="throughput tenants": just those
    echo "== $name (limit ${limit}s)"
    local t0=$SECONDS
    timeout "$limit" $PY "benchmarks/$1" "${@:2}" > "$out/$name.log" 2>&1
    echo "rc=$? in $((SECONDS - t0))s"
    grep -v -E 'INFO|WARNING|Warning|raylet|transformers|_dynamo|If it is' "$out/$name.log" | tail -n 18
}

run throughput 260 bench_throughput.py "${M[@]}" --sizes "$size" --steps "$steps" --clients 1 8 16 \
    --rounds 2 --requests-per-client 3 --raw-seconds 8 --max-batch 16 --out "$out/throughput"
# The same clients in whole calls (step joining off; the part above runs a GPU's default,
# continuous batching): on the H200 (2026-12-04, whole calls then) 16 HTTP clients made 0.64x
# raw batch 16. Compare the two parts' 16-client rows.
run whole 200 bench_throughput.py "${M[@]}" --sizes "$size" --steps "$steps" --clients 1 8 16 \
    --rounds 2 --requests-per-client 3 --raw-seconds 8 --max-batch 16 --step-joining off --out "$out/whole"
run latency 90 bench_latency.py "${M[@]}" --size "$size" --steps "$steps" --iters 8 --out "$out/latency.json"
run abort 60 bench_abort.py "${M[@]}" --size "$size" --steps 50 --trials 3 --out "$out/abort.json"
run lora 90 bench_lora.py "${M[@]}" --size "$size" --steps "$steps" --clients 8 --per-client 3 \
    --out "$out/lora.json"
run tenants 180 bench_tenants.py "${M[@]}" --size "$size" --steps "$steps" --seconds 10 --batch 8 \
    --out "$out/tenants.json"
read -r -a C <<< "${CACHE_MODELS:-builtin:sd15-arch}"
run cache 90 bench_cache.py "${M[@]}" --models "${C[@]}" --size "$size" --steps "$steps" --batch 1 \
    --rounds 2 --out "$out/cache.json"
run accel 240 bench_accel.py "${M[@]}" --size "$size" --steps "$steps" --batch 8 --rounds 2 \
    --out "$out/accel.json"
# The fast path (issue 54, `speed: max`): compiled with CUDA graphs against the eager raw pipeline
# at batch 1 and 16, the warm-up of both shapes cold and then cached in a second process, one HTTP
# client on it. Goals: batch 1 >= 3x eager and >= 100 steps/s, batch 16 >= 1.5x, HTTP <= 1.05x.
run fast 360 bench_fast.py "${M[@]}" --size "$size" --steps "$steps" --batch 16 --rounds 3 \
    --out "$out/fast.json"
# FLUX.1 shapes with float8 on the fast path (compute capability 8.9+), against bf16 eager; goal
# >= 1.6x at PSNR >= 30 dB. Opt in (up to 300 s): FLUX_FAST_ARGS="--model builtin:flux-arch --device cuda".
if [[ -n "${FLUX_FAST_ARGS:-}" ]]; then
    read -r -a FF <<< "$FLUX_FAST_ARGS"
    run flux_fast 300 bench_fast.py "${FF[@]}" --size 1024 --steps 4 --batch 1 --rounds 3 --no-http \
        --out "$out/flux_fast.json"
fi
run joining 120 bench_joining.py "${M[@]}" --size "$size" --steps "$steps" --requests 24 \
    --out "$out/joining.json"
run models 180 bench_models.py "${M[@]}" --size "$size" --steps "$steps" --loads 3 --out "$out/models.json"
# The transformer family at its real shapes (FLUX.1: 11.9B transformer, T5-XXL; random weights,
# no download), 1024x1024 at 4 steps as FLUX.1 [schnell] runs: the serving overhead over the raw
# pipeline where one call takes seconds. Opt in (it adds up to 200 s, past the 15-minute lease
# with the rest at their limits): FLUX_ARGS="--model builtin:flux-arch --device cuda".
read -r -a F <<< "${FLUX_ARGS:-}"
if [ ${#F[@]} -gt 0 ]; then
    run latency-flux 200 bench_latency.py "${F[@]}" --size 1024 --steps 4 --iters 3 --out "$out/latency-flux.json"
fi
# A newer family at its real shapes (LTX-Video 0.9: a 1.9B transformer, T5-XXL, 161 frames of
# 704x480; random weights): served against the raw pipeline, 8 steps. Opt in (up to 240 s):
# LTX_ARGS="--models ltx-arch --device cuda".
read -r -a L <<< "${LTX_ARGS:-}"
if [ ${#L[@]} -gt 0 ]; then
    run families-ltx 240 bench_families.py "${L[@]}" --steps 8 --rounds 3 --out "$out/families-ltx.json"
fi
echo "results in $out"
