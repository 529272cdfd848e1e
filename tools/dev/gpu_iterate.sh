#!/usr/bin/env bash
# One iteration of kernel work on the GPU machine (through the offline bundle): build with the ptxas report,
# test the changed paths, benchmark against the peers, profile the stages; a summary is printed last.
#
#   tools/dev/gpu_iterate.sh [OUT_DIR]        (default /tmp/kda-iter)
#
# Environment (each step is skipped when its variable is empty):
#   KDA_TESTS      bazel test arguments  (default: //kda/tests:all --test_tag_filters=-long_context,-sanitizer)
#   KDA_BENCH      bench_fwd arguments   (default: --peers=moonshot)
#   KDA_PROFILE    profile_kernels arguments (default: --cases=0,2,3,7 --iters=5)
#   KDA_VARIANT    PATH=FILE[+PATH=FILE...][,...]: after the benchmark, rebuild with the tree's PATH replaced by
#                  FILE (e.g. kda/csrc/decode.cu=/tmp/decode_v20.cu; "+" joins the files of one variant), run the
#                  same benchmark (bench_variantN.*) and
#                  profile (profile_variantN.log) on it, then put PATH back (bazel-bin keeps the last variant's
#                  build unless KDA_PROFILE rebuilds the tree after): several kernels measured on one machine; the
#                  summary shows each variant's CUDA-graph table and stage times, and last one table of every
#                  build's times (tools/dev/variant_table.py)
#   KDA_STEP_TIMEOUT  seconds: each test target's timeout (bazel --test_timeout) and a kill after that long for
#                  each benchmark and profile run, so that a kernel that never finishes costs one step, not the
#                  whole iteration (default: no limit)
#   KDA_PEERS=1    build the peers first (bash .peers/build_peers.sh: a git-ignored script that installs
#                  them into /tmp/peers-site, docs/PERFORMANCE.md "Reproducing it") in the background
#   TRITON_CACHE_DIR  fla's Triton/autotuning cache (default /tmp/kda-triton-cache). fla autotunes 70-100 s per
#                  new shape on a fresh machine; the cache travels between machines as .triton-cache/part-*
#                  (git-ignored: copy it along): unpacked before the benchmark when present, and with
#                  KDA_SAVE_TRITON_CACHE=DIR packed after it into DIR/triton-cache.part-* (xz, 15 MB parts, for
#                  copying back; put them into .triton-cache/ here). Only each kernel's .json and .cubin are packed
#                  (Triton loads a cached kernel from those two; 85 MB and 6.4 MB packed for all 15 bench cases).
#   KDA_WARM_FLA=1 compile fla's Triton kernels for KDA_WARM_CASES (default: the 15 bench_fwd cases) while the
#                  tests run, one bench_fwd process per case, with FLA_CACHE_RESULTS=0 so that no autotuning result
#                  from the busy GPU is kept: the benchmark then only re-runs fla's autotuning (needs .peers).
set -uo pipefail
out="$(realpath -m "${1:-/tmp/kda-iter}")"  # absolute: bench_fwd runs from its runfiles
mkdir -p "${out}"
# Into an OUT_DIR used before: the summary's table reads every bench JSON there, so a former iteration's would show
# as builds of this one.
rm -f "${out}"/bench.* "${out}"/bench_variant* "${out}"/profile.log "${out}"/profile_variant*.log
cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/../.."
bazel=tools/offline/bazel-offline
# Every command builds in one configuration and shares an action cache on disk. Bazel 4.2.3 keeps one output tree
# for all values of a Starlark flag, so a `bazel run` without the build's --config=ptxas would compile every CUDA
# file again, and the next build again; and with the cache a variant that returns to files built before (the tree
# between variants) is not compiled again.
flags=(--config=ptxas "--disk_cache=${KDA_DISK_CACHE:-/tmp/kda-disk-cache}")
export PYTHONUNBUFFERED=1
t0=${SECONDS}
stamp() { echo "[gpu_iterate $((SECONDS - t0)) s] $*"; }
step_timeout="${KDA_STEP_TIMEOUT:-}"
# A benchmark or profile run, killed after KDA_STEP_TIMEOUT seconds when that is set.
guarded() {
  if [[ -n "${step_timeout}" ]]; then timeout -s KILL "${step_timeout}" "$@"; else "$@"; fi
}

peers_pid=""
if [[ "${KDA_PEERS:-0}" == 1 && -f .peers/build_peers.sh ]]; then
  stamp "building the peers in the background"
  bash .peers/build_peers.sh > "${out}/peers_build.log" 2>&1 &
  peers_pid=$!
fi

stamp "build (ptxas report)"
"${bazel}" build "${flags[@]}" //kda:py //kda/bench:all > "${out}/build.log" 2>&1
build_rc=$?
grep -E "Compiling entry|registers|spill" "${out}/build.log" | sed 's/_ZN3kda[^ ]*kda_\([a-z]*\)_kernel\(I[^ ]*\)\?E.*/kda_\1_kernel \2/' > "${out}/ptxas.txt"
[[ ${build_rc} == 0 ]] || { tail -40 "${out}/build.log"; exit "${build_rc}"; }

export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/kda-triton-cache}"
if compgen -G ".triton-cache/part-*" > /dev/null; then
  mkdir -p "${TRITON_CACHE_DIR}" && cat .triton-cache/part-* | xz -dc | tar -x -C "${TRITON_CACHE_DIR}" &&
    stamp "unpacked the carried Triton cache into ${TRITON_CACHE_DIR}"
fi

warm_pid=""
if [[ "${KDA_WARM_FLA:-0}" == 1 && -d .peers/wheels ]]; then
  [[ -d /tmp/peers-site/fla ]] ||
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/peers-site .peers/wheels/*.whl
  stamp "compiling fla's Triton kernels in the background (FLA_CACHE_RESULTS=0)"
  # shellcheck disable=SC2016
  echo ${KDA_WARM_CASES:-0 1 2 3 4 5 6 7 8 9 10 11 12 13 14} | tr ' ' '\n' | FLA_FLASH_KDA=0 FLA_CACHE_RESULTS=0 \
    xargs -P 8 -I{} sh -c 'timeout 400 bazel-bin/kda/bench/bench_fwd --peers=fla --cases={} --iters=1 --warmup=1 \
      --noaccuracy --copy_mib=64 > /dev/null 2>&1; echo "fla warm-up case {}: exit $?"' > "${out}/warm_fla.log" 2>&1 &
  warm_pid=$!
fi

test_rc=0
tests="${KDA_TESTS-//kda/tests:all --test_tag_filters=-long_context,-sanitizer}"
if [[ -n "${tests}" ]]; then
  stamp "bazel test ${tests}"
  # shellcheck disable=SC2086
  "${bazel}" test "${flags[@]}" --keep_going ${step_timeout:+--test_timeout=${step_timeout}} ${tests} \
    > "${out}/test.log" 2>&1
  test_rc=$?
fi

[[ -n "${peers_pid}" ]] && { stamp "waiting for the peers build"; wait "${peers_pid}"; tail -2 "${out}/peers_build.log"; }
[[ -n "${warm_pid}" ]] && { stamp "waiting for fla's warm-up"; wait "${warm_pid}"; tr '\n' ' ' < "${out}/warm_fla.log"; echo; }

bench="${KDA_BENCH---peers=moonshot}"
if [[ -n "${bench}" ]]; then
  stamp "bench_fwd ${bench}"
  # shellcheck disable=SC2086
  guarded "${bazel}" run "${flags[@]}" //kda/bench:bench_fwd -- ${bench} --json="${out}/bench.json" \
    --markdown="${out}/bench.md" --png="${out}/bench.png" > "${out}/bench.log" 2>&1
  echo "bench exit status $?" >> "${out}/bench.log"
fi

variants="${KDA_VARIANT:-}"
vi=0
profile="${KDA_PROFILE---cases=0,2,3,7 --iters=5}"
for variant in ${variants//,/ }; do
  [[ -n "${bench}${profile}" ]] || break
  vi=$((vi + 1))
  swaps=(${variant//+/ })
  for si in "${!swaps[@]}"; do
    target="${swaps[si]%%=*}"
    cp "${target}" "${out}/variant_original${si}"
    cp "${swaps[si]#*=}" "${target}"
  done
  stamp "variant ${vi}: ${variant}: build, bench_fwd ${bench}, profile_kernels ${profile}"
  if "${bazel}" build "${flags[@]}" //kda:py //kda/bench:all > "${out}/variant${vi}_build.log" 2>&1; then
    if [[ -n "${bench}" ]]; then
      # shellcheck disable=SC2086
      guarded "${bazel}" run "${flags[@]}" //kda/bench:bench_fwd -- ${bench} --json="${out}/bench_variant${vi}.json" \
        --markdown="${out}/bench_variant${vi}.md" > "${out}/bench_variant${vi}.log" 2>&1
      echo "bench exit status $?" >> "${out}/bench_variant${vi}.log"
    fi
    if [[ -n "${profile}" ]]; then
      # shellcheck disable=SC2086
      guarded "${bazel}" run "${flags[@]}" //kda/bench:profile_kernels -- ${profile} \
        > "${out}/profile_variant${vi}.log" 2>&1
    fi
  else
    tail -20 "${out}/variant${vi}_build.log"
  fi
  for si in "${!swaps[@]}"; do cp "${out}/variant_original${si}" "${swaps[si]%%=*}"; done
done

if [[ -n "${KDA_SAVE_TRITON_CACHE:-}" && -d "${TRITON_CACHE_DIR}" ]]; then
  mkdir -p "${KDA_SAVE_TRITON_CACHE}"
  find "${TRITON_CACHE_DIR}" -type f \( -name '*.ttir' -o -name '*.ttgir' -o -name '*.llir' -o -name '*.ptx' \
    -o -name '*.source' \) -delete
  tar -C "${TRITON_CACHE_DIR}" -c . | xz -T0 -6 | split -b 15M - "${KDA_SAVE_TRITON_CACHE}/triton-cache.part-"
  stamp "packed the Triton cache: $(ls "${KDA_SAVE_TRITON_CACHE}"/triton-cache.part-* | wc -l) part(s)"
fi

if [[ -n "${profile}" ]]; then
  stamp "profile_kernels ${profile}"
  # shellcheck disable=SC2086
  guarded "${bazel}" run "${flags[@]}" //kda/bench:profile_kernels -- ${profile} > "${out}/profile.log" 2>&1
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
vi=0
for variant in ${variants//,/ }; do
  vi=$((vi + 1))
  echo "---- variant ${vi}: ${variant}"
  [[ -f "${out}/bench_variant${vi}.log" ]] &&
    sed -n -e '/^## Speed/,/^$/p' -e '/^## Decode rows replayed/,/^$/p' "${out}/bench_variant${vi}.log"
  [[ -f "${out}/profile_variant${vi}.log" ]] && grep "^|" "${out}/profile_variant${vi}.log"
done
[[ -f "${out}/profile.log" ]] && { echo "---- the tree"; grep "^|" "${out}/profile.log"; }
[[ -n "${variants}" ]] && python3 tools/dev/variant_table.py "${out}" --variants "${variants}"
exit "${test_rc}"
