#!/usr/bin/env bash
# Proves that MODULE.bazel is real: builds //... and runs the CPU tests (//kda/tests:all; the GPU tests skip
# without a GPU) with Debian sid's Bazel 7.7.1 under bzlmod (WORKSPACE disabled), offline, inside a throw-away
# Debian sid chroot (Bazel 7 needs glibc >= 2.38; this machine may be older).
#
#   tools/bzlmod_check.sh            (root; ~90 s the first time to create the chroot, ~1 min more to build)
#
# Steps:
#   1. the chroot: unpacked from a cached tarball ($KDA_BZLMOD_CACHE, default ~/.cache/flash_kda/bzlmod), or
#      created with `debootstrap --variant=minbase sid` + `apt-get install bazel-bootstrap g++-14` (CUDA 13.0
#      rejects gcc > 15, so gcc-14 is the host compiler) and then cached. If it cannot be created (no network,
#      no debootstrap, not root) the script prints "BZLMOD CHECK NOT RUN: <reason>" and exits 0.
#   2. the workspace files (git ls-files: tracked + untracked-not-ignored) are copied into the chroot; the
#      Python interpreter ($KDA_PYTHON, else the wrapper's <workspace>/.venv) and the pinned-wheel cache
#      ($KDA_ARTIFACT_CACHE) are bind-mounted at their own paths, so nothing is downloaded again.
#   3. Bazel 7 runs offline under bzlmod: --noenable_workspace, --lockfile_mode=off, --registry pointing at an
#      empty local registry, rules_cc / rules_python overridden by tools/shims, and every other module Bazel's
#      own MODULE.tools still asks for (protobuf, zlib, apple_support, buildozer, ...) overridden by an empty
#      generated module (discovered: a "module X not found in registries" error adds a stub and retries).
#   4. `bazel build //...` (must include the CUDA library and the pybind11 extension) and
#      `bazel test //kda/tests:all`; then a module that depends on flash_kda (bazel_dep + local_path_override)
#      runs tools/ci/consumer/uses_flash_kda.py on @flash_kda//kda:py; any failure exits non-zero.
# Mounts live in a private mount namespace (unshare -m), so they vanish with it whatever happens; the chroot
# directory is deleted on exit (KDA_BZLMOD_KEEP=1 keeps it for debugging).
# Environment: KDA_PYTHON, KDA_ARTIFACT_CACHE, KDA_BZLMOD_CACHE, KDA_BZLMOD_WORKDIR (default /var/tmp),
#   KDA_DEBIAN_MIRROR (debootstrap/apt mirror; default: debootstrap's own), KDA_BZLMOD_TARGETS (default //...),
#   KDA_BZLMOD_TESTS (default //kda/tests:all), KDA_BZLMOD_KEEP.
set -euo pipefail

t_start=${SECONDS}
say() { printf '[bzlmod_check %4ds] %s\n' "$((SECONDS - t_start))" "$*" >&2; }
not_run() {
  {
    echo
    echo "######################################################################################"
    echo "###  BZLMOD CHECK NOT RUN: $*"
    echo "###  (MODULE.bazel was NOT verified with Bazel 7 on this machine)"
    echo "######################################################################################"
    echo
  } >&2
  exit 0
}
fail() {
  {
    echo
    echo "######################################################################################"
    echo "###  BZLMOD CHECK FAILED: $*"
    echo "######################################################################################"
  } >&2
  exit 1
}

self="$(readlink -f "${BASH_SOURCE[0]}")"
workspace="$(cd "$(dirname "${self}")/.." && pwd)"

# Everything the recipe installs; a change here makes a new cached tarball.
SID_PACKAGES="bazel-bootstrap g++-14 binutils ca-certificates libssl3t64 libffi8 libsqlite3-0 libbz2-1.0 liblzma5 zlib1g libuuid1 libncursesw6 libreadline8t64"
RECIPE_VERSION=1
recipe_key="$(printf '%s\n' "${RECIPE_VERSION}" "${SID_PACKAGES}" "${KDA_DEBIAN_MIRROR:-}" | sha256sum | cut -c1-12)"
cache_dir="${KDA_BZLMOD_CACHE:-${XDG_CACHE_HOME:-${HOME}/.cache}/flash_kda/bzlmod}"

# =====================================================================================================
# Inner part: runs in a private mount namespace (re-executed by the outer part through unshare).
# =====================================================================================================
if [[ "${1:-}" == "--inner" ]]; then
  chroot_dir="$2"; python="$3"; artifacts="$4"
  mount --make-rprivate / 2>/dev/null || true
  mount -t proc proc "${chroot_dir}/proc"
  mount --rbind /dev "${chroot_dir}/dev"
  mount -t tmpfs -o size=4g tmpfs "${chroot_dir}/dev/shm" 2>/dev/null || true
  mount --rbind /sys "${chroot_dir}/sys" 2>/dev/null || true
  cp -L /etc/resolv.conf "${chroot_dir}/etc/resolv.conf" 2>/dev/null || true

  # The interpreter, its venv and base installation, at their own absolute paths, read-only.
  mapfile -t py_roots < <("${python}" - <<'EOF'
import os, sys, sysconfig
paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
         os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}
for k in ("stdlib", "platstdlib", "purelib", "platlib", "include", "platinclude"):
    p = sysconfig.get_paths().get(k)
    if p: paths.add(p)
for p in sys.path:
    if p and os.path.isdir(p): paths.add(p)
if sysconfig.get_config_var("Py_ENABLE_SHARED"):
    paths.add(sysconfig.get_config_var("LIBDIR") or "")
paths = sorted(os.path.realpath(p) for p in paths if p and os.path.exists(p))
paths += sorted({os.path.abspath(sys.executable)})
out = []
for p in sorted(set(paths)):
    if not any(p.startswith(q.rstrip("/") + "/") for q in out):
        out.append(p)
print("\n".join(out))
EOF
  )
  # The executable path as given (a venv's bin/python3 is usually a symlink): its directory must exist too.
  py_roots+=("$(dirname "${python}")")
  for p in "${py_roots[@]}"; do
    [[ -e "${p}" ]] || continue
    case "${p}" in
      /|/usr|/usr/local|/usr/lib|/usr/bin|/bin|/lib|/lib64|/etc|/opt|/home|/root|/tmp|/var)
        echo "bzlmod_check: refusing to bind-mount ${p} (Python root too broad)" >&2; continue ;;
    esac
    if [[ -d "${p}" ]]; then mkdir -p "${chroot_dir}${p}"; else mkdir -p "$(dirname "${chroot_dir}${p}")"; touch "${chroot_dir}${p}"; fi
    mount --rbind "${p}" "${chroot_dir}${p}"
    mount -o remount,bind,ro "${chroot_dir}${p}" 2>/dev/null || true
  done
  # If the venv's bin/python3 is a link into the base installation, that target is covered above.
  mkdir -p "${artifacts}" "${chroot_dir}${artifacts}"
  mount --bind "${artifacts}" "${chroot_dir}${artifacts}"

  # pip settings, for a wheel that is not in the cache yet (the repository rules then run pip download).
  passenv=()
  while IFS= read -r -d '' kv; do
    case "${kv}" in PIP_*=*|SSL_CERT_FILE=*|REQUESTS_CA_BUNDLE=*) passenv+=("${kv}") ;; esac
  done < <(env -0)
  [[ -f /etc/pip.conf ]] && cp /etc/pip.conf "${chroot_dir}/etc/pip.conf"
  in_chroot() {
    chroot "${chroot_dir}" /usr/bin/env -i HOME=/root PATH=/usr/bin:/bin LANG=C.UTF-8 TERM=dumb \
      USER=root CC=/usr/bin/gcc-14 CXX=/usr/bin/g++-14 \
      KDA_PYTHON="${python}" KDA_ARTIFACT_CACHE="${artifacts}" "${passenv[@]}" \
      /bin/bash -c "$1"
  }

  if ! in_chroot "'${python}' -c 'import sys, torch, pytest; print(\"python in chroot:\", sys.version.split()[0], \"torch\", torch.__version__)'"; then
    echo "bzlmod_check: KDA_PYTHON=${python} does not work inside the chroot" >&2
    exit 3
  fi

  stubs_root=/opt/kda-bzlmod/stubs
  mkdir -p "${chroot_dir}/opt/kda-bzlmod/registry" "${chroot_dir}${stubs_root}"
  make_stub() {   # an empty module: MODULE.bazel + BUILD, enough for a bazel_dep nobody loads from
    mkdir -p "${chroot_dir}${stubs_root}/$1"
    printf 'module(name = "%s")\n' "$1" > "${chroot_dir}${stubs_root}/$1/MODULE.bazel"
    printf '# Empty stand-in generated by tools/bzlmod_check.sh (offline bzlmod check).\n' \
      > "${chroot_dir}${stubs_root}/$1/BUILD.bazel"
    : > "${chroot_dir}${stubs_root}/$1/WORKSPACE"
  }
  stubbed=(protobuf zlib apple_support buildozer)
  for m in "${stubbed[@]}"; do make_stub "${m}"; done

  src=/src/flash_kda
  flags_for() {   # the bzlmod flags for one Bazel command
    local f="--noenable_workspace --lockfile_mode=off --registry=file:///opt/kda-bzlmod/registry"
    f+=" --override_module=rules_cc=${src}/tools/shims/rules_cc --override_module=rules_python=${src}/tools/shims/rules_python"
    for m in "${stubbed[@]}"; do f+=" --override_module=${m}=${stubs_root}/${m}"; done
    f+=" --repo_env=KDA_PYTHON=${python} --repo_env=KDA_ARTIFACT_CACHE=${artifacts} --repo_env=CC=/usr/bin/gcc-14"
    f+=" --nosandbox_debug --curses=no --color=no --show_progress_rate_limit=10"
    echo "${f}"
  }
  bazel_in_chroot() {   # bazel_in_chroot <command> <args...>; retries with a new stub per missing module
    local cmd="$1"; shift
    local log="${chroot_dir}/tmp/bazel-${cmd}.log" rc attempt missing
    for attempt in 1 2 3 4 5 6 7 8 9 10; do
      set +e
      in_chroot "cd ${bazel_dir:-${src}} && exec bazel ${cmd} $(flags_for) $*" 2>&1 | tee "${log}" | grep -v -E '^(Analyzing|Loading|Computing|Fetching)' >&2
      rc=${PIPESTATUS[0]}
      set -e
      [[ ${rc} == 0 ]] && return 0
      missing="$(grep -o -E 'module [A-Za-z0-9_.-]+@[^ ]+ not found in registries' "${log}" | head -1 | sed -E 's/module ([^@]+)@.*/\1/')"
      [[ -n "${missing}" ]] || return "${rc}"
      echo "bzlmod_check: Bazel wants module '${missing}' from a registry: overriding it with an empty local module" >&2
      stubbed+=("${missing}"); make_stub "${missing}"
    done
    return "${rc}"
  }

  in_chroot "bazel --version" | grep . | sed 's/^/bzlmod_check: chroot: /' >&2
  echo "bzlmod_check: == bazel build ${KDA_BZLMOD_TARGETS:-//...} (Bazel 7, bzlmod) ==" >&2
  bazel_in_chroot build --keep_going "${KDA_BZLMOD_TARGETS:-//...}" || { in_chroot "cd ${src} && bazel shutdown" || true; exit 10; }
  # The build must have produced the CUDA library and the extension.
  ext="$(in_chroot "cd ${src} && ls bazel-bin/kda/python/flash_kda/_C*.so 2>/dev/null | head -1" || true)"
  lib="$(in_chroot "cd ${src} && find -L bazel-bin/kda -path '*_cuda_objs*' -name '*.o' | head -1" || true)"
  if [[ -z "${ext}" || -z "${lib}" ]]; then
    echo "bzlmod_check: the build did not produce the extension (${ext:-none}) and the CUDA objects (${lib:-none})" >&2
    in_chroot "cd ${src} && bazel shutdown" || true
    exit 11
  fi
  fatbin="$(in_chroot "cd ${src} && readelf -S -W ${ext} | grep -c nv_fatbin" || true)"
  echo "bzlmod_check: built ${ext} ($(in_chroot "stat -c %s ${src}/${ext}") bytes, .nv_fatbin sections: ${fatbin:-0}) and ${lib}" >&2
  [[ "${fatbin:-0}" -ge 1 ]] || { echo "bzlmod_check: ${ext} carries no CUDA fatbin" >&2; exit 11; }

  echo "bzlmod_check: == bazel test ${KDA_BZLMOD_TESTS:-//kda/tests:all} (Bazel 7, bzlmod; GPU tests skip without a GPU) ==" >&2
  rc=0
  bazel_in_chroot test "${KDA_BZLMOD_TESTS:-//kda/tests:all}" || rc=12
  in_chroot "cd ${src} && bazel shutdown" >/dev/null 2>&1 || true

  # A module that depends on FlashKDA: bazel_dep + local_path_override, a py_test on @flash_kda//kda:py (the CUDA
  # library compiled from a non-root module, a CPU forward against float64; tools/ci/consumer_check.sh does the
  # same under WORKSPACE).
  if [[ ${rc} == 0 ]]; then
    echo "bzlmod_check: == a module depending on flash_kda: bazel test //:uses_flash_kda ==" >&2
    consumer=/src/consumer
    mkdir -p "${chroot_dir}${consumer}"
    cp "${chroot_dir}${src}/tools/ci/consumer/uses_flash_kda.py" "${chroot_dir}${consumer}/"
    printf '%s\n' 'module(name = "consumer")' '' 'bazel_dep(name = "flash_kda", version = "0.1.0")' \
      "local_path_override(module_name = \"flash_kda\", path = \"${src}\")" > "${chroot_dir}${consumer}/MODULE.bazel"
    printf '%s\n' 'py_test(' '    name = "uses_flash_kda",' '    srcs = ["uses_flash_kda.py"],' \
      '    deps = ["@flash_kda//kda:py"],' ')' > "${chroot_dir}${consumer}/BUILD.bazel"
    bazel_dir="${consumer}" bazel_in_chroot test --test_output=all //:uses_flash_kda || rc=13
    in_chroot "cd ${consumer} && bazel shutdown" >/dev/null 2>&1 || true
  fi
  echo "bzlmod_check: modules overridden by empty stubs: ${stubbed[*]}" >&2
  exit "${rc}"
fi

# =====================================================================================================
# Outer part
# =====================================================================================================
say "workspace ${workspace}"
[[ "$(id -u)" == 0 ]] || not_run "needs root (debootstrap, chroot, mounts); run it as root"
command -v unshare >/dev/null 2>&1 || not_run "unshare (util-linux) missing"
for f in MODULE.bazel tools/shims/rules_cc/MODULE.bazel tools/shims/rules_python/MODULE.bazel; do
  [[ -f "${workspace}/${f}" ]] || fail "${f} is missing"
done

# ---- Python and the artifact cache (from the host) ----------------------------------------------------
python="${KDA_PYTHON:-}"
if [[ -z "${python}" ]]; then
  python="${workspace}/.venv/bin/python3"
  if [[ ! -x "${python}" ]] || ! "${python}" -c 'import torch, pytest' >/dev/null 2>&1; then
    say "no KDA_PYTHON and no ready ${workspace}/.venv: letting tools/bazel create the venv ..."
    "${workspace}/tools/bazel" info release >/dev/null || fail "tools/bazel could not prepare the Python venv"
  fi
fi
[[ "${python}" == /* && -x "${python}" ]] || fail "KDA_PYTHON=${python} is not an absolute path to an interpreter"
"${python}" -c 'import torch, pytest, absl, numpy' 2>/dev/null || fail "${python} lacks torch/pytest/absl-py/numpy"
artifacts="${KDA_ARTIFACT_CACHE:-${HOME}/.cache/flash_kda/artifacts}"
mkdir -p "${artifacts}"
artifacts="$(readlink -f "${artifacts}")"
say "python ${python} ($("${python}" -c 'import sys; print(sys.version.split()[0])')); artifact cache ${artifacts} ($(ls "${artifacts}" | wc -l) entries)"

# ---- the chroot ----------------------------------------------------------------------------------------
work_base="${KDA_BZLMOD_WORKDIR:-/var/tmp}"
mkdir -p "${work_base}"
work="$(mktemp -d "${work_base}/kda-bzlmod.XXXXXX")"
chroot_dir="${work}/sid"
inner_pid=""
cleanup() {
  local rc=$?
  # Processes still running inside the chroot (a Bazel server): end them by pid.
  local p r pids=()
  for p in /proc/[0-9]*; do
    r="$(readlink "${p}/root" 2>/dev/null || true)"
    [[ "${r}" == "${chroot_dir}" || "${r}" == "${chroot_dir}/"* ]] && pids+=("${p#/proc/}")
  done
  if (( ${#pids[@]} )); then kill "${pids[@]}" 2>/dev/null || true; sleep 1; kill -9 "${pids[@]}" 2>/dev/null || true; fi
  # Mounts were made in a private namespace; none should be visible here. Never delete through a mount.
  if grep -q " ${work}" /proc/self/mounts; then
    echo "bzlmod_check: WARNING: mounts left under ${work}; not deleting it" >&2
  elif [[ -z "${KDA_BZLMOD_KEEP:-}" ]]; then
    say "removing the throw-away chroot ${work} ..."
    rm -rf "${work}"
  else
    echo "bzlmod_check: kept ${work} (KDA_BZLMOD_KEEP)" >&2
  fi
  exit "${rc}"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

tarball="${cache_dir}/sid-bazel7-${recipe_key}.tar.zst"
if command -v zstd >/dev/null 2>&1; then
  compress=(zstd -T0 -3 -q); decompress=(zstd -d -q -c)
else
  tarball="${tarball%.zst}.gz"; compress=(gzip -1); decompress=(gzip -d -c)
fi

if [[ -f "${tarball}" ]]; then
  say "unpacking the cached chroot $(basename "${tarball}") ($(du -h "${tarball}" | cut -f1)) ..."
  mkdir -p "${chroot_dir}"
  "${decompress[@]}" "${tarball}" | tar -C "${chroot_dir}" -xf - || fail "cannot unpack ${tarball} (delete it to rebuild)"
else
  if ! command -v debootstrap >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
      say "installing debootstrap ..."
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >&2 ||
        { DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >&2; } ||
        not_run "debootstrap is not installed and apt-get could not install it (no network?)"
    else
      not_run "debootstrap is not installed (and no apt-get)"
    fi
  fi
  say "creating a Debian sid chroot: debootstrap --variant=minbase sid (~20 s) ..."
  mirror=(); [[ -n "${KDA_DEBIAN_MIRROR:-}" ]] && mirror=("${KDA_DEBIAN_MIRROR}")
  if ! debootstrap --variant=minbase sid "${chroot_dir}" "${mirror[@]}" > "${work}/debootstrap.log" 2>&1; then
    tail -5 "${work}/debootstrap.log" >&2
    not_run "debootstrap of Debian sid failed (no network?); log above"
  fi
  # apt inside: the host's CA bundle and apt settings (proxies), and no expiry check on sid's Release file.
  mkdir -p "${chroot_dir}/etc/ssl/certs" "${chroot_dir}/etc/apt/apt.conf.d"
  [[ -f /etc/ssl/certs/ca-certificates.crt ]] && cp /etc/ssl/certs/ca-certificates.crt "${chroot_dir}/etc/ssl/certs/"
  [[ -f /etc/apt/apt.conf ]] && cp /etc/apt/apt.conf "${chroot_dir}/etc/apt/apt.conf"
  for f in /etc/apt/apt.conf.d/*; do
    [[ -f "${f}" ]] && cp -n "${f}" "${chroot_dir}/etc/apt/apt.conf.d/" 2>/dev/null || true
  done
  echo 'Acquire::Check-Valid-Until "false";' > "${chroot_dir}/etc/apt/apt.conf.d/99kda-no-valid-until"
  cp -L /etc/resolv.conf "${chroot_dir}/etc/resolv.conf" 2>/dev/null || true
  say "apt-get install ${SID_PACKAGES} inside (~650 MB, ~40 s) ..."
  if ! unshare -m --propagation private /bin/bash -c '
      set -e
      mount -t proc proc "$1/proc"; mount --rbind /dev "$1/dev"
      chroot "$1" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive \
        /bin/sh -c "apt-get update -q && apt-get install -y -q --no-install-recommends $2"' \
      x "${chroot_dir}" "${SID_PACKAGES}" > "${work}/apt.log" 2>&1; then
    tail -8 "${work}/apt.log" >&2
    not_run "apt-get install of Bazel 7 (bazel-bootstrap) in the sid chroot failed (network? sid in flux?); log above"
  fi
  # Slim it before caching: package caches, docs, and the JDK's jmods (the Bazel server needs only the runtime).
  rm -rf "${chroot_dir}"/var/cache/apt/*.bin "${chroot_dir}"/var/cache/apt/archives/*.deb \
         "${chroot_dir}"/var/lib/apt/lists/* "${chroot_dir}"/usr/share/doc/* "${chroot_dir}"/usr/share/man/* \
         "${chroot_dir}"/usr/share/locale/* "${chroot_dir}"/usr/lib/jvm/*/jmods
  say "caching the chroot as ${tarball} ..."
  mkdir -p "${cache_dir}"
  rm -f "${cache_dir}"/sid-bazel7-*.tar.* 2>/dev/null || true
  tar -C "${chroot_dir}" -cf - . | "${compress[@]}" > "${tarball}.part" && mv "${tarball}.part" "${tarball}"
  say "cached ($(du -h "${tarball}" | cut -f1))"
fi
bazel_pkg="$(chroot "${chroot_dir}" dpkg-query -W -f='${Version}' bazel-bootstrap 2>/dev/null || true)"
[[ -n "${bazel_pkg}" ]] || fail "the chroot has no bazel-bootstrap (delete ${tarball} to rebuild)"
say "chroot ready: Debian sid, bazel-bootstrap ${bazel_pkg}, $(chroot "${chroot_dir}" gcc-14 --version | head -1)"
case "${bazel_pkg}" in 7.*) ;; *) say "WARNING: expected Bazel 7.x in sid, got ${bazel_pkg}" ;; esac

# glibc >= 2.41 (sid has 2.43) declares the C23 rsqrt/rsqrtf in <bits/mathcalls.h>; CUDA 13.0's crt/math_functions.h
# declares them too with a different exception specification, so every nvcc compile fails ("exception
# specification is incompatible ... rsqrt"). Ubuntu 24.04 (glibc 2.39) and Debian 12 (2.36) are not affected.
# This throw-away chroot hides glibc's declaration from nvcc (__CUDACC__) only; the project is unchanged.
mathcalls="${chroot_dir}/usr/include/x86_64-linux-gnu/bits/mathcalls.h"
if [[ -f "${mathcalls}" ]] && grep -q '^__MATHCALL_VEC (rsqrt,' "${mathcalls}" && ! grep -q 'kda-bzlmod-check' "${mathcalls}"; then
  sed -i 's|^__MATHCALL_VEC (rsqrt,.*$|#ifndef __CUDACC__ /* kda-bzlmod-check: CUDA 13.0 declares rsqrt itself */\n&\n#endif|' "${mathcalls}"
  say "patched the chroot's <bits/mathcalls.h>: rsqrt hidden from nvcc (glibc $(awk '$1 == "#define" && $2 == "__GLIBC_MINOR__" {print "2." $3}' "${chroot_dir}/usr/include/features.h") vs CUDA 13.0)"
fi

# ---- the workspace files -------------------------------------------------------------------------------
mkdir -p "${chroot_dir}/src/flash_kda"
if git -C "${workspace}" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  (cd "${workspace}" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -C "${chroot_dir}/src/flash_kda" -xf -
else
  tar -C "${workspace}" --exclude='./bazel-*' --exclude=./.venv --exclude=./.git -cf - . | tar -C "${chroot_dir}/src/flash_kda" -xf -
fi
rm -f "${chroot_dir}/src/flash_kda/.bazelrc.kda" "${chroot_dir}/src/flash_kda/.bazelrc.user"
say "copied $(find "${chroot_dir}/src/flash_kda" -type f | wc -l) workspace files into the chroot"

# ---- build + test (in a private mount namespace) --------------------------------------------------------
set +e
unshare -m --propagation private "${self}" --inner "${chroot_dir}" "${python}" "${artifacts}"
rc=$?
set -e
case "${rc}" in
  0)  say "PASSED: Bazel ${bazel_pkg} (bzlmod) built ${KDA_BZLMOD_TARGETS:-//...} and ${KDA_BZLMOD_TESTS:-//kda/tests:all} passed, and a module depending on flash_kda ran it"
      echo "BZLMOD CHECK PASSED (Bazel ${bazel_pkg}, $((SECONDS - t_start)) s)" ;;
  3)  fail "the Python interpreter ${python} does not run inside the chroot" ;;
  10) fail "bazel build failed under Bazel ${bazel_pkg} (bzlmod)" ;;
  11) fail "the build under Bazel ${bazel_pkg} did not produce the CUDA library / extension" ;;
  12) fail "bazel test failed under Bazel ${bazel_pkg} (bzlmod)" ;;
  13) fail "a module depending on flash_kda (bazel_dep + local_path_override) failed under Bazel ${bazel_pkg}" ;;
  *)  fail "the chroot run failed (exit ${rc})" ;;
esac
