"""Write a GGUF model's shape without its weights: a directory with the Hugging Face config.json
its metadata describes and its tokenizer (tokenizer.json, tokenizer_config.json, chat template).
`jaxserve serve DIR --load-format dummy` then serves the same architecture and vocabulary with
random weights, where the weights cannot go (a lent accelerator reached only by a size-limited
copy: scripts/fetch_wheels.sh puts the default model's shape beside the wheels).

    python scripts/export_model_shape.py OUTPUT_DIR [--model FILE.gguf]   (default: the default model)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence


def export_shape(gguf_path: str, output_dir: str) -> None:
    from jaxserve.loader.gguf import load_gguf_tokenizer, read_gguf_config

    config = read_gguf_config(gguf_path)
    tokenizer = load_gguf_tokenizer(gguf_path)
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    tokenizer.save_pretrained(output_dir)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/export_model_shape.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("output_dir")
    parser.add_argument("--model", default=None, help="A .gguf file; default: the default model.")
    ns = parser.parse_args(argv)
    if ns.model is None:
        from jaxserve.loader.default_model import default_model_path

        ns.model = default_model_path()
    try:
        export_shape(ns.model, ns.output_dir)
    except (OSError, ValueError) as err:
        print(f"export_model_shape: {err}", file=sys.stderr)
        return 2
    print(f"{ns.output_dir}: the shape of {ns.model} (serve it with --load-format dummy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
