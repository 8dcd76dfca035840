"""Preflight: what a run will need, checked before any service starts.

    MasterConfig (already valid: typos, group size and launch rules failed in load_config)
        ──> [away from its hardware: a cuda config with cluster.target_hardware, on a machine without CUDA]
        ──> model folder ─> tokenizer ─> tool-call format (policy.tool_call_format against the chat template)
        ──> datasets (files, fields) ─> context (longest prompt + max_new_tokens)
        ──> SFT demonstrations file (sft.dataset) / OPD teacher folder
        ──> swe task sets as the sandbox loads them (swebench specs, mirror commits)
        ──> GPUs / NCCL layout ─> FP8 rollouts (a warning where they were measured slower than bf16)
        ──> image processor (multimodal) ─> desktop VM (osworld: a stated skip)
        ──> sandbox backend as `dockyard run` sets it (Docker engine, image) ─> buffer backend (Redis)
        ──> ports ─> free disk for checkpoints ─> reward functions (file or module found, function defined: ast)
        ──> [Finding(check, status, message)]     status: ok | error | skip | warn (the run starts)

Guarantees: every check runs (one failure never hides the next) and says exactly what is wrong and
how to fix it; nothing is started, written or downloaded; torch is imported only to count GPUs for a
cuda config, transformers only to load a tokenizer. Away from the hardware a config states
(cluster.target_hardware), what lives on those machines (GPUs, a missing model folder or task path) is
a SKIP that names them, never a pass; what exists here is still checked. The environment (DOCKYARD_SANDBOX_BACKEND,
DOCKYARD_BUFFER_BACKEND, ...) is read as the services that `dockyard run` starts would read it.


Why over 400 lines: it is one check per function, run in the order of the report above;
each check is a few lines around the library call that decides it (load_config, the task loaders,
the tokenizer, docker, redis, ast), and splitting them would scatter one report across files. The two
checks a service also runs (reward functions, the docker engine's message) live in launch_checks.py, so
no service imports this module of the CLI."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dockyard.launch_checks import ERROR, OK, SKIP, WARN, Finding, check_reward_functions, docker_problem

if TYPE_CHECKING:
    from dockyard.config import MasterConfig

# Bytes a checkpoint holds per parameter: fp32 weights plus AdamW's two fp32 moments.
CHECKPOINT_BYTES_PER_PARAM = 12


@dataclass(frozen=True)
class Context:
    """What the checks need besides the config: how the run will be started."""

    prepare: bool = False  # the bootstrap may build a missing policy folder (dockyard run --prepare / prepare)
    ports: Mapping[str, int] | None = None  # ports the run will bind (explicit ones only)
    free_ports: bool = True  # a port left unset is a free one (dockyard run without --default-ports)
    local_services: bool = True  # trainer and rollout run on this machine (dockyard run)
    environ: Mapping[str, str] | None = None


def preflight(config: MasterConfig, context: Context = Context()) -> list[Finding]:
    """Every check's finding, in the order of the module docstring. The environment is read with the
    sandbox settings `dockyard run` adds for the config (sandbox_env: the docker backend of an external
    scaffold or terminal_bench), so a check passes here only when it passes under `dockyard run`."""
    from dockyard.tasks.envs import docker_required, sandbox_env

    env = os.environ if context.environ is None else context.environ
    sandbox: list[Finding] = []
    if config.env.name != "osworld":  # osworld: its desktop_vm line says that `dockyard run` refuses it
        try:
            env = {**env, **sandbox_env(config)}
        except ValueError as exc:
            sandbox.append(Finding("sandbox", ERROR, str(exc)))
    away = away_from_target(config)
    checks: list[Callable[[], Finding | list[Finding]]] = [
        lambda: check_model(config, context.prepare, away),
        lambda: check_tokenizer_and_context(config, context.prepare, away),
        lambda: check_swe_task_sets(config, away),
        lambda: check_demonstrations_and_teacher(config),
        lambda: check_gpus(config, context.local_services, away),
        lambda: check_fp8(config),
        lambda: check_image_processor(config, context.prepare),
        lambda: check_desktop_vm(config),
        lambda: sandbox or check_docker(env, docker_required(config)),
        lambda: check_redis(env),
        lambda: check_ports(context.ports or {}, free_when_unset=context.free_ports),
        lambda: check_disk(config),
        lambda: check_reward_functions(config),
    ]
    findings: list[Finding] = []
    for check in checks:
        result = check()
        findings += result if isinstance(result, list) else [result]
    return findings


def away_from_target(config: MasterConfig) -> str | None:
    """The statement of a SKIP for a cuda config that names its hardware, on a machine without CUDA; else None."""
    cluster = config.cluster
    if cluster.device != "cuda" or cluster.target_hardware is None:
        return None
    import torch

    if torch.cuda.is_available():
        return None
    return f"written for {cluster.target_hardware} (cluster.target_hardware); this machine has no CUDA device"


def _folder_missing(config: MasterConfig) -> bool:
    name = config.policy.model_name
    return name is not None and not (Path(name) / "config.json").is_file()


def check_model(config: MasterConfig, prepare: bool, away: str | None = None) -> Finding:
    policy = config.policy
    if policy.model_name is None:
        return Finding("model", OK, f"random init of a {policy.model['model_type']} from policy.model")
    if not _folder_missing(config):
        return Finding("model", OK, f"policy folder {policy.model_name}")
    if away:
        return Finding("model", SKIP, f"{policy.model_name} is not here: {away}")
    if policy.bootstrap is None:
        return Finding(
            "model",
            ERROR,
            f"policy.model_name={policy.model_name!r} is not a local model folder (no config.json): "
            "point it at a Hugging Face folder (config.json, weights, tokenizer)",
        )
    boot = policy.bootstrap
    if prepare:
        return Finding(
            "model",
            OK,
            f"{policy.model_name} will be built by the {boot.recipe} warm start ({boot.steps} steps; `dockyard "
            "prepare CONFIG`, or `dockyard run --prepare CONFIG`)",
        )
    return Finding(
        "model",
        ERROR,
        f"policy.model_name={policy.model_name!r} does not exist; if that is the folder you mean, build it with the "
        f"config's bootstrap ({boot.recipe}, {boot.steps} steps): `dockyard prepare CONFIG` or `dockyard run --prepare "
        "CONFIG`; otherwise fix the path",
    )


def _max_positions(config: MasterConfig) -> int | None:
    policy = config.policy
    if policy.model_name is not None and not _folder_missing(config):
        data = json.loads((Path(policy.model_name) / "config.json").read_text())
        return data.get("max_position_embeddings") or data.get("text_config", {}).get("max_position_embeddings")
    return (policy.model or {}).get("max_position_embeddings")


def _tokenizer(config: MasterConfig):
    from dockyard.models.load import load_tokenizer

    if _folder_missing(config):  # the bootstrap builds the character tokenizer into the folder
        return load_tokenizer(config.policy.model_copy(update={"model_name": None}))
    return load_tokenizer(config.policy)


def _chat(config: MasterConfig, task) -> tuple[tuple[str, str], ...] | None:
    """The conversation a single-turn task is generated from (rendered by the chat template), or None: text."""
    if config.env.agentic:  # agent trials render their own conversation (see _prompt_lengths)
        return None
    if task.messages:
        return task.messages
    return (("user", task.prompt),) if config.data.chat_template else None


def _prompt_lengths(config: MasterConfig, tokenizer, prompts: list) -> list[int]:
    """Token counts of prompts: text, or conversations ((role, content) pairs) through the chat template."""
    if not config.env.agentic:
        conversation = [
            [{"role": role, "content": content} for role, content in p] if isinstance(p, tuple) else None
            for p in prompts
        ]
        return [
            len(_ids(tokenizer.apply_chat_template(c, add_generation_prompt=True)))
            if c is not None
            else len(tokenizer(p, add_special_tokens=True)["input_ids"])
            for p, c in zip(prompts, conversation, strict=True)
        ]
    # An agent trial's first turn is the chat template over the task and the tools, as the endpoint renders it.
    from dockyard.agents.tools import schemas

    tools = schemas(config.env.tools)
    return [
        len(
            _ids(
                tokenizer.apply_chat_template([{"role": "user", "content": p}], tools=tools, add_generation_prompt=True)
            )
        )
        for p in prompts
    ]


def _ids(rendered) -> list[int]:
    # transformers 5 returns a BatchEncoding where 4 returned the ids themselves.
    return rendered["input_ids"] if hasattr(rendered, "keys") else rendered


def check_tokenizer_and_context(config: MasterConfig, prepare: bool, away: str | None = None) -> list[Finding]:
    """The tokenizer, each split's tasks, the chat template and the context. A missing policy folder
    hides none of the data lines: a bootstrap's folder is checked as the warm start builds it (its
    character tokenizer), and without one (or away from the hardware) the tokenizer and context are
    skips beside the data lines."""
    data_findings, prompts = _check_datasets(config, away)
    if _folder_missing(config) and (config.policy.bootstrap is None or away):
        skipped = Finding("context", SKIP, "no tokenizer to count the prompts with (see model)")
        return [
            Finding("tokenizer", SKIP, "no policy folder to read it from (see model)"),
            *data_findings,
            *([skipped] if prompts else []),
        ]
    try:
        tokenizer = _tokenizer(config)
    except Exception as exc:  # any loader failure is the folder's: report it, never crash preflight
        return [
            Finding("tokenizer", ERROR, f"cannot load the tokenizer of {config.policy.model_name}: {exc}"),
            *data_findings,
        ]
    findings = [Finding("tokenizer", OK, f"{type(tokenizer).__name__}, {len(tokenizer)} tokens"), *data_findings]
    if calls := check_tool_call_format(config, tokenizer):
        findings.append(calls)
    if chat := _check_chat_template(config, tokenizer, prompts):
        findings.append(chat)
        if chat.status == ERROR:
            return findings
    positions = _max_positions(config)
    if not prompts:
        return findings
    if positions is None:
        findings.append(Finding("context", SKIP, "the model's config names no max_position_embeddings"))
        return findings
    longest = max(_prompt_lengths(config, tokenizer, list(set(prompts))))
    new_tokens = config.policy.generation.max_new_tokens
    if longest + new_tokens > positions:
        findings.append(Finding("context", ERROR, context_problem(longest, new_tokens, positions)))
    elif config.env.agentic and config.grpo.max_trial_tokens > positions:
        findings.append(
            Finding(
                "context",
                ERROR,
                f"grpo.max_trial_tokens ({config.grpo.max_trial_tokens}) exceeds the model's {positions} positions: "
                f"a trial's whole sequence must fit; set it to {positions} or less",
            )
        )
    else:
        findings.append(
            Finding("context", OK, f"longest prompt {longest} + {new_tokens} new tokens within {positions} positions")
        )
    return findings


def context_problem(longest: int, new_tokens: int, positions: int) -> str:
    """What to do when the longest prompt and max_new_tokens do not fit the model's positions; lowering
    max_new_tokens is proposed only when a value of at least 1 would fit."""
    said = (
        f"the longest prompt ({longest} tokens) + policy.generation.max_new_tokens ({new_tokens}) exceeds the "
        f"model's {positions} positions: "
    )
    if positions - longest >= 1:
        return said + (
            f"lower max_new_tokens to {positions - longest} or less, or use shorter prompts or a model with a "
            "longer context"
        )
    return said + "the prompt alone fills the context: use shorter prompts or a model with a longer context"


def _check_chat_template(config: MasterConfig, tokenizer, prompts: list) -> Finding | None:
    """ok when the prompts are conversations and the tokenizer can render them; None for text prompts
    (and agent trials, which the context check renders)."""
    if not any(isinstance(p, tuple) for p in prompts):
        return None
    if getattr(tokenizer, "chat_template", None):
        return Finding("chat template", OK, f"{type(tokenizer).__name__} renders the conversations")
    return Finding(
        "chat template",
        ERROR,
        f"the tokenizer of {config.policy.model_name or 'the built-in policy'} has no chat_template, and "
        "data.chat_template is true or data rows carry messages: use a tokenizer with a chat template "
        "(chat_template in tokenizer_config.json), or set data.chat_template=false and use prompt rows",
    )


def check_tool_call_format(config: MasterConfig, tokenizer) -> Finding | None:
    """An explicit policy.tool_call_format must be one the chat template renders (else the endpoint would
    read every call as text); `auto` says what it picked for a job whose trials call tools."""
    from dockyard.agents.tool_formats import FORMATS, detect, pick, renders

    setting = config.policy.tool_call_format
    if setting == "auto" and not config.env.agentic:
        return None
    name, how = pick(setting, tokenizer)
    model = config.policy.model_name or "the built-in policy"
    if how == "fallback":
        return Finding(
            "tool calls",
            OK,
            f"policy.tool_call_format=auto: the chat template of {model} renders none of the known tool-call "
            f"formats ({', '.join(FORMATS)}), so the endpoint falls back to {name}; set "
            "policy.tool_call_format if the model writes calls another way",
        )
    if how != "set" or renders(name, tokenizer):
        said = {"set": "policy.tool_call_format", "detected": "detected from the chat template (auto)"}
        return Finding("tool calls", OK, f"{name}: {said.get(how, 'the tokenizer has a response_template (auto)')}")
    renders_instead = detect(tokenizer)
    fix = f"set policy.tool_call_format={renders_instead} (or auto)" if renders_instead else "use a model that does"
    return Finding(
        "tool calls",
        ERROR,
        f"policy.tool_call_format={setting}, but the chat template of {model} does not render that format: "
        + (
            "the tokenizer has no response_template"
            if setting == "transformers"
            else f"the format's template features ({', '.join(FORMATS[setting].FEATURES)}) are not in it"
        )
        + f"; {fix}",
    )


def _check_datasets(config: MasterConfig, away: str | None) -> tuple[list[Finding], list]:
    """A finding per split, and the prompts of the tasks that loaded (text, or a conversation the chat
    template renders); a task path that is not here is a SKIP when the config is away from its
    hardware (the files live on its machines)."""
    from dockyard.tasks.envs import split_tasks

    findings: list[Finding] = []
    prompts: list = []
    for split in ("train", "validation"):
        dataset = getattr(config.data, split)
        if away and dataset.path is not None and not Path(dataset.path).exists():
            findings.append(Finding(f"data.{split}", SKIP, f"{dataset.path} is not here: {away}"))
            continue
        try:
            tasks = split_tasks(config, split)
        except (OSError, ValueError) as exc:
            findings.append(Finding(f"data.{split}", ERROR, f"{exc}"))
            continue
        said = f"{len(tasks)} tasks from {dataset.path or dataset.source}"
        if split == "validation" and len(tasks) < dataset.size:  # validated once each, not repeated to the size
            said += (
                f" (fewer than data.validation.size={dataset.size}: each of the {len(tasks)} is validated once; "
                f"set data.validation.size={len(tasks)} to say so, or add rows)"
            )
        findings.append(Finding(f"data.{split}", OK, said))
        prompts += [_chat(config, t) or t.prompt for t in tasks]
    return findings, prompts


def check_swe_task_sets(config: MasterConfig, away: str | None = None) -> list[Finding]:
    """A swe environment's task sets load as the sandbox loads them (swebench specs, mirror commits),
    checked by the sandbox's own loader in a child process (the library does not import the services)."""
    if config.env.name != "swe":
        return []
    findings = []
    for split in ("train", "validation"):
        path = getattr(config.data, split).path
        if not path:
            continue
        if away and not Path(path).exists():
            findings.append(Finding(f"sandbox.{split}", SKIP, f"{path} is not here: {away}"))
            continue
        cmd = [sys.executable, "-m", "services.sandbox.task_set_check", str(path)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        ok = done.returncode == 0
        message = (done.stdout if ok else done.stderr).strip().removeprefix("error: ") or f"exit {done.returncode}"
        findings.append(Finding(f"sandbox.{split}", OK if ok else ERROR, message))
    return findings


def check_demonstrations_and_teacher(config: MasterConfig) -> list[Finding]:
    """sft.dataset parses (records and fields; messages are rendered when the job starts); the OPD
    teacher of the job's agent is a model folder."""
    findings = []
    if config.sft is not None and config.sft.dataset is not None:
        from dockyard.tasks.demonstrations import read_demonstration_records

        try:
            records = read_demonstration_records(config.sft.dataset)
            findings.append(Finding("sft.dataset", OK, f"{len(records)} demonstration records"))
        except (OSError, ValueError) as exc:
            findings.append(Finding("sft.dataset", ERROR, str(exc)))
    teacher = config.teacher_model()
    if teacher is not None:
        key = f"on_policy_distillation.teacher_model_by_agent_name.{config.env.name}"
        if (Path(teacher) / "config.json").is_file():
            findings.append(Finding("teacher", OK, f"teacher folder {teacher}"))
        else:
            findings.append(
                Finding("teacher", ERROR, f"{key}={teacher!r} is not a local model folder (no config.json)")
            )
    return findings


def check_gpus(config: MasterConfig, local_services: bool, away: str | None = None) -> Finding:
    if config.cluster.device != "cuda":
        return Finding("gpus", SKIP, "cluster.device=cpu")
    if away:
        return Finding("gpus", SKIP, away)
    import torch

    if not torch.cuda.is_available():
        return Finding(
            "gpus",
            ERROR,
            "cluster.device=cuda but torch sees no CUDA device: install a CUDA build, or set cluster.device=cpu",
        )
    count = torch.cuda.device_count()
    cluster = config.cluster
    # Only the collective transport forms an NCCL group; the colocated and checkpoint ones use none.
    if local_services and cluster.weight_sync_transport == "collective" and cluster.weight_sync_backend == "nccl":
        if count < 2:
            # The colocated transport shares the one GPU's memory, as the sync's own message says; it
            # does not take SGLang (the config refuses that pair).
            colocated = "cluster.weight_sync_transport=colocated (one GPU, shared through CUDA IPC), "
            if config.policy.generation.backend == "sglang":
                colocated = ""
            return Finding(
                "gpus",
                ERROR,
                f"NCCL cannot join two processes on one GPU ({count} visible) and this run puts the trainer and the "
                f"rollout on this machine: set {colocated}cluster.weight_sync_backend=gloo (through host memory), "
                "or give each its own GPU",
            )
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(count))
    return Finding("gpus", OK, f"{count} CUDA device(s): {names}")


# bench/fp8_rollout.py on one H100 (bench/README.md, 2026-12-06), per precision: (parameters of the shape, FP8
# engine tok/s / bf16's).
FP8_MEASURED = {
    "fp8": ((494_032_768, 0.905), (7_615_616_512, 1.087)),
    "fp8_block": ((494_032_768, 0.930), (7_615_616_512, 1.045)),
}


def check_fp8(config: MasterConfig) -> Finding:
    """precision fp8(_block): a warning unless FP8 rollouts were measured faster than bf16 at the policy's size or
    below."""
    generation = config.policy.generation
    if generation.precision == "auto":
        return Finding("fp8", SKIP, "policy.generation.precision=auto")
    params = _parameter_count(config)
    figures = FP8_MEASURED.get(generation.precision, ())
    faster = [n for n, ratio in figures if ratio > 1.0]
    measured = "; ".join(f"{n / 1e9:.1f}B: {r:.2f}x" for n, r in figures)
    if params is not None and faster and params >= min(faster):
        return Finding(
            "fp8", OK, f"{params / 1e9:.1f}B parameters: FP8 rollouts measured faster from {min(faster) / 1e9:.1f}B"
        )
    size = f"{params / 1e9:.1f}B parameters" if params is not None else "a policy of unknown size"
    return Finding(
        "fp8",
        WARN,
        f"{size}: {generation.precision} rollouts were not measured faster than bf16 at this size (tok/s over "
        f"bf16's by parameters, bench/fp8_rollout.py: {measured or 'none yet'}), and they move the sampled "
        "logprobs further from the trainer's; policy.generation.precision=auto is the faster choice here",
    )


def check_image_processor(config: MasterConfig, prepare: bool) -> Finding:
    """With the multimodal gate on, the policy folder must hold an image processor (a vision-language model)."""
    if not config.policy.generation.allow_multimodal_inputs:
        return Finding("images", SKIP, "policy.generation.allow_multimodal_inputs=false: text only")
    fix = "point policy.model_name at a vision-language model folder, or set allow_multimodal_inputs=false"
    if config.policy.model_name is None:
        return Finding("images", ERROR, f"policy.model builds a text-only model, which cannot take images: {fix}")
    if _folder_missing(config):
        return Finding("images", SKIP, "no policy folder to read it from (see model)")
    folder = Path(config.policy.model_name)
    if not any((folder / name).is_file() for name in ("processor_config.json", "preprocessor_config.json")):
        return Finding("images", ERROR, f"{folder} has no image processor (processor_config.json): {fix}")
    return Finding("images", OK, f"image processor in {folder}")


def check_desktop_vm(config: MasterConfig) -> Finding:
    """env osworld: a stated skip (no desktop VM provider here), saying what a run would need."""
    if config.env.name != "osworld":
        return Finding("desktop_vm", SKIP, f"env {config.env.name} needs no desktop VM")
    from dockyard.tasks.osworld import DESKTOP_REQUIREMENTS

    return Finding("desktop_vm", SKIP, f"{DESKTOP_REQUIREMENTS}; `dockyard run` refuses this job")


def check_docker(env: Mapping[str, str], required: str | None = None) -> Finding:
    """The docker engine and sandbox image, when the sandbox runs on the docker backend; `required`:
    why the config needs that backend (then the local backend is never proposed)."""
    if env.get("DOCKYARD_SANDBOX_BACKEND", "local") != "docker":
        return Finding("docker", SKIP, "the sandbox runs on the local backend")
    import docker
    from docker.errors import DockerException, ImageNotFound

    try:
        client = docker.from_env(timeout=5, environment=dict(env))
        client.ping()
    except DockerException as exc:
        return Finding("docker", ERROR, docker_problem(exc, env, required))
    image = env.get("DOCKYARD_SANDBOX_IMAGE") or _default_sandbox_image()
    try:
        client.images.get(image)
    except ImageNotFound:
        return Finding("docker", ERROR, f"the sandbox image {image} is not built: run deploy/images/build.sh")
    finally:
        client.close()
    return Finding("docker", OK, f"engine answers, image {image} present")


def _default_sandbox_image() -> str:
    # services/sandbox/images.py's SANDBOX_IMAGE, read without importing the sandbox service.
    return "dockyard/sandbox:latest"


def check_redis(env: Mapping[str, str]) -> Finding:
    if env.get("DOCKYARD_BUFFER_BACKEND", "memory") != "redis":
        return Finding("redis", SKIP, "the buffer keeps experience in memory")
    url = env.get("DOCKYARD_BUFFER_REDIS_URL", "")
    if not url:
        return Finding(
            "redis", ERROR, "DOCKYARD_BUFFER_BACKEND=redis needs DOCKYARD_BUFFER_REDIS_URL (redis://host:port/db)"
        )
    import redis

    client = redis.Redis.from_url(url, socket_timeout=3, socket_connect_timeout=3)
    try:
        client.ping()
    except redis.AuthenticationError:
        return Finding("redis", ERROR, "Redis refused the password: set DOCKYARD_BUFFER_REDIS_PASSWORD(_FILE)")
    except redis.RedisError as exc:
        return Finding(
            "redis", ERROR, f"no Redis answers at {_redacted(url)}: {exc}; start redis-server or fix the URL"
        )
    finally:
        client.close()
    return Finding("redis", OK, f"Redis answers at {_redacted(url)}")


def _redacted(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}***@{rest.split('@', 1)[1]}" if "@" in rest else url


def check_ports(ports: Mapping[str, int], free_when_unset: bool = True) -> Finding:
    """Each port free to bind; the fix proposes free ports only where leaving a port unset gives one
    (`dockyard run`; `dockyard up` and `run --default-ports` take 50051-50055 when unset)."""
    taken = []
    for name, port in ports.items():
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                taken.append(f"{port} ({name})")
    if taken:
        fix = "stop what holds them, or pick others (--<service>-port, DOCKYARD_<SERVICE>_PORT)"
        if free_when_unset:
            fix += ", or leave them unset for free ports"
        return Finding("ports", ERROR, f"in use: {', '.join(taken)}; {fix}")
    return Finding("ports", OK, f"{len(ports)} port(s) free" if ports else "free ports are picked at start")


def _parameter_count(config: MasterConfig) -> int | None:
    policy = config.policy
    if policy.model_name is not None and not _folder_missing(config):
        folder = Path(policy.model_name)
        weights = sum(f.stat().st_size for f in folder.glob("*.safetensors")) or sum(
            f.stat().st_size for f in folder.glob("*.bin")
        )
        dtype_bytes = {"float32": 4}.get(json.loads((folder / "config.json").read_text()).get("torch_dtype"), 2)
        return weights // dtype_bytes if weights else None
    arch = policy.model or {}
    hidden, layers = arch.get("hidden_size"), arch.get("num_hidden_layers")
    if not hidden or not layers:
        return None
    inner, vocab = (
        arch.get("intermediate_size", 4 * hidden),
        arch.get("vocab_size", 256),
    )  # the character tokenizer's, unless named
    return layers * (4 * hidden * hidden + 3 * hidden * inner) + 2 * vocab * hidden


def check_disk(config: MasterConfig) -> Finding:
    if not config.checkpointing.enabled:
        return Finding("disk", SKIP, "checkpointing.enabled=false")
    params = _parameter_count(config)
    if params is None:
        return Finding("disk", SKIP, "the model's size is unknown before the bootstrap builds it")
    ckpt = config.checkpointing
    saves = 1 if ckpt.save_period == 0 else math.ceil(config.max_num_steps / ckpt.save_period)
    if ckpt.keep_top_k is not None:
        saves = min(saves, ckpt.keep_top_k + 1)
    need = params * CHECKPOINT_BYTES_PER_PARAM * saves
    folder = Path(ckpt.checkpoint_dir or config.logger.log_dir).resolve()
    existing = next((p for p in [folder, *folder.parents] if p.exists()), Path("/"))
    free = shutil.disk_usage(existing).free
    gib = 1 << 30
    if free < need:
        return Finding(
            "disk",
            ERROR,
            f"{saves} checkpoint(s) of ~{params / 1e6:.0f}M parameters need ~{need / gib:.1f} GiB under {folder}, "
            f"{free / gib:.1f} GiB free: free space, move checkpointing.checkpoint_dir, or set "
            "checkpointing.keep_top_k",
        )
    return Finding("disk", OK, f"~{need / gib:.2f} GiB of checkpoints, {free / gib:.0f} GiB free under {existing}")


def errors(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.status == ERROR]


def report(findings: list[Finding]) -> str:
    return "\n".join(f"  {f.status:<6} {f.check:<16} {f.message}" for f in findings)
