#!/usr/bin/env bash
# The CUDA path, verified: the versions found, every `gpu`-marked test, and the chapters' GPU
# benchmarks, on this machine's CUDA device, each part stopped at its time budget.
#
#   scripts/gpu_check.sh OUTDIR
#
# Writes to OUTDIR: gpu_check.log (everything printed), versions.json (Python, torch, triton,
# transformers, numpy, the GPU, its memory, CUDA; which packages are missing and what that
# skips), summary.json (per part: status ok / failed / skipped / timeout, reason, seconds,
# budget, key figures; rewritten after every part, so it is there whatever stops the run), and
# one JSON per benchmark (bandwidth.json, bench_s06.json, bench_s08.json, bench_s09.json,
# bench_s12.json, bench_s14.json, bench_s15.json; each rewritten after every row, so a part
# stopped at its budget keeps what it measured; bench_s16.json, S16's benchmark's; and
# bench_s17.json, S17's, rewritten after each of its parts, with pytest_s17.xml, its tests'
# JUnit report; bench_s18.json, S18's gpu section, rewritten after each of its parts). On a
# machine without a CUDA device it says so, writes versions.json and summary.json (status
# "no_device") and exits 0.
#
# Parts and their budgets in seconds (each under its own `timeout`; none runs past the total,
# GPU_CHECK_BUDGET_S, default 480, so the whole check ends within 8 minutes):
#   versions     40   scripts/gpu_check_report.py versions: what is installed, the device
#   bandwidth    25   benchmarks/gpu_bench.py bandwidth: device-to-device copy, bf16 matmul
#   pytest_gpu  120   python -m pytest -m gpu over the test files that use the marker, S17's
#                     excepted (S16's compiled and CUDA-graph tests in tests/test_s16_static.py
#                     too)
#   s06          26   S06's engine against HF generate(), bf16, batch 1, Qwen3-0.6B shape
#   s08          28   S08's static batches against HF's padded generate(), B = 1 .. 64
#   s09          17   S09's continuous batching against S08's static batches, mixed lengths
#   s12          16   S12's paged decode against S09's contiguous slots
#   s14          21   S14's int8 / int4 fused GEMVs and batch-1 decode against bf16
#   s15          17   S15's speculative decoding, batch 1: plain vs n-gram vs an int4 draft
#   s16          60   S16's benchmark (benchmarks/bench_s16_host.py --quick): eager vs static
#                     vs compiled vs CUDA-graph decode steps, async scheduling
#   s17          75   S17's gpu-marked tests (tests/test_s17_*.py: its Triton kernels compiled,
#                     at most S17_TESTS_S of the part), then its benchmark's gpu section
#                     (benchmarks/bench_s17_attention.py --sections gpu): the Triton flash
#                     forward vs SDPA, paged decode vs gather + SDPA, split-K at B = 1
#   s18          25   S18's benchmark's gpu section (benchmarks/bench_s18_tensor_parallel.py
#                     --sections gpu): NCCL at world size 1, a smoke test (the tensor-parallel
#                     executor's greedy tokens and step time against S17's engine alone, B = 1
#                     and 32; one all-reduce call at world size 1); one GPU shows no scaling
# The budgets add up to the default total less 10 s (the grace a part's KILL may take), so
# each part gets its whole budget even when every part before it used all of its own (tests/
# test_gpu_check.py checks this sum). S16's 60 s came from the six benchmark parts before it,
# in proportion to their budgets (285 s became 225 s; a benchmark told a smaller --budget-s
# leaves out rows, while pytest_gpu, which now also compiles S16's steps, and the fixed
# costs of versions and bandwidth kept theirs). S17's 75 s came from the same six parts in
# the same way (225 s became 150 s; S16's part, which has no --budget-s, kept its 60 s).
# S18's 25 s came from the same parts again, about a sixth of each (150 s became 125 s),
# except S12's 16 s, already near the 15 s below which a part is skipped.
# S17's tests run in its own part, not in pytest_gpu, so that compiling its Triton kernels
# is paid from its budget. A smaller GPU_CHECK_BUDGET_S cuts the last parts: each gets at
# most what is left, and one that would start with under 15 s left is skipped, said in the
# summary.
# A benchmark is told its budget less 10 s (--budget-s) and leaves out the rows that would
# not fit; `timeout` stops a part still running at its budget (a benchmark with TERM, pytest
# with INT so that it still reports the tests it ran; KILL 10 s later).
#
# Environment: PYTHON, the interpreter (default: the repository's .venv/bin/python if there
# is one, else python3, the one with torch on the course's GPU machines; nothing is
# installed); GPU_CHECK_BUDGET_S, the total in seconds; GPU_CHECK_CPU=1 runs every part on
# the CPU instead (the benchmarks with --device cpu --shape tiny, the gpu tests skipping): a
# rehearsal of the script itself on a machine without a GPU, its figures meaningless.
# Exit status: 0 when no part failed or timed out (skipped parts, with their reason, and a
# machine without CUDA included), 1 otherwise, 2 for a usage error.
#
# A chapter that adds a GPU benchmark adds its part to benchmarks/gpu_bench.py and one line
# below; a test marked `gpu` is picked up by the marker, with no change here. S16's benchmark
# is its own script (S16_BENCH below: its flags in one place), run with --device cuda (cpu
# under GPU_CHECK_CPU=1) and --json; it has no --budget-s, so `timeout` alone bounds it.
# S17's part is the function s17_part below, run by `bash -c` under the part's timeout: its
# tests, then its benchmark told the seconds left (--budget-s), which it fits its rows to; under
# GPU_CHECK_CPU=1 the benchmark runs its CPU traffic section instead (--quick). S18's part is
# its benchmark (S18_BENCH) with --device cuda and --budget-s; its gpu-marked tests run in
# pytest_gpu (the marker); under GPU_CHECK_CPU=1 the same section runs on gloo at world size 1
# (--device cpu --quick: a rehearsal, the CPU's figures).
set -u

if [ $# -ne 1 ] || [ "${1#-}" != "$1" ]; then
    echo "usage: scripts/gpu_check.sh OUTDIR   (see the comment at the top of the script)" >&2
    exit 2
fi
OUTDIR=$1
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$OUTDIR" || exit 2
OUTDIR=$(cd "$OUTDIR" && pwd)
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
TOTAL_BUDGET_S=${GPU_CHECK_BUDGET_S:-480}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
REPORT=(scripts/gpu_check_report.py)
BENCH=(benchmarks/gpu_bench.py)
S16_BENCH=(benchmarks/bench_s16_host.py --quick)     # the s16 part's command, less device, json
S17_TESTS_S=25       # the most of the s17 part its tests may take (pytest stopped by INT there)
S18_BENCH=(benchmarks/bench_s18_tensor_parallel.py --sections gpu)   # less device, json, budget

main() {
    cd "$ROOT" || return 1
    WORK=$(mktemp -d) || return 1
    trap 'rm -rf "$WORK"' EXIT
    PARTS=$WORK/parts.tsv
    JUNIT=$WORK/pytest_gpu.xml
    : >"$PARTS"
    START=$SECONDS
    FAILED=0
    echo "== gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ) on ${HOSTNAME:-?}, repo $ROOT"
    echo "== results in $OUTDIR; total budget ${TOTAL_BUDGET_S} s; python: $PYTHON"

    if ! command -v "$PYTHON" >/dev/null 2>&1; then
        echo "no python at '$PYTHON' (set PYTHON): nothing to check"
        write_bare_summary "no_python" "no python at '$PYTHON'"
        return 0
    fi

    run_part versions 40 versions.json TERM \
        "$PYTHON" "${REPORT[@]}" versions --json "$OUTDIR/versions.json"
    if [ ! -s "$OUTDIR/versions.json" ]; then
        echo "versions.json was not written: $PYTHON cannot report this machine"
        summarize --print --set status=failed --set "reason=the versions part failed"
        return 1
    fi
    local cuda torch_ok
    cuda=$(field versions.json cuda.available)
    torch_ok=$(field versions.json cuda.importable)
    local device_args=() s16_device=(--device cuda) s17_args=(--device cuda --sections gpu)
    local s18_device=(--device cuda)
    if [ "${GPU_CHECK_CPU:-0}" = "1" ]; then
        echo "GPU_CHECK_CPU=1: a rehearsal on the CPU, tiny model, figures meaningless"
        device_args=(--device cpu --shape tiny)
        s16_device=(--device cpu)
        s17_args=(--device cpu --sections traffic --quick)
        s18_device=(--device cpu --quick)
    elif [ "$cuda" != "True" ]; then
        local why="torch $(field versions.json cuda.torch) sees none"
        [ "$torch_ok" = "True" ] || why="torch is not importable with $PYTHON"
        echo "no CUDA device: nothing to check ($why)"
        for part in bandwidth pytest_gpu s06 s08 s09 s12 s14 s15 s16 s17 s18; do
            record "$part" skipped "no CUDA device ($why)" 0 "" ""
        done
        if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
            echo "but nvidia-smi lists a GPU: this python's torch cannot use it"
            summarize --set status=failed --print \
                --set "reason=nvidia-smi lists a GPU, torch cannot use it ($why)"
            return 1
        fi
        summarize --set status=no_device --print \
            --set "reason=no CUDA device: nothing to check ($why)"
        return 0
    fi

    run_part bandwidth 25 bandwidth.json TERM "$PYTHON" "${BENCH[@]}" bandwidth \
        --json "$OUTDIR/bandwidth.json" "${device_args[@]}"

    if [ "$(field versions.json modules.pytest.found)" != "True" ]; then
        record pytest_gpu skipped "pytest is not installed for $PYTHON" 0 "" ""
    else
        # The files that use the marker (a decorator, a module-level pytestmark or an alias;
        # not a mention in a string or a comment); -m gpu selects the marked tests in them.
        # S17's files run in the s17 part.
        local files
        files=$(grep -lE '^[^#"'"'"']*pytest\.mark\.gpu\b' tests/test_*.py tests/*/test_*.py \
            2>/dev/null | grep -v '^tests/test_s17_' | sort)
        if [ -z "$files" ]; then
            record pytest_gpu skipped "no test file uses the gpu marker" 0 "" ""
        else
            local per_test=()
            if [ "$(field versions.json modules.pytest_timeout.found)" = "True" ]; then
                per_test=(--timeout=60)
            else
                echo "pytest-timeout missing: no per-test limit, the part's budget still holds"
            fi
            echo "gpu test files:" $files
            # shellcheck disable=SC2086  # one word per file
            run_part pytest_gpu 120 "" INT "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider \
                --continue-on-collection-errors --junitxml="$JUNIT" "${per_test[@]}" $files
        fi
    fi

    if [ "$(field versions.json modules.transformers.found)" != "True" ]; then
        for part in s06 s08 s09 s12 s14 s15 s16; do
            record "$part" skipped "transformers is not installed: no random model to build" 0 "" ""
        done
    else
        local bw=(--bandwidth-json "$OUTDIR/bandwidth.json" "${device_args[@]}")
        bench s06 26 "${bw[@]}"
        bench s08 28 "${bw[@]}"
        bench s09 17 "${bw[@]}"
        bench s12 16 "${bw[@]}"
        bench s14 21 "${bw[@]}"
        bench s15 17 "${device_args[@]}"   # measures no bandwidth: no --bandwidth-json
        # S16's benchmark, its own script; its GPU tests ran in pytest_gpu (the marker)
        run_part s16 60 bench_s16.json TERM "$PYTHON" "${S16_BENCH[@]}" "${s16_device[@]}" \
            --json "$OUTDIR/bench_s16.json"
    fi

    # S17: its gpu tests, then its benchmark's gpu section (neither needs transformers' random
    # models: after the branch above, whichever way it went)
    export -f s17_part          # run by `bash -c` under the part's timeout
    run_part s17 75 bench_s17.json TERM bash -c 's17_part "$@"' s17 "$PYTHON" "@BUDGET_LESS_10@" \
        "$OUTDIR/pytest_s17.xml" "$OUTDIR/bench_s17.json" "$S17_TESTS_S" "${s17_args[@]}"

    # S18: its benchmark's gpu section, NCCL at world size 1 on the bundled model (no
    # transformers needed); its gpu-marked tests ran in pytest_gpu
    run_part s18 25 bench_s18.json TERM "$PYTHON" "${S18_BENCH[@]}" "${s18_device[@]}" \
        --json "$OUTDIR/bench_s18.json" --budget-s "@BUDGET_LESS_10@"

    local total=$((SECONDS - START))
    echo "== gpu_check done in ${total} s"
    summarize --set "seconds_s=$total" --print
    [ "$FAILED" -eq 0 ]
}

# s17_part PYTHON BUDGET JUNIT JSON TESTS_S ARGS...: the s17 part, in a `bash -c` of its own
# (so that SECONDS counts from its start): S17's gpu-marked tests (the files that use the
# marker, as pytest_gpu picks them) for at most TESTS_S seconds and half of BUDGET (the part's
# budget less 10 s), stopped by INT so that pytest still writes JUNIT; then its benchmark with
# ARGS, --json JSON and --budget-s what is left. Without pytest the tests are skipped, said;
# pytest's exit status 5 (no test selected) is not a failure.
s17_part() {
    local py=$1 budget=$2 junit=$3 json=$4 tests_s=$5 rc=0 status limit left files
    shift 5
    # S17's test files that use the marker, by pytest_gpu's rule
    files=$(grep -lE '^[^#"'"'"']*pytest\.mark\.gpu\b' tests/test_s17_*.py 2>/dev/null | sort)
    if [ -z "$files" ]; then
        echo "no S17 test file uses the gpu marker"
    elif "$py" -c "import pytest" 2>/dev/null; then
        limit=$((budget / 2 < tests_s ? budget / 2 : tests_s))
        echo "S17's gpu test files (at most ${limit} s):" $files
        # shellcheck disable=SC2086  # one word per file
        timeout -s INT -k 5 "$limit" "$py" -m pytest -m gpu -q -p no:cacheprovider \
            --continue-on-collection-errors --junitxml="$junit" $files
        status=$?
        if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then rc=$status; fi
    else
        echo "pytest is not installed for $py: S17's tests skipped"
    fi
    left=$((budget - SECONDS))
    "$py" benchmarks/bench_s17_attention.py "$@" --json "$json" \
        --budget-s $((left > 1 ? left : 1)) || rc=$?
    return "$rc"
}

# bench PART BUDGET ARGS...: a gpu_bench.py part writing bench_PART.json.
bench() {
    local part=$1 budget=$2
    shift 2
    run_part "$part" "$budget" "bench_$part.json" TERM "$PYTHON" "${BENCH[@]}" "$part" \
        --json "$OUTDIR/bench_$part.json" --budget-s "@BUDGET_LESS_10@" "$@"
}

# run_part NAME BUDGET OUTPUT SIGNAL CMD...: CMD under `timeout`, its budget cut to what is
# left of the total, sent SIGNAL at its budget (KILL 10 s later); its status recorded and the
# summary rewritten. @BUDGET_LESS_10@ in CMD becomes the budget less 10 s.
run_part() {
    local name=$1 budget=$2 output=$3 signal=$4
    shift 4
    local left=$((TOTAL_BUDGET_S - (SECONDS - START) - 10))
    if [ "$left" -lt "$budget" ]; then budget=$left; fi
    if [ "$budget" -lt 15 ]; then
        echo "== $name: skipped, the total budget is spent"
        record "$name" skipped "the total budget (${TOTAL_BUDGET_S} s) is spent" 0 "" "$output"
        summarize
        return
    fi
    local args=() arg
    for arg in "$@"; do args+=("${arg//@BUDGET_LESS_10@/$((budget - 10))}"); done
    echo
    echo "== $name (budget ${budget} s): ${args[*]}"
    local t0=$SECONDS rc
    timeout -s "$signal" -k 10 "$budget" "${args[@]}"
    rc=$?
    local took=$((SECONDS - t0)) status reason=""
    case $rc in
        0) status=ok ;;
        124 | 137) status=timeout; reason="stopped at its budget of ${budget} s" ;;
        *) status=failed; reason="exit status $rc" ;;
    esac
    if [ "$status" != ok ]; then FAILED=1; fi
    echo "== $name: $status${reason:+ ($reason)} in ${took} s"
    record "$name" "$status" "$reason" "$took" "$budget" "$output"
    summarize
}

record() {   # NAME STATUS REASON SECONDS BUDGET OUTPUT, one line of the parts table
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "${3//$'\t'/ }" "$4" "$5" "$6" >>"$PARTS"
}

field() {    # FILE KEY: one field of a JSON file in OUTDIR (empty when it is not there)
    "$PYTHON" "${REPORT[@]}" get "$OUTDIR/$1" "$2" 2>/dev/null
}

summarize() {   # [--print] [--set KEY=VALUE ...]: rewrite OUTDIR/summary.json
    local junit=() quiet=1 sets=() arg
    for arg in "$@"; do
        if [ "$arg" = "--print" ]; then quiet=0; else sets+=("$arg"); fi
    done
    if [ -s "$JUNIT" ]; then junit=(--junit "$JUNIT"); fi
    local line
    line=$("$PYTHON" "${REPORT[@]}" summary "$OUTDIR" --parts "$PARTS" "${junit[@]}" \
        --set "budget_s=$TOTAL_BUDGET_S" --set "python=$PYTHON" "${sets[@]}") \
        || { echo "(summary.json could not be written)"; return; }
    if [ "$quiet" -eq 0 ]; then echo "$line"; fi
}

write_bare_summary() {   # STATUS REASON, without python
    printf '{\n "script": "scripts/gpu_check.sh",\n "status": "%s",\n "reason": "%s",\n %s\n}\n' \
        "$1" "${2//\"/\'}" '"parts": {}' >"$OUTDIR/summary.json"
}

main 2>&1 | tee "$OUTDIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
