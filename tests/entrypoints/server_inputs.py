"""What the server tests send: the served model's name, a token budget and 32 prompts. A module of
its own so that tests import it by a name no other directory's module shares (`from conftest
import` finds whichever conftest.py was imported last)."""

MODEL = "tiny"
MAX_TOKENS = 12
_WORDS = "The quick brown fox jumps over the lazy dog Paris is capital of France JAX compiles".split()
# 32 distinct prompts of different lengths.
PROMPTS = [" ".join(_WORDS[i % 7 : i % 7 + 2 + i % 9]) + f" {i}" for i in range(32)]
