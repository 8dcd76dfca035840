"""The sandbox service: runs untrusted code under limits and returns verdicts.

    coordinator --Execute(files, argv, limits)-------> verdict: PASSED iff exit code 0
                --RunTests(program, tests, limits)--> verdict: PASSED iff every test passed
                --ScorePatch(task set, instance, patch) --> verdict: PASSED iff resolved (SWE-bench style)
                --Reward(source, function, arguments) --> the function's reward, or ERROR naming it
    agent       --OpenSession / SessionExec / ReadFile / WriteFile / ScoreSession / CloseSession-->
                  a work folder kept across calls (sessions.py)

    settings.py        SandboxSettings: DOCKYARD_SANDBOX_*, backend choice, default limits and ceilings
    backend.py         SandboxBackend and SessionHandle, what every backend implements; Outcome, ResourceLimits
    verdicts.py        the verdict rules both backends apply to a finished run (Execute, RunTests)
    docker_backend.py  DockerBackend: one locked-down container per run (production)
    docker_container.py  its container: host config (limits), shell wrapper, work folder tar, owner label
    local.py           LocalBackend: child process groups on this host (development)
    bwrap.py           the local backend's bubblewrap command line: namespaces, read-only host paths
    staging.py         both backends' file checks, work folder staging and removal, report parsing
    harness.py         the launcher (rlimits, then exec) and the RunTests harness, as source strings
    reward_runner.py   Reward: a user reward function run through execute, its value checked
    images.py          offline builds of the base, sandbox and per-repository environment images
    admission.py       Admission: bounded running + waiting calls, RESOURCE_EXHAUSTED beyond
    servicer.py        SandboxServicer: limits validation, admission, Outcome -> common.v1.Verdict
    swe.py             task sets, checkouts from local git mirrors, the in-sandbox driver, SWE verdicts
    patches.py         patch checks before anything applies a patch; the integrity rule
    log_parsing.py     test logs -> per-test statuses -> grading, by the swebench package's parsers and grading
    swe_specs.py       swebench's spec for a row's (repo, version) -> an offline recipe, or a named refusal
    swe_images.py      a SWE-bench row's environment image, built offline per (repo, version, spec)
    sessions.py        SessionStore: session ids, the bound on open sessions, idle reaping
    session_api.py     the session RPCs' checks and flow (store, backend, SWE scoring of the work folder)
    session_files.py   ReadFile / WriteFile confined to the work folder, never through a link
    local_sessions.py  local sessions: a host folder, each command a fresh bubblewrap run over it
    work_folders.py    per-call work folders naming their owner; a start removes a killed service's
    docker_sessions.py docker sessions: one long-lived container, `docker exec` per command
    docker_session_start.py  the start of a docker session's container, cold or warm
    task_builder.py    SWE task sets from a PyPI sdist with injected bugs; a command of its own, run by
                       `dockyard tasks build-swe`

What it covers, on either backend: a fresh work folder per call, removed
afterwards; a wall-clock timeout that kills the run; memory
and CPU-time limits; output capped per stream; bounded concurrency with a
bounded queue; a test report the program cannot forge by printing or by
exiting early. The docker backend adds: no network, no view of the host's
files, a read-only root, a non-root user without capabilities, a pids limit.

What it does NOT cover: the local backend is weaker isolation, meant for
development (code can open sockets, read the host filesystem, and root is not
bound by RLIMIT_NPROC); docker containers share the host's kernel; code that
introspects the harness's memory can forge a test report on either backend.

Verdicts: ERROR is reserved for infrastructure failures (masked from
rewards); whatever the code does to itself, crashes included, is FAILED; the
wall-clock kill is TIMEOUT. verdicts.py states the rule in full.
"""
