"""A row's image cannot reach the sandbox host's files through the start tree made from it: hard links out
of the tree are refused at untar, held-out paths through a symbolic link are refused, and nothing of a
held-out test (its bytecode, pytest's cache) stays in the tree."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from services.sandbox.swe_formats import PrebuiltEnv
from services.sandbox.swe_image_trees import ImageTreeError, build_tree


class _Container:
    def __init__(self, archives: dict[str, bytes]) -> None:
        self.archives = archives

    def get_archive(self, folder: str):
        return iter([self.archives[folder]]), {}

    def remove(self, force: bool) -> None:
        pass


class _Client:
    """The docker client calls build_tree makes: create a container of an image, read a folder's archive."""

    def __init__(self, archives: dict[str, bytes]) -> None:
        self.containers = self
        self.archives = archives

    def create(self, image: str, command: list[str]) -> _Container:
        return _Container(self.archives)


def _archive(*members: tuple[str, str, str]) -> bytes:
    """A docker get_archive stream: (kind, name, data or link target) with kind file, dir, symlink or hardlink."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for kind, name, value in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                info.size = len(value.encode())
                tar.addfile(info, io.BytesIO(value.encode()))
                continue
            info.type = {"dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE}[kind]
            info.mode = 0o755
            info.linkname = value
            tar.addfile(info)
    return buffer.getvalue()


def _env(**fields) -> PrebuiltEnv:
    return PrebuiltEnv(image="row/image:latest", repo_dir="/repo", env_bin="/usr/bin", start="image", **fields)


@pytest.fixture
def host_file(tmp_path: Path) -> Path:
    """A file of the host's that an image names."""
    secret = tmp_path / "host" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("host only\n")
    return secret


def test_a_hard_link_to_a_host_file_is_refused(tmp_path: Path, host_file: Path) -> None:
    client = _Client({"/repo": _archive(("dir", "repo", ""), ("hardlink", "repo/leak.txt", str(host_file)))})
    with pytest.raises(ImageTreeError, match="instance 'i1'.*copy /repo out of"):
        build_tree(client, "row/image:latest", "i1", _env(), tmp_path / "tree")
    assert not (tmp_path / "tree").exists()
    assert host_file.stat().st_nlink == 1  # no link to it was made anywhere


def test_a_relative_hard_link_out_of_the_tree_is_refused(tmp_path: Path, host_file: Path) -> None:
    escape = "../" * 12 + str(host_file).lstrip("/")
    client = _Client({"/repo": _archive(("dir", "repo", ""), ("hardlink", "repo/leak.txt", escape))})
    with pytest.raises(ImageTreeError):
        build_tree(client, "row/image:latest", "i1", _env(), tmp_path / "tree")
    assert host_file.stat().st_nlink == 1


def test_a_held_out_path_through_a_symbolic_link_leaves_the_host_untouched(tmp_path: Path, host_file: Path) -> None:
    client = _Client({"/repo": _archive(("dir", "repo", ""), ("symlink", "repo/tests", str(host_file.parent)))})
    with pytest.raises(ImageTreeError, match="passes through the symbolic link tests"):
        build_tree(client, "row/image:latest", "i1", _env(held_out=("tests/secret.txt",)), tmp_path / "tree")
    assert host_file.read_text() == "host only\n"


def test_a_repository_folder_that_is_a_link_is_refused(tmp_path: Path, host_file: Path) -> None:
    client = _Client({"/repo": _archive(("symlink", "repo", str(host_file.parent)))})
    with pytest.raises(ImageTreeError, match="symbolic link in the image"):
        build_tree(client, "row/image:latest", "i1", _env(), tmp_path / "tree")
    assert host_file.read_text() == "host only\n"


def test_links_inside_the_tree_are_kept_and_held_out_tests_leave_no_trace(tmp_path: Path) -> None:
    client = _Client(
        {
            "/repo": _archive(
                ("dir", "repo", ""),
                ("file", "repo/pkg.py", "def add(a, b):\n    return a + b\n"),
                ("hardlink", "repo/pkg_copy.py", "repo/pkg.py"),
                ("symlink", "repo/python", "/usr/bin/python3"),
                ("file", "repo/tests/test_add.py", "def test_add():\n    assert True\n"),
                ("file", "repo/tests/__pycache__/test_add.cpython-311-pytest-8.pyc", "compiled"),
                ("file", "repo/tests/__pycache__/conftest.cpython-311.pyc", "kept"),
                ("file", "repo/.pytest_cache/v/cache/nodeids", '["tests/test_add.py::test_add"]'),
            )
        }
    )
    patch = build_tree(client, "row/image:latest", "i1", _env(held_out=("tests/test_add.py",)), tmp_path / "tree")
    tree = tmp_path / "tree"
    assert "b/tests/test_add.py" in patch and "+def test_add():" in patch
    assert not (tree / "tests" / "test_add.py").exists()
    assert [p.name for p in (tree / "tests" / "__pycache__").iterdir()] == ["conftest.cpython-311.pyc"]
    assert not (tree / ".pytest_cache").exists()
    assert (tree / "python").is_symlink() and str((tree / "python").readlink()) == "/usr/bin/python3"
    assert (tree / "pkg_copy.py").read_text() == (tree / "pkg.py").read_text()
