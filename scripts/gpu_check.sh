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
# stopped at its budget keeps what it measured; and bench_s16.json, S16's benchmark's). On a
# machine without a CUDA device it says so, writes versions.json and summary.json (status
# "no_device") and exits 0.
#
# Parts and their budgets in seconds (each under its own `timeout`; none runs past the total,
# GPU_CHECK_BUDGET_S, default 480, so the whole check ends within 8 minutes):
#   versions     40   scripts/gpu_check_report.py versions: what is installed, the device
#   bandwidth    25   benchmarks/gpu_bench.py bandwidth: device-to-device copy, bf16 matmul
#   pytest_gpu  120   python -m pytest -m gpu over the test files that use the marker
#                     (S16's compiled and CUDA-graph tests in tests/test_s16_static.py too)
#   s06          47   S06's engine against HF generate(), bf16, batch 1, Qwen3-0.6B shape
#   s08          51   S08's static batches against HF's padded generate(), B = 1 .. 64
#   s09          32   S09's continuous batching against S08's static batches, mixed lengths
#   s12          24   S12's paged decode against S09's contiguous slots
#   s14          39   S14's int8 / int4 fused GEMVs and batch-1 decode against bf16
#   s15          32   S15's speculative decoding, batch 1: plain vs n-gram vs an int4 draft
#   s16          60   S16's benchmark (benchmarks/bench_s16_host.py --quick): eager vs static
#                     vs compiled vs CUDA-graph decode steps, async scheduling
# The budgets add up to the default total less 10 s (the grace a part's KILL may take), so
# each part gets its whole budget even when every part before it used all of its own (tests/
# test_gpu_check.py checks this sum). S16's 60 s came from the six benchmark parts before it,
# in proportion to their budgets (285 s became 225 s; a benchmark told a smaller --budget-s
# leaves out rows, while pytest_gpu, which now also compiles S16's steps, and the fixed
# costs of versions and bandwidth kept theirs). A smaller GPU_CHECK_BUDGET_S cuts the last
# parts: each gets at most what is left, and one that would start with under 15 s left is
# skipped, said in the summary.
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
    local device_args=() s16_device=(--device cuda)
    if [ "${GPU_CHECK_CPU:-0}" = "1" ]; then
        echo "GPU_CHECK_CPU=1: a rehearsal on the CPU, tiny model, figures meaningless"
        device_args=(--device cpu --shape tiny)
        s16_device=(--device cpu)
    elif [ "$cuda" != "True" ]; then
        local why="torch $(field versions.json cuda.torch) sees none"
        [ "$torch_ok" = "True" ] || why="torch is not importable with $PYTHON"
        echo "no CUDA device: nothing to check ($why)"
        for part in bandwidth pytest_gpu s06 s08 s09 s12 s14 s15 s16; do
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
        local files
        files=$(grep -lE '^[^#"'"'"']*pytest\.mark\.gpu\b' tests/test_*.py tests/*/test_*.py \
            2>/dev/null | sort)
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
        bench s06 47 "${bw[@]}"
        bench s08 51 "${bw[@]}"
        bench s09 32 "${bw[@]}"
        bench s12 24 "${bw[@]}"
        bench s14 39 "${bw[@]}"
        bench s15 32 "${device_args[@]}"   # measures no bandwidth: no --bandwidth-json
        # S16's benchmark, its own script; its GPU tests ran in pytest_gpu (the marker)
        run_part s16 60 bench_s16.json TERM "$PYTHON" "${S16_BENCH[@]}" "${s16_device[@]}" \
            --json "$OUTDIR/bench_s16.json"
    fi

    local total=$((SECONDS - START))
    echo "== gpu_check done in ${total} s"
    summarize --set "seconds_s=$total" --print
    [ "$FAILED" -eq 0 ]
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
