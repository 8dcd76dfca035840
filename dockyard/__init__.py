"""dockyard: GRPO post-training of coding agents against execution-grounded rewards."""

__version__ = "0.1.0"
