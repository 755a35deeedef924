#!/usr/bin/env bash
# The GPU host's compile caches across device loans: vLLM's torch.compile cache
# (~/.cache/vllm/torch_compile_cache) and Triton's kernel cache (~/.triton/cache). A
# loan keeps them between its calls; a new loan starts empty and compiles again (about
# 25 s of torch.compile per engine configuration, plus the Triton kernels' first
# launches). Both caches are keyed by what they compiled (vLLM hashes the config and the
# traced source files; Triton the kernel source, its version and the target), so a stale
# entry is never used, only missed.
#
#   bash bench/compile_cache.sh restore TARBALL   # unpack into $HOME, once per machine
#   bash bench/compile_cache.sh save OUT_FILE     # pack both caches, if at most
#                                                 # COMPILE_CACHE_MAX_MIB (15) MiB
#
# bench/gpu_session.sh calls it: DDTREE_COMPILE_CACHE=<a carried tarball> restores before
# the steps, COMPILE_CACHE_SAVE=1 saves $OUT/compile-cache.tar.gz after them.
set -uo pipefail
MARKER="${COMPILE_CACHE_MARKER:-/tmp/ddtree-compile-cache-restored}"
DIRS=(.cache/vllm/torch_compile_cache .triton/cache)

case "${1:-}" in
  restore)
    tarball="${2:?restore: the tarball}"
    if [ -f "$MARKER" ]; then
      echo "compile cache: already restored on this machine"; exit 0
    fi
    [ -f "$tarball" ] || { echo "compile cache: no $tarball" >&2; exit 1; }
    mkdir -p "$HOME"
    tar -C "$HOME" -xzf "$tarball" || { echo "compile cache: cannot unpack $tarball" >&2; exit 1; }
    touch "$MARKER"
    echo "compile cache: restored $(du -sh "$tarball" | cut -f1) from $tarball"
    ;;
  save)
    out="${2:?save: the output file}"
    max_mib="${COMPILE_CACHE_MAX_MIB:-15}"
    present=()
    for d in "${DIRS[@]}"; do [ -d "$HOME/$d" ] && present+=("$d"); done
    if [ "${#present[@]}" -eq 0 ]; then
      echo "compile cache: nothing to save"; exit 0
    fi
    tmp="$out.tmp"
    tar -C "$HOME" -czf "$tmp" "${present[@]}" || { rm -f "$tmp"; echo "compile cache: tar failed" >&2; exit 1; }
    size=$(stat -c %s "$tmp")
    if [ "$size" -gt $((max_mib * 1024 * 1024)) ]; then
      rm -f "$tmp"
      echo "compile cache: $((size / 1024 / 1024)) MiB is over ${max_mib} MiB: not saved"
      exit 0
    fi
    mv "$tmp" "$out"
    echo "compile cache: saved ${present[*]} ($((size / 1024)) KiB) to $out"
    ;;
  *)
    echo "usage: $0 restore TARBALL | save OUT_FILE" >&2; exit 2 ;;
esac
