"""The `dockyard` command line.

    dockyard up [--rollout-replicas N] [--sandbox-workers M] [--<service>-port PORT ...]
                                        the five services on localhost until Ctrl-C (ports: the flags,
                                        else DOCKYARD_<SERVICE>_PORT, else 50051-50055) and the policy
                                        endpoint (HTTP, --endpoint-port, else DOCKYARD_ENDPOINT_PORT, else 8000)
    dockyard submit CONFIG [k=v ...]    submit a job to a running coordinator, print its id
                                        (--wait: then follow it; exit 0 only when it SUCCEEDS)
    dockyard status [JOB]               one job in detail, or every job and the fleet
    dockyard cancel JOB                 cancel a job
    dockyard prepare CONFIG [k=v ...]   build the policy folder a recipe bootstraps (warm start)
    dockyard preflight CONFIG [k=v ...] check what a run needs (model, data, context, Docker, Redis, GPUs,
                                        ports, disk) and say what to fix; exit 2 when something is wrong
    dockyard run CONFIG [k=v ...]       preflight + up + submit + follow, then stop everything
                                        (--prepare: build a missing policy folder with the config's bootstrap);
                                        Ctrl-C: the job's state, run folder, last checkpoint and the command
                                        that goes on
    dockyard export hf CHECKPOINT OUT   a Hugging Face folder from a (sharded) checkpoint
    dockyard export gguf FOLDER OUT --type T [--type T ...]
                                        validated GGUF file(s) of an HF folder (dockyard/export/commands.py)
    dockyard tasks to-harbor SRC DST    a terminal-bench task set written in Harbor's format
                                        (dockyard/tasks/harbor_convert.py, docs/terminal_tasks.md)

submit, status and cancel talk to the coordinator at --coordinator, else
DOCKYARD_CLI_COORDINATOR_ADDRESS, else 127.0.0.1:50051 (none answering: a hint how to start one).
A command's k=v overrides may stand before or after its flags (`dockyard run CONFIG --prepare k=v`).

Heavy modules (torch, transformers, grpc, pydantic, even asyncio) load only in the commands that
need them, so `dockyard --help` answers at once, and a config is validated without torch.
A config given on the command line is strict: a key dockyard does not define is an error that
names the closest valid key, unless an override adds it on purpose (`+section.key=value`).

The package: `main.py` the parser and the small commands, `run.py` `dockyard run` and what an
interrupted run reports, `prepare.py` the warm start, `views.py` how jobs, steps and members read
on a terminal, `common.py` what the commands share (config loading, the coordinator stub, the local
stack, following a job).
"""

from dockyard.cli.main import main

__all__ = ["main"]
