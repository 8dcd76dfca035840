"""The sandbox service: runs untrusted code under limits and returns verdicts.

    coordinator --Execute(files, argv, limits)-------> verdict: PASSED iff exit code 0
                --RunTests(program, tests, limits)--> verdict: PASSED iff every test passed
                --ScorePatch(task set, instance, patch) --> verdict: PASSED iff resolved (SWE-bench style)

    settings.py   SandboxSettings: DOCKYARD_SANDBOX_*, default limits and ceilings
    backend.py    SandboxBackend, the interface every backend implements; Outcome, ResourceLimits
    local.py      LocalBackend: child process groups on this host
    harness.py    the launcher (rlimits, then exec) and the RunTests harness, as source strings
    servicer.py   SandboxServicer: limits validation, Outcome -> common.v1.Verdict
    swe.py        task sets, checkouts from local git mirrors, the in-sandbox driver, SWE verdicts
    patches.py    patch checks before anything applies a patch; the integrity rule
    log_parsing.py  pytest logs -> per-test statuses -> grading, as the swebench package does
    task_builder.py SWE task sets from a PyPI sdist with injected bugs (`dockyard tasks build-swe`)

What it covers: a fresh work folder per call, removed afterwards; a scrubbed
environment; wall-clock timeout that kills the whole process group; memory
(RLIMIT_AS), CPU time, file size and core-dump limits; output capped per
stream; bounded concurrency; a test report the program cannot forge by
printing or by exiting early.

What it does NOT cover: only the local backend exists, and it is weaker
isolation meant for development. There is no network namespace (code can
open sockets); the host filesystem is readable; RLIMIT_NPROC is not enforced
for root (nor are hard limits, which root may raise); a process that starts
its own session escapes the group kill; code that introspects the harness's
memory can forge a test report. The docker backend (per-task containers, no
network, read-only root, pids cgroup) comes later.

Verdicts: ERROR is reserved for infrastructure failures (masked from
rewards); whatever the code does to itself, crashes included, is FAILED; the
wall-clock kill is TIMEOUT. local.py states the rule in full.
"""
