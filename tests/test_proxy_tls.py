"""The proxy actor's own wiring of issue 29 (run as a plain object: no engines, no Ray calls):
TLS from proxy.ssl_certfile/ssl_keyfile (uvicorn's), and API keys handed over as the launcher
does (through the actor's arguments, not the config)."""
from __future__ import annotations

import datetime
import ssl

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from pd_cluster.serving.cluster.proxy_actor import ProxyActor


def _self_signed(tmp_path) -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(__import__("ipaddress").ip_address("127.0.0.1"))]), False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def test_tls_and_keys_handed_through_the_actor(tmp_path) -> None:
    cert, key = _self_signed(tmp_path)
    config = {"mode": "colocated", "colocated": {"replicas": 1},
              "proxy": {"host": "127.0.0.1", "port": 0, "ssl_certfile": cert,
                        "ssl_keyfile": key, "log_stats_interval": 0}}
    proxy = ProxyActor(config, [], "unused", {"api_keys": ["handed-over"]})
    try:
        url = proxy.url()
        assert url.startswith("https://127.0.0.1:")
        trust = ssl.create_default_context(cafile=cert)
        with httpx.Client(verify=trust, timeout=10) as http:
            assert http.get(f"{url}/health").status_code == 200  # open, over TLS
            assert http.get(f"{url}/v1/models").status_code == 401
            ok = http.get(f"{url}/v1/models", headers={"Authorization": "Bearer handed-over"})
            assert ok.status_code == 200
        try:  # plain http to the TLS port is not served
            httpx.get(url.replace("https", "http") + "/health", timeout=5)
            raise AssertionError("plain http was served")
        except httpx.HTTPError:
            pass
    finally:
        proxy.stop()
