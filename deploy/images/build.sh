#!/usr/bin/env bash
# Build every image offline, skipping what is up to date:
#   dockyard/sandbox-base:bookworm  (debootstrap minbase + docker import; needs root and a Debian mirror)
#   dockyard/sandbox:latest         (deploy/images/sandbox/Dockerfile: the image sandbox tasks run in)
#   dockyard/{coordinator,trainer,rollout,endpoint,buffer,sandbox-service,redis}:latest  (deploy/images/<fleet>/Dockerfile)
# Wheels come from `pip download` on the host into a wheelhouse; the builds run with --network none.
# Options go to the sandbox step: --base-image, --image, --mirror, --wheelhouse (services/sandbox/images.py).
# FLEETS=trainer,buffer builds a subset of the service images; FLEETS= builds none of them.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
"$PYTHON" -m services.sandbox.images "$@"
if [ -n "${FLEETS-coordinator,trainer,rollout,endpoint,buffer,sandbox-service,redis}" ]; then
  "$PYTHON" deploy/images/fleet.py --only "${FLEETS-coordinator,trainer,rollout,endpoint,buffer,sandbox-service,redis}"
fi
