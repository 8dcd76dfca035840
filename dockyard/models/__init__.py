"""Small policy models and their tokenizers, built locally from configs."""

from dockyard.models.build import build_random_model
from dockyard.models.tokenizer import build_char_tokenizer

__all__ = ["build_char_tokenizer", "build_random_model"]
