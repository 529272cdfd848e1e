#!/usr/bin/env bash
# Nsight Compute on the GPU machine: one launch of each FlashKDA kernel for one bench_fwd case (after
# tools/dev/gpu_iterate.sh or any build of //kda/bench:bench_fwd), clocks left alone (--clock-control none).
#
#   tools/dev/ncu_kernels.sh OUT_DIR CASE_NAME [KERNEL_REGEX]     e.g. tools/dev/ncu_kernels.sh /tmp/n "T8192 H16"
#
# Writes OUT_DIR/<kernel>.txt (the details page: throughput, occupancy, warp stall reasons) and
# OUT_DIR/<kernel>_sass.csv (per-instruction stall samples, for reading where a step waits; summed by
# tools/dev/ncu_stalls.py).
set -uo pipefail
out="${1:?usage: ncu_kernels.sh OUT_DIR CASE_NAME [KERNEL_REGEX]}"
out="$(realpath -m "${out}")"  # absolute: used after the cd below
case_name="${2:?case name, a substring of a bench_fwd case}"
mkdir -p "${out}"
cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/../.."
bench=bazel-bin/kda/bench/bench_fwd
[[ -x "${bench}" ]] || { echo "build //kda/bench:bench_fwd first" >&2; exit 1; }
for kernel in ${3:-kda_prepare kda_recurrence}; do
  ncu --clock-control none --target-processes all --set full --import-source yes -k "regex:${kernel}" -s 2 -c 1 \
    -f -o "${out}/${kernel}" "${bench}" --peers= --noaccuracy --iters=1 --warmup=2 --copy_mib=64 \
    --case_names="${case_name}" > "${out}/${kernel}_run.log" 2>&1 || tail -5 "${out}/${kernel}_run.log"
  ncu -i "${out}/${kernel}.ncu-rep" --page details > "${out}/${kernel}.txt" 2>&1
  ncu -i "${out}/${kernel}.ncu-rep" --page source --csv --print-source sass > "${out}/${kernel}_sass.csv" 2>&1
  echo "== ${kernel}: $(grep -E 'Duration|Memory Throughput|Registers Per|Achieved Occupancy' "${out}/${kernel}.txt" | tr -s ' ' | tr '\n' ';')"
done
