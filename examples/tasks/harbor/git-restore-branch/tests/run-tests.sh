#!/bin/bash
# Runs offline: pytest comes from the image's /opt/venv, already on PATH.
set -u
pytest "$TEST_DIR/test_outputs.py" -rA -p no:cacheprovider
