#!/usr/bin/env bash
# Create .venv at the repo root with a Python 3.12 found on this machine, and install jaxgrad[dev] into it.
# JAX 0.11 needs Python >= 3.12; the system python3 may be older, so we look for one ourselves.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

is_312() { "$1" -c 'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 12) else 1)' 2>/dev/null; }

find_python() {
  local c
  for c in "${JAXGRAD_PYTHON:-}" python3.12 python3.13 python3; do
    [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && is_312 "$(command -v "$c")" && { command -v "$c"; return; }
  done
  local root="${PYENV_ROOT:-$HOME/.pyenv}"
  command -v pyenv >/dev/null 2>&1 && root="$(pyenv root)"
  for c in "$root"/versions/3.12*/bin/python3.12 "$root"/versions/3.13*/bin/python3.13 \
           /usr/local/bin/python3.12 /usr/bin/python3.12; do
    [ -x "$c" ] && is_312 "$c" && { echo "$c"; return; }
  done
  return 1
}

# On a machine whose nvidia-smi lists a GPU, also install JAX's CUDA build (the [cuda] extra: jax[cuda13] at the
# pinned version), as JAX users do; JAXGRAD_CUDA=0 skips it, JAXGRAD_CUDA=1 forces it.
extras="dev"
if [ "${JAXGRAD_CUDA:-auto}" = "1" ] || { [ "${JAXGRAD_CUDA:-auto}" = "auto" ] && command -v nvidia-smi >/dev/null 2>&1 \
     && nvidia-smi -L 2>/dev/null | grep -q "^GPU "; }; then
  extras="dev,cuda"
  echo "setup: a GPU is present (nvidia-smi): installing the [cuda] extra (jax[cuda13]); JAXGRAD_CUDA=0 skips it"
fi
if [ -n "${JAXGRAD_SETUP_DRY_RUN:-}" ]; then  # for tests: say what would be installed, change nothing
  echo "setup: would install: pip install -e .[$extras]"
  exit 0
fi

if [ ! -x .venv/bin/python ] || ! is_312 .venv/bin/python; then
  PY="$(find_python)" || { echo "setup: no Python >= 3.12 found (tried PATH, pyenv, /usr/local/bin); set JAXGRAD_PYTHON=/path/to/python3.12" >&2; exit 1; }
  echo "setup: creating .venv with $PY ($("$PY" --version))"
  rm -rf .venv
  "$PY" -m venv .venv
fi
# pip, quiet, minus two kinds of noise that say nothing about this project (anything else, errors included, shows):
# * "WARNING: Location 'file:///.../simple/<name>/' is ignored: it is neither a file nor a directory." -- once per
#   package, on machines whose pip configuration lists a local file:// index that lacks that package;
# * setuptools' "Editable installation ... be careful with folders in your working directory with the same name as
#   your package ..." -- a ten-line BuildBackendWarning that pip relays from the build backend on every
#   `pip install -e`; silenced with PYTHONWARNINGS, which pip hands on to the build backend.
# pip's exit status is kept (pipefail): a failed install stops the set-up.
pip_quiet() {
  PYTHONWARNINGS="ignore:Editable installation" .venv/bin/python -m pip "$@" 2>&1 \
    | { grep -v -E "^WARNING: Location '[^']*' is ignored: it is neither a file nor a directory\.$" || true; }
}
pip_quiet install -q --upgrade pip
pip_quiet install -q -e ".[$extras]"
.venv/bin/python -c "import jax, jaxgrad; print('setup: jax', jax.__version__, 'on', jax.default_backend(), '| jaxgrad', jaxgrad.__version__)"
