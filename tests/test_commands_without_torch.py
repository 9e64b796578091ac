"""Every command works on a machine without torch (the README's `pip install -e .` gives none).

Each command runs in its own process where `import torch` fails, on the real default model (its
tokenizer comes from the GGUF metadata, the path that once needed torch): generate and chat answer
the capital-of-France question, convert writes a checkpoint that generates the same text, and
`bench serve` measures a server started the same way. On the GGUF file, serve, generate, chat and
bench serve also run with transformers unimportable.
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

# A module in sys.modules as None: every import of it raises, and importlib's find_spec reports it
# absent, as on a machine that never installed it. A GGUF file's commands need no transformers
# either (it costs a second and a half of every start): its tokenizer and chat template are ours.
PRELUDE = (
    "import sys\n"
    "blocked = sys.argv.pop(1).split(',')\n"
    "for name in blocked:\n"
    "    sys.modules[name] = None\n"
    "from jaxserve.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "assert all(sys.modules.get(name, None) is None for name in blocked)\n"
    "sys.exit(code)\n"
)
WITHOUT_TORCH = ("torch",)
WITHOUT_TRANSFORMERS = ("torch", "transformers")
ENGINE_FLAGS = [
    "--max-model-len", "512",
    "--max-num-seqs", "4",
    "--max-num-batched-tokens", "128",
    "--no-use-tqdm-on-load",
    "--compilation-config", json.dumps({"cache_dir": TEST_XLA_CACHE}),
]  # fmt: skip
QUESTION = "What is the capital of France?"
GREEDY = ["--temperature", "0", "--max-tokens", "12"]


def command(blocked: tuple[str, ...], *args: str) -> list[str]:
    return [sys.executable, "-c", PRELUDE, ",".join(blocked), *args]


def jaxserve_without(
    blocked: tuple[str, ...], *args: str, stdin: str | None = None, timeout: float = 300
) -> str:
    """`jaxserve args...` with the `blocked` modules unimportable; its stdout, or the test fails
    with its stderr."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        command(blocked, *args),
        input=stdin, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torch" not in done.stderr.lower(), done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def generated(default_gguf) -> str:
    return jaxserve_without(
        WITHOUT_TRANSFORMERS, "generate", default_gguf, *ENGINE_FLAGS, *GREEDY, "--chat", "--prompt", QUESTION
    )


def test_generate_and_chat_answer_without_torch_or_transformers(default_gguf, generated):
    assert "Paris" in generated
    chatted = jaxserve_without(
        WITHOUT_TRANSFORMERS, "chat", default_gguf, *ENGINE_FLAGS, *GREEDY, stdin=QUESTION + "\n"
    )
    assert "Paris" in chatted


def test_convert_without_torch_gives_a_checkpoint_that_answers_the_same(default_gguf, generated, tmp_path):
    output = str(tmp_path / "converted")
    jaxserve_without(WITHOUT_TORCH, "convert", default_gguf, "--output", output, "--no-use-tqdm-on-load")
    converted = jaxserve_without(  # a converted directory's tokenizer loads through transformers
        WITHOUT_TORCH, "generate", output, *ENGINE_FLAGS, *GREEDY, "--chat", "--prompt", QUESTION
    )
    assert converted == generated and "Paris" in converted


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_and_bench_serve_without_torch_or_transformers(default_gguf, tmp_path):
    port = _free_port()
    log = open(tmp_path / "server.log", "w+")
    server = subprocess.Popen(
        command(WITHOUT_TRANSFORMERS, "serve", default_gguf, *ENGINE_FLAGS, "--host", "127.0.0.1",
                "--port", str(port)),
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
        out = jaxserve_without(
            WITHOUT_TRANSFORMERS, "bench", "serve", "--backend", "openai-chat", "--base-url", f"http://127.0.0.1:{port}",
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
