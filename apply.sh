#!/usr/bin/env bash
# Apply the DDTree patch series (patches/series) to vLLM, strictly and reversibly.
#
#   ./apply.sh                 set up .venv (pinned vLLM + test tools + vllm_ddtree) and
#                              apply the series to it; reuses an existing .venv. The
#                              default pin is UPSTREAM's; DDTREE_VLLM=V (or --pin V) sets
#                              up another pin listed in UPSTREAM's PINS=; DDTREE_VENV=DIR
#                              sets up DIR instead of .venv (e.g. one venv a pin)
#   ./apply.sh --site DIR      apply to an installed vLLM at DIR/vllm (site-packages,
#                              dist-packages, /opt/vllm-site) and copy vllm_ddtree/ to DIR
#   ./apply.sh --source DIR    apply to a vLLM git checkout at the pinned commit (patches
#                              only; pip install this repo so vLLM can import vllm_ddtree)
# Options:
#   --check        dry run: say what would happen, change nothing (exit 1 if it would fail)
#   --revert       restore the original files byte for byte, remove created files, the
#                  package copy and the manifest
#   --pin V        the pin whose series to apply (default: with --site, the pin of the
#                  vLLM found there; otherwise $DDTREE_VLLM, else UPSTREAM's VLLM_VERSION)
#   --patches DIR  patch directory (default: the pin's, patches/ for UPSTREAM's pin)
#   --no-package   with --site: do not copy vllm_ddtree/ (it is pip-installed there)
#   --upstream F   pin file (default: UPSTREAM beside this script; for tests)
#
# Strict: git apply with full context (no fuzz, no --reject), all patches staged in a
# scratch copy first; the tree is touched only when every patch applies. The manifest
# DIR/vllm/ddtree_series.json records the series hash; originals live in
# DIR/vllm/.ddtree_orig/ until --revert.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PROG=apply.sh
MODE=venv
TARGET=
ACTION=apply
DRY=0
COPY_PACKAGE=1
PATCHES=$REPO/patches
UPSTREAM_FILE=$REPO/UPSTREAM
PIN=${DDTREE_VLLM:-}
EXPLICIT_SERIES=0  # --patches/--upstream given: that series and pin file, no choice
PKG_SRC=$REPO/vllm_ddtree
MANIFEST_PY=$PKG_SRC/manifest.py

die() { echo "$PROG: error: $*" >&2; exit 1; }
say() { echo "$PROG: $*"; }
usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"; }

while [[ $# -gt 0 ]]; do
  case $1 in
    --site|--source)
      [[ $# -ge 2 ]] || die "$1 needs a directory"
      MODE=${1#--}; TARGET=$2; shift 2 ;;
    --check) DRY=1; shift ;;
    --revert) ACTION=revert; shift ;;
    --patches) [[ $# -ge 2 ]] || die "--patches needs a directory"; PATCHES=$2; EXPLICIT_SERIES=1; shift 2 ;;
    --upstream) [[ $# -ge 2 ]] || die "--upstream needs a file"; UPSTREAM_FILE=$2; EXPLICIT_SERIES=1; shift 2 ;;
    --pin) [[ $# -ge 2 ]] || die "--pin needs a vLLM version"; PIN=$2; shift 2 ;;
    --no-package) COPY_PACKAGE=0; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see ./apply.sh --help)" ;;
  esac
done

command -v python3 >/dev/null || die "python3 is needed"
command -v git >/dev/null || die "git is needed"

# Runs vllm_ddtree/manifest.py by path, so the package's __init__ (and torch) is not
# imported and nothing in vllm_ddtree/ can shadow a standard-library module.
manifest() {
  python3 -c 'import importlib.util as u, sys
s = u.spec_from_file_location("vllm_ddtree_manifest", sys.argv[1])
m = u.module_from_spec(s); s.loader.exec_module(m); sys.exit(m._main(sys.argv[2:]))' \
    "$MANIFEST_PY" "$@"
}

pin() {  # pin KEY: value of KEY=VALUE in UPSTREAM
  local v
  v=$(sed -n "s/^$1=//p" "$UPSTREAM_FILE" | tail -n 1)
  [[ -n $v ]] || die "$UPSTREAM_FILE has no $1="
  printf '%s\n' "$v"
}

# select_pin VERSION: the pin file and series of the pin serving vLLM VERSION
# (manifest.pin_for; the error names every supported pin).
PINNED_SERIES=0
select_pin() {
  local out
  out=$(manifest pin-for "$REPO" "$1" 2>&1) || die "${out#error: }"
  mapfile -t out <<<"$out"
  UPSTREAM_FILE=${out[1]}
  PATCHES=${out[2]}
  PINNED_SERIES=1
}
load_pin() {
  [[ -f $UPSTREAM_FILE ]] || die "pin file $UPSTREAM_FILE not found"
  [[ -d $PATCHES ]] || die "patch directory $PATCHES not found"
  PATCHES=$(cd "$PATCHES" && pwd)
  VLLM_VERSION=$(pin VLLM_VERSION)
  VLLM_COMMIT=$(pin VLLM_COMMIT)
}
if [[ $EXPLICIT_SERIES == 1 ]]; then
  [[ -n $PIN && -n ${DDTREE_VLLM:-} && $PIN == "$DDTREE_VLLM" ]] && PIN=
  [[ -z $PIN ]] || die "--pin cannot be combined with --patches/--upstream"
elif [[ -n $PIN ]]; then
  select_pin "$PIN"
elif [[ $MODE != site ]]; then
  PINNED_SERIES=1  # UPSTREAM's pin and patches/
fi
load_pin

# --- set-up of the project venv (no --site/--source) --------------------------------
VENV=${DDTREE_VENV:-$REPO/.venv}
[[ $VENV == /* ]] || VENV=$PWD/$VENV
REVERT_CMD="./apply.sh --revert"
[[ $MODE != venv ]] && REVERT_CMD="./apply.sh --$MODE $TARGET --revert"
venv_site() { "$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

# The pinned vLLM brings torch with its CUDA libraries: 7.9 GiB in .venv, 0.5 GiB in
# .venv-lint, plus pip's downloads while it installs (10.8 GiB at the peak, measured on a
# fresh clone). Refuses to start (instead of pip's "No space left on device" minutes
# later) when the disk holding DIR or TMPDIR has less than DDTREE_MIN_FREE_GB (default
# 12 GiB; 0 skips the check) free.
require_free_disk() {
  local need=${DDTREE_MIN_FREE_GB:-12} dir free_kb
  [[ $need =~ ^[0-9]+$ ]] || die "DDTREE_MIN_FREE_GB must be a whole number of GiB, got '$need'"
  [[ $need == 0 ]] && return 0
  for dir in "$(dirname "$1")" "${TMPDIR:-/tmp}"; do
    free_kb=$(df -Pk "$dir" | awk 'NR == 2 {print $4}')
    if [[ $free_kb =~ ^[0-9]+$ ]] && (( free_kb < need * 1024 * 1024 )); then
      die "only $((free_kb / 1024)) MiB free on the disk holding $dir; installing vllm==$VLLM_VERSION needs about $need GiB (free some space, or set DDTREE_MIN_FREE_GB to override)"
    fi
  done
}

# Creates .venv if missing and installs the pinned vLLM and the test requirements, unless
# a stamp says this exact set is already there. Sets TARGET to the venv's site-packages.
setup_venv() {
  local stamp=$VENV/.ddtree-setup want site found=
  want=$( { echo "vllm==$VLLM_VERSION"; cat "$REPO/requirements-test.txt"; } | sha256sum | cut -c1-64)
  if [[ -x $VENV/bin/python ]]; then
    site=$(venv_site)
    [[ -d $site/vllm ]] && found=$(manifest vllm-version "$site/vllm" 2>/dev/null || true)
  fi
  if [[ -n $found && -f $stamp && $(cat "$stamp") == "$want" ]] \
      && manifest version-matches "$found" "$VLLM_VERSION"; then
    say "reusing $VENV (vLLM $found, test requirements installed)"
  elif [[ $DRY == 1 ]]; then
    say "check: would set up $VENV (vllm==$VLLM_VERSION, requirements-test.txt, vllm_ddtree) and apply the series there; nothing was changed"
    exit 0
  else
    # Only a set-up that installs vLLM itself needs the room; one that adds a test
    # requirement to a venv with the pinned vLLM does not.
    if [[ -z $found ]] || ! manifest version-matches "$found" "$VLLM_VERSION"; then
      require_free_disk "$VENV"
    fi
    if [[ ! -x $VENV/bin/python ]]; then
      say "creating $VENV"
      python3 -m venv "$VENV"
      site=$(venv_site)
    fi
    if [[ -n $found ]] && ! manifest version-matches "$found" "$VLLM_VERSION" \
        && [[ -f $site/vllm/ddtree_series.json ]]; then
      say "$VENV has vLLM $found carrying a series; reverting it before installing $VLLM_VERSION"
      "${BASH_SOURCE[0]}" --site "$site" --revert --upstream "$UPSTREAM_FILE"
    fi
    say "installing vllm==$VLLM_VERSION and requirements-test.txt into $VENV (about 8.4 GiB on a fresh machine)"
    # No pip cache (it would hold a second copy of every downloaded wheel) and a scratch
    # TMPDIR removed afterwards (pip leaves unpacked downloads behind in it).
    local scratch
    scratch=$(mktemp -d "${TMPDIR:-/tmp}/ddtree-pip.XXXXXX")
    TMPDIR=$scratch "$VENV/bin/python" -m pip install --no-cache-dir \
      "vllm==$VLLM_VERSION" -r "$REPO/requirements-test.txt" || { rm -rf "$scratch"; exit 1; }
    rm -rf "$scratch"
    echo "$want" > "$stamp"
  fi
  if [[ $DRY == 0 ]]; then
    # The linters of tests/deploy live in their own venv (checkov's pins clash with
    # vLLM's); a no-op when requirements-lint.txt has not changed.
    "$REPO/tools/setup-lint-venv.sh"
  fi
  TARGET=$site
}

if [[ $MODE == venv ]]; then
  if [[ $ACTION == revert ]]; then
    [[ -x $VENV/bin/python ]] || die "no $VENV to revert"
    TARGET=$(venv_site)
  else
    setup_venv
  fi
  MODE=site
fi

[[ -n $TARGET ]] || die "no target directory"
[[ -d $TARGET ]] || die "$TARGET is not a directory"
TARGET=$(cd "$TARGET" && pwd)
VLLM_DIR=$TARGET/vllm
[[ -f $VLLM_DIR/__init__.py ]] || die "$TARGET has no vllm package (expected $VLLM_DIR/__init__.py)"
MANIFEST_JSON=$VLLM_DIR/ddtree_series.json
ORIG=$VLLM_DIR/.ddtree_orig
[[ $MODE == source ]] && COPY_PACKAGE=0
PKG_DST=$TARGET/vllm_ddtree

# Same content, ignoring __pycache__? (cmp the two trees' file lists and bytes)
package_differs() {
  [[ -d $PKG_DST ]] || return 0
  ! diff -rq -x __pycache__ -x '*.pyc' "$PKG_SRC" "$PKG_DST" >/dev/null 2>&1
}

copy_package() {
  local tmp=$TARGET/.vllm_ddtree.tmp.$$
  rm -rf "$tmp"
  mkdir -p "$tmp"
  (cd "$PKG_SRC" && find . -name __pycache__ -prune -o -type f ! -name '*.pyc' -print0 \
     | xargs -0 -r cp --parents -t "$tmp")
  rm -rf "$PKG_DST"
  mv "$tmp" "$PKG_DST"
}

# --- revert ---------------------------------------------------------------------------
if [[ $ACTION == revert ]]; then
  if [[ ! -f $MANIFEST_JSON ]]; then
    [[ -e $ORIG ]] && die "$ORIG exists but $MANIFEST_JSON does not; restore by hand from $ORIG"
    say "$VLLM_DIR carries no DDTree series; nothing to revert"; exit 0
  fi
  mapfile -t modified < <(manifest get "$MANIFEST_JSON" modified)
  mapfile -t created < <(manifest get "$MANIFEST_JSON" created)
  mapfile -t deleted < <(manifest get "$MANIFEST_JSON" deleted)
  pkg_copy=$(manifest get "$MANIFEST_JSON" package_copy)
  for f in "${modified[@]}" "${deleted[@]}"; do
    [[ -f $ORIG/$f ]] || die "original of $f missing from $ORIG; cannot revert"
  done
  mapfile -t changed < <(manifest changed "$TARGET")
  if [[ $DRY == 1 ]]; then
    say "check: would revert series $(manifest get "$MANIFEST_JSON" series_sha256 | cut -c1-12) in $VLLM_DIR:"
    for f in "${modified[@]}" "${deleted[@]}"; do echo "  restore $f"; done
    for f in "${created[@]}"; do echo "  remove  $f"; done
    [[ -n $pkg_copy ]] && echo "  remove  $pkg_copy/ (package copy)"
    for f in "${changed[@]}"; do echo "  note: $f was changed after the series was applied"; done
    exit 0
  fi
  for f in "${changed[@]}"; do say "warning: $f was changed after the series was applied; restoring the original anyway"; done
  for f in "${modified[@]}" "${deleted[@]}"; do
    mkdir -p "$(dirname "$TARGET/$f")"
    cp -p "$ORIG/$f" "$TARGET/$f"
  done
  for f in "${created[@]}"; do
    rm -f "$TARGET/$f"
    # drop directories the series created and left empty (never vllm/ itself)
    d=$(dirname "$TARGET/$f")
    while [[ $d != "$VLLM_DIR" && $d == "$VLLM_DIR"/* ]] && rmdir "$d" 2>/dev/null; do d=$(dirname "$d"); done
  done
  [[ -n $pkg_copy ]] && rm -rf "${TARGET:?}/$pkg_copy"
  rm -rf "$ORIG"
  rm -f "$MANIFEST_JSON"
  say "reverted $VLLM_DIR to the original files (${#modified[@]} restored, ${#created[@]} removed, ${#deleted[@]} recreated)"
  exit 0
fi

# --- apply: refuse the wrong vLLM ----------------------------------------------------
if [[ $MODE == source && -e $TARGET/.git ]]; then
  head=$(git -C "$TARGET" rev-parse HEAD 2>/dev/null) || die "$TARGET: cannot read the git HEAD"
  [[ $head == "$VLLM_COMMIT"* ]] \
    || die "$TARGET is at commit ${head:0:12}, but the series is pinned to vLLM $VLLM_VERSION (commit $VLLM_COMMIT); check out the pinned commit"
  found=$VLLM_VERSION
else
  if [[ $MODE == site && $EXPLICIT_SERIES == 0 && -z $PIN ]]; then
    # No pin asked for: the series of the vLLM found here.
    found=$(manifest vllm-version "$VLLM_DIR") \
      || die "cannot tell the vLLM version of $VLLM_DIR (no _version.py/version.py); the series supports vLLM $(manifest pins "$REPO" | paste -sd ' ' | sed 's/ / and /g')"
    select_pin "$found"
    load_pin
  fi
  found=$(manifest vllm-version "$VLLM_DIR") \
    || die "cannot tell the vLLM version of $VLLM_DIR (no _version.py/version.py); the series needs vLLM $VLLM_VERSION"
  manifest version-matches "$found" "$VLLM_VERSION" \
    || die "$VLLM_DIR is vLLM $found, but this series is pinned to vLLM $VLLM_VERSION; install vllm==$VLLM_VERSION"
fi

want_hash=$(manifest hash "$PATCHES") || die "bad series in $PATCHES"
mapfile -t names < <(manifest names "$PATCHES")

# --- already carrying a series? ------------------------------------------------------
if [[ -f $MANIFEST_JSON ]]; then
  have_hash=$(manifest get "$MANIFEST_JSON" series_sha256)
  if [[ $have_hash != "$want_hash" ]]; then
    die "$VLLM_DIR already carries another DDTree series (${have_hash:0:12}; this one is ${want_hash:0:12}); run '$REVERT_CMD' first, then apply again"
  fi
  mapfile -t changed < <(manifest changed "$TARGET")
  if [[ ${#changed[@]} -gt 0 ]]; then
    die "$VLLM_DIR carries this series, but these files changed since it was applied: ${changed[*]}; run '$REVERT_CMD' and apply again"
  fi
  if [[ $COPY_PACKAGE == 1 && -n $(manifest get "$MANIFEST_JSON" package_copy) ]] && package_differs; then
    if [[ $DRY == 1 ]]; then
      say "check: series ${want_hash:0:12} already applied; would refresh the vllm_ddtree copy in $TARGET"
    else
      copy_package
      say "series ${want_hash:0:12} already applied to $VLLM_DIR; refreshed the vllm_ddtree copy"
    fi
    exit 0
  fi
  say "series ${want_hash:0:12} (${#names[@]} patches) already applied to $VLLM_DIR; nothing to do"
  exit 0
fi
[[ -e $ORIG ]] && die "$ORIG exists without $MANIFEST_JSON (an interrupted apply?); restore the files listed there by hand or reinstall vLLM"
if [[ $COPY_PACKAGE == 1 && -e $PKG_DST ]]; then
  die "$PKG_DST exists but was not put there by apply.sh (pip-installed?); pass --no-package to keep it, or remove it"
fi

# --- stage: apply every patch to scratch copies --------------------------------------
STAGE=$(mktemp -d "${TMPDIR:-/tmp}/ddtree-apply.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
TREE=$STAGE/tree
# git with no user/system config, so settings such as apply.whitespace=fix cannot
# change what gets applied
sgit() {
  GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null git -C "$TREE" \
    -c user.name=apply.sh -c user.email=apply.sh@localhost -c core.autocrlf=false "$@"
}
git init -q "$TREE"
declare -A seen=()
for name in "${names[@]}"; do
  p=$PATCHES/$name
  summary=$(sgit apply --summary "$p" 2>&1) || die "patch $name is not a patch git can read: $summary"
  if grep -Eq '^ (rename|copy) |^ mode change ' <<<"$summary"; then
    die "patch $name renames, copies or changes the mode of a file; the series supports creating, changing and deleting files only"
  fi
  numstat=$(sgit apply --numstat "$p") || die "patch $name cannot be read"
  while IFS=$'\t' read -r add del path; do
    [[ -n $path ]] || continue
    [[ $add == - ]] && die "patch $name has a binary change to $path; not supported"
    [[ $path == vllm/* && $path != *..* ]] || die "patch $name touches $path, outside vllm/"
    if [[ -z ${seen[$path]:-} ]]; then
      seen[$path]=1
      if [[ -f $TARGET/$path ]]; then
        mkdir -p "$(dirname "$TREE/$path")"
        cp -p "$TARGET/$path" "$TREE/$path"
      fi
    fi
  done <<<"$numstat"
done
sgit add -A
sgit commit -q --allow-empty --no-verify -m original
for name in "${names[@]}"; do
  if ! err=$(sgit apply -p1 -C3 --whitespace=nowarn "$PATCHES/$name" 2>&1); then
    file=$(sed -n -E 's/^error: patch failed: (.*):[0-9]+$/\1/p; s/^error: (vllm\/[^:]*): (No such file|already exists).*/\1/p' <<<"$err" | head -n 1)
    echo "$err" >&2
    die "patch $name does not apply${file:+ to $file} (strict: no fuzz); $VLLM_DIR was not changed"
  fi
done
sgit add -A
changes=$STAGE/changes
sgit diff --cached --name-status --no-renames HEAD > "$changes"
mapfile -t modified < <(awk -F'\t' '$1=="M"{print $2}' "$changes")
mapfile -t created < <(awk -F'\t' '$1=="A"{print $2}' "$changes")
mapfile -t deleted < <(awk -F'\t' '$1=="D"{print $2}' "$changes")

if [[ $DRY == 1 ]]; then
  say "check: series ${want_hash:0:12} (${#names[@]} patches) applies cleanly to $VLLM_DIR (vLLM $found):"
  for n in "${names[@]}"; do echo "  patch   $n"; done
  for f in "${modified[@]}"; do echo "  modify  $f"; done
  for f in "${created[@]}"; do echo "  create  $f"; done
  for f in "${deleted[@]}"; do echo "  delete  $f"; done
  [[ $COPY_PACKAGE == 1 ]] && echo "  copy    vllm_ddtree/ -> $PKG_DST"
  say "check: nothing was changed"
  exit 0
fi

# --- commit: back up originals, then put the results in place ------------------------
mkdir -p "$ORIG"
for f in "${modified[@]}" "${deleted[@]}"; do
  mkdir -p "$(dirname "$ORIG/$f")"
  cp -p "$TARGET/$f" "$ORIG/$f"
done
rollback() {
  echo "$PROG: error while writing $VLLM_DIR; restoring the originals" >&2
  for f in "${modified[@]}" "${deleted[@]}"; do cp -p "$ORIG/$f" "$TARGET/$f" || true; done
  for f in "${created[@]}"; do rm -f "$TARGET/$f"; done
  rm -rf "$ORIG" "$MANIFEST_JSON"
  [[ $COPY_PACKAGE == 1 ]] && rm -rf "$PKG_DST"
  rm -rf "$STAGE"
}
trap 'rc=$?; [[ $rc != 0 ]] && rollback; rm -rf "$STAGE"' EXIT
for f in "${modified[@]}"; do cat "$TREE/$f" > "$TARGET/$f"; done
for f in "${created[@]}"; do
  mkdir -p "$(dirname "$TARGET/$f")"
  cp "$TREE/$f" "$TARGET/$f"
done
for f in "${deleted[@]}"; do rm -f "$TARGET/$f"; done
pkg_args=()
if [[ $COPY_PACKAGE == 1 ]]; then
  copy_package
  pkg_args=(--package-copy)
fi
[[ $PINNED_SERIES == 1 ]] && pkg_args+=(--pin "$VLLM_VERSION")
manifest write "$TARGET" --patches "$PATCHES" --vllm-version "$found" \
  --package-dir "$PKG_SRC" --files "$changes" "${pkg_args[@]}"
trap 'rm -rf "$STAGE"' EXIT

say "applied series ${want_hash:0:12} (${#names[@]} patches: ${#modified[@]} files changed, ${#created[@]} created, ${#deleted[@]} deleted) to $VLLM_DIR"
[[ $COPY_PACKAGE == 1 ]] && say "copied vllm_ddtree/ to $PKG_DST"
if [[ $MODE == source ]]; then
  say "now install this repo's package beside it: pip install $REPO"
fi
exit 0
