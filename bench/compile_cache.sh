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
#                                                 # (TARBALL, or its parts TARBALL.NN)
#   bash bench/compile_cache.sh save OUT_FILE     # pack both caches: OUT_FILE if at most
#                                                 # COMPILE_CACHE_MAX_MIB (15) MiB, else
#                                                 # parts OUT_FILE.00, .01 .. of that size,
#                                                 # at most COMPILE_CACHE_MAX_PARTS (2)
#
# The device tool returns files of at most 16 MiB, and a call carries at most 64 MiB with
# the working tree (~20 MiB): two parts of 15 MiB is what one call can bring back.
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
    parts=("$tarball")
    if [ ! -f "$tarball" ]; then
      shopt -s nullglob
      parts=("$tarball".[0-9][0-9])
      shopt -u nullglob
      [ "${#parts[@]}" -gt 0 ] || { echo "compile cache: no $tarball (nor its parts $tarball.NN)" >&2; exit 1; }
    fi
    mkdir -p "$HOME"
    cat "${parts[@]}" | tar -C "$HOME" -xzf - \
      || { echo "compile cache: cannot unpack ${parts[*]}" >&2; exit 1; }
    touch "$MARKER"
    echo "compile cache: restored $(du -ck --apparent-size "${parts[@]}" | tail -1 | cut -f1) KiB from ${parts[*]}"
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
    max_parts="${COMPILE_CACHE_MAX_PARTS:-2}"
    part_bytes=$((max_mib * 1024 * 1024))
    if [ "$size" -le "$part_bytes" ]; then
      mv "$tmp" "$out"
      echo "compile cache: saved ${present[*]} ($((size / 1024)) KiB) to $out"
      exit 0
    fi
    if [ "$part_bytes" -eq 0 ] || [ "$size" -gt $((part_bytes * max_parts)) ]; then
      rm -f "$tmp"
      echo "compile cache: $((size / 1024 / 1024)) MiB is over ${max_parts} parts of ${max_mib} MiB: not saved"
      exit 0
    fi
    split -b "$part_bytes" -d -a 2 "$tmp" "$out." || { rm -f "$tmp" "$out".[0-9][0-9]; echo "compile cache: split failed" >&2; exit 1; }
    rm -f "$tmp"
    echo "compile cache: saved ${present[*]} ($((size / 1024)) KiB) in parts $(echo "$out".[0-9][0-9])"
    ;;
  *)
    echo "usage: $0 restore TARBALL | save OUT_FILE" >&2; exit 2 ;;
esac
