#!/usr/bin/env bash
# Makes the offline bundle for an air-gapped GPU machine (README.md next to this file).
#
#   tools/offline/make_bundle.sh [OUT.tar.xz]        (default: tools/offline/kda-offline.tar.xz, git-ignored)
#
# Runs on a Debian/Ubuntu build machine with network (root, for apt-get when something is missing). The bundle:
#   kda-offline/bin/bazel-4            Debian's bazel-bootstrap 4.2.3 client, RPATH=$ORIGIN/../lib
#   kda-offline/lib/                   the shared libraries it needs (from ldd; glibc itself excluded)
#   kda-offline/usr/share/bazel/       the install base (server jar, embedded tools, builtins)
#   kda-offline/usr/libexec/.../bazel/ process-wrapper, linux-sandbox, ... (patched RPATH, same libs)
#   kda-offline/jre/                   a jlink'ed JRE 17 (the Bazel server's javabase)
#   kda-offline/artifacts/<sha256>/    the pinned small wheels of tools/cuda/private/pins.bzl (all except the
#                                      CUDA toolkit wheels: the target uses its own toolkit, KDA_CUDA_HOME)
#   kda-offline/MANIFEST               versions, sizes, sha256 of the wheels
# Environment: KDA_PYTHON (interpreter for pip download when a wheel is not cached yet; default python3),
#              KDA_ARTIFACT_CACHE (the cache to take wheels from / fill; default ~/.cache/flash_kda/artifacts),
#              XZ_OPT (default -9 -T0).
set -euo pipefail

say() { echo "make_bundle: $*" >&2; }
die() { echo "make_bundle: ERROR: $*" >&2; exit 1; }

here="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)"
workspace="$(cd "${here}/../.." && pwd)"
out="${1:-${here}/kda-offline.tar.xz}"
[[ "${out}" == *.tar.xz ]] || die "the output name must end in .tar.xz (got ${out})"
out="$(readlink -f "$(dirname "${out}")")/$(basename "${out}")"
pins="${workspace}/tools/cuda/private/pins.bzl"
wheel_tool="${workspace}/tools/cuda/private/wheel_tool.py"
cache="${KDA_ARTIFACT_CACHE:-${HOME}/.cache/flash_kda/artifacts}"
python="${KDA_PYTHON:-$(command -v python3 || true)}"
[[ -n "${python}" ]] || die "python3 not found (set KDA_PYTHON)"

JRE_MODULES="java.base,java.logging,java.management,java.naming,java.security.sasl,java.xml,jdk.management,jdk.unsupported"
t0=${SECONDS}

# ---- tools this script needs -------------------------------------------------------------------------------
need_pkgs=()
[[ -x /usr/bin/bazel-4 && -d /usr/share/bazel ]] || need_pkgs+=(bazel-bootstrap)
command -v jlink >/dev/null 2>&1 || need_pkgs+=(openjdk-17-jdk-headless)
command -v patchelf >/dev/null 2>&1 || need_pkgs+=(patchelf)
command -v xz >/dev/null 2>&1 || need_pkgs+=(xz-utils)
if (( ${#need_pkgs[@]} )); then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    say "installing ${need_pkgs[*]} with apt-get ..."
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >&2
  else
    die "missing: ${need_pkgs[*]} (apt-get install them as root)"
  fi
fi
bazel_version="$(dpkg-query -W -f='${Version}' bazel-bootstrap 2>/dev/null || echo unknown)"
case "${bazel_version}" in 4.2.3*) ;; *) die "need Debian's bazel-bootstrap 4.2.3, found ${bazel_version}" ;; esac
jlink="$(readlink -f "$(command -v jlink)")"
jdk_home="$(dirname "$(dirname "${jlink}")")"
"${jlink}" --version | grep -q '^17\.' || die "need jlink from JDK 17 (found $("${jlink}" --version))"
[[ -d "${jdk_home}/jmods" ]] || die "${jdk_home}/jmods missing (apt-get install openjdk-17-jdk-headless)"

stage="$(mktemp -d "${TMPDIR:-/tmp}/kda-bundle.XXXXXX")"
trap 'rm -rf "${stage}"' EXIT
root="${stage}/kda-offline"
mkdir -p "${root}/bin" "${root}/lib" "${root}/usr/share" "${root}/usr/libexec/x86_64-linux-gnu" \
         "${root}/usr/lib/x86_64-linux-gnu" "${root}/artifacts"

# ---- 1. Bazel 4.2.3: client + libraries + install base + helpers --------------------------------------------
say "Bazel ${bazel_version}: client, libraries, install base ..."
cp -a /usr/share/bazel "${root}/usr/share/bazel"
cp -a /usr/libexec/x86_64-linux-gnu/bazel "${root}/usr/libexec/x86_64-linux-gnu/bazel"
cp -a /usr/lib/x86_64-linux-gnu/bazel "${root}/usr/lib/x86_64-linux-gnu/bazel"
cp /usr/bin/bazel-4 "${root}/bin/bazel-4"
# The install base's helper links are relative (../../libexec/...): check they resolve inside the bundle.
for l in "${root}"/usr/share/bazel/*; do
  [[ -e "${l}" ]] || die "dangling link in the install base: ${l} -> $(readlink "${l}")"
done

# Shared libraries of the client and the helpers, except glibc's own (the target's newer glibc serves those).
elfs=("${root}/bin/bazel-4")
for f in "${root}"/usr/libexec/x86_64-linux-gnu/bazel/* "${root}"/usr/lib/x86_64-linux-gnu/bazel/*; do
  [[ -f "${f}" ]] && file -b "${f}" | grep -q ELF && elfs+=("${f}")
done
for f in "${elfs[@]}"; do
  ldd "${f}" | awk '$2 == "=>" && $3 ~ /^\// {print $3}'
done | sort -u | while read -r lib; do
  case "$(basename "${lib}")" in
    libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|libresolv.so.*|ld-linux*) continue ;;
  esac
  cp -L "${lib}" "${root}/lib/"
done
nlibs=$(ls "${root}/lib" | wc -l)
# RPATH (not RUNPATH: it also serves the libraries' own dependencies) to the bundle's lib/.
patchelf --force-rpath --set-rpath '$ORIGIN/../lib' "${root}/bin/bazel-4"
for f in "${root}"/usr/libexec/x86_64-linux-gnu/bazel/* "${root}"/usr/lib/x86_64-linux-gnu/bazel/*; do
  [[ -f "${f}" ]] && file -b "${f}" | grep -q ELF || continue
  patchelf --force-rpath --set-rpath '$ORIGIN/../../../../lib' "${f}"
done
for f in "${root}"/lib/*; do patchelf --force-rpath --set-rpath '$ORIGIN' "${f}"; done
# Every ELF must now resolve all its libraries (against the bundle + glibc).
for f in "${elfs[@]}"; do
  if ldd "${f}" | grep -q 'not found'; then ldd "${f}" >&2; die "unresolved libraries in ${f}"; fi
done
say "  client + ${nlibs} libraries + install base ($(du -sh "${root}/usr" | cut -f1) unpacked)"

# ---- 2. JRE 17 (jlink) --------------------------------------------------------------------------------------
# --compress=0: an uncompressed modules image xz-compresses to 13 MB; jlink's own zip (--compress=2) gives 20 MB.
say "jlink JRE 17 (${JRE_MODULES}) ..."
"${jlink}" --module-path "${jdk_home}/jmods" --add-modules "${JRE_MODULES}" \
  --strip-debug --no-header-files --no-man-pages --compress=0 --output "${root}/jre"
"${root}/jre/bin/java" -version 2>&1 | head -1 | sed 's/^/make_bundle:   /' >&2
say "  jre $(du -sh "${root}/jre" | cut -f1) unpacked"

# ---- 3. the small pinned artifacts (everything in pins.bzl except the CUDA toolkit wheels) ------------------
[[ -f "${pins}" && -f "${wheel_tool}" ]] || die "${pins} or ${wheel_tool} missing"
# pins.bzl is plain Starlark data: evaluate it as Python with a `struct` that builds dicts.
mapfile -t wheels < <("${python}" - "${pins}" <<'EOF'
import sys
ns = {"struct": lambda **kw: kw}
exec(open(sys.argv[1]).read(), ns)
cuda = {w["sha256"] for w in ns.get("CUDA_WHEELS", [])}
seen = set()
for w in ns["ALL_WHEELS"]:
    if w["sha256"] in cuda or w["sha256"] in seen:
        continue
    seen.add(w["sha256"])
    print("%s %s %s %s" % (w["name"], w["version"], w["sha256"], w.get("strip", "")))
EOF
)
(( ${#wheels[@]} )) || die "no non-CUDA wheels found in ${pins}"
manifest_wheels=""
for line in "${wheels[@]}"; do
  read -r name version sha strip <<<"${line}"
  # wheel_tool.py fetches (pip) when missing, verifies the sha256 and unpacks: the same code the repository
  # rules run, so what lands in the bundle is exactly what they will look for.
  "${python}" "${wheel_tool}" --name="${name}" --version="${version}" --sha256="${sha}" --cache="${cache}" \
    --tmp="${stage}/dl" --strip="${strip}" --dest="${stage}/unpack-check" 2>&1 | sed 's/^/make_bundle:   /' >&2
  rm -rf "${stage}/unpack-check"
  mkdir -p "${root}/artifacts/${sha}"
  whl="$(ls "${cache}/${sha}"/*.whl | head -1)"
  cp "${whl}" "${root}/artifacts/${sha}/"
  manifest_wheels+="  ${name}==${version}  $(basename "${whl}")  $(stat -c %s "${whl}") bytes  sha256 ${sha}"$'\n'
done

# ---- 4. manifest + archive ----------------------------------------------------------------------------------
cat > "${root}/MANIFEST" <<EOF
FlashKDA offline bundle (tools/offline/make_bundle.sh; use tools/offline/bazel-offline)
bazel-bootstrap ${bazel_version} (Debian), client bin/bazel-4, install base usr/share/bazel, ${nlibs} libraries in lib/
JRE: $("${root}/jre/bin/java" -version 2>&1 | sed -n 2p) ; modules ${JRE_MODULES}
artifact cache (artifacts/<sha256>/<wheel>, layout of tools/cuda/private/wheel_tool.py):
${manifest_wheels}
EOF
# Deterministic-ish: sorted names, fixed owner and mtime (the last commit's time when there is one).
epoch="$(git -C "${workspace}" log -1 --format=%ct 2>/dev/null || echo 0)"
say "packing (xz) ..."
mkdir -p "$(dirname "${out}")"
tar -C "${stage}" --sort=name --owner=0 --group=0 --numeric-owner --mtime="@${epoch}" \
    --format=gnu -cf - kda-offline | xz ${XZ_OPT:--9 -T0} > "${out}.part"
mv "${out}.part" "${out}"
bytes=$(stat -c %s "${out}")
say "wrote ${out}: $((bytes / 1024 / 1024)) MiB (${bytes} bytes), sha256 $(sha256sum "${out}" | cut -c1-16)..., $((SECONDS - t0)) s"
echo "${out} $((bytes / 1024 / 1024)) MiB"
if (( bytes > 45 * 1024 * 1024 )); then
  say "WARNING: the bundle is over 45 MiB; the tree sent to the GPU machine must stay under 64 MiB"
fi
