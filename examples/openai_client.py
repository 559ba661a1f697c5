"""Use prefixgate with the official `openai` client: only `base_url` changes.

Start a server first (`prefixgate serve`), install the client (`.venv/bin/pip install openai`), then run
`.venv/bin/python examples/openai_client.py`. Two questions share a long system prompt; the second one is served
mostly from the cache, which the usage says in `cached_tokens`.
"""

from __future__ import annotations

import argparse
import time

import openai

MANUAL = "You are the support assistant for the Acme 3000 espresso machine. Answer from this manual.\n" + "\n".join(
    f"Section {i}: step {i} of the cleaning routine uses {i * 10} ml of water at {60 + i % 30} degrees."
    for i in range(1, 61)
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="none", help="an API key, when the server requires one")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    for question in ("How much water does step 3 use?", "What temperature does step 7 need?"):
        start = time.perf_counter()
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "system", "content": MANUAL}, {"role": "user", "content": question}],
            max_tokens=32,
            temperature=0,
        )
        seconds = time.perf_counter() - start
        usage = reply.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        print(f"Q: {question}")
        print(f"A: {reply.choices[0].message.content}")
        print(
            f"   {usage.prompt_tokens} prompt tokens, {usage.prompt_tokens_details.cached_tokens} from the cache, "
            f"{seconds:.2f} s"
        )


if __name__ == "__main__":
    main()
