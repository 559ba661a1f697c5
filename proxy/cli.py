"""The `prefixgate` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Run the `prefixgate` command."""
    parser = argparse.ArgumentParser(prog="prefixgate", description="A prompt-caching proxy for LLMs.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP proxy")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--model", default="smollm2-135m")
    serve.add_argument("--store", default="./prefixgate-store")
    parser.parse_args(argv)
    print(
        "prefixgate serve: the HTTP proxy is not built yet. What exists today is the tiered KV block store\n"
        "(prefixgate.store) with its policies (prefixgate.policies), and the Hugging Face backend\n"
        "(prefixgate.backends); see the README.",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
