#!/usr/bin/env bash
# One device call for kernel work on the GPU machine (through the offline bundle): build with the ptxas report,
# test the changed paths, benchmark against the peers, profile the stages; a summary is printed last.
#
#   tools/dev/gpu_iterate.sh [OUT_DIR]        (default /tmp/kda-iter)
#
# Environment (each step is skipped when its variable is empty):
#   KDA_TESTS      bazel test arguments  (default: //kda/tests:all --test_tag_filters=-long_context,-sanitizer)
#   KDA_BENCH      bench_fwd arguments   (default: --peers=moonshot)
#   KDA_PROFILE    profile_kernels arguments (default: --cases=0,2,3,7 --iters=5)
#   KDA_PEERS=1    build the peers first (bash .peers/build_peers.sh, ../shared/peers/README.md) in the background
#   TRITON_CACHE_DIR  fla's Triton/autotuning cache (default /tmp/kda-triton-cache). fla autotunes 70-100 s per
#                  new shape on a fresh machine; the cache travels between leases as .triton-cache/part-*
#                  (git-ignored: carry it): unpacked before the benchmark when present, and with
#                  KDA_SAVE_TRITON_CACHE=DIR packed after it into DIR/triton-cache.part-* (xz, 15 MB parts, for
#                  $OUT; copy them back into .triton-cache/ here).
set -uo pipefail
out="${1:-/tmp/kda-iter}"
mkdir -p "${out}"
cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/../.."
bazel=tools/offline/bazel-offline
export PYTHONUNBUFFERED=1
t0=${SECONDS}
stamp() { echo "[gpu_iterate $((SECONDS - t0)) s] $*"; }

peers_pid=""
if [[ "${KDA_PEERS:-0}" == 1 && -f .peers/build_peers.sh ]]; then
  stamp "building the peers in the background"
  bash .peers/build_peers.sh > "${out}/peers_build.log" 2>&1 &
  peers_pid=$!
fi

stamp "build (ptxas report)"
"${bazel}" build --config=ptxas //kda:py //kda/bench:all > "${out}/build.log" 2>&1
build_rc=$?
grep -E "Compiling entry|registers|spill" "${out}/build.log" | sed 's/_ZN3kda[^ ]*kda_\([a-z]*\)_kernel\(I[^ ]*\)\?E.*/kda_\1_kernel \2/' > "${out}/ptxas.txt"
[[ ${build_rc} == 0 ]] || { tail -40 "${out}/build.log"; exit "${build_rc}"; }

test_rc=0
tests="${KDA_TESTS-//kda/tests:all --test_tag_filters=-long_context,-sanitizer}"
if [[ -n "${tests}" ]]; then
  stamp "bazel test ${tests}"
  # shellcheck disable=SC2086
  "${bazel}" test --keep_going ${tests} > "${out}/test.log" 2>&1
  test_rc=$?
fi

[[ -n "${peers_pid}" ]] && { stamp "waiting for the peers build"; wait "${peers_pid}"; tail -2 "${out}/peers_build.log"; }

export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/kda-triton-cache}"
if compgen -G ".triton-cache/part-*" > /dev/null; then
  mkdir -p "${TRITON_CACHE_DIR}" && cat .triton-cache/part-* | xz -dc | tar -x -C "${TRITON_CACHE_DIR}" &&
    stamp "unpacked the carried Triton cache into ${TRITON_CACHE_DIR}"
fi

bench="${KDA_BENCH---peers=moonshot}"
if [[ -n "${bench}" ]]; then
  stamp "bench_fwd ${bench}"
  # shellcheck disable=SC2086
  "${bazel}" run //kda/bench:bench_fwd -- ${bench} --json="${out}/bench.json" --markdown="${out}/bench.md" \
    --png="${out}/bench.png" > "${out}/bench.log" 2>&1
  echo "bench exit status $?" >> "${out}/bench.log"
fi

if [[ -n "${KDA_SAVE_TRITON_CACHE:-}" && -d "${TRITON_CACHE_DIR}" ]]; then
  mkdir -p "${KDA_SAVE_TRITON_CACHE}"
  tar -C "${TRITON_CACHE_DIR}" -c . | xz -T0 -6 | split -b 15M - "${KDA_SAVE_TRITON_CACHE}/triton-cache.part-"
  stamp "packed the Triton cache: $(ls "${KDA_SAVE_TRITON_CACHE}"/triton-cache.part-* | wc -l) part(s)"
fi

profile="${KDA_PROFILE---cases=0,2,3,7 --iters=5}"
if [[ -n "${profile}" ]]; then
  stamp "profile_kernels ${profile}"
  # shellcheck disable=SC2086
  "${bazel}" run //kda/bench:profile_kernels -- ${profile} > "${out}/profile.log" 2>&1
fi

echo
echo "================ summary ($((SECONDS - t0)) s) ================"
sort -u "${out}/ptxas.txt" | grep -E "registers|spill" | sort | uniq -c | head -8
if [[ -n "${tests}" ]]; then
  grep -E "^//kda/tests:[a-z_0-9]+ +(\(cached\) )?(PASSED|FAILED|NO STATUS|TIMEOUT)" "${out}/test.log" | sed 's/  */ /g'
  grep -E "^Executed|tests pass|fail" "${out}/test.log" | tail -2
  python="${KDA_PYTHON:-/opt/torch/.venv/bin/python3}"
  "${python}" tools/pytest/junit_summary.py "$("${bazel}" info bazel-testlogs 2>/dev/null)" || true
  # The failing tests and their error lines (assertions, out-of-memory, ...), if any.
  grep -h -E "^FAILED |^E +[A-Za-z.]*(Error|Exception)|^E +(out|final_state|input) " \
    bazel-testlogs/kda/tests/*/test.log bazel-testlogs/kda/tests/*/shard_*/test.log 2>/dev/null | cut -c1-220 | head -60
fi
[[ -f "${out}/bench.log" ]] && { sed -n '/^## Speed/,$p' "${out}/bench.log"; tail -3 "${out}/bench.log"; }
[[ -f "${out}/profile.log" ]] && grep "^|" "${out}/profile.log"
exit "${test_rc}"
