"""TLS endpoints for people who prefer certificates: ``ssl:`` to listen, ``tls:`` to dial.

A self-signed certificate for 127.0.0.1 is made in the test; the node listens on an ``ssl:``
endpoint string through its twistd options, and the head library dials it with a ``tls:``
string that trusts that certificate (hostname checked against the certificate's IP address).
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path
from typing import Any

from twisted.internet import reactor
from twisted.trial.unittest import TestCase

from sfnode.head.fleet.backend import HeadRequest
from sfnode.head.link import HandshakeError, HeadIds, LinkSettings, connect_node
from sfnode.linkf.wire import FINISH_LENGTH
from sfnode.node import tap
from tests.nodefixture import expected_tokens

try:
    import OpenSSL  # noqa: F401
    import service_identity  # noqa: F401
except ImportError:  # pragma: no cover - the test extra installs both
    TLS_MISSING: str | None = "TLS needs pyOpenSSL and service_identity (twisted[tls])"
else:
    TLS_MISSING = None


def self_signed(folder: Path, name: str) -> Path:
    """A key and a self-signed certificate for 127.0.0.1 in one PEM file; returns its path."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    path = folder / f"{name}.pem"
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
        + certificate.public_bytes(serialization.Encoding.PEM)
    )
    return path


class TLSEndpointTests(TestCase):
    skip = TLS_MISSING

    def start_tls_node(self) -> tuple[int, Path]:
        folder = Path(self.mktemp())
        folder.mkdir(parents=True)
        pem = self_signed(folder, "node")
        options = tap.Options()
        options.parseOptions(
            [
                "--listen", f"ssl:0:privateKey={pem}:interface=127.0.0.1",
                "--engine", "mock", "--identity", "tls-node",
            ]
        )  # fmt: skip
        node = tap.makeService(options, reactor)
        node.startService()
        self.addCleanup(node.stopService)
        listen: Any = node.getServiceNamed("listen")
        return listen.port.getHost().port, pem

    async def test_a_node_on_an_ssl_endpoint_serves_a_head_dialing_tls(self) -> None:
        """A node listening on ``ssl:`` serves a head that dials ``tls:`` and trusts its
        certificate: the handshake names the node and a generation is correct."""
        port, pem = self.start_tls_node()
        roots = pem.parent / "roots"
        roots.mkdir()
        (roots / "node.pem").write_bytes(
            pem.read_bytes().split(b"-----END EC PRIVATE KEY-----\n")[1]
        )
        link = await connect_node(
            reactor, f"tls:127.0.0.1:{port}:trustRoots={roots}", ids=HeadIds()
        )
        self.addCleanup(link.close)
        self.assertEqual(link.node_identity, "tls-node")
        link.assign(1)
        link.append(1, [5, 6, 7])
        outcome = await link.generate(1, HeadRequest((), 8)).result
        self.assertEqual(
            (outcome.tokens, outcome.finish), (expected_tokens([5, 6, 7], 8), FINISH_LENGTH)
        )

    async def test_a_head_that_does_not_trust_the_certificate_fails(self) -> None:
        """A head whose trust roots lack the node's certificate fails at the handshake, with
        an error that names the TLS handshake (not a timeout)."""
        port, pem = self.start_tls_node()
        other = self_signed(pem.parent, "stranger")
        roots = pem.parent / "other-roots"
        roots.mkdir()
        (roots / "stranger.pem").write_bytes(
            other.read_bytes().split(b"-----END EC PRIVATE KEY-----\n")[1]
        )
        error = await self.assertFailure(
            connect_node(
                reactor,
                f"tls:127.0.0.1:{port}:trustRoots={roots}",
                ids=HeadIds(),
                # The refusal comes at once; the timeout is only a cap, kept far away so that a
                # loaded machine cannot turn the TLS failure into a handshake timeout.
                settings=LinkSettings(handshake_timeout_s=60.0),
            ),
            HandshakeError,
        )
        self.assertIn("TLS handshake", str(error))
        self.flushLoggedErrors()
