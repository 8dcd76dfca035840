"""A real external scaffold that crashes before its first model call fails its trials, not the job.

`dockyard run` of the tiny external recipe (the five services and the policy endpoint as processes,
the sandbox on the docker backend), with a scaffold that is a shell line in the confined session
container: on the step's first task it writes to stderr and exits 3 before calling the model (the
endpoint never sees its session); on the other it calls the endpoint once with Python's own urllib
and writes the reply to the answer file. Half of the step's trials fail, not more than
`env.scaffold.max_error_fraction=0.5`: the job SUCCEEDS, the step counts `scaffold_errors`, the
failed trials' stderr reaches samples.jsonl and their group is a failed one in groups.jsonl.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from dockyard.config import load_config
from services.coordinator.task_stream import TaskStream, load_tasks
from tests.conftest import REPO_ROOT
from tests.e2e.conftest import DOCKYARD

# The sandbox image may be built first (deploy/images/build.sh), then a whole `dockyard run` (about 4 min here).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CONFIG = REPO_ROOT / "examples" / "configs" / "tiny_agent_external.yaml"
CALL_THE_MODEL = """python3 - <<'PY'
import json, os, urllib.request
body = {"model": os.environ["DOCKYARD_MODEL"], "max_tokens": int(os.environ["DOCKYARD_MAX_NEW_TOKENS"]),
        "messages": [{"role": "user", "content": os.environ["DOCKYARD_TASK"]}]}
request = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=json.dumps(body).encode(),
    headers={"authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "content-type": "application/json"})
reply = json.load(urllib.request.urlopen(request, timeout=240))
open("answer.txt", "w").write(reply["choices"][0]["message"]["content"] or "")
PY"""


def test_a_scaffold_that_crashes_on_some_trials_leaves_them_masked_and_the_job_succeeds(
    tmp_path: Path, docker_sandbox_image: str
) -> None:
    overrides = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "data.train.size=4"]
    config = load_config(CONFIG, overrides)
    first = next(TaskStream(load_tasks(config, "train"), config.grpo.seed))
    fingerprint = dict(first.files)["f.py"]
    raw = yaml.safe_load(CONFIG.read_text())
    raw["env"]["scaffold"] = {
        "package": None,  # the sandbox image's own python3
        "answer_file": "answer.txt",
        "max_error_fraction": 0.5,
        "command": (
            f'if [ "$(sha256sum f.py | cut -c1-64)" = "{_sha256(fingerprint)}" ]; then\n'
            "  echo 'scaffold: cannot start: no model configured' >&2; exit 3\nfi\n" + CALL_THE_MODEL
        ),
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    runs = tmp_path / "runs"
    seconds = 240  # a cold session container and one model call on a busy 2-core machine
    result = subprocess.run(
        [
            str(DOCKYARD),
            "run",
            "--prepare",
            str(path),
            f"policy.model_name={tmp_path / 'model'}",
            "policy.bootstrap.steps=1",
            f"logger.log_dir={runs}",
            "grpo.max_num_steps=1",
            "grpo.val_at_start=false",
            "grpo.val_at_end=false",
            f"grpo.max_trial_seconds={seconds}",
            f"env.sandbox.timeout_seconds={seconds}",
            f"env.sandbox.cpu_seconds={seconds}",
            "data.validation.size=1",
            *overrides,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=800,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "DOCKYARD_SANDBOX_BACKEND": "docker"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [run_dir] = [p for p in runs.iterdir() if p.name != "logs"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    [train] = [r for r in records if r["kind"] == "train"]
    print(json.dumps({k: v for k, v in train.items() if k.startswith(("agent_", "scaffold", "invalid", "num_"))}))
    assert train["scaffold_errors"] == 2, train  # both trials of the first task
    assert train["agent_trials"] == 2, train  # both of the other's were scored
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    failed = [s for s in samples if s["verdict"] == "scaffold_error"]
    assert len(failed) == 2
    assert all("cannot start: no model configured" in s["scaffold_output"] for s in failed), failed
    assert all("exited with status 3" in s["error"] for s in failed), failed
    groups = [json.loads(line) for line in (run_dir / "groups.jsonl").read_text().splitlines()]
    assert sorted(g["outcome"] for g in groups) == ["failed", "put"], groups


def _sha256(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()
