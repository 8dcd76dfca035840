"""Seconds per GRPO step of dockyard against TRL's GRPOTrainer on the tiny recipe's job, on CPU.

    warm start (the recipe's own: `dockyard prepare`) ──> one policy folder, used by both sides
    dockyard: `dockyard run examples/configs/tiny_expr.yaml` + overrides  (five services, LocalStack)
              seconds per step: the `time` of consecutive "train" records of the run's metrics.jsonl
    TRL:      trl.GRPOTrainer(GRPOConfig matched) in this process
              seconds per step: wall time between consecutive `on_step_end` callbacks
    both:     steps 2..N+1 of N+1 (the first step is warm-up and is not counted)

Matched (the recipe's values, read from examples/configs/tiny_expr.yaml):
- model and tokenizer: the same warm-started folder (char-level Llama, float32), loaded with
  `from_pretrained` on both sides;
- prompts: the same tasks in the same order (data.train drawn through the coordinator's
  TaskStream with grpo.seed), 8 prompts × 8 completions = 64 completions per optimizer step,
  one micro-batch of 64 (TRL: per_device_train_batch_size=64, no accumulation, one generation
  per step, one update per generation);
- sampling: temperature 1, top_p 1, no top_k, max_new_tokens 16; a completion ends after eos or
  after the first newline, the token kept (dockyard: stop string "\\n"; TRL: the newline's id
  added to the model's eos ids, which TRL's completion mask honours the same way); with
  `--no-stop`, neither side stops at the newline (dockyard: no stop strings; TRL: eos only), so
  every completion runs to eos or 16 tokens;
- reward: each completion's first line defines `f`, run against the task's 8 asserts, reward =
  tests passed / tests. dockyard scores through its sandbox service as the recipe does. TRL's
  reward is, by default (`--trl-reward subprocess`), what a TRL user writes: one plain
  `python3 -I -c` subprocess per completion (the program, then each assert in a try), on a thread
  pool of the machine's cores, with the recipe's timeout; `--trl-reward sandbox` gives TRL the
  sandbox's own local backend instead (bwrap namespaces, the settings object the sandbox service
  reads, limits from env.sandbox; an ERROR verdict is no reward: dockyard masks the trajectory,
  TRL gets None), which isolates both sides alike;
- loss and optimizer: PPO-clip 0.2/0.2, no KL term and no reference model, token-level loss mean
  (TRL: loss_type "dapo", which with one process and one micro-batch is the mean over the batch's
  completion tokens), rewards scaled by the group's std, AdamW lr 1e-4, betas (0.9, 0.99),
  eps 1e-8, no weight decay, constant schedule without warmup, grad-norm clip 1.0;
- no validation, no checkpoints, no plots (dockyard), no eval, no saving, no reporting (TRL); CPU;
  torch's default thread count on both sides, or --threads N for TRL's process and dockyard's
  trainer and rollout (DOCKYARD_TRAINER_NUM_THREADS, DOCKYARD_ROLLOUT_NUM_THREADS).

What differs, and why it stays:
- dockyard runs as five processes talking gRPC (coordinator, rollout, trainer, buffer, sandbox),
  with weight sync (gloo) from trainer to rollout after every step and the groups passing through
  the buffer service; TRL trains and generates in one process on one model. That is the systems
  comparison.
- dockyard's advantage baseline is leave-one-out (the recipe's setting); TRL's is the group mean.
  The two differ by a factor G/(G-1) before the std scaling: the same work per step.
- TRL's generation left-pads the 8 distinct prompts of a step into one `generate` batch of 64;
  dockyard asks its rollout for one group of 8 per prompt (one Generate call each). Prompts of
  this task set all have about the same length.
- Learning itself is not compared: only the time a step takes.

Both sides share the machine's cores with whatever else runs on it: run on an idle machine, or
use --rounds (sides in alternating order) and read several runs before trusting a figure.

Prints each round's step times and reward means, the mean seconds per step of each side over
all rounds, then `dockyard_vs_trl_steps: R` (TRL seconds per step / dockyard seconds per step;
higher is better; the goal is R >= 1.0 on a 2-core machine, 1.5 with --async-grpo, which runs
dockyard's side with grpo.async_grpo.enabled=true: generation and scoring overlap training).

    .venv/bin/python bench/vs_trl.py                     # warm start (minutes), 3 measured steps per side
    .venv/bin/python bench/vs_trl.py --rounds 2 --model-dir /tmp/tiny-expr-sft  # reuse a warm start
    .venv/bin/python bench/vs_trl.py --quick             # 100-step warm start, 3 measured steps
    .venv/bin/python bench/vs_trl.py --rounds 3 --steps 11 --no-stop   # the outside side-by-side's setting
    .venv/bin/python bench/vs_trl.py --trl-reward sandbox  # both sides score in the sandbox

Each figure line names its setting: `dockyard_vs_trl_steps` (TRL's reward as set, stop strings as
set) is the headline; the setting is printed above it.

Needs `trl` (the `bench` extra: `.venv/bin/pip install -e '.[bench]'`), and bwrap for `--trl-reward sandbox`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "configs" / "tiny_expr.yaml"
DOCKYARD = Path(sys.executable).parent / "dockyard"
GOAL = 1.0
ASYNC_GOAL = 1.5  # with grpo.async_grpo.enabled=true on the dockyard side


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def overrides_for(model_dir: Path, log_dir: Path, steps: int, warm_steps: int | None) -> list[str]:
    """The recipe unchanged but for its folders, its length, and no validation, checkpoints or plots."""
    extra = [f"policy.bootstrap.steps={warm_steps}"] if warm_steps else []
    return [
        f"policy.model_name={model_dir}",
        f"logger.log_dir={log_dir}",
        f"grpo.max_num_steps={steps}",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "grpo.val_period=0",
        "checkpointing.enabled=false",
        "logger.plot=false",
        *extra,
    ]


def measured(times: list[float]) -> list[float]:
    """Seconds of each step after the first, from the times at which steps ended."""
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def run_dockyard(overrides: list[str], log_dir: Path, threads: int | None) -> tuple[list[float], list[float]]:
    """`dockyard run` of the recipe; (seconds of each step after the first, reward mean of every step)."""
    command = [str(DOCKYARD), "run", str(RECIPE), *overrides]
    env = dict(os.environ)
    if threads:  # the two services that run the model
        env.update(DOCKYARD_TRAINER_NUM_THREADS=str(threads), DOCKYARD_ROLLOUT_NUM_THREADS=str(threads))
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env)
    if result.returncode == 2 and "would share a port" in result.stderr:
        # Free ports are picked before the services bind them, so two can draw the same one: pick again.
        say(f"dockyard run refused its ports ({result.stderr.strip()}); once more")
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env)
    if result.returncode != 0:
        raise SystemExit(f"dockyard run failed ({result.returncode}):\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    [run_dir] = [p for p in log_dir.iterdir() if p.is_dir() and p.name != "logs"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = sorted((r for r in records if r["kind"] == "train"), key=lambda r: r["step"])
    return measured([r["time"] for r in train]), [r["reward_mean"] for r in train]


def subprocess_script(program: str, tests: list[str]) -> str:
    """The program, then each assert in a try, printing how many passed: a TRL user's usual harness."""
    lines = [program, "passed = 0"]
    for test in tests:
        lines += ["try:", f"    {test}", "    passed += 1", "except BaseException:", "    pass"]
    return "\n".join([*lines, "print(passed)", ""])


def make_reward(kind: str, cfg):
    """(reward function for GRPOTrainer, close): a plain subprocess per completion, or the sandbox's backend."""
    from dockyard.tasks import expr

    timeout = cfg.env.sandbox.timeout_seconds
    if kind == "subprocess":
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1)

        def one(completion: str, tests: list[str]) -> float:
            script = subprocess_script(expr.program_for(completion), tests)
            try:
                run = subprocess.run(
                    [sys.executable, "-I", "-c", script], capture_output=True, text=True, timeout=timeout
                )
                passed = int(run.stdout.strip().splitlines()[-1]) if run.returncode == 0 else 0
            except (subprocess.TimeoutExpired, ValueError, IndexError):
                passed = 0
            return passed / len(tests)

        def by_subprocess(completions: list[str], tests: list[list[str]], **_: object) -> list[float]:
            return list(pool.map(one, completions, tests))

        return by_subprocess, pool.shutdown

    from dockyard.api.sandbox.v1 import sandbox_pb2
    from services.coordinator.rewards import reward_of
    from services.sandbox.__main__ import make_backend
    from services.sandbox.servicer import resolve_limits, to_verdict
    from services.sandbox.settings import SandboxSettings

    # The sandbox service's own backend and limit resolution, on one event loop kept for the run.
    loop = asyncio.new_event_loop()
    settings = SandboxSettings()
    backend = loop.run_until_complete(make_backend(settings))
    box = cfg.env.sandbox
    limits = resolve_limits(
        sandbox_pb2.Limits(
            timeout_seconds=box.timeout_seconds,
            memory_mb=box.memory_mb,
            cpu_seconds=box.cpu_seconds,
            max_output_bytes=box.max_output_bytes,
        ),
        settings,
    )

    def by_sandbox(completions: list[str], tests: list[list[str]], **_: object) -> list[float | None]:
        async def score() -> list:
            runs = (backend.run_tests(expr.program_for(c), t, limits) for c, t in zip(completions, tests, strict=True))
            return await asyncio.gather(*runs)

        rewards = []
        for outcome in loop.run_until_complete(score()):
            reward, valid = reward_of(to_verdict(outcome), cfg.env.reward)
            rewards.append(reward if valid else None)
        return rewards

    def close() -> None:
        loop.run_until_complete(backend.close())
        loop.close()

    return by_sandbox, close


def run_trl(
    cfg, model_dir: Path, out_dir: Path, steps: int, threads: int | None, trl_reward: str
) -> tuple[list[float], list[float]]:
    """GRPOTrainer on the same folder, prompts and reward; (seconds of each step after the first, reward means)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback

    # TRL checks the vLLM it finds installed; this bench generates with transformers.
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
    from trl import GRPOConfig, GRPOTrainer

    from services.coordinator.task_stream import TaskStream, load_tasks

    grpo, policy, gen = cfg.grpo, cfg.policy, cfg.policy.generation
    if list(gen.stop_strings) not in (["\n"], []) or cfg.env.name != "expr":
        raise SystemExit("this bench matches the tiny recipe: env expr, stop_strings ['\\n'] or none")
    per_step = grpo.num_prompts_per_step * grpo.num_generations_per_prompt
    stream = TaskStream(load_tasks(cfg, "train"), grpo.seed)
    tasks = [next(stream) for _ in range(steps * grpo.num_prompts_per_step)]
    dataset = Dataset.from_list([{"prompt": t.prompt, "tests": list(t.tests)} for t in tasks])

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, policy.dtype))
    if gen.stop_strings:
        [newline] = tokenizer("\n", add_special_tokens=False)["input_ids"]
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, newline]

    reward_fn, close_reward = make_reward(trl_reward, cfg)
    ends: list[float] = []
    rewards: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])

    opt = policy.optimizer
    config = GRPOConfig(
        output_dir=str(out_dir),
        use_cpu=True,
        seed=policy.seed,
        max_steps=steps,
        num_generations=grpo.num_generations_per_prompt,
        per_device_train_batch_size=per_step,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        shuffle_dataset=False,
        max_completion_length=gen.max_new_tokens,
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=0,
        beta=cfg.loss_fn.kl_penalty,
        epsilon=cfg.loss_fn.clip_low,
        epsilon_high=cfg.loss_fn.clip_high,
        loss_type="dapo" if cfg.loss_fn.reduction == "token" else "grpo",
        scale_rewards="group",
        learning_rate=opt.lr,
        adam_beta1=opt.betas[0],
        adam_beta2=opt.betas[1],
        adam_epsilon=opt.eps,
        weight_decay=opt.weight_decay,
        lr_scheduler_type="constant",
        warmup_steps=opt.warmup_steps,
        max_grad_norm=opt.max_grad_norm,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_fn,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer.remove_callback(PrinterCallback)  # the log dict of every step; the summary prints what matters
    try:
        trainer.train()
    finally:
        close_reward()
    return measured(ends[1:]), rewards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per side and round (one more runs first)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of both sides, in alternating order")
    parser.add_argument("--model-dir", type=Path, default=None, help="warm-start folder: reused if present")
    parser.add_argument("--warm-steps", type=int, default=None, help="warm-start steps (default the recipe's)")
    parser.add_argument("--quick", action="store_true", help="a 100-step warm start")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads of TRL and of dockyard's trainer and rollout"
    )
    parser.add_argument("--only", choices=("dockyard", "trl"), default=None, help="run one side")
    parser.add_argument(
        "--trl-reward",
        choices=("subprocess", "sandbox"),
        default="subprocess",
        help="TRL's reward: a plain python subprocess per completion (what TRL users write), or dockyard's sandbox",
    )
    parser.add_argument("--no-stop", action="store_true", help="no stop string on either side (eos or length)")
    parser.add_argument(
        "--async-grpo",
        action="store_true",
        help="dockyard with grpo.async_grpo.enabled=true (generation and scoring overlap training; goal 1.5)",
    )
    args = parser.parse_args()
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1")
    warm_steps = args.warm_steps or (100 if args.quick else None)
    sys.path.insert(0, str(ROOT))
    from dockyard.config import load_config

    steps = args.steps + 1
    sides = [args.only] if args.only else ["dockyard", "trl"]
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="dockyard-vs-trl-") as tmp:
        model_dir = (args.model_dir or Path(tmp) / "model").resolve()
        stop = ["policy.generation.stop_strings=[]"] if args.no_stop else []
        stop += ["grpo.async_grpo.enabled=true"] if args.async_grpo else []
        overrides = overrides_for(model_dir, Path(tmp) / "runs", steps, warm_steps) + stop
        cfg = load_config(RECIPE, overrides)
        if not (model_dir / "config.json").is_file():
            say(f"warm start into {model_dir} (dockyard prepare, {cfg.policy.bootstrap.steps} steps)")
            subprocess.run([str(DOCKYARD), "prepare", str(RECIPE), *overrides], cwd=ROOT, check=True)
        per_step = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
        say(f"{steps} steps per side and round ({per_step} completions each, first not counted); policy {model_dir}")
        say(
            f"setting: TRL reward {args.trl_reward}; stop strings {'none' if args.no_stop else 'newline'}; "
            f"dockyard GRPO {'asynchronous' if args.async_grpo else 'synchronous'}"
        )
        for round_ in range(args.rounds):
            # Alternating the order spreads a drift in the machine's load over both sides.
            for side in sides if round_ % 2 == 0 else sides[::-1]:
                if side == "dockyard":
                    say(f"round {round_ + 1}: dockyard run (five services)")
                    log_dir = Path(tmp) / f"runs-{round_}"
                    run_overrides = overrides_for(model_dir, log_dir, steps, warm_steps) + stop
                    took, rewards = run_dockyard(run_overrides, log_dir, args.threads)
                else:
                    say(f"round {round_ + 1}: TRL GRPOTrainer")
                    out = Path(tmp) / f"trl-{round_}"
                    took, rewards = run_trl(cfg, model_dir, out, steps, args.threads, args.trl_reward)
                seconds[side] += took
                say(
                    f"round {round_ + 1}: {side} steps 2..{steps}: {' '.join(f'{s:.2f}' for s in took)} s; "
                    f"reward mean per step {' '.join(f'{r:.3f}' for r in rewards)}"
                )

    means = {side: statistics.mean(took) for side, took in seconds.items()}
    for side, took in seconds.items():
        spread = f", median {statistics.median(took):.2f}, min {min(took):.2f}, max {max(took):.2f}"
        print(f"{side:8s}: {means[side]:.2f} s per step (mean of {len(took)} steps{spread})")
    if len(means) == 2:
        goal = ASYNC_GOAL if args.async_grpo else GOAL
        print(f"goal: dockyard_vs_trl_steps >= {goal} on the 2-core machine")
        print(f"dockyard_vs_trl_steps: {means['trl'] / means['dockyard']:.3f}")


if __name__ == "__main__":
    main()
