"""Use prefixgate with the official `anthropic` client: only `base_url` changes.

Start a server first (`prefixgate serve`), install the client (`.venv/bin/pip install anthropic`), then run
`.venv/bin/python examples/anthropic_client.py`. Two questions share a long system prompt that ends in a cache
breakpoint: the first computes it and writes it to the cache (`cache_creation_input_tokens`), the second reads it
from there (`cache_read_input_tokens`).
"""

from __future__ import annotations

import argparse
import time

import anthropic

MANUAL = "You are the support assistant for the Acme 3000 espresso machine. Answer from this manual.\n" + "\n".join(
    f"Section {i}: step {i} of the cleaning routine uses {i * 10} ml of water at {60 + i % 30} degrees."
    for i in range(1, 61)
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's root: the client adds /v1")
    parser.add_argument("--api-key", default="none", help="an API key, when the server requires one")
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    client = anthropic.Anthropic(base_url=args.base_url, api_key=args.api_key)
    system = [{"type": "text", "text": MANUAL, "cache_control": {"type": "ephemeral"}}]
    for question in ("How much water does step 3 use?", "What temperature does step 7 need?"):
        start = time.perf_counter()
        reply = client.messages.create(
            model=args.model,
            system=system,  # type: ignore[arg-type]  # a TypedDict the literal matches
            messages=[{"role": "user", "content": question}],
            max_tokens=32,
            extra_body={"temperature": 0},  # greedy; the client has no field for it, the server takes it
        )
        seconds = time.perf_counter() - start
        usage = reply.usage
        text = "".join(block.text for block in reply.content if block.type == "text")
        print(f"Q: {question}")
        print(f"A: {text}")
        print(
            f"   input tokens: {usage.cache_creation_input_tokens} written to the cache, "
            f"{usage.cache_read_input_tokens} read from it, {usage.input_tokens} other; "
            f"{usage.output_tokens} output tokens, {seconds:.2f} s"
        )


if __name__ == "__main__":
    main()
