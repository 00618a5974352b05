"""schemas.clients: every Kafka security option, Redis auth/TLS and ClickHouse user/TLS mapped to
the client libraries' arguments, checked by constructing the real clients (no connection made)."""

from __future__ import annotations

import asyncio
import datetime as dt
import ssl
from pathlib import Path
from typing import Any

import pytest

from schemas.clients import clickhouse_args, faust_args, group_args, kafka_args, redis_args
from schemas.errors import ConfigError
from schemas.settings import Settings


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A self-signed CA and a client certificate + key signed by it (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    out = tmp_path_factory.mktemp("pki")
    now = dt.datetime.now(dt.UTC)

    def cert(subject: str, key: Any, issuer: str, issuer_key: Any, ca: bool) -> x509.Certificate:
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .sign(issuer_key, hashes.SHA256())
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    client_key = ec.generate_private_key(ec.SECP256R1())
    files = {"ca": out / "ca.pem", "cert": out / "client.pem", "key": out / "client.key"}
    files["ca"].write_bytes(
        cert("adstream-test-ca", ca_key, "adstream-test-ca", ca_key, True).public_bytes(
            serialization.Encoding.PEM
        )
    )
    files["cert"].write_bytes(
        cert("adstream-client", client_key, "adstream-test-ca", ca_key, False).public_bytes(
            serialization.Encoding.PEM
        )
    )
    files["key"].write_bytes(
        client_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return files


def _aiokafka_clients(args: dict[str, Any]) -> list[Any]:
    """Producer, consumer and admin client built from `args` (their constructors validate them)."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient

    async def build() -> list[Any]:
        return [AIOKafkaProducer(**args), AIOKafkaConsumer(**args), AIOKafkaAdminClient(**args)]

    return asyncio.run(build())


def test_kafka_plaintext_is_the_default() -> None:
    args = kafka_args(Settings(kafka={"bootstrap": "k1:9092,k2:9092"}))
    assert args == {"bootstrap_servers": "k1:9092,k2:9092", "security_protocol": "PLAINTEXT"}
    producer, consumer, _ = _aiokafka_clients(args)
    assert producer.client._security_protocol == "PLAINTEXT"
    assert consumer._client._bootstrap_servers == "k1:9092,k2:9092"


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_kafka_sasl_plaintext_each_mechanism(mechanism: str) -> None:
    s = Settings(
        kafka={
            "security_protocol": "SASL_PLAINTEXT",
            "sasl_mechanism": mechanism,
            "sasl_username": "svc-ads",
            "sasl_password": "s3cret",
        }
    )
    args = kafka_args(s)
    assert args["security_protocol"] == "SASL_PLAINTEXT" and "ssl_context" not in args
    assert (args["sasl_mechanism"], args["sasl_plain_username"], args["sasl_plain_password"]) == (
        mechanism,
        "svc-ads",
        "s3cret",
    )
    for client in _aiokafka_clients(args):
        inner = getattr(client, "client", None) or getattr(client, "_client", None)
        assert inner._sasl_mechanism == mechanism and inner._sasl_plain_password == "s3cret"
    assert "s3cret" not in repr(s)  # the secret stays masked in the settings


def test_kafka_sasl_ssl_with_ca_and_client_cert(pki: dict[str, Path]) -> None:
    s = Settings(
        kafka={
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-256",
            "sasl_username": "u",
            "sasl_password": "p",
            "ssl_cafile": pki["ca"],
            "ssl_certfile": pki["cert"],
            "ssl_keyfile": pki["key"],
            "ssl_check_hostname": False,
        }
    )
    args = kafka_args(s)
    ctx = args["ssl_context"]
    assert isinstance(ctx, ssl.SSLContext) and ctx.verify_mode == ssl.CERT_REQUIRED
    assert not ctx.check_hostname
    assert [c["subject"] for c in ctx.get_ca_certs()] == [((("commonName", "adstream-test-ca"),),)]
    producer, _, _ = _aiokafka_clients(args)
    assert producer.client._security_protocol == "SASL_SSL" and producer.client._ssl_context is ctx


def test_kafka_ssl_without_sasl_uses_system_cas_by_default() -> None:
    args = kafka_args(Settings(kafka={"security_protocol": "SSL"}))
    assert set(args) == {"bootstrap_servers", "security_protocol", "ssl_context"}
    assert args["ssl_context"].check_hostname and args["ssl_context"].verify_mode == ssl.CERT_REQUIRED
    _aiokafka_clients(args)


def test_kafka_misconfigurations_name_the_field(tmp_path: Path, pki: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match=r"kafka\.sasl_username"):
        kafka_args(Settings(kafka={"security_protocol": "SASL_SSL"}))
    with pytest.raises(ConfigError, match=r"kafka\.ssl_cafile is set but .* 'PLAINTEXT'"):
        kafka_args(Settings(kafka={"ssl_cafile": pki["ca"]}))
    with pytest.raises(ConfigError, match=r"kafka\.ssl: cannot load TLS files"):
        kafka_args(Settings(kafka={"security_protocol": "SSL", "ssl_cafile": tmp_path / "missing.pem"}))
    with pytest.raises(ConfigError, match=r"kafka\.ssl_keyfile is set"):
        kafka_args(Settings(kafka={"security_protocol": "SSL", "ssl_keyfile": pki["key"]}))


def test_faust_credentials_follow_the_kafka_settings(pki: dict[str, Path]) -> None:
    from faust.auth import SASLCredentials, SSLCredentials
    from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

    plain = faust_args(
        Settings(kafka={"bootstrap": "a:1, b:2", "session_timeout_ms": 6000, "heartbeat_interval_ms": 2000})
    )
    assert plain == {
        "broker": ["kafka://a:1", "kafka://b:2"],
        "broker_credentials": None,
        "broker_session_timeout": 6.0,
        "broker_heartbeat_interval": 2.0,
    }
    s = Settings(
        kafka={
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_username": "u",
            "sasl_password": "p",
            "ssl_cafile": pki["ca"],
        }
    )
    creds = faust_args(s)["broker_credentials"]
    assert isinstance(creds, SASLCredentials)
    auth = credentials_to_aiokafka_auth(creds)  # what Faust hands to aiokafka
    assert {k: auth[k] for k in ("security_protocol", "sasl_mechanism", "sasl_plain_username")} == {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "u",
    }
    assert auth["sasl_plain_password"] == "p" and isinstance(auth["ssl_context"], ssl.SSLContext)
    sasl_plain = faust_args(
        s.model_copy(
            update={
                "kafka": s.kafka.model_copy(
                    update={"security_protocol": "SASL_PLAINTEXT", "ssl_cafile": None}
                )
            }
        )
    )
    assert credentials_to_aiokafka_auth(sasl_plain["broker_credentials"])["security_protocol"] == (
        "SASL_PLAINTEXT"
    )
    tls = faust_args(Settings(kafka={"security_protocol": "SSL", "ssl_cafile": pki["ca"]}))
    assert isinstance(tls["broker_credentials"], SSLCredentials)
    assert credentials_to_aiokafka_auth(tls["broker_credentials"])["security_protocol"] == "SSL"


def test_redis_args_auth_and_tls(pki: dict[str, Path]) -> None:
    import redis

    assert redis_args(Settings(redis={"url": "redis://h:6380/2"})) == {"url": "redis://h:6380/2"}
    s = Settings(redis={"url": "redis://old:pw@h:6380/2", "username": "ads", "password": "new"})
    args = redis_args(s)
    assert args == {"url": "redis://h:6380/2", "username": "ads", "password": "new"}
    kw = redis.Redis.from_url(**args).connection_pool.connection_kwargs
    assert (kw["username"], kw["password"], kw["host"], kw["port"], kw["db"]) == ("ads", "new", "h", 6380, 2)
    tls = redis_args(
        Settings(
            redis={
                "url": "redis://h:6380/0",
                "tls": True,
                "tls_cafile": pki["ca"],
                "tls_certfile": pki["cert"],
                "tls_keyfile": pki["key"],
            }
        )
    )
    assert tls["url"] == "rediss://h:6380/0"
    pool = redis.Redis.from_url(**tls).connection_pool
    assert pool.connection_class is redis.SSLConnection
    assert pool.connection_kwargs["ssl_ca_certs"] == str(pki["ca"])
    assert pool.connection_kwargs["ssl_cert_reqs"] == "required"
    import redis.asyncio as aredis

    assert aredis.Redis.from_url(**tls).connection_pool.connection_class is aredis.SSLConnection
    assert redis_args(Settings(redis={"url": "rediss://h:6380/0"}))["ssl_check_hostname"] is True
    with pytest.raises(ConfigError, match=r"redis\.tls_"):
        redis_args(Settings(redis={"tls_cafile": pki["ca"]}))
    with pytest.raises(ConfigError, match=r"redis\.url: scheme 'http'"):
        redis_args(Settings(redis={"url": "http://h:6379"}))


def test_clickhouse_args_user_password_tls(pki: dict[str, Path]) -> None:
    from clickhouse_driver import Client

    s = Settings(clickhouse={"url": "clickhouse://u:url-pw@ch:9000/ads", "password": "settings-pw"})
    assert clickhouse_args(s, "ads")["password"] == "settings-pw"
    assert clickhouse_args(s)["user"] == "u"
    assert (
        clickhouse_args(
            s.model_copy(update={"clickhouse": s.clickhouse.model_copy(update={"user": "reader"})})
        )["user"]
        == "reader"
    )
    sec = clickhouse_args(
        Settings(clickhouse={"url": "clickhouses://ch/ads", "ca_certs": pki["ca"], "verify": False})
    )
    assert (sec["port"], sec["secure"], sec["verify"], sec["ca_certs"]) == (9440, True, False, str(pki["ca"]))
    conn = Client(**sec).connection
    assert conn.secure_socket and conn.ssl_options["ca_certs"] == str(pki["ca"])
    with pytest.raises(ConfigError, match="clickhouse TLS files"):
        clickhouse_args(Settings(clickhouse={"certfile": pki["cert"]}))
    with pytest.raises(ConfigError, match=r"clickhouse\.url: scheme 'http'"):
        clickhouse_args(Settings(clickhouse={"url": "http://ch:8123"}))


def test_group_timeouts_come_from_the_settings_and_the_heartbeat_stays_under_a_third() -> None:
    s = Settings(kafka={"session_timeout_ms": 45_000, "heartbeat_interval_ms": 3000})
    assert group_args(s) == {"session_timeout_ms": 45_000, "heartbeat_interval_ms": 3000}
    from aiokafka import AIOKafkaConsumer

    async def build() -> Any:
        return AIOKafkaConsumer(**kafka_args(s), **group_args(s), group_id="g")

    consumer = asyncio.run(build())  # aiokafka checks heartbeat < session itself
    assert (consumer._session_timeout_ms, consumer._heartbeat_interval_ms) == (45_000, 3000)
    with pytest.raises(ValueError, match=r"kafka\.heartbeat_interval_ms \(4000\) must be at most a third"):
        Settings(kafka={"session_timeout_ms": 10_000, "heartbeat_interval_ms": 4000})
