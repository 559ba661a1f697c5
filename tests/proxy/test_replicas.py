"""Replicas sharing one Redis: two `prefixgate serve` processes on the real SmolLM2, each with its own store folder,
driven by the official `openai` client. What one computes the other serves from the remote tier; tenants stay
apart; a Redis that stops costs the replicas their shared cache, never a request.

The two replicas and their Redis serve every test here (a start costs seconds): each test reads its own handbook, so
no test finds what another left, and counts what the replicas report as differences."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.proxy.conftest import metric_families, sample
from tests.services import REDIS_SERVER, RedisServer, Server

pytestmark = pytest.mark.smollm2

MODEL = "smollm2-135m"
BLOCK_SIZE = 64  # the default
ADMIN_KEY = "admin-key-for-tests"
KEYS = ("--api-key", "acme-key=acme", "--api-key", "globex-key=globex")


def handbook(title: str) -> str:
    """Return a system prompt of about 1.5k tokens that no other test reads."""
    return f"You answer questions about the {title} warehouse handbook below.\n" + "\n".join(
        f"Rule {i}: aisle {i} holds {['bolts', 'cables', 'valves', 'pumps'][i % 4]}, restocked every {i % 7 + 1} days."
        for i in range(1, 51)
    )


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """The replicas' Redis, for this module."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    running = RedisServer(tmp_path_factory.mktemp("redis"))
    running.start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[tuple[Server, Server]]:
    """Two replicas on the module's Redis, each with a store folder of its own, serving two tenants. In float32: the
    tests compare a greedy answer computed whole with the same answer from cached blocks, which bfloat16 may part at a
    near tie (README, "The model's dtype")."""
    flags = ("--remote", redis_server.url, "--admin-key", ADMIN_KEY, "--dtype", "float32", *KEYS)
    first = Server(tmp_path_factory.mktemp("replica"), *flags)
    try:
        second = Server(tmp_path_factory.mktemp("replica"), *flags)
    except BaseException:
        first.stop()
        raise
    yield first, second
    first.stop()
    second.stop()


def ask(server: Server, question: str, system: str, api_key: str = "acme-key") -> tuple[str, int, int]:
    """Return the greedy answer to `question` after `system`, the prompt tokens served from the cache, and all."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=16,
        temperature=0,
    )
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    cached = reply.usage.prompt_tokens_details.cached_tokens or 0
    return reply.choices[0].message.content or "", cached, reply.usage.prompt_tokens


def writes(server: Server) -> int:
    """Return the blocks `server` has written to Redis so far."""
    count: int = admin_cache(server)["remote"]["writes"]
    return count


def wait_for_writes(server: Server, count: int) -> None:
    """Wait until `server` has written `count` blocks to Redis: a replica writes them in the background once it has
    answered."""
    deadline = time.monotonic() + 60  # they arrive within a second; the bound only stops a broken run hanging
    while writes(server) < count:
        assert time.monotonic() < deadline, f"the replica never wrote {count} blocks to Redis"
        time.sleep(0.05)


def reusable_blocks(prompt_tokens: int) -> int:
    return (prompt_tokens - 1) // BLOCK_SIZE


def filed_blocks(prompt_tokens: int) -> int:
    """Return the blocks a short answer leaves in Redis: the prompt's whole ones before its last token, then the one
    holding that token and the answer (whole, or a tail)."""
    return reusable_blocks(prompt_tokens) + 1


def admin_cache(server: Server) -> dict[str, Any]:
    request = urllib.request.Request(f"{server.url}/admin/cache", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    with urllib.request.urlopen(request) as response:
        body: dict[str, Any] = json.load(response)
    return body


def health(server: Server) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(server.get("/health"))
    return body


def test_a_prompt_computed_on_one_replica_is_served_from_redis_by_another(replicas: tuple[Server, Server]) -> None:
    first, second = replicas
    system, before = handbook("Northwind"), writes(first)
    answer, cached, prompt_tokens = ask(first, "What does aisle 12 hold?", system)
    assert cached == 0
    wait_for_writes(first, before + filed_blocks(prompt_tokens))

    saved_before = admin_cache(second)["remote"]["tokens_saved"]
    metrics_before = metric_families(second.metrics())
    again, cached, _ = ask(second, "What does aisle 12 hold?", system)
    assert again == answer  # greedy, from blocks the first replica computed
    assert cached == prompt_tokens - 1  # whole blocks, then the block after them to the prompt's last token
    remote = admin_cache(second)["remote"]
    assert remote["tokens_saved"] - saved_before == cached and remote["available"]
    assert remote["entries"] >= reusable_blocks(prompt_tokens)
    assert health(second)["status"] == "ok" and "***" in health(second)["remote"]["url"]
    metrics = metric_families(second.metrics())

    def grown(name: str, **labels: str) -> float:
        return sample(metrics, name, **labels) - sample(metrics_before, name, **labels)

    assert grown("prefixgate_prefix_cache_hits_by_tier_total", tier="remote") == cached
    assert grown("prefixgate_remote_hits_total") == reusable_blocks(prompt_tokens)
    assert sample(metrics, "prefixgate_remote_up") == 1

    assert ask(second, "What does aisle 12 hold?", system)[1] >= cached
    assert admin_cache(second)["remote"]["tokens_saved"] - saved_before == cached  # from its own tiers: promoted


def test_tenants_share_nothing_across_replicas(replicas: tuple[Server, Server]) -> None:
    first, second = replicas
    system, before = handbook("Southwind"), writes(first)
    answer, _, prompt_tokens = ask(first, "How often is aisle 7 restocked?", system, api_key="acme-key")
    wait_for_writes(first, before + filed_blocks(prompt_tokens))
    assert ask(second, "How often is aisle 7 restocked?", system, api_key="globex-key")[1] == 0
    again, cached, _ = ask(second, "How often is aisle 7 restocked?", system, api_key="acme-key")
    assert cached == prompt_tokens - 1 and again == answer


def test_replicas_go_on_without_redis_and_use_it_again_once_it_is_back(
    replicas: tuple[Server, Server], redis_server: RedisServer
) -> None:
    first, second = replicas
    system, before = handbook("Eastwind"), writes(first)
    answer, _, prompt_tokens = ask(first, "What does aisle 3 hold?", system)
    wait_for_writes(first, before + filed_blocks(prompt_tokens))
    redis_server.stop()

    again, cached, _ = ask(second, "What does aisle 3 hold?", system)  # Redis is gone: computed here, and answered
    assert (again, cached) == (answer, 0)
    assert health(second)["status"] == "degraded" and not health(second)["remote"]["available"]
    remote = admin_cache(second)["remote"]
    assert remote["errors"] >= 1 and remote["entries"] is None
    metrics = metric_families(second.metrics())
    assert sample(metrics, "prefixgate_remote_up") == 0 and sample(metrics, "prefixgate_remote_errors_total") >= 1

    redis_server.start()  # empty: what the first computed before is gone
    # Each health check asks Redis once the backoff (a second at first, doubling with each failed try) is over.
    deadline = time.monotonic() + 60
    while health(second)["status"] != "ok":
        assert time.monotonic() < deadline, "the remote tier did not come back"
        time.sleep(0.1)
    memo, before = "Night shift memo. " + system, writes(second)  # a prefix neither replica holds
    answer, _, prompt_tokens = ask(second, "What does aisle 5 hold?", memo)
    wait_for_writes(second, before + filed_blocks(prompt_tokens))
    again, cached, _ = ask(first, "What does aisle 5 hold?", memo)
    assert again == answer and cached == prompt_tokens - 1
