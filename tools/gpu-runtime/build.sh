#!/usr/bin/env bash
# Builds the GPU-host runtime of a pin: the pinned vLLM wheel plus what the host lacks,
# pruned, packed by the shared pack.sh into xz chunks of at most 49 MiB.
#
#   PIN=0.33.0 tools/gpu-runtime/build.sh [DEST]   # DEST default: ./.gpu-runtime
#   tools/gpu-runtime/build.sh [DEST]              # the default pin: the shared build.sh
#
# A pin other than the default reads patches/vllm-PIN/UPSTREAM (VLLM_VERSION,
# TORCH_VERSION, VLLM_WHEEL_SHA256) and tools/gpu-runtime/requirements-gpu-host-PIN.txt
# (torch, triton and NCCL included: that pin's torch is not the host's), and packs
# DEST/vllm-site-PIN/K/ (unpacks into /opt/vllm-site-PIN), with ddtree-env.sh inside
# for the host to source. KEEP_MOE=1 keeps the MoE, MLA-indexer and KDA kernels;
# PACK=0 stops before packing (the site is in ~/.cache/gpu-runtime/PIN/site).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
SHARED="${GPU_RUNTIME_SHARED:-$ROOT/../shared/gpu-runtime}"
[ -f "$SHARED/pack.sh" ] || SHARED=/work/shared/gpu-runtime
pin_value() { sed -n "s/^$1=//p" "$2" | head -1; }
DEFAULT_PIN="$(pin_value VLLM_VERSION "$ROOT/UPSTREAM")"
PIN="${PIN:-$DEFAULT_PIN}"
if [ "$PIN" = "$DEFAULT_PIN" ]; then
  # The host's own torch serves the default pin: the shared builder makes its runtime.
  exec env VLLM_VERSION="$PIN" bash "$SHARED/build.sh" "$@"
fi

PINFILE="$ROOT/patches/vllm-$PIN/UPSTREAM"
[ -f "$PINFILE" ] || { echo "no pin file $PINFILE" >&2; exit 1; }
VLLM_VERSION="$(pin_value VLLM_VERSION "$PINFILE")"
TORCH_VERSION="$(pin_value TORCH_VERSION "$PINFILE")"
WHEEL_SHA="$(pin_value VLLM_WHEEL_SHA256 "$PINFILE")"
REQ="$HERE/requirements-gpu-host-$PIN.txt"
[ -f "$REQ" ] || { echo "no $REQ (see tools/gpu-runtime/README.md: derive it)" >&2; exit 1; }
grep -q "^torch==$TORCH_VERSION " "$REQ" || { echo "$REQ does not pin torch==$TORCH_VERSION" >&2; exit 1; }
NAME="vllm-site-$PIN"
DEST="${1:-.gpu-runtime}"
CACHE="${HOME}/.cache/gpu-runtime/$PIN"
WHEELS="$CACHE/wheels"; SITE="$CACHE/site"
mkdir -p "$WHEELS"

PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for g in 5 12 17 18 24 26 27 28 31 34; do PLAT+=(--platform "manylinux_2_${g}_x86_64"); done
stamp="$WHEELS/.done-$(sha256sum "$REQ" | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  PIP_CONSTRAINT="" python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$WHEELS" \
    "vllm==$VLLM_VERSION" -r "$REQ"
  touch "$stamp"
fi
# Exactly the pinned wheels (the cache may hold others from earlier lists).
wheels=("$WHEELS"/vllm-"$VLLM_VERSION"-*.whl)
[ "$(sha256sum "${wheels[0]}" | cut -d' ' -f1)" = "$WHEEL_SHA" ] || { echo "vLLM wheel sha256 differs from $PINFILE" >&2; exit 1; }
while read -r spec; do
  n="${spec%%==*}"; v="${spec#*==}"
  w=""   # wheel names use _ where the project name may have - or .
  for f in "$WHEELS"/*.whl; do
    b="$(basename "$f")"; b="${b,,}"; want="${n,,}"; want="${want//[-.]/_}-$v-"
    [ "${b:0:${#want}}" = "$want" ] && { w="$f"; break; }
  done
  [ -n "$w" ] || { echo "no wheel for $spec in $WHEELS" >&2; exit 1; }
  wheels+=("$w")
done < <(sed 's/#.*//; s/ //g; /^$/d' "$REQ")

rm -rf "$SITE"; mkdir -p "$SITE"
for w in "${wheels[@]}"; do unzip -q -o "$w" -d "$SITE"; done
for d in "$SITE"/*.data; do            # wheels with a .data folder
  [ -d "$d" ] || continue
  for lib in purelib platlib; do [ -d "$d/$lib" ] && cp -a "$d/$lib/." "$SITE/"; done
  rm -rf "$d"
done

V="$SITE/vllm"
# vLLM, as the shared build.sh prunes 0.26.0: FA2 kernels (FA3 serves Hopper), the MLA
# kernels, the vendored deep_gemm (FP8 block GEMMs, import-guarded) and the SM100 FMHA
# sources, the Rust front end; without KEEP_MOE=1 also the MoE kernels and the kernels of
# MoE families only (DeepSeek sparse-attention indexer, Kimi/GLM KDA), all import-guarded
# or imported by those models alone.
rm -rf "$V/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$V"/_flashmla*.so \
       "$V/third_party/deep_gemm" "$V/third_party/fmha_sm100" "$V/vllm-rs"
[ "${KEEP_MOE:-0}" = 1 ] || rm -f "$V/_moe_C_stable_libtorch.abi3.so" "$V/_deepselect_C.abi3.so" "$V/_flashkda_C.abi3.so"
# Triton: static archives (never loaded; only linking Triton itself uses them), the
# Blackwell ptxas and CUPTI (compiler.py picks ptxas-blackwell for arch >= 100 only),
# Triton's own test libraries.
T="$SITE/triton"
if [ -d "$T" ]; then
  find "$T/backends/nvidia/lib" -name '*.a' -delete
  rm -rf "$T/backends/nvidia/lib/cupti-blackwell" "$T/backends/nvidia/bin/ptxas-blackwell" \
         "$T/instrumentation/libGPUInstrumentationTestLib.so" "$T/plugins/libTritonPluginsTestLib.so"
fi
# torch: the protobuf compiler (a build tool; two copies). torch/include stays
# (Inductor's C++ codegen and torch.utils.cpp_extension compile against it).
rm -f "$SITE"/torch/bin/protoc*
find "$SITE" -name '__pycache__' -prune -exec rm -rf {} +

# The CUDA sonames the runtime's libraries need and do not carry (the host's nvidia
# wheels provide them; the driver's libcuda and NVML are the host's own): env.sh finds
# each on the host and fails naming any it cannot find.
{ find "$SITE" -name '*.so*' -type f -print0 | xargs -0 readelf -d 2>/dev/null || true; } \
  | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | sort -u \
  | grep -E '^lib(cu|nv|nccl)' | grep -v -E '^lib(cuda\.so|nvidia-ml\.so)' \
  | while read -r lib; do
      [ -n "$(find "$SITE" -name "$lib" -print -quit)" ] || echo "$lib"
    done > "$SITE/ddtree-host-libs.txt"
cp "$HERE/env.sh" "$SITE/ddtree-env.sh"
{ echo "vLLM $VLLM_VERSION runtime for the GPU host (pin $PIN), built $(date -u +%F)"
  echo "source ddtree-env.sh after staging; packages:"
  sed 's/#.*//; s/ //g; /^$/d' "$REQ"; } > "$SITE/ddtree-runtime.txt"
echo "site: $(du -sh "$SITE" | cut -f1) in $SITE; needs from the host: $(paste -sd' ' "$SITE/ddtree-host-libs.txt")"

[ "${PACK:-1}" = 0 ] && exit 0
bash "$SHARED/pack.sh" "$NAME" "$DEST" "$SITE"
