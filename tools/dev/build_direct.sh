#!/usr/bin/env bash
# Debug build of the flash_kda extension WITHOUT Bazel, for quick kernel iteration on a GPU machine:
#   tools/dev/build_direct.sh OUT_DIR [NVCC]
# Compiles kda/csrc with the given nvcc (default: $KDA_CUDA_HOME/bin/nvcc) and the running python3's
# pybind11, then lays out OUT_DIR/flash_kda (the package + _C.so) so `PYTHONPATH=OUT_DIR` imports it.
# The product build is Bazel's (//kda:py); this script exists so a kernel can be tried when Bazel can't run.
set -euo pipefail
out=${1:?usage: build_direct.sh OUT_DIR [NVCC]}
root=$(cd "$(dirname "$0")/../.." && pwd)
nvcc=${2:-${KDA_CUDA_HOME:?set KDA_CUDA_HOME or pass NVCC}/bin/nvcc}
python=${KDA_PYTHON:-python3}
ccbin=${CC:-/usr/bin/gcc}
cuda_home=$(cd "$(dirname "$nvcc")/.." && pwd)
mkdir -p "$out/obj"
rm -rf "$out/flash_kda"
cp -r "$root/kda/python/flash_kda" "$out/flash_kda"
flags=(-std=c++17 -O3 -lineinfo -Xcompiler -fPIC -gencode=arch=compute_90a,code=sm_90a -I"$root"
       -ccbin "$ccbin" -DKDA_CUDA_ARCHS='"sm_90a"' -Xptxas -v)
objs=()
for src in "$root"/kda/csrc/*.cu; do
  obj="$out/obj/$(basename "$src").o"
  "$nvcc" "${flags[@]}" -c "$src" -o "$obj" 2> "$obj.log" || { cat "$obj.log"; exit 1; }
  objs+=("$obj")
done
pyinc=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
pybind_inc=$("$python" -c 'import pybind11; print(pybind11.get_include())')
"$ccbin" -std=c++17 -O2 -fPIC -fvisibility=hidden -I"$root" -I"$pyinc" -I"$pybind_inc" -I"$cuda_home/include" \
  -c "$root/kda/csrc/binding.cpp" -o "$out/obj/binding.o"
g++ -shared -o "$out/flash_kda/_C$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" \
  "${objs[@]}" "$out/obj/binding.o" -L"$cuda_home/lib64" -L"$cuda_home/lib" -lcudart_static -ldl -lpthread -lrt
grep -h "registers\|spill" "$out"/obj/*.log || true
echo "built $out/flash_kda"
