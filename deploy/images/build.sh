#!/usr/bin/env bash
# Build the sandbox images offline, skipping what already exists:
#   dockyard/sandbox-base:bookworm  (debootstrap minbase + docker import; needs root and a Debian mirror)
#   dockyard/sandbox:latest         (deploy/images/sandbox/Dockerfile, wheels from `pip download`)
# Options: --base-image, --image, --mirror, --wheelhouse (see services/sandbox/images.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
exec "$PYTHON" -m services.sandbox.images "$@"
