"""Client arguments from the settings: the one place that knows how adstream reaches Kafka, Redis
and ClickHouse (addresses, SASL, TLS, users and passwords).

Every room builds its clients from these dicts (`AIOKafkaProducer(**kafka_args(s), acks="all")`,
`redis.Redis.from_url(**redis_args(s))`, `clickhouse_driver.Client(**clickhouse_args(s, db))`),
so a secured cluster is reached by settings alone. The functions are pure (no connection is
made) except `check_kafka`, the start-up probe that turns "no broker answers" into one
`BrokerError`; only the standard library is imported here, client libraries inside the functions
that need them.

>>> s = Settings(kafka={"security_protocol": "SASL_PLAINTEXT", "sasl_username": "u",
...                     "sasl_password": "p", "sasl_mechanism": "SCRAM-SHA-512"})
>>> args = kafka_args(s)
>>> args["security_protocol"], args["sasl_mechanism"], args["sasl_plain_username"]
('SASL_PLAINTEXT', 'SCRAM-SHA-512', 'u')
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlunparse

from schemas.errors import BrokerError, ConfigError
from schemas.settings import Settings

SASL_PROTOCOLS = frozenset({"SASL_PLAINTEXT", "SASL_SSL"})
TLS_PROTOCOLS = frozenset({"SSL", "SASL_SSL"})


def tls_context(
    field: str,
    cafile: Path | None,
    certfile: Path | None = None,
    keyfile: Path | None = None,
    key_password: str | None = None,
    check_hostname: bool = True,
) -> ssl.SSLContext:
    """A verifying client TLS context (system CAs unless `cafile`); ConfigError naming the
    settings `field` when a file is missing or unreadable."""
    if keyfile is not None and certfile is None:
        raise ConfigError(f"{field}_keyfile is set ({str(keyfile)!r}) but {field}_certfile is not")
    try:
        ctx = ssl.create_default_context(cafile=str(cafile) if cafile else None)
        if certfile is not None:
            ctx.load_cert_chain(str(certfile), str(keyfile) if keyfile else None, key_password or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{field}: cannot load TLS files ({exc})") from exc
    ctx.check_hostname = check_hostname
    return ctx


# -- Kafka ------------------------------------------------------------------------------------
def kafka_args(settings: Settings) -> dict[str, Any]:
    """Keyword arguments for aiokafka's `AIOKafkaProducer`, `AIOKafkaConsumer` and
    `AIOKafkaAdminClient`: bootstrap servers, security protocol, SASL and a TLS context."""
    s = settings
    proto = s.kafka.security_protocol
    args: dict[str, Any] = {"bootstrap_servers": s.kafka.bootstrap, "security_protocol": proto}
    if proto in SASL_PROTOCOLS:
        if not s.kafka.sasl_username:
            raise ConfigError(
                f"kafka.sasl_username is empty but kafka.security_protocol is {proto!r} (SASL needs a user)"
            )
        args["sasl_mechanism"] = s.kafka.sasl_mechanism
        args["sasl_plain_username"] = s.kafka.sasl_username
        args["sasl_plain_password"] = s.kafka.sasl_password.get_secret_value()
    if proto in TLS_PROTOCOLS:
        args["ssl_context"] = kafka_tls_context(s)
    else:
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            if getattr(s.kafka, name) is not None:
                raise ConfigError(
                    f"kafka.{name} is set but kafka.security_protocol is {proto!r} (TLS: SSL or SASL_SSL)"
                )
    return args


def group_args(settings: Settings) -> dict[str, Any]:
    """Keyword arguments of an aiokafka consumer in a consumer group: the session timeout and
    heartbeat period (`kafka.session_timeout_ms`, `kafka.heartbeat_interval_ms`)."""
    k = settings.kafka
    return {"session_timeout_ms": k.session_timeout_ms, "heartbeat_interval_ms": k.heartbeat_interval_ms}


def fetch_args(settings: Settings) -> dict[str, Any]:
    """Keyword arguments of every aiokafka consumer: how long a fetch may wait for new records
    (`kafka.fetch_max_wait_ms`; a record produced meanwhile waits as long, at every hop)."""
    return {"fetch_max_wait_ms": settings.kafka.fetch_max_wait_ms}


def kafka_tls_context(settings: Settings) -> ssl.SSLContext:
    """The TLS context for the Kafka brokers (CA, optional client certificate)."""
    s = settings
    return tls_context(
        "kafka.ssl",
        s.kafka.ssl_cafile,
        s.kafka.ssl_certfile,
        s.kafka.ssl_keyfile,
        s.kafka.ssl_key_password.get_secret_value(),
        s.kafka.ssl_check_hostname,
    )


async def check_kafka(settings: Settings) -> None:
    """Ask the brokers at `kafka.bootstrap` for cluster metadata, with these settings' security;
    `BrokerError` naming the address (and what to do) when none answers within
    `kafka.connect_timeout_s`. Commands call it before they build anything that needs Kafka, so
    a broker that is down is one clear line, not a client library's traceback."""
    import asyncio

    from aiokafka import AIOKafkaClient
    from aiokafka.errors import KafkaError

    timeout_s = settings.kafka.connect_timeout_s
    client = AIOKafkaClient(**kafka_args(settings), request_timeout_ms=int(timeout_s * 1000))
    try:
        await asyncio.wait_for(client.bootstrap(), timeout_s)
    except (KafkaError, OSError, TimeoutError) as exc:
        reason = str(exc) or type(exc).__name__
        raise BrokerError(
            f"Kafka at {settings.kafka.bootstrap} did not answer within {timeout_s:g} s ({reason}); "
            "start the local stack with `adstream up`, or point ADSTREAM_KAFKA__BOOTSTRAP at your brokers"
        ) from exc
    finally:
        await client.close()


def require_kafka(settings: Settings) -> None:
    """`check_kafka` for a synchronous command (runs its own event loop)."""
    import asyncio

    asyncio.run(check_kafka(settings))


def faust_args(settings: Settings) -> dict[str, Any]:
    """`faust.App(...)` keyword arguments: `broker` URLs, `broker_credentials` (None on PLAINTEXT),
    and the consumer group's session timeout and heartbeat (`group_args`, in seconds)."""
    s = settings
    args: dict[str, Any] = {
        "broker": [f"kafka://{h.strip()}" for h in s.kafka.bootstrap.split(",") if h.strip()],
        "broker_credentials": None,
        "broker_session_timeout": s.kafka.session_timeout_ms / 1000,
        "broker_heartbeat_interval": s.kafka.heartbeat_interval_ms / 1000,
    }
    kafka = kafka_args(s)  # the same checks and TLS context as every aiokafka client
    proto = s.kafka.security_protocol
    if proto in SASL_PROTOCOLS:
        from faust.auth import SASLCredentials

        args["broker_credentials"] = SASLCredentials(
            username=kafka["sasl_plain_username"],
            password=kafka["sasl_plain_password"],
            ssl_context=kafka.get("ssl_context"),
            mechanism=kafka["sasl_mechanism"],
        )
    elif proto == "SSL":
        from faust.auth import SSLCredentials

        args["broker_credentials"] = SSLCredentials(kafka["ssl_context"])
    return args


# -- Redis ------------------------------------------------------------------------------------
def redis_args(settings: Settings) -> dict[str, Any]:
    """Keyword arguments for `redis.Redis.from_url(**args)` (sync or `redis.asyncio`): the URL
    plus auth and TLS options. Settings win over what the URL carries (redis-py lets the URL
    override keyword arguments, so credentials given by settings are taken out of the URL)."""
    s = settings
    url = urlparse(s.redis.url)
    if url.scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(f"redis.url: scheme {url.scheme!r} is not redis://, rediss:// or unix://")
    tls = s.redis.tls or url.scheme == "rediss"
    if tls and url.scheme == "unix":
        raise ConfigError("redis.tls is on but redis.url is a unix socket")
    args: dict[str, Any] = {}
    password = s.redis.password.get_secret_value()
    if password or s.redis.username:
        netloc = url.hostname or ""
        if ":" in netloc:  # IPv6 literal
            netloc = f"[{netloc}]"
        if url.port:
            netloc += f":{url.port}"
        url = url._replace(netloc=netloc)
        args["username"] = s.redis.username or None
        args["password"] = password or None
    if tls:
        url = url._replace(scheme="rediss")
        args["ssl_cert_reqs"] = "required"
        args["ssl_check_hostname"] = s.redis.tls_check_hostname
        if s.redis.tls_cafile is not None:
            args["ssl_ca_certs"] = str(s.redis.tls_cafile)
        if s.redis.tls_certfile is not None:
            args["ssl_certfile"] = str(s.redis.tls_certfile)
        if s.redis.tls_keyfile is not None:
            args["ssl_keyfile"] = str(s.redis.tls_keyfile)
    elif s.redis.tls_cafile or s.redis.tls_certfile or s.redis.tls_keyfile:
        raise ConfigError("redis.tls_* files are set but TLS is off (set redis.tls or use rediss://)")
    return {"url": urlunparse(url), **args}


# -- ClickHouse -------------------------------------------------------------------------------
def redacted_url(url: str) -> str:
    """`url` with its password (if any) replaced by `***`, for messages and logs.

    >>> redacted_url("clickhouse://ads:s3cret@db.internal:9000/adstream")
    'clickhouse://ads:***@db.internal:9000/adstream'
    >>> redacted_url("redis://127.0.0.1:6379/0")
    'redis://127.0.0.1:6379/0'
    """
    parts = urlparse(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunparse(parts._replace(netloc=netloc))


def clickhouse_args(settings: Settings, database: str | None = None) -> dict[str, Any]:
    """clickhouse-driver `Client(**args)` for `settings.clickhouse.url` (bound to `database`, or
    to `default` when None), with the user, password and TLS the settings name."""
    s = settings
    url = urlparse(s.clickhouse.url)
    if url.scheme not in ("clickhouse", "clickhouses"):
        raise ConfigError(f"clickhouse.url: scheme {url.scheme!r} is not clickhouse:// or clickhouses://")
    secure = s.clickhouse.secure or url.scheme == "clickhouses"
    args: dict[str, Any] = {
        "host": url.hostname or "127.0.0.1",
        "port": url.port or (9440 if secure else 9000),
        "user": s.clickhouse.user or url.username or "default",
        "password": s.clickhouse.password.get_secret_value() or url.password or "",
        "database": database or "default",
        "connect_timeout": 5,
    }
    if secure:
        args["secure"] = True
        args["verify"] = s.clickhouse.verify
        for key, value in (
            ("ca_certs", s.clickhouse.ca_certs),
            ("certfile", s.clickhouse.certfile),
            ("keyfile", s.clickhouse.keyfile),
        ):
            if value is not None:
                args[key] = str(value)
    elif s.clickhouse.ca_certs or s.clickhouse.certfile or s.clickhouse.keyfile:
        raise ConfigError(
            "clickhouse TLS files are set but TLS is off (set clickhouse.secure or use clickhouses://)"
        )
    return args


def clickhouse_database(settings: Settings | str) -> str:
    """The events database named in `clickhouse.url` (settings or the URL itself; default
    `adstream`): the one place its name is read. ConfigError if it is not a plain identifier (it
    is spliced into DDL).

    >>> clickhouse_database("clickhouse://127.0.0.1:9000/ads_test")
    'ads_test'
    >>> clickhouse_database("clickhouse://127.0.0.1:9000")
    'adstream'
    """
    url = settings if isinstance(settings, str) else settings.clickhouse.url
    name = urlparse(url).path.strip("/") or "adstream"
    # ASCII only: `str.isalnum` alone takes any script's letters and digits ("ads٣", "café")
    if not (name.isascii() and name.replace("_", "").isalnum()):
        raise ConfigError(f"clickhouse.url: database name {name!r} must be ASCII letters, digits or _")
    return name


def clickhouse_client(settings: Settings, database: str | None = None, /, **options: Any) -> Any:
    """The one way every room connects to ClickHouse: a clickhouse-driver `Client` for the
    settings' URL, user, password and TLS (`clickhouse_args`), bound to `database` (`default`
    when None; the events database is `clickhouse_database(settings)`). `options` are the
    driver's own (`settings={...}`, `send_receive_timeout`, a shorter `connect_timeout`)."""
    from clickhouse_driver import Client

    return Client(**{**clickhouse_args(settings, database), **options})
