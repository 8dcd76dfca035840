"""Prebuilt SWE images on a real docker engine: found locally without a pull, refused by instance and image
when neither present nor pullable (no registry answers here), and a SWE-rebench row scored end to end in
its image (the sandbox image tagged under the row's docker_image): the gold patch resolves, an empty or
irrelevant one does not; the row's image and the run image fitted on it in the image cache, the row's kept
while the fitted one is."""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path

import pytest

from services.sandbox.backend import ResourceLimits
from services.sandbox.images import SANDBOX_IMAGE
from services.sandbox.settings import SandboxSettings
from services.sandbox.swe import SweScorer, TaskSets
from services.sandbox.swe_formats import REPO_DIR, PrebuiltEnv
from services.sandbox.swe_prebuilt import PrebuiltImageError, ensure_prebuilt, resolve
from services.sandbox.task_set_check import check
from tests.conftest import missing, require_docker, require_tool
from tests.unit.sandbox.swe_repo import TEST_FILE, make_task_set

LIMITS = ResourceLimits(timeout_seconds=120, memory_mb=1024, cpu_seconds=120, max_output_bytes=16384)
DEAD_REGISTRY = "127.0.0.1:9"  # nothing listens there: a pull is refused at once


@pytest.fixture
def client():
    require_docker()
    import docker
    import docker.errors

    engine = docker.from_env(timeout=120)
    try:
        engine.images.get(SANDBOX_IMAGE)
    except docker.errors.ImageNotFound:
        missing(f"{SANDBOX_IMAGE} is not built (deploy/images/build.sh)")
    return engine


@pytest.fixture
def tagged(client):
    """Tags the sandbox image under names a test gives (unless the name exists); removes them afterwards."""
    names: list[str] = []

    def tag(name: str) -> str:
        repository, _, version = name.rpartition(":")
        if name != SANDBOX_IMAGE and not client.images.list(name=name):
            client.images.get(SANDBOX_IMAGE).tag(repository, tag=version)
        names.append(name)
        return name

    yield tag
    for name in names:
        client.images.remove(name, noprune=True)


def editable_at_testbed(client, name: str) -> str:
    """The sandbox image plus a .pth naming /testbed (as SWE-bench's images install the repository
    editable there), built offline and tagged `name`: the code under test imports from /testbed only."""
    import io

    # The label makes the image's id this name's own: a build cache hit would otherwise give every such
    # image one id, and a container another test runs on it would count as a use of this one.
    dockerfile = (
        f"FROM {SANDBOX_IMAGE}\nUSER root\n"
        'RUN echo /testbed > "$(/opt/venv/bin/python -c \'import sysconfig; print(sysconfig.get_paths()["purelib"])\')'
        f'/testbed.pth"\nUSER 1000:1000\nLABEL dockyard.test.image="{name}"\n'
    )
    client.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=name, network_mode="none", pull=False, rm=True)
    return name


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


def test_a_present_image_is_used_without_a_pull(client, tagged):
    image = tagged(f"swebench/sweb.eval.x86_64.{unique('o_1776_r')}:latest")
    # A pull from a registry that refuses every connection would fail: returning proves none was tried.
    assert resolve(client, "o__r-1", image, registry=DEAD_REGISTRY) == image


def test_an_image_present_under_the_registry_name_is_used_too(client, tagged):
    image = f"swerebench/sweb.eval.x86_64.{unique('o_1776_r')}"
    tagged(f"{DEAD_REGISTRY}/{image}:latest")
    assert resolve(client, "o__r-1", image, registry=DEAD_REGISTRY) == f"{DEAD_REGISTRY}/{image}"


@pytest.mark.parametrize("registry", [DEAD_REGISTRY, ""])
def test_an_image_neither_present_nor_pullable_is_refused_by_instance_and_image(client, registry):
    image = f"swebench/sweb.eval.x86_64.{unique('absent_1776_absent')}:latest"
    with pytest.raises(PrebuiltImageError) as info:
        resolve(client, "absent__absent-1", image, registry=registry)
    message = str(info.value)
    assert "instance 'absent__absent-1'" in message and image in message, message
    assert "not present locally and cannot be pulled" in message
    assert (f"registry '{DEAD_REGISTRY}'" if registry else "DOCKYARD_SANDBOX_IMAGE_REGISTRY is unset") in message


def test_a_bad_auth_file_is_named(client, tmp_path):
    auth = tmp_path / "auth.json"
    auth.write_text('{"username": "u"}')
    with pytest.raises(PrebuiltImageError, match=r"auth.json: must be a JSON object with username and password"):
        resolve(client, "absent__absent-1", f"{unique('absent')}/x:1", registry=DEAD_REGISTRY, auth_file=str(auth))


def test_the_fitted_image_links_the_repository_folder_to_the_checkout(client, tagged):
    image = tagged(f"swebench/sweb.eval.x86_64.{unique('o_1776_r')}:latest")
    fitted = ensure_prebuilt(client, "o__r-1", PrebuiltEnv(image, REPO_DIR, "/env/bin"), registry=DEAD_REGISTRY)
    out = client.containers.run(fitted, ["sh", "-c", f"readlink {REPO_DIR}; id -u; pwd; echo $PATH"], remove=True)
    link, uid, cwd, path = out.decode().split()
    assert (link, uid, cwd) == ("/work", "1000", "/work") and path.startswith("/env/bin:")


def test_a_rows_image_stays_cached_while_its_fitted_run_image_is_and_goes_after_it(client, tmp_path):
    import docker.errors

    from services.sandbox.image_cache import ImageCache

    row_image = editable_at_testbed(client, f"swebench/sweb.eval.x86_64.{unique('o_1776_r')}:latest")
    made: list[tuple[str, str | None]] = []
    fitted = None
    try:
        building = ImageCache(client, 1e-9, str(tmp_path), keep={SANDBOX_IMAGE})  # within the grace: nothing goes
        building.record(row_image)  # as if this service had pulled it (no registry answers here)

        def added(image: str, base: str | None) -> None:
            made.append((image, base))
            building.added(image, base)

        env = PrebuiltEnv(row_image, REPO_DIR, f"/env/{unique('bin')}")  # a fitted image of its own
        fitted = ensure_prebuilt(client, "o__r-1", env, registry=DEAD_REGISTRY, on_made=added)
        assert made == [(fitted, row_image)]  # built here on the row's image; the row's was present: no pull
        later = ImageCache(client, 1e-9, str(tmp_path), keep={SANDBOX_IMAGE}, grace_seconds=0)  # the grace past
        container = client.api.create_container(fitted, command=["true"])["Id"]
        try:
            assert later.evict() == []  # the fitted image has a container; the row's is its base
        finally:
            client.api.remove_container(container, force=True)
        assert later.evict() == [fitted, row_image]  # the child first, then its base
        assert later.recorded() == {} and client.images.get(SANDBOX_IMAGE)
    finally:
        for name in (fitted, row_image):
            try:
                if name is not None:
                    client.images.remove(name, noprune=True)
            except docker.errors.ImageNotFound:
                pass  # evicted


def rebench_task_set(root: Path, image: str) -> dict:
    """swe_repo's task set, its row rewritten in SWE-rebench's columns (docker_image, install_config)."""
    row = make_task_set(root)
    row.update(
        docker_image=image,
        install_config={"install": "pip install -e .", "test_cmd": "pytest -rA --tb=no -p no:cacheprovider"},
        requirements="pytest==8.0.0\n",  # SWE-rebench describes the image's packages; dockyard reads none of it
        environment="",
        meta={"num_modified_files": 1},
    )
    (root / "set" / "instances.jsonl").write_text(json.dumps(row) + "\n")
    return row


async def test_a_swe_rebench_row_scores_in_its_tagged_image(client, tagged, tmp_path):
    require_tool("/usr/bin/git", "git")
    from services.sandbox.__main__ import make_swe_scorer
    from services.sandbox.docker_backend import DockerBackend

    image = f"swerebench/sweb.eval.x86_64.{unique('o_1776_r')}:latest"
    tagged(editable_at_testbed(client, image))
    row = rebench_task_set(tmp_path, image)
    settings = SandboxSettings(backend="docker", task_root=str(tmp_path), image_registry=DEAD_REGISTRY)
    backend = await DockerBackend.open(image=SANDBOX_IMAGE, max_concurrency=2, work_root=str(tmp_path))
    scorer = make_swe_scorer(settings, backend)
    try:
        (instance,) = scorer.task_sets.instances("set").values()
        assert instance.prebuilt.image == image and instance.test_cmd[-1] == TEST_FILE
        irrelevant = "--- /dev/null\n+++ b/NOTES.txt\n@@ -0,0 +1 @@\n+notes\n"
        gold, empty, other = await asyncio.gather(
            *(scorer.score("set", instance, patch, LIMITS) for patch in (row["patch"], "", irrelevant))
        )
    finally:
        scorer.close()
        await backend.close()
    assert gold.status == "passed" and gold.resolved, (gold.error_message, gold.outcome and gold.outcome.stdout[-4000:])
    assert empty.status == "patch_failed" and not empty.resolved
    assert other.status == "failed" and other.fail_to_pass == {f"{TEST_FILE}::test_add": False}


async def test_a_swe_bench_row_named_so_scores_in_the_harness_eval_image(client, tagged, tmp_path):
    """SWE-bench's columns, dataset.json naming the format: the image is the harness's eval image of
    the instance, the test command swebench's spec for (psf/requests, 2.0), `pytest -rA`."""
    require_tool("/usr/bin/git", "git")
    from services.sandbox.__main__ import make_swe_scorer
    from services.sandbox.docker_backend import DockerBackend

    iid = unique("psf__requests")
    row = make_task_set(tmp_path, repo="psf/requests")
    row.update(instance_id=iid, version="2.0")
    (tmp_path / "set" / "repos" / "o__r.git").rename(tmp_path / "set" / "repos" / "psf__requests.git")
    (tmp_path / "set" / "instances.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "set" / "dataset.json").write_text('{"format": "swe-bench"}')
    image = f"swebench/sweb.eval.x86_64.{iid.replace('__', '_1776_')}:latest"
    tagged(editable_at_testbed(client, image))
    settings = SandboxSettings(backend="docker", task_root=str(tmp_path), image_registry=DEAD_REGISTRY)
    backend = await DockerBackend.open(image=SANDBOX_IMAGE, max_concurrency=2, work_root=str(tmp_path))
    scorer = make_swe_scorer(settings, backend)
    try:
        (instance,) = scorer.task_sets.instances("set").values()
        assert instance.prebuilt.image == image and instance.test_cmd == ["pytest", "-rA", TEST_FILE]
        gold, empty = await asyncio.gather(*(scorer.score("set", instance, p, LIMITS) for p in (row["patch"], "")))
    finally:
        scorer.close()
        await backend.close()
    assert gold.status == "passed", (gold.error_message, gold.outcome and gold.outcome.stdout[-4000:])
    assert empty.status == "patch_failed" and not empty.resolved


async def test_a_session_of_a_prebuilt_row_finds_its_checkout_at_testbed(client, tagged, tmp_path):
    require_tool("/usr/bin/git", "git")
    from services.sandbox.__main__ import make_swe_scorer
    from services.sandbox.backend import Status
    from services.sandbox.docker_backend import DockerBackend

    image = f"swerebench/sweb.eval.x86_64.{unique('o_1776_r')}:latest"
    tagged(editable_at_testbed(client, image))
    rebench_task_set(tmp_path, image)
    settings = SandboxSettings(backend="docker", task_root=str(tmp_path), image_registry=DEAD_REGISTRY)
    backend = await DockerBackend.open(image=SANDBOX_IMAGE, max_concurrency=2, work_root=str(tmp_path))
    scorer = make_swe_scorer(settings, backend)
    try:
        (instance,) = scorer.task_sets.instances("set").values()
        checkout, run_image = await scorer.prepare("set", instance)
        session = await backend.open_session({}, LIMITS, seed_dir=str(checkout), image=run_image)
        try:
            probe = "import pkg, pkg.core; print(pkg.__file__); print(pkg.core.add(2, 3))"
            done = await session.exec(["sh", "-c", f"cd / && python -c '{probe}'"], None, LIMITS)
        finally:
            await session.close()
    finally:
        scorer.close()
        await backend.close()
    assert done.status is Status.PASSED, done
    assert done.stdout.split() == ["/testbed/pkg/__init__.py", "-1"]  # base_commit's buggy add, via /testbed


async def test_scoring_a_row_whose_image_cannot_be_had_is_an_error_naming_it(client, tmp_path):
    require_tool("/usr/bin/git", "git")
    from services.sandbox.__main__ import make_swe_scorer
    from services.sandbox.docker_backend import DockerBackend

    image = f"swerebench/sweb.eval.x86_64.{unique('absent_1776_absent')}"
    row = rebench_task_set(tmp_path, image)
    settings = SandboxSettings(backend="docker", task_root=str(tmp_path), image_registry=DEAD_REGISTRY)
    backend = await DockerBackend.open(image=SANDBOX_IMAGE, max_concurrency=1, work_root=str(tmp_path))
    scorer = make_swe_scorer(settings, backend)
    try:
        (instance,) = scorer.task_sets.instances("set").values()
        result = await scorer.score("set", instance, row["patch"], LIMITS)
    finally:
        scorer.close()
        await backend.close()
    assert result.status == "error" and not result.resolved
    assert f"instance {row['instance_id']!r}" in result.error_message
    assert f"{DEAD_REGISTRY}/{image}" in result.error_message and "cannot be pulled" in result.error_message


async def test_a_prebuilt_row_on_the_local_backend_is_an_error_naming_its_image(tmp_path):
    require_tool("/usr/bin/git", "git")
    from services.sandbox.local import LocalBackend

    row = rebench_task_set(tmp_path, "swerebench/sweb.eval.x86_64.o_1776_r-1")
    scorer = SweScorer(
        LocalBackend(max_concurrency=1, work_root=str(tmp_path)), TaskSets(str(tmp_path)), log_cap_bytes=1 << 20
    )
    try:
        (instance,) = scorer.task_sets.instances("set").values()
        result = await scorer.score("set", instance, row["patch"], LIMITS)
    finally:
        scorer.close()
    assert result.status == "error" and "swerebench/sweb.eval.x86_64.o_1776_r-1" in result.error_message
    assert "docker backend" in result.error_message
    assert "1 in their dataset's prebuilt images" in check(tmp_path / "set")
