"""Mutual TLS between a client and a real service, with a throwaway CA.

With DOCKYARD_TLS_CERT/KEY/CA set, the service speaks only TLS and accepts only
clients whose certificate its CA signed: a client presenting one (and the
token) is served, health included; a plaintext client, a client without a
certificate and a client whose certificate another CA signed are all refused
at the handshake.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dockyard.api.buffer.v1 import buffer_pb2, buffer_pb2_grpc
from dockyard.rpc.auth import AuthSettings
from dockyard.rpc.client import channel_health, connect, health_status
from tests.conftest import REPO_ROOT, expect_code, free_port

TOKEN = "mtls-token-42"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key) -> bytes:
    pkcs8 = serialization.PrivateFormat.PKCS8
    return key.private_bytes(serialization.Encoding.PEM, pkcs8, serialization.NoEncryption())


def make_ca(folder: Path, name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(key, hashes.SHA256())
    )
    (folder / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert


def issue(folder: Path, name: str, ca: tuple[ec.EllipticCurvePrivateKey, x509.Certificate]) -> tuple[Path, Path]:
    """A certificate for `name` valid as server (localhost, 127.0.0.1) and as client."""
    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    san = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    usage = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(san, critical=False)
        .add_extension(usage, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = folder / f"{name}.crt", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(_pem_key(key))
    return cert_path, key_path


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, AuthSettings]:
    ca = make_ca(tmp_path, "dockyard-ca")
    rogue = make_ca(tmp_path, "rogue-ca")
    settings = {}
    # Every party trusts dockyard-ca; the rogue's own certificate is signed by another CA.
    for name, authority in (("buffer", ca), ("client", ca), ("rogue", rogue)):
        cert, key = issue(tmp_path, name, authority)
        settings[name] = AuthSettings(
            auth_token=TOKEN, tls_cert=str(cert), tls_key=str(key), tls_ca=str(tmp_path / "dockyard-ca.pem")
        )
    return settings


@pytest.fixture
def buffer(pki: dict[str, AuthSettings], tmp_path: Path):
    port = free_port()
    server = pki["buffer"]
    env = {
        **os.environ,
        "DOCKYARD_BUFFER_PORT": str(port),
        "DOCKYARD_AUTH_TOKEN": TOKEN,
        "DOCKYARD_TLS_CERT": server.tls_cert,
        "DOCKYARD_TLS_KEY": server.tls_key,
        "DOCKYARD_TLS_CA": server.tls_ca,
    }
    log = open(tmp_path / "buffer.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.buffer"], env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT
    )
    yield f"localhost:{port}", proc
    proc.terminate()
    proc.wait(20)
    log.close()


async def wait_serving(address: str, auth: AuthSettings, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    async with connect(address, auth=auth) as channel:
        while await channel_health(channel, timeout=1.0) != "SERVING":
            assert proc.poll() is None, "the buffer exited"
            assert time.monotonic() < deadline, "the buffer did not serve within 60 s"
            await asyncio.sleep(0.1)


async def test_mutual_tls(buffer, pki: dict[str, AuthSettings], monkeypatch: pytest.MonkeyPatch) -> None:
    address, proc = buffer
    await wait_serving(address, pki["client"], proc)
    # health_status (what `dockyard up` waits with) takes its transport from the environment.
    assert await health_status(address) == "UNREACHABLE"
    client = pki["client"]
    for variable, value in (("CERT", client.tls_cert), ("KEY", client.tls_key), ("CA", client.tls_ca)):
        monkeypatch.setenv(f"DOCKYARD_TLS_{variable}", value)
    assert await health_status(address) == "SERVING"
    request = buffer_pb2.GetStatsRequest(job_id="job-1")
    async with connect(address, default_timeout=10, auth=pki["client"]) as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        await stub.OpenJob(buffer_pb2.OpenJobRequest(job_id="job-1", max_groups=2, max_trajectory_age_steps=1))
        assert (await stub.GetStats(request)).held == 0
    # TLS does not replace the token: both are checked.
    no_token = AuthSettings(tls_cert=client.tls_cert, tls_key=client.tls_key, tls_ca=client.tls_ca)
    async with connect(address, default_timeout=10, auth=no_token) as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        await expect_code(stub.GetStats(request), grpc.StatusCode.UNAUTHENTICATED, "missing credentials")
        assert await channel_health(channel) == "SERVING"

    ca = Path(pki["client"].tls_ca).read_bytes()
    refused = {
        "plaintext": grpc.aio.insecure_channel(address),
        "no client certificate": grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca)),
        "certificate of another CA": connect(address, auth=pki["rogue"]),
    }
    for what, channel in refused.items():
        async with channel:
            stub = buffer_pb2_grpc.BufferServiceStub(channel)
            metadata = (("authorization", f"Bearer {TOKEN}"),)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetStats(request, metadata=metadata, timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, (what, info.value.details())
