"""Which work folders the start-time reaper removes: a dead owner's of this host, nothing else."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from services.sandbox.docker_container import owner_label
from services.sandbox.work_folders import OWNER_SUFFIX, PREFIX, WorkFolders, reap_dead_work_folders


def _claim(root: Path, token: str, owner: str, folders: int = 2) -> list[Path]:
    (root / f"{PREFIX}{token}{OWNER_SUFFIX}").write_text(owner)
    made = [root / f"{PREFIX}{token}-f{i}" for i in range(folders)]
    for folder in made:
        (folder / "sub").mkdir(parents=True)
        (folder / "sub" / "file").write_text("x")
    return made


def test_only_a_dead_owners_folders_of_this_host_are_removed(tmp_path: Path) -> None:
    host, pid = socket.gethostname(), os.getpid()
    dead = _claim(tmp_path, "a" * 16, f"{host}/{pid}/0")  # this pid, another start time: a predecessor
    alive = _claim(tmp_path, "b" * 16, owner_label())
    elsewhere = _claim(tmp_path, "c" * 16, f"not-{host}/{pid}/0")
    ownerless = tmp_path / f"{PREFIX}d-legacy"
    ownerless.mkdir()
    assert reap_dead_work_folders(str(tmp_path)) == 2
    assert not any(folder.exists() for folder in dead)
    assert not (tmp_path / f"{PREFIX}{'a' * 16}{OWNER_SUFFIX}").exists()
    assert all(folder.is_dir() for folder in alive + elsewhere + [ownerless])


def test_a_folder_is_made_only_once_its_owner_is_named_and_close_forgets_the_owner(tmp_path: Path) -> None:
    folders = WorkFolders(str(tmp_path))
    work = Path(folders.make())
    owner_files = list(tmp_path.glob(f"*{OWNER_SUFFIX}"))
    assert [f.read_text() for f in owner_files] == [owner_label()]
    assert work.name.startswith(owner_files[0].name.removesuffix(OWNER_SUFFIX) + "-")
    assert oct(work.stat().st_mode & 0o777) == "0o700"
    folders.close()
    assert owner_files[0].exists()  # a folder is left: its owner stays named, so a later start can judge it
    work.rmdir()
    folders.close()
    assert not owner_files[0].exists()
