#!/usr/bin/env bash
# The acceptance run on an air-gapped GPU machine, through the offline bundle (README.md next to this file):
#
#   tools/offline/gpu_acceptance.sh [LOG_DIR]          (default LOG_DIR: /tmp/kda-gpu-logs)
#
#   1. `bazel test $KDA_TEST_TARGETS` (default //kda/tests:all; --config=gpu_machine: KDA_REQUIRE_GPU=1, so a GPU
#      test can fail but never skip; --keep_going), then the junit totals and every per-case error line of the
#      matrix into LOG_DIR. Both read the whole bazel-testlogs tree, so on one machine a run split into parts (each
#      naming some targets; bazel keeps the others' results) ends with the totals of all of them;
#   2. `bazel run //kda:demo` (the main job on the GPU);
#   3. unless KDA_SKIP_BENCH=1: `bazel run //kda/bench:bench_fwd $KDA_BENCH_ARGS` (default: MoonshotAI FlashKDA
#      as the only peer, when built into /tmp/peers-site; add fla with KDA_BENCH_ARGS=--peers=fla,moonshot: its
#      Triton autotuning takes 70-100 s per shape on a fresh machine unless TRITON_CACHE_DIR is carried),
#      bounded by KDA_BENCH_TIMEOUT seconds (default 300).
# Prints a summary last. Exit status: that of the tests.
set -uo pipefail

logs="${1:-/tmp/kda-gpu-logs}"
KDA_BENCH_ARGS="${KDA_BENCH_ARGS---peers=moonshot --accuracy_max_token_heads=800000}"
mkdir -p "${logs}"
cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/../.."
bazel=tools/offline/bazel-offline
export PYTHONUNBUFFERED=1
t0=${SECONDS}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "${logs}/gpu.txt"

targets="${KDA_TEST_TARGETS:-//kda/tests:all}"
echo "=== bazel test ${targets}"
# shellcheck disable=SC2086
"${bazel}" test --keep_going ${targets} 2>&1 | tee "${logs}/bazel_test.log"
test_rc=${PIPESTATUS[0]}
test_s=$((SECONDS - t0))
testlogs="$("${bazel}" info bazel-testlogs 2>/dev/null)"
python="${KDA_PYTHON:-/opt/torch/.venv/bin/python3}"
[[ -x "${python}" ]] || python=python3
totals="$("${python}" tools/pytest/junit_summary.py "${testlogs}")"
# The errors vs float64 each matrix case measured (junit properties of test_matrix.py), per slice.
"${python}" - "${testlogs}/kda/tests" > "${logs}/matrix_errors.txt" <<'PY'
import collections, os, sys
import xml.etree.ElementTree as ET
worst = collections.defaultdict(dict)
cases = collections.Counter()
for dirpath, _, files in os.walk(sys.argv[1], followlinks=True):
    if "test.xml" not in files or "matrix_" not in dirpath:
        continue
    target = dirpath.split("kda/tests/")[1].split("/")[0]
    for case in ET.parse(os.path.join(dirpath, "test.xml")).getroot().iter("testcase"):
        props = {p.get("name"): float(p.get("value")) for p in case.iter("property")}
        if props:
            cases[target] += 1
        for name, value in props.items():
            worst[target][name] = max(worst[target].get(name, 0.0), value)
for target in sorted(cases):
    print(target, cases[target], "cases; worst:", " ".join(f"{k}={v:.2e}" for k, v in sorted(worst[target].items())))
print("matrix cases measured:", sum(cases.values()))
PY

echo "=== bazel run //kda:demo"
"${bazel}" run //kda:demo 2>&1 | tee "${logs}/demo.log" | tail -20

if [[ "${KDA_SKIP_BENCH:-0}" != 1 ]]; then
  echo "=== bazel run //kda/bench:bench_fwd"
  # shellcheck disable=SC2086
  timeout "${KDA_BENCH_TIMEOUT:-300}" "${bazel}" run //kda/bench:bench_fwd -- ${KDA_BENCH_ARGS} \
    --json "${logs}/bench.json" --markdown "${logs}/bench.md" > "${logs}/bench.log" 2>&1
  echo "bench exit status $?"
fi

echo
echo "================ summary ================"
grep -E "^//kda/tests:[a-z_0-9]+ +(\(cached\) )?(PASSED|FAILED|NO STATUS|TIMEOUT)" "${logs}/bazel_test.log" | sed 's/  */ /g'
grep -E "^Executed|tests pass|fail" "${logs}/bazel_test.log" | tail -3
echo "bazel test exit status ${test_rc} after ${test_s} s; junit: ${totals}"
cat "${logs}/matrix_errors.txt"
grep -E "backend|ms|rel" "${logs}/demo.log" | tail -6
[[ -f "${logs}/bench.log" ]] && sed -n '/^## Speed/,$p' "${logs}/bench.log"
exit "${test_rc}"
