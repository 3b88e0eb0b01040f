"""Mesh configuration: one typed settings object, read from AGENTMESH_* environment variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DRAIN_SETTLE_S = 5.0  # after the shutdown grace, a drain settles what it cut short within this


class Addresses(BaseModel):
    """Where each service is reached (host:port, `dns:///name:port`, or `ipv4:a:p,b:q` for several
    replicas), and where it listens unless `listen` says otherwise. Port 0 lets the OS pick (tests)."""

    orchestrator: str = "127.0.0.1:50051"
    agent_runtime: str = "127.0.0.1:50052"
    trace: str = "127.0.0.1:50053"
    stream: str = "127.0.0.1:50054"


class Listen(BaseModel):
    """Where each service binds when that is not its address in `addresses`: in a container it binds
    0.0.0.0:PORT while the others dial its Service's DNS name. Empty: the address in `addresses`."""

    orchestrator: str = ""
    agent_runtime: str = ""
    trace: str = ""
    stream: str = ""


class MetricsAddresses(BaseModel):
    """Where each gRPC service serves Prometheus text at GET /metrics (host:port); empty: no metrics
    server. (The gateway serves /metrics on its own HTTP port.)"""

    orchestrator: str = ""
    agent_runtime: str = ""
    trace: str = ""
    stream: str = ""


class LLMSettings(BaseModel):
    """The OpenAI-compatible model endpoint."""

    base_url: str = "http://127.0.0.1:8090/v1"
    api_key: str = "sk-agentmesh-local"
    request_timeout_s: float = 60.0
    max_retries: int = 0


class StreamSettings(BaseModel):
    """Live buffers."""

    backend: str = "memory"  # memory | redis
    ttl_s: float = 3600.0  # closed buffers expire after this long
    lease_s: float = 30.0  # an open buffer with no append or renewal for this long is closed (interrupted)
    max_events: int = 100_000  # size cap of one buffer
    # The memory backend keeps closed buffers (for late readers) until their TTL, but never more than
    # these: past either cap the oldest closed are dropped first (docs/design/streams.md#closed-buffers).
    max_closed_buffers: int = Field(default=10_000, ge=0)
    max_closed_bytes: int = Field(default=128 * 1024 * 1024, ge=0)  # their events' serialized size
    idle_timeout_ms: int = 300_000  # an idle subscription of an open buffer ends with an error
    heartbeat_s: float = 15.0  # SSE comment interval at the gateway
    redis_prefix: str = "agentmesh:"  # namespace of this mesh's keys in a shared Redis
    # Connections a stream service holds to Redis at most; a command waits for a free one. Its live
    # subscriptions share one (docs/design/streams.md#the-service-side).
    redis_max_connections: int = Field(default=100, ge=2)
    # A process's writes (its runs' events) go out at most this often once a batch went, so that the
    # events of many runs streaming at once share a message; a buffer's first batch goes at once.
    linger_ms: float = 10.0
    # A stream service that went away (restarted, a replica lost): writers and followers wait this long
    # for one to answer again, then go on from where they were (docs/design/streams.md#reconnects).
    reconnect_s: float = 15.0


class SubagentDefaults(BaseModel):
    """Global subagent defaults (docs/requirements.md#subagent-global-defaults)."""

    enabled: bool = True
    max_concurrent: int = 3
    timeout_ms: int = 120_000
    # Background children (docs/agents.md#background-subagents): at most this many queued or running
    # per supervisor agent and trace (a delegate call past it is refused, creating nothing), each
    # with this deadline of its own instead of timeout_ms (the child agent's own limit applies too).
    max_background: int = 4
    background_timeout_ms: int = 600_000
    blocked_tool_names: list[str] = Field(
        default_factory=lambda: [
            "delegate_task",
            "delegate_parallel",
            "clarify",
            "memory_save",
            "memory_recall",
        ]
    )


class FederationSettings(BaseModel):
    """Calls to peer meshes (remote traces, remote agents): bounds on every request."""

    timeout_s: float = 10.0  # one HTTP request to a peer (connect, read, write)
    connect_timeout_s: float = 3.0
    read_retries: int = 2  # extra attempts of an idempotent read (never of a write), with backoff
    backoff_s: float = 0.2  # the first retry's delay; doubles
    max_response_bytes: int = 32 * 1024 * 1024  # a larger answer (decompressed) is refused
    page_size: int = 1000  # messages per page when syncing a remote trace
    # A peer that did not answer (refused, cut, timed out) is marked down: reads answer from the cache
    # at once, writes fail at once, and one background probe (GET /healthz) per peer finds it back, first
    # after down_s, then at doubling intervals up to probe_max_s (down_s 0: no memo, dial every time).
    down_s: float = 2.0
    probe_max_s: float = 30.0
    # A read of a peer's trace whose cached copy exists waits this long for the peer, then answers from
    # the copy (stale) while the sync goes on in the background.
    cached_read_wait_s: float = 0.8
    # What a call to a peer leaves of its caller's deadline, to answer from the copy or with an error.
    deadline_margin_s: float = 0.5


class A2ASettings(BaseModel):
    """The gateway's A2A server (gateway/a2a): the gRPC binding's own port and what agent cards say."""

    grpc_listen: str = "127.0.0.1:50055"  # where the gateway serves lf.a2a.v1.A2AService; empty: not at all
    grpc_url: str = ""  # the gRPC address cards advertise; empty: the bound address
    public_url: str = ""  # the gateway's base URL in cards (behind a proxy); empty: the request's
    default_agent: str = "general"  # the agent of GET /.well-known/agent-card.json
    # Push notifications (docs/a2a.md): the URL prefixes a client's push config may name; empty: none is
    # allowed, and a push config is refused. An entry matches a URL of its scheme, host and port whose
    # path starts with the entry's path.
    push_allowed_urls: list[str] = Field(default_factory=list)
    push_timeout_s: float = 10.0  # one notification POST (connect, send, answer)
    push_retries: int = 5  # extra attempts of a notification the receiver did not take (5xx, 429, down)
    push_backoff_s: float = 0.5  # the first retry's delay; doubles, at most push_max_backoff_s
    push_max_backoff_s: float = 30.0
    # The PEM file of the RSA key that signs notification JWTs (its public half served as JWKS at
    # /.well-known/jwks.json); empty: a key generated per gateway process at start.
    push_signing_key_file: str = ""
    # Push notifications of the remote tasks WE call (docs/a2a.md#push-notifications-of-remote-tasks):
    # when on and the remote agent's card says pushNotifications, agent-invoke sends the message without
    # holding a stream and takes the remote task's notifications at POST {push_receiver_url}/<id> of this
    # gateway (no stream held open). Off: every remote task is followed over a stream, as before.
    push_receive: bool = False
    # The receiver's public URL (what the remote agent POSTs to); empty: {public_url}/a2a/push, else
    # http://{gateway_host}:{gateway_port}/a2a/push. The remote's allow-list must name it.
    push_receiver_url: str = ""
    # With no notification for this long, the remote task is read with GetTask (a missed notification
    # cannot hang a turn: the turn's deadline bounds the wait as for a stream).
    push_poll_s: float = Field(default=10.0, gt=0)
    push_jwks_ttl_s: float = 300.0  # how long the receiver keeps a remote agent's JWKS
    push_max_age_s: float = 300.0  # a notification JWT issued longer ago than this (iat) is refused


class MeshSettings(BaseSettings):
    """Everything a service reads at start; passed in, never read twice."""

    model_config = SettingsConfigDict(env_prefix="AGENTMESH_", env_nested_delimiter="__", extra="ignore")

    data_dir: Path = Path(".agentmesh")
    database_url: str = ""  # empty: SQLite file in data_dir
    redis_url: str = "redis://127.0.0.1:6379/0"
    mesh_secret: str = ""  # HMAC key of caller identities; empty: <data_dir>/mesh_secret (created once)
    catalog: Path = Path(__file__).resolve().parent.parent / "services" / "trace" / "demo_catalog.yaml"
    addresses: Addresses = Field(default_factory=Addresses)
    listen: Listen = Field(default_factory=Listen)
    metrics: MetricsAddresses = Field(default_factory=MetricsAddresses)
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 8080
    # host:port where the gateway serves GET /metrics instead of its public port; empty: the public port
    gateway_metrics_listen: str = ""
    llm: LLMSettings = Field(default_factory=LLMSettings)
    stream: StreamSettings = Field(default_factory=StreamSettings)
    subagent: SubagentDefaults = Field(default_factory=SubagentDefaults)
    peers: str = ""  # the peer registry file (libs/peers.py); empty: no peers, nothing is contacted
    federation: FederationSettings = Field(default_factory=FederationSettings)
    a2a: A2ASettings = Field(default_factory=A2ASettings)
    rpc_timeout_s: float = 10.0  # deadline of every unary RPC
    stream_rpc_timeout_s: float = 3600.0  # deadline of every server-streaming RPC
    # A server sends GOAWAY to a connection this old (in-flight calls finish on it), so clients
    # reconnect and re-resolve: round_robin over a DNS name then reaches replicas added since. 0: never.
    max_connection_age_s: float = 300.0
    turn_timeout_s: float = 600.0  # a whole chat turn
    # Turns a user or an A2A client may have running on one orchestrator replica at once (their callees'
    # and subagents' turns are not counted: a tree runs whole); past it a new one is refused (429). 0: no
    # limit.
    max_turns: int = 2000
    retry_after_s: int = 2  # what a refused turn's Retry-After says
    lease_s: float = 30.0  # work in progress whose runner stopped renewing it for this long is settled
    shutdown_grace_s: float = 10.0  # drain in-flight streams on SIGTERM
    log_level: str = "INFO"
    log_json: bool | None = None  # JSON lines; empty: JSON unless stderr is a terminal (libs/log.py)
    gateway_access_log: bool = False  # a log line per HTTP request at the gateway (uvicorn's access log)

    @property
    def push_receiver_url(self) -> str:
        """Where remote A2A agents POST the push notifications of the tasks we called them with."""
        if self.a2a.push_receiver_url:
            return self.a2a.push_receiver_url.rstrip("/")
        base = self.a2a.public_url.rstrip("/") or f"http://{self.gateway_host}:{self.gateway_port}"
        return f"{base}/a2a/push"

    def listen_address(self, service: str) -> str:
        """Where `service` (orchestrator, agent_runtime, trace, stream) binds: `listen`, else its address."""
        return getattr(self.listen, service) or getattr(self.addresses, service)

    @property
    def sqlalchemy_url(self) -> str:
        """The async SQLAlchemy URL: PostgreSQL via asyncpg when configured, else a SQLite file."""
        url = self.database_url
        if not url:
            return f"sqlite+aiosqlite:///{(self.data_dir / 'agentmesh.db').resolve()}"
        if url.startswith(("postgres://", "postgresql://")):
            return "postgresql+asyncpg://" + url.split("://", 1)[1]
        return url


def load_settings(**overrides: object) -> MeshSettings:
    """Reads the environment once; keyword overrides win (tests, CLI flags)."""
    return MeshSettings(**overrides)  # type: ignore[arg-type]
