"""The names the config may choose among for the loss and advantages, kept free of torch.

Guarantees: the loss and advantage functions (dockyard.algorithms) accept exactly these names;
the config schema and the launch rules refuse any other.
"""

KL_TYPES: tuple[str, ...] = ("k1", "k2", "k3")
IS_CORRECTIONS: tuple[str, ...] = ("plain", "tis", "icepop", "seq-mask-tis")
REDUCTIONS: tuple[str, ...] = ("token", "sequence")
SCALES: tuple[str, ...] = ("group", "batch", "none")
