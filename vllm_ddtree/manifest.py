"""Which DDTree patch series a vLLM install carries.

``apply.sh`` writes ``<site>/vllm/ddtree_series.json`` after applying the series in
``patches/``; the patched vLLM logs it at start-up. This module owns that file's format
and the series hash, for ``apply.sh`` (which runs this file as a script), ``tools/series``
and the tests alike, so the hash is defined in one place.

Standard library only, and importable without importing vLLM or torch: ``apply.sh`` runs
it with the system ``python3`` as ``python3 vllm_ddtree/manifest.py COMMAND ...``.

Manifest (JSON object):
  series_sha256        series_hash() of the applied patch directory
  patches              patch file names, in order
  vllm_version         version of the vLLM the series was applied to
  vllm_ddtree_version  version of the vllm_ddtree package beside it
  modified, created, deleted
                       paths relative to the site (``vllm/...``) the series changed;
                       originals of modified/deleted files sit in ``vllm/.ddtree_orig/``
  patched_sha256       {path: sha256} of modified/created files right after applying,
                       so a later run can tell whether someone changed them since
  package_copy         "vllm_ddtree" when apply.sh copied the package into the site,
                       else null
  pin                  the pinned vLLM release whose series was applied (one of
                       supported_pins()), or null for a series given by directory

Pins: ``UPSTREAM`` is the default pin's file and ``patches/`` its series; each other
release ``V`` listed in UPSTREAM's ``PINS=`` has its pin file and series in
``patches/vllm-V/`` (``patches/vllm-V/UPSTREAM``, ``patches/vllm-V/series``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

MANIFEST_NAME = "ddtree_series.json"
ORIG_DIR_NAME = ".ddtree_orig"
SERIES_FILE = "series"
PIN_FILE = "UPSTREAM"
PIN_DIR_PREFIX = "vllm-"

_VERSION_RE = re.compile(
    r"""^\s*__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.MULTILINE
)


class SeriesError(ValueError):
    """The patch directory or its series file is malformed."""


def series_names(patch_dir: str | os.PathLike[str]) -> list[str]:
    """Patch file names listed in ``patch_dir/series``, in order.

    One name per line; blank lines and lines starting with ``#`` are ignored. Raises
    SeriesError when the series file is missing, a name is listed twice, a name is not a
    plain file name, or a listed patch does not exist.
    """
    patch_dir = Path(patch_dir)
    series = patch_dir / SERIES_FILE
    if not series.is_file():
        raise SeriesError(f"{series}: series file not found")
    names: list[str] = []
    for lineno, raw in enumerate(series.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "/" in line or line in (".", "..") or any(c.isspace() for c in line):
            raise SeriesError(f"{series}:{lineno}: not a plain patch file name: {line!r}")
        if line in names:
            raise SeriesError(f"{series}:{lineno}: {line} is listed twice")
        if not (patch_dir / line).is_file():
            raise SeriesError(f"{series}:{lineno}: listed patch {line} does not exist")
        names.append(line)
    return names


def series_hash(patch_dir: str | os.PathLike[str]) -> str:
    """sha256 over the series file and then each listed patch, in series order.

    Each part is framed as ``name NUL length NUL bytes`` so that moving bytes between
    files, or renaming a patch, changes the hash.
    """
    patch_dir = Path(patch_dir)
    h = hashlib.sha256()
    parts = [SERIES_FILE] + series_names(patch_dir)
    for name in parts:
        data = (patch_dir / name).read_bytes()
        h.update(name.encode("utf-8") + b"\0" + str(len(data)).encode() + b"\0")
        h.update(data)
    return h.hexdigest()


def read_version_file(pkg_dir: str | os.PathLike[str]) -> str | None:
    """The ``__version__`` a vLLM package directory states, read without importing it.

    Looks at ``_version.py`` (written into wheels by vcs-versioning) and then
    ``version.py``; returns None when neither states a literal version.
    """
    for name in ("_version.py", "version.py"):
        path = Path(pkg_dir) / name
        if path.is_file():
            m = _VERSION_RE.search(path.read_text(encoding="utf-8", errors="replace"))
            if m:
                return m.group(1)
    return None


def version_matches(found: str, pinned: str) -> bool:
    """True for the pinned release itself or a local build of it (``0.26.0+cu130``)."""
    return found == pinned or found.split("+", 1)[0] == pinned


def read_pin_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """``KEY=VALUE`` lines of a pin file (``#`` comments and blank lines skipped)."""
    pins: dict[str, str] = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            pins[key.strip()] = value.strip()
    return pins


def supported_pins(repo: str | os.PathLike[str]) -> dict[str, tuple[Path, Path]]:
    """``{vLLM version: (pin file, patch dir)}``, the default pin (UPSTREAM) first."""
    repo = Path(repo)
    default = repo / PIN_FILE
    if not default.is_file():
        raise SeriesError(f"{default}: pin file not found")
    pins = read_pin_file(default)
    version = pins.get("VLLM_VERSION")
    if not version:
        raise SeriesError(f"{default} has no VLLM_VERSION=")
    out = {version: (default, repo / "patches")}
    for other in pins.get("PINS", "").split():
        if other not in out:
            pin_dir = repo / "patches" / f"{PIN_DIR_PREFIX}{other}"
            out[other] = (pin_dir / PIN_FILE, pin_dir)
    return out


def pin_for(repo: str | os.PathLike[str], version: str) -> tuple[str, Path, Path]:
    """``(pinned version, pin file, patch dir)`` of the pin serving vLLM ``version`` (a
    release or a local build of one); SeriesError naming every supported pin if none."""
    pins = supported_pins(repo)
    for pinned, (pin_file, patch_dir) in pins.items():
        if version_matches(version, pinned):
            if not pin_file.is_file():
                raise SeriesError(f"{pin_file}: pin file of vLLM {pinned} not found")
            return pinned, pin_file, patch_dir
    raise SeriesError(f"no series for vLLM {version}: the supported pins are "
                      + " and ".join(pins))


def file_sha256(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def vllm_package_dir() -> Path | None:
    """Directory of the vllm package Python would import, without importing it."""
    mod = sys.modules.get("vllm")
    if mod is not None and getattr(mod, "__file__", None):
        return Path(mod.__file__).resolve().parent
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).resolve()


def load_manifest(vllm_dir: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """The manifest next to the vllm package (or in ``vllm_dir``), or None if absent."""
    pkg = Path(vllm_dir) if vllm_dir is not None else vllm_package_dir()
    if pkg is None:
        return None
    path = pkg / MANIFEST_NAME
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or "series_sha256" not in data:
        raise ValueError(f"{path}: not a DDTree series manifest")
    return data


def describe(manifest: dict[str, Any] | None) -> str:
    if manifest is None:
        return "no DDTree patch series applied (no vllm/ddtree_series.json)"
    patches = manifest.get("patches") or []
    return (
        f"DDTree patch series {manifest['series_sha256'][:12]} applied to vLLM "
        f"{manifest.get('vllm_version')}: {len(patches)} patch(es)"
        + (f" ({', '.join(patches)})" if patches else "")
        + (f", series of pin {manifest['pin']}" if manifest.get("pin") else "")
        + f", vllm_ddtree {manifest.get('vllm_ddtree_version')}"
    )


def log_manifest(logger: Any, vllm_dir: str | os.PathLike[str] | None = None) -> dict | None:
    """Log which series this vLLM carries (info), or a warning when none; return it."""
    try:
        manifest = load_manifest(vllm_dir)
    except (OSError, ValueError) as e:
        logger.warning("DDTree series manifest unreadable: %s", e)
        return None
    if manifest is None:
        logger.warning("%s", describe(None))
    else:
        logger.info("%s", describe(manifest))
    return manifest


def package_version(pkg_dir: str | os.PathLike[str]) -> str | None:
    """``__version__`` of a vllm_ddtree source directory, read without importing it."""
    path = Path(pkg_dir) / "__init__.py"
    if not path.is_file():
        return None
    m = _VERSION_RE.search(path.read_text(encoding="utf-8"))
    return m.group(1) if m else None


def write_manifest(
    site: str | os.PathLike[str],
    patch_dir: str | os.PathLike[str],
    vllm_version: str,
    package_dir: str | os.PathLike[str] | None,
    modified: list[str],
    created: list[str],
    deleted: list[str],
    package_copy: bool,
    pin: str | None = None,
) -> dict[str, Any]:
    """Write ``site/vllm/ddtree_series.json`` atomically and return its content."""
    site = Path(site)
    data: dict[str, Any] = {
        "series_sha256": series_hash(patch_dir),
        "patches": series_names(patch_dir),
        "vllm_version": vllm_version,
        "vllm_ddtree_version": package_version(package_dir) if package_dir else None,
        "modified": sorted(modified),
        "created": sorted(created),
        "deleted": sorted(deleted),
        "patched_sha256": {p: file_sha256(site / p) for p in sorted(modified + created)},
        "package_copy": "vllm_ddtree" if package_copy else None,
        "pin": pin,
    }
    out = site / "vllm" / MANIFEST_NAME
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, out)
    return data


def changed_since_apply(site: str | os.PathLike[str], manifest: dict[str, Any]) -> list[str]:
    """Paths the series wrote whose content no longer matches what was written."""
    site = Path(site)
    changed = []
    for path, digest in sorted((manifest.get("patched_sha256") or {}).items()):
        p = site / path
        if not p.is_file() or file_sha256(p) != digest:
            changed.append(path)
    for path in manifest.get("deleted") or []:
        if (site / path).exists():
            changed.append(path)
    return changed


def _main(argv: list[str]) -> int:
    """Command line used by apply.sh; see ``--help``."""
    import argparse

    ap = argparse.ArgumentParser(prog="manifest.py", description=_main.__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("hash", help="print the series hash of PATCH_DIR")
    p.add_argument("patch_dir")
    p = sub.add_parser("names", help="print the patch names of PATCH_DIR, one a line")
    p.add_argument("patch_dir")
    p = sub.add_parser("vllm-version", help="print the version a vllm package dir states")
    p.add_argument("pkg_dir")
    p = sub.add_parser("version-matches", help="exit 0 if FOUND is the PINNED release")
    p.add_argument("found")
    p.add_argument("pinned")
    p = sub.add_parser("get", help="print a manifest field (lists: one item a line)")
    p.add_argument("manifest")
    p.add_argument("field")
    p = sub.add_parser("changed", help="print paths changed since the series was applied")
    p.add_argument("site")
    p = sub.add_parser("write", help="write SITE/vllm/ddtree_series.json")
    p.add_argument("site")
    p.add_argument("--patches", required=True)
    p.add_argument("--vllm-version", required=True)
    p.add_argument("--package-dir")
    p.add_argument("--package-copy", action="store_true")
    p.add_argument("--files", required=True,
                   help="file of 'M|A|D<TAB>path' lines (git diff --name-status)")
    p.add_argument("--pin", help="the pinned vLLM release whose series this is")
    p = sub.add_parser("pins", help="print the supported vLLM pins of REPO, default first")
    p.add_argument("repo")
    p = sub.add_parser("pin-for", help="print VERSION's pin: version, pin file, patch dir")
    p.add_argument("repo")
    p.add_argument("version")
    p = sub.add_parser("show", help="describe the manifest of the importable vllm")
    a = ap.parse_args(argv)

    try:
        if a.cmd == "hash":
            print(series_hash(a.patch_dir))
        elif a.cmd == "names":
            for n in series_names(a.patch_dir):
                print(n)
        elif a.cmd == "vllm-version":
            v = read_version_file(a.pkg_dir)
            if v is None:
                print(f"{a.pkg_dir}: no _version.py or version.py stating a version",
                      file=sys.stderr)
                return 1
            print(v)
        elif a.cmd == "version-matches":
            return 0 if version_matches(a.found, a.pinned) else 1
        elif a.cmd == "get":
            with open(a.manifest, encoding="utf-8") as f:
                value = json.load(f).get(a.field)
            if isinstance(value, list):
                for item in value:
                    print(item)
            elif value is not None:
                print(value)
        elif a.cmd == "changed":
            m = load_manifest(Path(a.site) / "vllm")
            for path in changed_since_apply(a.site, m or {}):
                print(path)
        elif a.cmd == "write":
            kinds: dict[str, list[str]] = {"M": [], "A": [], "D": []}
            for line in Path(a.files).read_text(encoding="utf-8").splitlines():
                if line.strip():
                    kind, path = line.split("\t", 1)
                    kinds[kind[0]].append(path)
            write_manifest(a.site, a.patches, a.vllm_version, a.package_dir,
                           kinds["M"], kinds["A"], kinds["D"], a.package_copy, a.pin)
        elif a.cmd == "pins":
            for version in supported_pins(a.repo):
                print(version)
        elif a.cmd == "pin-for":
            for item in pin_for(a.repo, a.version):
                print(item)
        elif a.cmd == "show":
            print(describe(load_manifest()))
    except (SeriesError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
