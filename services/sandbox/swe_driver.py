"""The SWE scoring driver: runs inside the sandbox as `python .dockyard-swe/run.py`, the checkout as cwd.

    spec.json, agent.patch, test.patch (read into memory, then deleted)
        ─> git apply agent.patch ─> git apply test.patch (unless empty) ─> the instance's test command
           (with spec "path" first on PATH: a prebuilt image's environment, e.g. its conda env's bin)
        ─> "<nonce> tests-done <rc>" on stdout

Guarantees: stdlib only, Python 3.5 or later (a prebuilt image's own environment runs it), and
every input is read into memory and deleted before the first untrusted byte (the patch) touches
the tree. Exit codes (services/sandbox/swe.py
reads them): 0 tests ran; 10 the patch did not apply; 11 the held-out test patch did not apply.
This file is never imported by the service: services/sandbox/swe.py ships its source.
"""

import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GIT = ["git", "-c", "safe.directory=*", "-c", "core.autocrlf=false", "-c", "core.hooksPath=/dev/null"]


def read(name):
    with open(os.path.join(HERE, name), "rb") as f:
        return f.read()


def say(text):
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def run(argv, data=None):
    try:
        done = subprocess.run(argv, input=data, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except OSError as exc:
        return 127, "{}: {}".format(argv[0], exc)
    return done.returncode, done.stdout.decode("utf-8", "replace")


def apply(data, label, fuzzy):
    rc, out = run(GIT + ["apply", "--verbose", "--whitespace=nowarn", "-"], data)
    say("{}: git apply: exit {}\n{}".format(label, rc, out))
    if rc == 0 or not fuzzy:
        return rc == 0
    patch = ["patch", "--batch", "--forward", "--fuzz=5", "-p1", "--no-backup-if-mismatch", "--reject-file=-"]
    rc, out = run(patch + ["--dry-run"], data)
    say("{}: patch --fuzz=5 --dry-run: exit {}\n{}".format(label, rc, out))
    if rc != 0:
        return False
    rc, out = run(patch, data)
    say("{}: patch --fuzz=5: exit {}\n{}".format(label, rc, out))
    return rc == 0


def main():
    spec = json.loads(read("spec.json"))
    agent, test = read("agent.patch"), read("test.patch")
    shutil.rmtree(HERE)
    nonce = spec["nonce"].encode()
    if not apply(agent, "patch", fuzzy=True):
        sys.exit(10)
    for path in spec["test_files"]:  # the held-out tests are judged as written, whatever the patch did
        rc, _ = run(GIT + ["cat-file", "-e", "HEAD:" + path])
        if rc == 0:
            run(GIT + ["checkout", "HEAD", "--", path])
        elif os.path.lexists(path):
            os.remove(path)
    if test.strip() and not apply(test, "test_patch", fuzzy=False):  # SWE-bench allows an empty one
        sys.exit(11)
    argv, env = list(spec["test_cmd"]), None
    if spec.get("path"):  # a prebuilt image's own environment runs the tests, found first on PATH
        env = dict(os.environ, PATH=spec["path"] + os.pathsep + os.environ.get("PATH", ""))
        argv[0] = shutil.which(argv[0], path=env["PATH"]) or argv[0]
    elif argv[0] in ("python", "python3"):
        argv = [sys.executable] + argv[1:]
    elif argv[0] == "pytest":
        argv = [sys.executable, "-m", "pytest"] + argv[1:]
    os.write(1, nonce + b" tests-start\n")
    try:
        rc = subprocess.run(argv, stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env).returncode
    except OSError as exc:
        say("cannot start the test command: {}".format(exc))
        rc = 127
    os.write(1, b"\n" + nonce + b" tests-done " + str(rc).encode() + b"\n")


if __name__ == "__main__":
    main()
