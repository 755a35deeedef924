#!/usr/bin/env python3
"""Derive the pinned packages a pin's GPU runtime must carry beyond the GPU host.

Walks the runtime requirements (Requires-Dist, markers evaluated for Linux x86_64,
CPython 3.12, with the extras asked for) of the vLLM wheel and of the packages the
runtime ships anyway (--ship, e.g. torch and triton), recursively. A requirement is
served by the host when host-packages.txt has the package at a version that satisfies
it; otherwise the package must travel: at the first --prefer pin that satisfies it, else
at the newest version `pip download` finds; its own requirements are walked in turn.
Packages in --skip travel never (each with its reason; see skip-*.txt).

  python3 tools/gpu-runtime/derive_requirements.py --vllm-wheel W --host HOST.txt \
      --ship torch==2.14.0 ... --skip SKIP.txt [--prefer FREEZE.txt ...] \
      --wheels DIR > requirements-gpu-host-V.txt

Writes the pinned list (one `name==version` a line, each with what asked for it and
what the host has) to stdout, and the served / skipped decisions to stderr.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # pip always vendors it
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import Version

# The GPU host: Linux x86_64, CPython 3.12 (Ubuntu 24.04's 3.12.3).
ENV = {
    "python_version": "3.12", "python_full_version": "3.12.3", "os_name": "posix",
    "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
    "platform_python_implementation": "CPython", "implementation_name": "cpython",
    "implementation_version": "3.12.3", "platform_release": "", "platform_version": "",
}

PLAT = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
for _g in (5, 12, 17, 18, 24, 26, 27, 28, 31, 34):
    PLAT += ["--platform", f"manylinux_2_{_g}_x86_64"]
PLAT += ["--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64"]


def read_pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, ver = line.split("==", 1)
            pins[canonicalize_name(name.split("[")[0])] = ver.strip()
    return pins


def read_skip(path: Path) -> dict[str, str]:
    skip = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, why = line.partition("#")
            skip[canonicalize_name(name.strip())] = why.strip()
    return skip


def wheel_name_version(path: Path) -> tuple[str, str]:
    name, ver = path.name.split("-")[:2]
    return canonicalize_name(name), ver


def wheel_requires(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist()
                    if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        msg = Parser().parsestr(z.read(meta).decode())
    return msg.get_all("Requires-Dist") or []


def applies(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**ENV, "extra": e}) for e in (extras or {""}))


def find_wheel(wheels: Path, name: str, version: str | None) -> Path | None:
    for w in sorted(wheels.glob("*.whl")):
        n, v = wheel_name_version(w)
        if n == name and (version is None or Version(v) == Version(version)):
            return w
    return None


def download(wheels: Path, spec: str) -> Path:
    before = set(wheels.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLAT,
           "-d", str(wheels), spec]
    subprocess.run(cmd, check=True, env={**__import__("os").environ, "PIP_CONSTRAINT": ""})
    new = set(wheels.glob("*.whl")) - before
    name = canonicalize_name(Requirement(spec).name)
    for w in new or wheels.glob("*.whl"):
        if wheel_name_version(w)[0] == name:
            if not new and not Requirement(spec).specifier.contains(wheel_name_version(w)[1], True):
                continue
            return w
    raise SystemExit(f"pip download {spec}: no wheel for {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-wheel", type=Path, required=True)
    ap.add_argument("--host", type=Path, required=True, help="the host's `pip list --format=freeze`")
    ap.add_argument("--ship", action="append", default=[], help="name==version the runtime carries anyway")
    ap.add_argument("--skip", type=Path, help="packages that never travel: `name  # reason` a line")
    ap.add_argument("--prefer", type=Path, action="append", default=[], help="pins to prefer, in order")
    ap.add_argument("--wheels", type=Path, required=True, help="wheel cache (downloads land here)")
    args = ap.parse_args()

    host = read_pins(args.host)
    skip = read_skip(args.skip) if args.skip else {}
    prefer = [read_pins(p) for p in args.prefer]
    args.wheels.mkdir(parents=True, exist_ok=True)

    shipped: dict[str, str] = {}          # name -> version, travels
    why: dict[str, list[str]] = {}        # name -> "asked-by: spec"
    log: list[str] = []
    queue: list[tuple[str, str, set[str]]] = []   # (parent, requirement, parent's extras)

    def enqueue_from(parent: str, wheel: Path, extras: set[str]) -> None:
        for r in wheel_requires(wheel):
            queue.append((parent, r, extras))

    v_name, v_ver = wheel_name_version(args.vllm_wheel)
    enqueue_from(f"{v_name}=={v_ver}", args.vllm_wheel, set())
    fixed = {}
    for spec in args.ship:
        r = Requirement(spec)
        n, ver = canonicalize_name(r.name), str(r.specifier).lstrip("=")
        fixed[n] = ver
        shipped[n] = ver
        why.setdefault(n, []).append("shipped by the builder")
        w = find_wheel(args.wheels, n, ver) or download(args.wheels, spec)
        enqueue_from(f"{n}=={ver}", w, set())

    walked: set[tuple[str, frozenset[str]]] = set()
    while queue:
        parent, text, parent_extras = queue.pop(0)
        req = Requirement(text)
        if not applies(req, parent_extras):
            continue
        name = canonicalize_name(req.name)
        extras = {canonicalize_name(e) for e in req.extras}
        asked = f"{parent}: {req.name}{req.specifier}" + (f" [{','.join(sorted(extras))}]" if extras else "")
        if name in skip:
            log.append(f"skip   {asked}   host: {host.get(name, '-')}   ({skip[name]})")
            continue
        if name in shipped:
            if not req.specifier.contains(shipped[name], prereleases=True):
                raise SystemExit(f"conflict: {asked} but {name}=={shipped[name]} ships")
            why.setdefault(name, []).append(asked)
            if extras and (name, frozenset(extras)) not in walked:
                walked.add((name, frozenset(extras)))
                enqueue_from(f"{name}=={shipped[name]}", find_wheel(args.wheels, name, shipped[name]), extras)
            continue
        if name in host and req.specifier.contains(host[name], prereleases=True):
            log.append(f"host   {asked}   host: {host[name]}")
            continue
        version = next((p[name] for p in prefer
                        if name in p and req.specifier.contains(p[name], prereleases=True)), None)
        spec = f"{req.name}=={version}" if version else f"{req.name}{req.specifier}"
        wheel = (find_wheel(args.wheels, name, version) if version else None) or download(args.wheels, spec)
        shipped[name] = wheel_name_version(wheel)[1]
        why.setdefault(name, []).append(asked + f"   (host: {host.get(name, 'none')})")
        walked.add((name, frozenset(extras)))
        enqueue_from(f"{name}=={shipped[name]}", wheel, extras)

    for line in sorted(set(log)):
        print(line, file=sys.stderr)
    for name in sorted(shipped):
        print(f"{name}=={shipped[name]}  # {'; '.join(why[name][:2])}")


if __name__ == "__main__":
    main()
