"""An agent loop through prefixgate with the official `openai` client: the model calls a tool, the tool's result goes
back, the model answers; each turn starts from the previous one in the cache.

Start a server first (`prefixgate serve`), install the client (`.venv/bin/pip install openai`), then run
`.venv/bin/python examples/agent_loop.py`. The first turn forces a call of the tool (`tool_choice: required`), so even
a small model makes one, with arguments valid against the tool's schema; the second turn sends the call's result and
lets the model answer. Each turn prints how many of its prompt tokens came from the cache.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import openai

SYSTEM = "You are a travel assistant. Use the tools to look things up, then answer in one sentence.\n" + "\n".join(
    f"Policy {i}: for request type {i}, check the {['weather', 'trains', 'hotels'][i % 3]} first." for i in range(1, 41)
)
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather now in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "the city's name"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    }
]


def get_weather(city: str, unit: str) -> str:
    """Stand in for a weather service."""
    return json.dumps({"city": city, "temperature": 21 if unit == "celsius" else 70, "unit": unit, "sky": "clear"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="none", help="an API key, when the server requires one")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the weather like in Lisbon right now?"},
    ]
    for turn, tool_choice in ((1, "required"), (2, "auto")):
        start = time.perf_counter()
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, tool_choice=tool_choice, max_tokens=64, temperature=0
        )
        seconds = time.perf_counter() - start
        message = reply.choices[0].message
        usage = reply.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens
        print(f"turn {turn}: {usage.prompt_tokens} prompt tokens, {cached} from the cache, {seconds:.2f} s")
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            print(f"  answer: {message.content}")
            break
        for call in message.tool_calls:
            assert call.type == "function"
            result = get_weather(**json.loads(call.function.arguments))
            print(f"  call: {call.function.name}({call.function.arguments}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})


if __name__ == "__main__":
    main()
