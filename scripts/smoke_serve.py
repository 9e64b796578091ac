"""The README's first command, checked the way a new user would see it work.

Starts `jaxserve serve` (the default model, default flags) from the given install, waits for /health,
asks the capital-of-France question over /v1/chat/completions and expects "Paris"; then stops the
server with SIGINT and expects exit 0. Standard library only, so it runs beside any install.

    python scripts/smoke_serve.py --jaxserve .venv/bin/jaxserve
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
import urllib.request


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jaxserve", default="jaxserve", help="The jaxserve executable to run.")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600, help="Seconds to wait for /health.")
    args = parser.parse_args()

    base = f"http://127.0.0.1:{args.port}"
    start = time.monotonic()
    server = subprocess.Popen([args.jaxserve, "serve", "--port", str(args.port)])
    try:
        while True:
            if server.poll() is not None:
                print(
                    f"smoke: the server exited with {server.returncode} before /health answered",
                    file=sys.stderr,
                )
                return 1
            if time.monotonic() - start > args.timeout:
                print(f"smoke: no /health 200 within {args.timeout:.0f} s", file=sys.stderr)
                return 1
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                time.sleep(0.25)
        print(f"smoke: /health 200 after {time.monotonic() - start:.1f} s")
        body = {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 32,
            "temperature": 0,
        }
        request = urllib.request.Request(
            base + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as reply:
            answer = json.load(reply)["choices"][0]["message"]["content"]
        print(f"smoke: the model answered {answer!r}")
        if "Paris" not in answer:
            print("smoke: expected the answer to name Paris", file=sys.stderr)
            return 1
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
    if server.returncode != 0:
        print(f"smoke: the server exited with {server.returncode} on SIGINT", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
