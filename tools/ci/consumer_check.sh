#!/usr/bin/env bash
# Proves that another Bazel workspace can depend on FlashKDA: a throw-away WORKSPACE (Bazel 4.2.3, the same Bazel
# and Python as tools/bazel) that declares this checkout as `local_repository(name = "flash_kda_src")`, loads
# tools/deps.bzl, and runs a py_test depending on @flash_kda_src//kda:py: the CUDA library compiles from an
# external repository and a CPU forward matches the float64 recurrence.
#
#   tools/ci/consumer_check.sh        (after tools/bazel has run once: it uses .bazelrc.kda's interpreter)
#
# Exits non-zero on any failure; the consumer workspace and its Bazel output base are deleted on exit.
set -euo pipefail

workspace="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/../.." && pwd)"
python="$(sed -n 's/^build --repo_env=KDA_PYTHON=//p' "${workspace}/.bazelrc.kda" 2>/dev/null | head -1)"
[[ -n "${python}" ]] || { echo "consumer_check: run tools/bazel once first (no .bazelrc.kda)" >&2; exit 1; }
bazel_bin="$(command -v bazel || echo /usr/bin/bazel)"

consumer="$(mktemp -d "${TMPDIR:-/tmp}/kda-consumer.XXXXXX")"
output_base="${consumer}.out"
cleanup() {
  "${bazel_bin}" --output_base="${output_base}" shutdown > /dev/null 2>&1 || true
  chmod -R u+w "${output_base}" 2> /dev/null || true
  rm -rf "${consumer}" "${output_base}"
}
trap cleanup EXIT

shims="${workspace}/tools/shims"
cat > "${consumer}/WORKSPACE" <<WS
workspace(name = "consumer")

local_repository(name = "flash_kda_src", path = "${workspace}")

# The rules FlashKDA's BUILD files load; a real consumer has its own.
local_repository(name = "rules_cc", path = "${shims}/rules_cc")
local_repository(name = "rules_python", path = "${shims}/rules_python")
local_repository(name = "rules_java", path = "${shims}/rules_java")
local_repository(name = "remote_coverage_tools", path = "${shims}/remote_coverage_tools")

load("@flash_kda_src//tools:deps.bzl", "flash_kda_dependencies")

flash_kda_dependencies()
WS
cat > "${consumer}/BUILD" <<'BUILD'
py_test(
    name = "uses_flash_kda",
    srcs = ["uses_flash_kda.py"],
    deps = ["@flash_kda_src//kda:py"],
)
BUILD
cp "${workspace}/tools/ci/consumer/uses_flash_kda.py" "${consumer}/"

cd "${consumer}"
"${bazel_bin}" --output_base="${output_base}" test --nosandbox_debug --incompatible_strict_action_env \
  --repo_env=KDA_PYTHON="${python}" --test_output=all //:uses_flash_kda
echo "CONSUMER CHECK PASSED: a WORKSPACE depending on @flash_kda_src built //kda:py and ran it"
