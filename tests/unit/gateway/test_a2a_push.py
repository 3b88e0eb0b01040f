"""Push notifications without a mesh: the allow-list (gateway/a2a/push_config.py), which URLs a config
may name, and the signing key (gateway/a2a/push_signing.py)."""

from __future__ import annotations

from pathlib import Path

import jwt
import pytest
from a2a.types import a2a_pb2 as a2a
from a2a.utils.errors import InvalidParamsError
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from agentmesh.gateway.a2a.push_config import check_config, url_allowed
from agentmesh.gateway.a2a.push_signing import PushSigner

ALLOWED = ["https://hooks.example/a2a/", "http://127.0.0.1:9000/in"]


@pytest.mark.parametrize(
    "url",
    [
        "https://hooks.example/a2a/done",
        "https://HOOKS.example:443/a2a/x/y?task=1",
        "https://hooks.example/a2a/",
        "http://127.0.0.1:9000/in",
        "http://127.0.0.1:9000/in/more",
    ],
)
def test_allowed(url: str) -> None:
    assert url_allowed(url, ALLOWED)


@pytest.mark.parametrize(
    "url",
    [
        "http://hooks.example/a2a/done",  # another scheme
        "https://hooks.example:8443/a2a/done",  # another port
        "https://hooks.example.evil/a2a/done",
        "https://hooks.example/a2b",
        "https://hooks.example/a2a/../admin",  # resolves outside the prefix
        "https://hooks.example/a2a/%2e%2e/admin",
        "https://hooks.example/a2a\\..\\admin",
        "http://127.0.0.1:9000/inside",  # not under /in by segments
        "http://127.0.0.1:9001/in",
        "http://localhost:9000/in",
        "https://user:pw@hooks.example/a2a/x",
        "file:///etc/passwd",
        "gopher://hooks.example/a2a/",
        "https://hooks.example/a2a/x\n",
        "not a url",
        "",
    ],
)
def test_refused(url: str) -> None:
    assert not url_allowed(url, ALLOWED)


def test_nothing_is_allowed_by_default() -> None:
    with pytest.raises(InvalidParamsError) as err:
        check_config(a2a.TaskPushNotificationConfig(url="https://hooks.example/a2a/x"), [])
    assert "AGENTMESH_A2A__PUSH_ALLOWED_URLS allows no URL" in str(err.value.message)


def test_bounds_and_refusals_name_the_setting() -> None:
    with pytest.raises(InvalidParamsError) as refused:
        check_config(a2a.TaskPushNotificationConfig(url="http://10.0.0.1/x"), ALLOWED)
    assert "AGENTMESH_A2A__PUSH_ALLOWED_URLS" in str(refused.value.message)
    with pytest.raises(InvalidParamsError) as long_token:
        check_config(a2a.TaskPushNotificationConfig(url=ALLOWED[0] + "x", token="t" * 2000), ALLOWED)
    assert "token is longer" in str(long_token.value.message)
    with pytest.raises(InvalidParamsError):
        check_config(a2a.TaskPushNotificationConfig(url=""), ALLOWED)
    check_config(a2a.TaskPushNotificationConfig(url=ALLOWED[0] + "x", token="t"), ALLOWED)  # fine


def test_a_key_file_gives_every_replica_the_same_kid(tmp_path: Path) -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = tmp_path / "push.pem"
    pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    one, two = PushSigner(str(pem)), PushSigner(str(pem))
    assert one.jwk["kid"] == two.jwk["kid"] and "d" not in one.jwk
    token = one.sign(issuer="http://gw", audience="https://hooks.example/a2a/x", task_id="t", body=b"{}")
    public = jwt.PyJWKSet.from_dict(two.jwks())[one.jwk["kid"]].key
    claims = jwt.decode(
        token, public, algorithms=["RS256"], audience="https://hooks.example/a2a/x", issuer="http://gw"
    )
    assert claims["task_id"] == "t" and claims["exp"] - claims["iat"] == 300
    assert PushSigner().jwk["kid"] != one.jwk["kid"]  # no file: a key of its own


def test_a_key_file_that_is_not_rsa_is_refused(tmp_path: Path) -> None:
    pem = tmp_path / "ec.pem"
    pem.write_bytes(
        ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    with pytest.raises(ValueError, match="RSA private key"):
        PushSigner(str(pem))
