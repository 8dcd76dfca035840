"""A task's Dockerfile as dockyard builds it offline: FROM mapped, network steps served or refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dockyard.tasks.terminal import read_task
from services.sandbox.terminal_images import DockerfileError, translate, workdir_of
from tests.conftest import REPO_ROOT

SHIPPED = REPO_ROOT / "examples" / "tasks" / "terminal"


def task_with(tmp_path: Path, dockerfile: str, compose: str | None = None):
    folder = tmp_path / "t1"
    shutil.copytree(SHIPPED / "hello-file", folder)
    (folder / "Dockerfile").write_text(dockerfile)
    if compose is not None:
        (folder / "docker-compose.yaml").write_text(compose)
    return read_task(folder)


def test_from_is_mapped_and_the_session_layout_appended(tmp_path: Path) -> None:
    task = task_with(
        tmp_path,
        "FROM python:3.13-slim-bookworm AS base\nWORKDIR /app\nRUN echo hi > a.txt\n"
        'ENTRYPOINT ["/bin/app"]\nCMD ["x"]\n',
    )
    t = translate(task)
    lines = t.dockerfile.splitlines()
    assert lines[:3] == ["ARG BASE_IMAGE", "FROM ${BASE_IMAGE}", "USER root"]
    assert "python:3.13" not in t.dockerfile and '"/bin/app"' not in t.dockerfile
    assert "RUN echo hi > a.txt" in lines
    assert lines[-5:] == ["ENV TEST_DIR=/tests", "USER 1000:1000", "WORKDIR /work", "ENTRYPOINT []", 'CMD ["python3"]']
    assert "ln -s /work /app" in t.dockerfile and workdir_of(t) == "/app" and t.requirements == ()


def test_pip_installs_are_served_from_the_wheelhouse(tmp_path: Path) -> None:
    task = task_with(
        tmp_path, "FROM x\nWORKDIR /srv/app\nRUN pip install numpy==2.1.0 && python3 -m pip install -q six\n"
    )
    t = translate(task)
    assert t.requirements == ("numpy==2.1.0", "six")
    assert t.dockerfile.count("--no-index --find-links /tmp/dockyard-wheels") == 2
    assert workdir_of(t) == "/srv/app"


@pytest.mark.parametrize(
    ("dockerfile", "words"),
    [
        ("FROM x\nWORKDIR /app\nRUN apt-get update && apt-get install -y tmux\n", "line 3: 'apt-get update': apt"),
        ("FROM x\nWORKDIR /app\nRUN \\\n  curl -LsSf https://example.com/x.sh | sh\n", "line 3: .*curl"),
        ("FROM x\nWORKDIR /app\nRUN git clone https://example.com/r.git\n", "git clone"),
        ("FROM x\nWORKDIR /app\nRUN pip install -r requirements.txt\n", "no -r"),
        ("FROM x\nWORKDIR /app\nADD https://example.com/f.tgz /app/\n", "ADD of a URL"),
        ("FROM x AS a\nFROM y\nWORKDIR /app\n", "several stages"),
        ("FROM x\nRUN true\n", "set a WORKDIR"),
        ("FROM x\nWORKDIR /app\nVOLUME /data\n", "VOLUME"),
        ("RUN true\n", "before FROM"),
    ],
)
def test_what_cannot_be_built_offline_is_refused_with_its_line(tmp_path: Path, dockerfile: str, words: str) -> None:
    with pytest.raises(DockerfileError, match=words):
        translate(task_with(tmp_path, dockerfile))


def test_compose_must_be_one_client_service_and_gives_its_environment(tmp_path: Path) -> None:
    compose = (
        "services:\n  client:\n    build: {dockerfile: Dockerfile}\n"
        "    environment:\n      - TEST_DIR=${T}\n      - MODE=strict\n"
    )
    assert "ENV MODE=strict" in translate(task_with(tmp_path, "FROM x\nWORKDIR /app\n", compose)).dockerfile
    two = "services:\n  client: {}\n  db: {}\n"
    with pytest.raises(DockerfileError, match="one service named `client`"):
        translate(task_with(tmp_path / "b", "FROM x\nWORKDIR /app\n", two))


def test_a_harbor_task_builds_from_its_environment_folder_with_the_same_layout(tmp_path: Path) -> None:
    """A task's two forms share their image; /logs and /solution (Harbor's verifier and oracle folders)
    are links into /tmp, since the root file system is read-only at run time."""
    from dockyard.tasks.harbor import read_harbor_task
    from services.sandbox.terminal_images import _context_files

    harbor = read_harbor_task(SHIPPED.parent / "harbor" / "fix-mean")
    terminal = read_task(SHIPPED / "fix-mean")
    assert translate(harbor) == translate(terminal)
    assert _context_files(harbor) == _context_files(terminal)
    assert "ln -s /tmp/dockyard-logs /logs" in translate(harbor).dockerfile
    assert "ln -s /tmp/dockyard-solution /solution" in translate(harbor).dockerfile
    folder = tmp_path / "h1"
    shutil.copytree(SHIPPED.parent / "harbor" / "hello-file", folder)
    (folder / "environment" / "data.csv").write_text("a,b\n")
    (folder / "environment" / "Dockerfile").write_text("FROM x\nWORKDIR /app\nCOPY data.csv /app/\n")
    assert [str(p) for p in _context_files(read_harbor_task(folder))] == ["data.csv"]
