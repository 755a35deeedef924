#!/usr/bin/env bash
# Create .venv-lint/ with the linters of requirements-lint.txt (hadolint, checkov,
# yamllint, kubernetes-validate, shellcheck, actionlint). tests/deploy run them from
# there. A separate environment because checkov's pins conflict with vLLM's .venv.
#   tools/setup-lint-venv.sh [PYTHON]     (default: python3)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${1:-python3}
venv="$root/.venv-lint"
stamp="$venv/.requirements-lint.sha256"
want=$(sha256sum "$root/requirements-lint.txt" | cut -d' ' -f1)
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
    echo "setup-lint-venv: $venv is up to date"
    exit 0
fi
rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --no-cache-dir --disable-pip-version-check -r "$root/requirements-lint.txt"
"$venv/bin/python" -m pip check
printf '%s\n' "$want" >"$stamp"
echo "setup-lint-venv: installed requirements-lint.txt into $venv"
