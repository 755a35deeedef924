#!/usr/bin/env python3
"""Check that the patch series is applied to the vLLM this Python imports.

Run after `apply.sh --site DIR` (the Dockerfile does; so can anyone on a host). It checks:

* vLLM imports and is the pinned version (--vllm-version);
* vllm_ddtree imports from the same site directory as vllm, not from a source tree
  that happens to be on sys.path;
* vllm_ddtree.manifest.load_manifest() returns the manifest apply.sh wrote, with a
  sha256 series hash, a non-empty patch list and versions matching what is imported;
* each module given with --import imports (so the patched files at least load).

Prints one line on success. With --print-labels it prints `key=value` lines instead,
for tools/build-image.sh to turn into image labels. Exit status 1 names the problem.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MANIFEST_KEYS = ("series_sha256", "patches", "vllm_version", "vllm_ddtree_version")


class InstallError(Exception):
    pass


def _field(manifest: Any, key: str) -> Any:
    if isinstance(manifest, Mapping):
        if key not in manifest:
            raise InstallError(f"manifest has no '{key}' (keys: {sorted(manifest)})")
        return manifest[key]
    if not hasattr(manifest, key):
        raise InstallError(f"manifest {type(manifest).__name__} has no '{key}'")
    return getattr(manifest, key)


def check(expected_vllm_version: str, imports: list[str]) -> dict[str, str]:
    try:
        import vllm
    except Exception as exc:  # any failure to import the patched package is the finding
        raise InstallError(f"import vllm failed: {exc!r}") from exc
    if vllm.__version__ != expected_vllm_version:
        raise InstallError(f"vLLM is {vllm.__version__}, expected the pinned {expected_vllm_version}")
    site = Path(vllm.__file__).resolve().parent.parent

    try:
        import vllm_ddtree
        import vllm_ddtree.manifest as manifest_module
    except Exception as exc:
        raise InstallError(f"import vllm_ddtree failed (did apply.sh --site {site} run?): {exc!r}") from exc
    ddtree_site = Path(vllm_ddtree.__file__).resolve().parent.parent
    if ddtree_site != site:
        raise InstallError(f"vllm_ddtree is imported from {ddtree_site}, not from vLLM's site {site}")

    try:
        manifest = manifest_module.load_manifest()
    except Exception as exc:
        raise InstallError(f"load_manifest() failed: {exc!r}") from exc
    if manifest is None:
        raise InstallError(f"no series manifest: the patch series is not applied to {site / 'vllm'}")
    values = {key: _field(manifest, key) for key in MANIFEST_KEYS}
    if not isinstance(values["series_sha256"], str) or not re.fullmatch(r"[0-9a-f]{64}", values["series_sha256"]):
        raise InstallError(f"manifest series_sha256 is not a sha256 hex digest: {values['series_sha256']!r}")
    if not values["patches"] or isinstance(values["patches"], str):
        raise InstallError(f"manifest patches must be a non-empty list, got {values['patches']!r}")
    if values["vllm_version"] != vllm.__version__:
        raise InstallError(f"manifest says vLLM {values['vllm_version']}, but {vllm.__version__} is installed")
    if values["vllm_ddtree_version"] != vllm_ddtree.__version__:
        raise InstallError(
            f"manifest says vllm_ddtree {values['vllm_ddtree_version']}, "
            f"but {vllm_ddtree.__version__} is installed"
        )

    for name in imports:
        try:
            importlib.import_module(name)
        except Exception as exc:
            raise InstallError(f"import {name} failed: {exc!r}") from exc

    return {
        "series_sha256": values["series_sha256"],
        "patch_count": str(len(values["patches"])),
        "vllm_version": values["vllm_version"],
        "vllm_ddtree_version": values["vllm_ddtree_version"],
        "site": str(site),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-version", required=True, help="the pinned vLLM version (UPSTREAM's VLLM_VERSION)")
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="also import MODULE (repeatable)")
    parser.add_argument("--print-labels", action="store_true", help="print key=value lines instead of a summary")
    args = parser.parse_args(argv)
    try:
        info = check(args.vllm_version, args.imports)
    except InstallError as exc:
        print(f"check_install: error: {exc}", file=sys.stderr)
        return 1
    if args.print_labels:
        for key, value in info.items():
            print(f"{key}={value}")
    else:
        print(f"vllm-ddtree install OK: vLLM {info['vllm_version']}, vllm_ddtree {info['vllm_ddtree_version']}, "
              f"series {info['series_sha256'][:12]} ({info['patch_count']} patches) in {info['site']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
