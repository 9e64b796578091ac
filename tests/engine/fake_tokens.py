"""The tokens FakeModel (conftest.py) samples: a hash of the context a row reads back, so a
request's output depends only on its prompt. A module of its own so that tests import it by a
name no other directory's module shares (`from conftest import` finds whichever conftest.py
was imported last)."""

from __future__ import annotations

import zlib

import numpy as np

EOS = 1
# Fake sampled tokens lie in [FIRST_FAKE_TOKEN, FIRST_FAKE_TOKEN + NUM_FAKE_TOKENS), away
# from EOS and from the stop token ids the tests choose.
FIRST_FAKE_TOKEN = 100
NUM_FAKE_TOKENS = 50


def context_token(context: list[int]) -> int:
    return FIRST_FAKE_TOKEN + zlib.crc32(np.asarray(context, np.int64).tobytes()) % NUM_FAKE_TOKENS
