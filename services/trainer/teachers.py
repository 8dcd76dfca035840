"""Teacher policies of on-policy distillation, loaded by the trainer the way the reference policy is.

    on_policy_distillation.teacher_model_by_agent_name[env.name] ─load_teacher─> frozen HF causal LM
        (eval mode, no gradient, no optimizer state) ─> PolicyTrainer scores the student's rollouts with it

Guarantees:
- Without on-policy distillation nothing is loaded (None), so a GRPO or SFT job pays nothing.
- The teacher is the job's agent's (a job's rollouts all carry its env.name as their agent name):
  the launch rules refuse an OPD job whose map has no entry for it, so here a missing entry is a bug.
- A missing teacher folder is FileNotFoundError and a teacher whose vocabulary differs from the
  student's is ConfigError, each naming the config key and the folder (the servicer answers
  FAILED_PRECONDITION and INVALID_ARGUMENT): token-level distillation compares logprobs of the
  same token ids.
- What this covers: the token-level estimator sg[log π_teacher − log π_student] on the sampled
  token, not a full-vocabulary KL; teachers live in the trainer's memory (no teacher service).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dockyard.config import ConfigError, MasterConfig
from dockyard.models.load import load_policy


def load_teacher(config: MasterConfig, device: str, dtype: torch.dtype, vocab_size: int) -> torch.nn.Module | None:
    """The frozen teacher of this job's rollouts, or None when the job does not distil."""
    folder = config.teacher_model()
    if folder is None:
        return None
    no_lora = config.policy.lora.model_copy(update={"enabled": False})
    source = config.policy.model_copy(update={"model_name": folder, "bootstrap": None, "lora": no_lora})
    key = f"on_policy_distillation.teacher_model_by_agent_name.{config.env.name}"
    if not (Path(folder) / "config.json").is_file():
        raise FileNotFoundError(f"{key}={folder!r} is not a local model folder (no config.json)")
    teacher, _ = load_policy(source, device, dtype=dtype)
    teacher_vocab = teacher.config.vocab_size
    if teacher_vocab != vocab_size:
        raise ConfigError(
            f"{key}={folder!r}: the teacher's vocabulary has {teacher_vocab} tokens and the student's "
            f"{vocab_size}; a teacher must share the student's tokenizer"
        )
    return teacher.eval().requires_grad_(False)
