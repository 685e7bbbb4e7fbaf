"""`pof router` configuration: one frozen, validated object from a YAML file.

Validated with pydantic (unknown keys are refused); a bad file raises
:class:`~pof_connector.config.ConfigError` naming the key (``backends.1.url``) and what is
allowed. See ``examples/router/pof-router.yaml`` for every key with its default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pof_connector.config import ConfigError
from pof_connector.config.credentials import IndexAuth, read_secret


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BackendConfig(_Frozen):
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    url: str = Field(pattern=r"^https?://", description="the engine's OpenAI server, e.g. http://10.0.0.5:8000")
    node_id: str | None = Field(None, description="node_id of this engine's pool in the index; None: same as name")

    @field_validator("url")
    @classmethod
    def no_trailing_slash(cls, v: str) -> str:
        return v.rstrip("/")

    @property
    def pool_node(self) -> str:
        return self.node_id or self.name


class CostConfig(_Frozen):
    """The time-to-first-token estimate (see :mod:`pof_connector.router.cost_model`)."""

    # The three coefficients are start values, learnt from streamed requests' TTFTs when learn is on.
    prefill_s_per_token: float = Field(2e-4, gt=0, description="prefill time per token to compute")
    request_overhead_s: float = Field(0.02, gt=0, description="fixed cost of a request on a node")
    decode_s_per_running: float = Field(0.002, ge=0, description="delay a decoding request adds to a prefill")
    learn: bool = Field(True, description="learn the coefficients from observed TTFTs")
    learn_range: float = Field(100.0, ge=1.0, description="a learnt coefficient stays at or above start / "
                                                          "learn_range, and under start * learn_range or a fixed "
                                                          "ceiling (10 s, 0.1 s/token, 1 s), whichever is higher: "
                                                          "a fit fed odd samples cannot collapse to nothing")
    balance_within_error: bool = Field(False, description="route for load (the least loaded backend with KV room) "
                                                          "when the lowest estimate beats it by no more than the "
                                                          "estimates' measured mean error. Off by default: under "
                                                          "load that error grows, and the rule then spread "
                                                          "long sessions away from their holders (issue 42's "
                                                          "capacity runs)")
    displacement_weight: float = Field(1.0, ge=0, description="what a move costs the destination's other "
                                                              "conversations, as a multiple of what it costs "
                                                              "the moved request to bring its prefix there: "
                                                              "the destination allocates the prefix the holder "
                                                              "already has, and evicts that much cached context "
                                                              "someone loads or recomputes later. 0: a move "
                                                              "costs only its own request's time")
    tier_gbps: dict[str, float] = Field(
        default_factory=lambda: {"cpu_dram": 8.0, "cxl": 6.0, "peer_hbm": 100.0, "remote": 3.0},
        description="load bandwidth per tier, GB/s (pof bench tiers / pof bench fabric measure them)")

    @field_validator("tier_gbps")
    @classmethod
    def positive(cls, v: dict[str, float]) -> dict[str, float]:
        bad = [k for k, g in v.items() if g <= 0]
        if bad:
            raise ValueError(f"bandwidths must be > 0 GB/s: {bad}")
        return v


class CapacityConfig(_Frozen):
    """KV-memory-aware admission (see :mod:`pof_connector.router.kv_admission`)."""

    enabled: bool = Field(True, description="read each backend's KV usage, queue and preemptions from its "
                                            "/metrics and keep requests off saturated nodes")
    metrics_interval_s: float = Field(0.5, gt=0, description="how often each backend's /metrics is read")
    stale_after_s: float = Field(5.0, gt=0, description="a reading older than this is ignored (routing as "
                                                        "without metrics)")
    high_watermark: float = Field(0.9, gt=0, le=1.0, description="KV usage from which a node with queued "
                                                                 "requests or recent preemptions is saturated")
    default_max_tokens: int = Field(256, ge=0, description="tokens a request without max_tokens is assumed to "
                                                           "generate, for its KV need")
    block_tokens: int = Field(16, ge=1, description="tokens per KV block when the engine does not export it "
                                                    "(SGLang)")


class HealthConfig(_Frozen):
    interval_s: float = Field(2.0, gt=0)
    timeout_s: float = Field(2.0, gt=0)
    failures_to_remove: int = Field(2, ge=1, description="failed checks before a backend is taken out")


class RouterConfig(_Frozen):
    listen: str = Field("127.0.0.1:8080", pattern=r"^[^:]+:\d+$", description="host:port")
    index_url: str | None = Field(None, description="redis://... of the pool's locality index; None: no "
                                                     "locality, least-loaded routing")
    model: str | None = Field(None, description="the pof model name (pool config 'model'); None: the only one")
    policy: Literal["pof", "least_loaded", "round_robin"] = "pof"
    sticky_header: str | None = Field(None, description="a request header naming a session: its requests stay "
                                                        "on one backend while it is healthy")
    tokenizer: str | None = Field(None, description="tokenizer.json or model dir for text prompts; 'backend': "
                                                     "always ask a backend's /tokenize; None: the tokenizer.json "
                                                     "in the model directory the backends serve (their "
                                                     "/v1/models root), else a backend's /tokenize")
    chat_template: str | None = Field(None, description="a Jinja file the backends render chat requests with "
                                                         "(their --chat-template); None: the model directory's "
                                                         "own template (that of 'tokenizer')")
    request_timeout_s: float = Field(600.0, gt=0)
    max_body_bytes: int = Field(64 << 20, ge=1 << 10, description="larger request bodies are refused (413) "
                                                                  "before they are read whole")
    read_timeout_s: float = Field(30.0, gt=0, description="a request whose headers have not all arrived this "
                                                         "long after its connection opened or its last answer is "
                                                         "closed, one whose body has not is answered 408 (slow "
                                                         "clients)")
    max_tokenize_chars: int = Field(1_000_000, ge=0, description="longer text prompts are routed without "
                                                                 "their tokens (least loaded), not tokenized")
    index_username: str | None = Field(None, description="the index's Redis ACL user; None: the URL's, else default")
    index_password_env: str | None = Field(None, description="environment variable holding the index password")
    index_password_file: str | None = Field(None, description="file holding the index password")
    index_tls_ca_file: str | None = Field(None, description="CA of a rediss:// index server's certificate")
    index_tls_cert_file: str | None = Field(None, description="client certificate for the index (with its key)")
    index_tls_key_file: str | None = Field(None, description="the client certificate's key")
    api_key_env: str | None = Field(None, description="environment variable holding the key clients must send "
                                                       "('Authorization: Bearer KEY'); None: no key required")
    api_key_file: str | None = Field(None, description="file holding that key (trailing newline stripped)")
    backend_api_key_env: str | None = Field(None, description="environment variable holding the key the backends "
                                                               "require (their --api-key); None: the client's "
                                                               "Authorization header is passed on")
    backend_api_key_file: str | None = Field(None, description="file holding the backends' key")
    backends: list[BackendConfig] = Field(default_factory=list, description="the engines (leave out with "
                                                                             "prefill: and decode:)")
    prefill: list[BackendConfig] = Field(default_factory=list, description="P/D mode: the prefill servers (vLLM "
                                                                           "with pof); each request is prefilled "
                                                                           "on one of them, its pages handed to "
                                                                           "a decode server through the pool")
    decode: list[BackendConfig] = Field(default_factory=list, description="P/D mode: the decode servers")
    pd_min_prefill_tokens: int = Field(0, ge=0, description="P/D mode: a prompt of fewer tokens skips the prefill "
                                                            "servers and is computed on its decode server (its "
                                                            "prefill costs less than a hand-off); 0: every prompt "
                                                            "is prefilled remotely. A text prompt the router does "
                                                            "not tokenize always is")
    cost: CostConfig = CostConfig()
    capacity: CapacityConfig = CapacityConfig()
    health: HealthConfig = HealthConfig()

    @model_validator(mode="after")
    def secrets_readable(self) -> RouterConfig:
        """Every secret is read once at start-up, so a missing variable or file stops the router
        with the key's name (never the secret) instead of failing requests later."""
        try:
            self.index_auth.check(self.index_url)
            self.api_key()
            self.backend_api_key()
        except ConfigError as e:
            raise ValueError(str(e)) from None
        return self

    @property
    def index_auth(self) -> IndexAuth:
        return IndexAuth(username=self.index_username, password_env=self.index_password_env,
                         password_file=self.index_password_file, tls_ca_file=self.index_tls_ca_file,
                         tls_cert_file=self.index_tls_cert_file, tls_key_file=self.index_tls_key_file)

    def api_key(self) -> str | None:
        """The key clients must present, read now; ``None``: clients need none."""
        return read_secret(self.api_key_env, self.api_key_file, "api_key")

    def backend_api_key(self) -> str | None:
        """The key sent to the backends, read now; ``None``: the client's header is passed on."""
        return read_secret(self.backend_api_key_env, self.backend_api_key_file, "backend_api_key")

    @model_validator(mode="after")
    def unique_names(self) -> RouterConfig:
        if self.prefill or self.decode:
            if not self.prefill or not self.decode:
                missing = "prefill" if not self.prefill else "decode"
                raise ValueError(f"{missing}: P/D mode needs at least one prefill and one decode server")
            if self.backends:
                raise ValueError("backends: leave it out in P/D mode (prefill: and decode: name the servers)")
        elif not self.backends:
            raise ValueError("backends: at least one backend is needed (or prefill: and decode: groups)")
        names = [b.name for b in (*self.backends, *self.prefill, *self.decode)]
        if len(set(names)) != len(names):
            raise ValueError(f"backends: names must be unique (across prefill and decode too), got {names}")
        return self

    @property
    def pd(self) -> bool:
        """P/D mode: requests are prefilled on the prefill group, decoded on the decode group."""
        return bool(self.prefill)

    def group(self, name: str) -> RouterConfig:
        """This config routing over ``name`` ('prefill' or 'decode') as its backends."""
        return self.model_copy(update={"backends": list(getattr(self, name)), "prefill": [], "decode": []})

    @property
    def host(self) -> str:
        return self.listen.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.listen.rsplit(":", 1)[1])

    @classmethod
    def from_mapping(cls, raw: Any, *, source: str = "router config") -> RouterConfig:
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            first = e.errors()[0]
            key = ".".join(str(p) for p in first["loc"]) or "(top level)"
            allowed = ""
            if first["type"] == "extra_forbidden":
                allowed = f"; allowed keys here: {', '.join(_allowed_keys(first['loc']))}"
            # A validator's own message, without pydantic's "Value error, " before it.
            msg = str(first["ctx"]["error"]) if first["type"] == "value_error" else first["msg"]
            raise ConfigError(f"{source}: {key}: {msg}{allowed}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> RouterConfig:
        p = Path(path)
        try:
            raw = yaml.safe_load(p.read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"{p}: cannot read the router config: {e}") from None
        return cls.from_mapping(raw, source=str(p))


def _allowed_keys(loc: tuple[int | str, ...]) -> list[str]:
    model: type[BaseModel] = RouterConfig
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        ann = model.model_fields[str(part)].annotation
        inner = getattr(ann, "__args__", (ann,))
        nested = [a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)]
        if not nested:
            break
        model = nested[0]
    return sorted(model.model_fields)
