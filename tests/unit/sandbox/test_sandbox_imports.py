"""The sandbox service runs in an image without the config package's dependencies (deploy/images/fleet.py:
sandbox-service is base.txt + sandbox.txt): its modules must import without omegaconf, and the one rule it
shares with the config (what a local project folder requirement is) must agree with the config's."""

from __future__ import annotations

import subprocess
import sys

from dockyard.config.verifiers import is_project_folder as config_rule
from services.sandbox.images import is_project_folder as sandbox_rule


def test_the_sandbox_service_imports_without_omegaconf() -> None:
    modules = ["services.sandbox.__main__", "services.sandbox.servicer", "services.sandbox.docker_backend"]
    code = "import sys; sys.modules['omegaconf'] = None; import " + ", ".join([*modules, "services.sandbox.local"])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_sandbox_and_the_config_agree_on_project_folders() -> None:
    for requirement in ["./env", "../env", "/abs/env", "verifiers==0.4.0", "my-env>=1", "env", ".hidden"]:
        assert sandbox_rule(requirement) == config_rule(requirement), requirement
