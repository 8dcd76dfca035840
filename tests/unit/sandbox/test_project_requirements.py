"""A local project folder as a session image's requirement (env.verifiers.package): accepted only inside the
sandbox's project root (its build code runs on the host), built into a wheel of the wheelhouse from a
copy, and the image tag follows the folder's files."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path
from types import SimpleNamespace

from services.sandbox.images import build_project_wheels, env_image_tag, package_error, project_digest
from tests.conftest import REPO_ROOT

EXAMPLE = REPO_ROOT / "examples" / "verifiers_env"


def client() -> SimpleNamespace:
    return SimpleNamespace(images=SimpleNamespace(get=lambda tag: SimpleNamespace(id="sha256:base")))


def test_the_tag_follows_a_folders_files_but_not_its_build_outputs(tmp_path: Path) -> None:
    folder = tmp_path / "env"
    shutil.copytree(EXAMPLE, folder)
    requirements = ["verifiers==0.4.0", str(folder)]
    tag = env_image_tag(client(), "base", requirements)
    digest = project_digest(folder)
    for junk in ("__pycache__/x.pyc", "build/lib/x.py", "x.egg-info/PKG-INFO", "dist/x.whl", ".git/HEAD", ".venv/x"):
        (folder / junk).parent.mkdir(parents=True, exist_ok=True)
        (folder / junk).write_text("junk")
    assert project_digest(folder) == digest and env_image_tag(client(), "base", requirements) == tag
    init = folder / "dockyard_verifiers_example" / "__init__.py"
    init.write_text(init.read_text() + "\n# changed\n")
    assert env_image_tag(client(), "base", requirements) != tag
    # A requirement of the index is hashed as its string, as before.
    assert env_image_tag(client(), "base", ["a==1"]) == env_image_tag(client(), "base", ["a==1", " a==1 "])


def test_a_folder_becomes_a_wheel_of_the_wheelhouse_and_stays_clean(tmp_path: Path) -> None:
    before = sorted(p.relative_to(EXAMPLE) for p in EXAMPLE.rglob("*") if "__pycache__" not in p.parts)
    [name] = build_project_wheels([str(EXAMPLE)], tmp_path)
    [wheel] = tmp_path.glob("*.whl")
    assert name == "dockyard_verifiers_example" and wheel.name.startswith("dockyard_verifiers_example-0.1.0-")
    assert "dockyard_verifiers_example/__init__.py" in zipfile.ZipFile(wheel).namelist()
    after = sorted(p.relative_to(EXAMPLE) for p in EXAMPLE.rglob("*") if "__pycache__" not in p.parts)
    assert after == before  # no build/, no .egg-info left in the project


def test_a_project_folder_is_accepted_only_inside_the_project_root(tmp_path: Path) -> None:
    root = tmp_path / "projects"
    (root / "env").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (root / "escape").symlink_to(tmp_path / "elsewhere")
    assert package_error(["verifiers==0.4.0", str(root / "env")], str(root)) is None
    assert "DOCKYARD_SANDBOX_PROJECT_ROOT, which is unset" in package_error([str(root / "env")], None)
    for outside in ("/", str(tmp_path / "elsewhere"), str(root / "env" / ".." / ".."), str(root / "escape")):
        assert "is outside DOCKYARD_SANDBOX_PROJECT_ROOT" in package_error([outside], str(root)), outside
    # Index packages need no root; options and blank lines are never requirements.
    assert package_error(["six==1.16.0"], None) is None
    assert "each must be a pip requirement" in package_error(["--index-url=http://x"], str(root))
