# shellcheck shell=bash
# Sourced on the GPU host after staging a runtime that carries its own torch:
#
#   . /opt/vllm-site-0.33.0/ddtree-env.sh
#
# (the builder copies this file into the runtime as ddtree-env.sh, beside
# ddtree-host-libs.txt: the CUDA sonames its libraries need and do not carry.)
# Puts the runtime first on PYTHONPATH, so its torch, triton and vLLM shadow the host's;
# finds each needed CUDA library in the host's nvidia wheels (nvidia/*/lib under the
# host's site-packages: DDTREE_HOST_SITE, else /opt/*/.venv/lib/python3*/site-packages,
# else the site-packages of the host's python3) and puts those folders on
# LD_LIBRARY_PATH, after the runtime's own NCCL (torch's RPATH also finds that one
# first: $ORIGIN/../../nvidia/nccl/lib); and lets torch accept the host's older cuDNN.
# Fails, naming what is missing, when a library is found nowhere.

_ddt_fail() { echo "ddtree-env: $*" >&2; return 1; }
_ddt_env() {
  local site need host="" d lib dirs="" missing=""
  site="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
  need="$site/ddtree-host-libs.txt"
  [ -f "$need" ] || { _ddt_fail "$need not found (is $site a staged runtime?)"; return 1; }
  [ -f "$site/nvidia/nccl/lib/libnccl.so.2" ] || { _ddt_fail "the runtime's NCCL ($site/nvidia/nccl/lib/libnccl.so.2) is missing"; return 1; }
  local cands=()
  if [ -n "${DDTREE_HOST_SITE:-}" ]; then cands=("$DDTREE_HOST_SITE")
  else
    for d in /opt/*/.venv/lib/python3*/site-packages; do [ -d "$d/nvidia" ] && cands+=("$d"); done
    if [ ${#cands[@]} -eq 0 ]; then
      for d in $(PYTHONPATH='' python3 -c 'import site; print(*site.getsitepackages())' 2>/dev/null); do
        [ -d "$d/nvidia" ] && cands+=("$d")
      done
    fi
  fi
  [ ${#cands[@]} -gt 0 ] || { _ddt_fail "no host site-packages with nvidia/ found (set DDTREE_HOST_SITE)"; return 1; }
  host="${cands[0]}"
  while read -r lib; do
    [ -n "$lib" ] || continue
    local hit=""
    for d in "$host"/nvidia/*/lib; do
      case "$d" in */nvidia/nccl/lib) continue ;; esac   # NCCL comes from the runtime
      if [ -e "$d/$lib" ]; then hit="$d"; break; fi
    done
    if [ -z "$hit" ]; then missing="$missing $lib"
    else case ":$dirs:" in *":$hit:"*) ;; *) dirs="${dirs:+$dirs:}$hit" ;; esac
    fi
  done < "$need"
  [ -z "$missing" ] || { _ddt_fail "not in $host/nvidia/*/lib:$missing"; return 1; }
  export LD_LIBRARY_PATH="$site/nvidia/nccl/lib:$dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1
  echo "ddtree-env: runtime $site, CUDA libraries from $host/nvidia ($(echo "$dirs" | tr ':' '\n' | sed 's|.*/nvidia/||; s|/lib$||' | paste -sd' '))"
}
# shellcheck disable=SC2317  # exit only when executed rather than sourced
_ddt_env || { unset -f _ddt_env _ddt_fail; return 1 2>/dev/null || exit 1; }
unset -f _ddt_env _ddt_fail
