"""Server settings: read once at the edge from flags, `PREFIXGATE_*` variables and a TOML file, then validated."""

from __future__ import annotations

import re
import tomllib
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)
from pydantic_settings.exceptions import SettingsError

from prefixgate.errors import ConfigError
from prefixgate.policies import policy_names
from prefixgate.urls import masked_url

_config_file: ContextVar[Path | None] = ContextVar("prefixgate_config_file", default=None)


class ModelPrices(BaseModel):
    """A model's prices per million tokens, in whatever currency the deployment bills in."""

    model_config = ConfigDict(extra="forbid")

    input: NonNegativeFloat  # prompt tokens computed
    cached_input: NonNegativeFloat  # prompt tokens served from the cache
    cache_write: NonNegativeFloat  # prompt tokens written to the cache at a breakpoint
    output: NonNegativeFloat  # generated tokens


class Settings(BaseSettings):
    """Every setting of a prefixgate server; precedence: flags, then environment, then config file, then default."""

    model_config = SettingsConfigDict(env_prefix="PREFIXGATE_", extra="forbid", validate_default=True)

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=1, le=65535, description="port to listen on")
    model: str = Field(
        "smollm2-135m",
        description="model to serve: the embedded default's short name, a local Hugging Face folder, a GGUF file, or a "
        "Hugging Face Hub id (org/name; from its cache, downloaded there unless HF_HUB_OFFLINE=1)",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="model and KV dtype; auto is bfloat16 on GPUs and on CPUs that compute it (AVX-512 BF16, AMX), "
        "else float32",
    )
    compile: Literal["auto", "on", "off"] = Field(
        "auto",
        description="run the model's step compiled (torch.compile, in the background while steps run eagerly); auto "
        "compiles where it was measured to pay: a CPU whose linear weights are prepacked (bfloat16, or float32 on "
        "AMD's x86 CPUs)",
    )
    compile_wait: bool = Field(
        False,
        description="compile the model's step before taking requests, as vLLM compiles at start (minutes from "
        "nothing, seconds from torch's compile cache): a server busy from its start then runs compiled, where traffic "
        "can hold the background compile off for long",
    )
    store: Path | None = Field(
        Path("prefixgate-store"), description="store folder (LMDB tier and secret); empty for memory only"
    )
    block_size: PositiveInt = Field(64, le=4096, description="tokens per cached KV block")
    prefill_chunk_tokens: PositiveInt = Field(
        512, description="prompt tokens one forward pass computes while no stream is decoding"
    )
    interleaved_prefill_tokens: PositiveInt | None = Field(
        None,
        description="the most prompt tokens a forward pass computes beside decoding streams (fewer when they would "
        "slow the streams past 3 times their pace, as measured); default prefill_chunk_tokens",
    )
    kv_memory_budget: ByteSize | None = Field(
        None,
        description="KV memory running requests may hold, each its prompt plus max_tokens; default half the free "
        "GPU memory with CUDA, a quarter of the available memory on CPU",
    )
    max_running: PositiveInt = Field(64, description="most requests the model runs at once")
    max_waiting: NonNegativeInt = Field(
        256, description="most requests waiting for room; beyond it a request gets 429 with Retry-After"
    )
    device_budget: ByteSize | None = Field(
        None, description="device tier bytes (e.g. 4GiB); default 4GiB with CUDA, 0 on CPU"
    )
    host_budget: ByteSize = Field(ByteSize(8 << 30), description="host (CPU memory) tier bytes")
    disk_budget: ByteSize = Field(ByteSize(64 << 30), description="disk (LMDB) tier bytes; 0 turns it off")
    remote: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Redis URL of a remote tier shared by replicas (redis://, or rediss:// for TLS), or the URLs of "
        "several nodes of one Redis Cluster; none: no remote tier. A password in a flag shows in `ps`: prefer "
        "PREFIXGATE_REMOTE (URLs separated by commas)",
    )
    upstream: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="base URL of an OpenAI-compatible server to forward to instead of loading a model "
        "(http://host:8000/v1: vLLM, SGLang, llama.cpp's server, another prefixgate), routed by prefix; "
        "PREFIXGATE_UPSTREAM takes them separated by commas",
    )
    upstream_api_keys: dict[str, str] = Field(
        default_factory=dict, description="upstream URL -> the API key prefixgate sends it; none: no key"
    )
    upstream_balance: PositiveInt = Field(
        4,
        description="requests in flight an upstream may have beyond the least loaded one (and 1.5 times as many) "
        "before a request that would go to it for its prefix goes to the least loaded one instead",
    )
    upstream_check_interval: PositiveFloat = Field(
        5.0,
        description="seconds between health checks of the upstreams (GET /models): one that fails leaves rotation, "
        "one that answers again comes back",
    )
    remote_ttl: PositiveFloat = Field(24 * 3600.0, description="seconds a block lives in Redis")
    remote_timeout: PositiveFloat = Field(
        0.25, description="seconds a lookup waits for Redis before it goes on without it"
    )
    remote_queue_budget: ByteSize = Field(
        ByteSize(256 << 20), description="bytes of blocks waiting to be sent to Redis; beyond it, writes are dropped"
    )
    kv_buffer_budget: ByteSize = Field(
        ByteSize(1 << 30), description="bytes of finished requests' KV buffers kept on the model's device for reuse"
    )
    policy: str = Field("lru", description=f"eviction policy of every tier: {', '.join(policy_names())}")
    ttl: PositiveFloat | None = Field(None, description="seconds a block lives after it is computed")
    idle_ttl: PositiveFloat | None = Field(None, description="seconds a block lives after its last use")
    layout: bool = Field(True, description="move dates, times and ids out of system prompts (static before dynamic)")
    layout_patterns: dict[str, str] | None = Field(
        None, description="named regexes of per-request content to move (replaces the defaults)"
    )
    api_keys: dict[str, str] = Field(
        default_factory=dict,
        description="API key -> tenant; empty means no key is required. A flag shows in `ps` to every local user: "
        'prefer PREFIXGATE_API_KEYS=\'{"KEY": "TENANT"}\' or [api_keys] in the --config file',
    )
    admin_key: str | None = Field(
        None,
        description="key for /admin; unset means /admin answers 403. A flag shows in `ps` to every local user: "
        "prefer PREFIXGATE_ADMIN_KEY or admin_key in the --config file",
    )
    prices: dict[str, ModelPrices] = Field(
        default_factory=dict,
        description="model id -> its prices per million tokens, INPUT,CACHED_INPUT,CACHE_WRITE,OUTPUT (as a flag: "
        "MODEL=0.15,0.075,0.1875,0.6), to show what the cache saved in money; none: no money is shown",
    )
    metrics_tenants: bool = Field(
        False,
        description="label /metrics with each tenant's name and traffic; off because /metrics needs no key "
        "(the admin endpoint shows tenants behind its key)",
    )
    max_body_bytes: ByteSize = Field(ByteSize(16 << 20), description="largest request body accepted")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="least severe log messages shown; info logs one line per request"
    )
    log_format: Literal["text", "json"] = Field(
        "text", description="log lines as text, or as one JSON object each (for log pipelines)"
    )
    model_cache_dir: Path = Field(
        Path.home() / ".cache" / "prefixgate" / "models", description="where converted models are kept"
    )

    @field_validator("prices", mode="before")
    @classmethod
    def _prices_from_text(cls, value: Any) -> Any:
        """Take a model's prices as the flag gives them, four numbers separated by commas, or as a table."""
        if not isinstance(value, dict):
            return value
        return {model: _price_table(model, prices) for model, prices in value.items()}

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in policy_names():
            raise ValueError(f"unknown policy {value!r}; choose one of: {', '.join(policy_names())}")
        return value

    @field_validator("admin_key")
    @classmethod
    def _admin_key_not_empty(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("the admin key must not be empty; leave it unset to turn /admin off")
        return value

    @model_validator(mode="after")
    def _admin_key_is_no_api_key(self) -> Settings:
        # An API key that also opened /admin would hand every tenant the whole cache, every tenant's included.
        if self.admin_key is not None and self.admin_key in self.api_keys:
            raise ValueError("admin_key is also an API key; give /admin a key of its own")
        return self

    @field_validator("remote", mode="before")
    @classmethod
    def _remote_urls(cls, value: Any) -> Any:
        return _urls(value, ("redis", "rediss"), "a Redis URL starts with redis:// or rediss://")

    @field_validator("upstream", mode="before")
    @classmethod
    def _upstream_urls(cls, value: Any) -> Any:
        urls = _urls(value, ("http", "https"), "an upstream URL starts with http:// or https://")
        # As an OpenAI client takes it, with or without its trailing slash: one upstream, one spelling.
        return [url.rstrip("/") for url in urls] if isinstance(urls, list) else urls

    @field_validator("store", mode="before")
    @classmethod
    def _empty_store_is_none(cls, value: Any) -> Any:
        return None if value in ("", "none", "None") else value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: tuple[PydanticBaseSettingsSource, ...] = (init_settings, env_settings)
        config_file = _config_file.get()
        if config_file is not None:
            sources += (TomlConfigSettingsSource(settings_cls, toml_file=config_file),)
        return sources


def _urls(value: Any, schemes: tuple[str, ...], rule: str) -> Any:
    """Return a list setting of URLs, from a list or from one string that separates them with commas."""
    if isinstance(value, str):
        value = [url for url in value.split(",") if url.strip()]  # empty: none
    if not isinstance(value, list):
        return value  # pydantic says what it expected
    urls = [url.strip() if isinstance(url, str) else url for url in value]
    for url in urls:
        if isinstance(url, str) and urlsplit(url).scheme not in schemes:
            raise ValueError(f"{rule}, got {masked_url(url)!r}")
    return urls


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Return validated settings; raise ConfigError naming every bad setting and what it accepts."""
    if config_file is not None and not config_file.is_file():
        raise ConfigError(f"config file {config_file} does not exist")
    token = _config_file.set(config_file)
    try:
        return Settings(**{name: value for name, value in overrides.items() if value is not None})
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in problem['loc']) or 'settings'}: {problem['msg']}"
            for problem in error.errors()
        )
        raise ConfigError(f"bad settings: {problems}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file {config_file} is not valid TOML: {error}") from None
    except SettingsError as error:
        # pydantic-settings reads a map setting from the environment as JSON; its own message names no fix.
        named = re.search(r'field "(\w+)"', str(error))
        variable = f"PREFIXGATE_{named.group(1).upper()}" if named else "a PREFIXGATE_ variable"
        raise ConfigError(
            f'{variable} must be a JSON object, e.g. {variable}=\'{{"KEY": "VALUE"}}\' ({error})'
        ) from None
    finally:
        _config_file.reset(token)


_PRICE_FIELDS = ("input", "cached_input", "cache_write", "output")


def _price_table(model: str, prices: Any) -> Any:
    if not isinstance(prices, str):
        return prices
    parts = prices.split(",")
    if len(parts) != len(_PRICE_FIELDS):
        raise ValueError(
            f"the prices of {model} are four numbers per million tokens, INPUT,CACHED_INPUT,CACHE_WRITE,OUTPUT "
            f"(e.g. {model}=0.15,0.075,0.1875,0.6); got {prices!r}"
        )
    return dict(zip(_PRICE_FIELDS, (part.strip() for part in parts), strict=True))
