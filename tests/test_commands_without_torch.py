"""Every command works on a machine without torch (the README's `pip install -e .` gives none).

Each command runs in its own process where `import torch` fails, on the real default model (its
tokenizer comes from the GGUF metadata, the path that once needed torch): generate and chat answer
the capital-of-France question, convert writes a checkpoint that generates the same text, and
`bench serve` measures a server started the same way.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from tiny_models import TEST_XLA_CACHE

pytestmark = pytest.mark.slow

# `torch` in sys.modules as None: every `import torch` raises, and importlib's find_spec reports
# it absent, as on a machine that never installed it.
WITHOUT_TORCH = (
    "import sys\n"
    "sys.modules['torch'] = None\n"
    "from jaxserve.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "assert sys.modules.get('torch', None) is None\n"
    "sys.exit(code)\n"
)
ENGINE_FLAGS = [
    "--max-model-len", "512",
    "--max-num-seqs", "4",
    "--max-num-batched-tokens", "128",
    "--no-use-tqdm-on-load",
    "--compilation-config", json.dumps({"cache_dir": TEST_XLA_CACHE}),
]  # fmt: skip
QUESTION = "What is the capital of France?"
GREEDY = ["--temperature", "0", "--max-tokens", "12"]


def jaxserve_without_torch(*args: str, stdin: str | None = None, timeout: float = 300) -> str:
    """`jaxserve args...` with torch unimportable; its stdout, or the test fails with its stderr."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, *args],
        input=stdin, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torch" not in done.stderr.lower(), done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def generated(default_gguf) -> str:
    return jaxserve_without_torch(
        "generate", default_gguf, *ENGINE_FLAGS, *GREEDY, "--chat", "--prompt", QUESTION
    )


def test_generate_and_chat_answer_without_torch(default_gguf, generated):
    assert "Paris" in generated
    chatted = jaxserve_without_torch("chat", default_gguf, *ENGINE_FLAGS, *GREEDY, stdin=QUESTION + "\n")
    assert "Paris" in chatted


def test_convert_without_torch_gives_a_checkpoint_that_answers_the_same(default_gguf, generated, tmp_path):
    output = str(tmp_path / "converted")
    jaxserve_without_torch("convert", default_gguf, "--output", output, "--no-use-tqdm-on-load")
    converted = jaxserve_without_torch(
        "generate", output, *ENGINE_FLAGS, *GREEDY, "--chat", "--prompt", QUESTION
    )
    assert converted == generated and "Paris" in converted


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_and_bench_serve_without_torch(default_gguf, tmp_path):
    port = _free_port()
    log = open(tmp_path / "server.log", "w+")
    server = subprocess.Popen(
        [sys.executable, "-c", WITHOUT_TORCH, "serve", default_gguf, *ENGINE_FLAGS,
         "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not become healthy"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        out = jaxserve_without_torch(
            "bench", "serve", "--backend", "openai-chat", "--base-url", f"http://127.0.0.1:{port}",
            "--model", default_gguf, "--dataset-name", "random", "--random-input-len", "16",
            "--random-output-len", "8", "--num-prompts", "4", "--disable-tqdm",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json",
        )  # fmt: skip
        result = json.loads((tmp_path / "bench.json").read_text())
        assert result["completed"] == 4, out
        assert result["total_output_tokens"] > 0
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    assert "torch" not in (tmp_path / "server.log").read_text().lower()
