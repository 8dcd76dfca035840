"""The names the config may choose among for the loss and advantages, kept free of torch.

Guarantees: the loss and advantage functions (dockyard.algorithms) accept exactly these names;
the config schema and the launch rules refuse any other.
"""

KL_TYPES: tuple[str, ...] = ("k1", "k2", "k3")
IS_CORRECTIONS: tuple[str, ...] = ("plain", "tis", "icepop", "seq-mask-tis")
# "constant": Dr.GRPO's token sum over (sequences × a constant length), in place of a mean.
REDUCTIONS: tuple[str, ...] = ("token", "sequence", "constant")
SCALES: tuple[str, ...] = ("group", "batch", "none")
# The per-token objectives clipped_pg_loss computes (its `policy_loss` argument).
POLICY_LOSSES: tuple[str, ...] = ("grpo", "gspo", "gspo-token", "cispo", "sapo")
# `loss_fn.name`: each objective, plus the presets that set knobs of the GRPO objective (presets.py).
LOSS_NAMES: tuple[str, ...] = ("grpo", "dapo", "dr-grpo", "gspo", "gspo-token", "cispo", "sapo")
# The objective each `loss_fn.name` computes.
POLICY_LOSS_OF: dict[str, str] = {"dapo": "grpo", "dr-grpo": "grpo"} | {name: name for name in POLICY_LOSSES}
# The objectives whose ratio is the hard-clipped one, where a dual clip means something.
CLIPPED_LOSSES: tuple[str, ...] = ("grpo", "gspo", "gspo-token")
# Objectives whose ratio is a sequence's (a row's) length-normalised ratio: one sequence per row.
SEQUENCE_RATIO_LOSSES: tuple[str, ...] = ("gspo", "gspo-token")
# `grpo.adv_estimator.name`.
ADV_ESTIMATORS: tuple[str, ...] = ("grpo", "rloo", "reinforce++", "reinforce++-baseline", "opd")
