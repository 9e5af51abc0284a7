"""The authenticated frames of the driver-worker channel (:mod:`fedsim.engine.channel`).

Security. The driver makes a random 32-byte key ``K`` (from the OS) per worker
and hands it over through Ray. Each connection starts with a mutual handshake
(both parties prove knowledge of ``K``, neither learns anything from a party
that does not)::

    worker -> driver   hello   = PROTOCOL || n_w                         (n_w: 32 random bytes)
    driver -> worker   n_d || p_d,   p_d = HMAC(K, "driver proof" | hello | n_d)
    worker -> driver   p_w,          p_w = HMAC(K, "worker proof" | hello | n_d | p_d)

The worker answers only after ``p_d`` verifies, so an impostor driver gets no
proof to replay; the driver sends nothing but ``n_d || p_d`` before ``p_w``
verifies, and ``p_d`` is bound to the worker's fresh ``n_w``, so an impostor
worker gets nothing it can use. Both proofs cover the whole transcript. Each
direction then has its own key, ``HMAC(K, "driver->worker" | hello | n_d)``
and ``HMAC(K, "worker->driver" | hello | n_d)``, fresh per connection, and
every frame is::

    header = seq (8 bytes) || length (8 bytes)
    k_seq  = the first 32 bytes of ChaCha20(k_dir, counter 0, nonce seq)
    tag    = Poly1305(k_seq, header | payload)
    wire   = header || tag || payload

(RFC 8439: §2.6 generates the one-time Poly1305 key, §2.5 is the MAC). ``seq`` never repeats
on a connection and each direction has its own key, so every frame has a key of its own, as
Poly1305's forgery bound (at most 8 ceil(L / 16) / 2^106 per forged frame of L bytes) needs.
Poly1305 runs at several times SHA-256's speed, which matters to a driver that authenticates
every masked vector and client state of a cohort.

The receiver checks the tag (constant time), then that ``seq`` is the next one
it expects, and only then unpickles the payload: a tampered, replayed,
reordered or dropped frame ends the connection without anything of it being
unpickled. Handshakes run under a timeout in their own threads, so a peer that
connects and stays silent blocks neither the worker's accept loop nor the
driver. (Handshake proofs and keys: HMAC-SHA256 after Krawczyk et al., RFC 2104; frames as
in TLS's record MAC, RFC 5246 §6.2.3.1, with an explicit sequence number.) Frames are
authenticated, not encrypted: like Ray's own transport without TLS, whoever can
read the network between driver and workers can read the batches.
"""

from __future__ import annotations

import hashlib
import hmac
import pickle
import secrets
import socket
import threading
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.poly1305 import Poly1305

#: the protocol's name and version, sent first and covered by both proofs (16 bytes)
PROTOCOL = b"fedsim-chan/v3\x00\x00"
NONCE_BYTES = 32
#: a handshake proof (HMAC-SHA256)
PROOF_BYTES = hashlib.sha256().digest_size
#: a frame's tag (Poly1305)
TAG_BYTES = 16
#: seconds a handshake may take before the connection is dropped
HANDSHAKE_TIMEOUT_S = 10.0
#: handshakes a worker runs at once; connections beyond are closed at once
MAX_HANDSHAKES = 32
#: the largest frame accepted (a length beyond it ends the connection)
MAX_FRAME_BYTES = 1 << 36
_HEADER = 16  # seq (8) || length (8), big-endian
_JOIN_BYTES = 1 << 16  # frames up to this size go out in one joined buffer
_DRIVER_PROOF = b"fedsim-chan driver proof"
_WORKER_PROOF = b"fedsim-chan worker proof"
_TO_WORKER = b"fedsim-chan driver->worker"
_TO_DRIVER = b"fedsim-chan worker->driver"


class ChannelAuthError(ConnectionError):
    """The peer did not prove knowledge of the channel key (or spoke out of protocol)."""


class FrameError(ConnectionError):
    """A frame failed its MAC, came out of sequence, or announced an impossible length."""


def dumps(value: Any) -> bytes:
    """Pickle ``value``; cloudpickle for what plain pickle cannot (local classes)."""
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError):
        import cloudpickle  # noqa: PLC0415  (ships with Ray)

        return cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def new_key() -> bytes:
    """A channel key, from the operating system's randomness."""
    return secrets.token_bytes(32)


def _mac(key: bytes, label: bytes, *parts: bytes | bytearray | memoryview) -> bytes:
    """``HMAC-SHA256(key, label | len(p1) | p1 | ...)``: one pass over each part."""
    mac = hmac.new(key, label, "sha256")
    for part in parts:
        mac.update(len(part).to_bytes(8, "big"))
        mac.update(part)
    return mac.digest()


def _frame_mac(key: bytes, header: bytes) -> Poly1305:
    """The Poly1305 state of the frame ``header`` announces, under its one-time key: the first
    32 bytes of ChaCha20 under the direction's ``key`` with block counter 0 and the frame's
    sequence number as nonce (RFC 8439 §2.6), fed the header."""
    nonce = bytes(8) + header[:8]  # counter 0, then the frame's seq
    one_time = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor().update(bytes(32))
    mac = Poly1305(one_time)
    mac.update(header)
    return mac


def _read_handshake(sock: socket.socket, size: int) -> bytes:
    """``size`` bytes of a handshake; ChannelAuthError if the peer hangs up first
    (TimeoutError, an OSError, if it stays silent past the socket's timeout)."""
    try:
        return bytes(_read_exact(sock, size))
    except EOFError as err:
        raise ChannelAuthError(f"the peer hung up during the handshake ({err})") from err


def _read_exact(sock: socket.socket, size: int) -> bytearray:
    """Exactly ``size`` bytes from ``sock``; EOFError if it closes first."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise EOFError(f"connection closed after {got} of {size} bytes")
        got += n
    return buffer


def _send_frame(sock: socket.socket, head: bytes, payload: bytes | bytearray) -> None:
    """Send ``head`` then ``payload``: joined when small (one copy is cheaper than a
    scatter list), else without copying the payload."""
    if len(payload) <= _JOIN_BYTES:
        sock.sendall(head + payload)
        return
    sock.sendall(head)
    sock.sendall(memoryview(payload))


class FramedSocket:
    """A socket whose frames carry a MAC and a sequence number per direction.

    Built by :func:`driver_handshake` or :func:`worker_handshake`; ``send`` may be called
    from several threads (frames never interleave), ``recv`` from one at a time.
    """

    def __init__(self, sock: socket.socket, send: bytes, receive: bytes) -> None:
        self.sock = sock
        self._send_key, self._recv_key = send, receive  # each direction's key
        self._send_seq = 0
        self._recv_seq = 0
        self._sending = threading.Lock()
        self.closed = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, payload: bytes | bytearray, prefix: bytes = b"") -> None:
        """Send one frame of ``prefix || payload`` (OSError if the connection is gone,
        TimeoutError if the socket's timeout passes first)."""
        with self._sending:
            size = len(prefix) + len(payload)
            header = self._send_seq.to_bytes(8, "big") + size.to_bytes(8, "big")
            mac = _frame_mac(self._send_key, header)
            mac.update(prefix)
            mac.update(memoryview(payload))
            _send_frame(self.sock, header + mac.finalize() + prefix, payload)
            self._send_seq += 1

    def recv(self) -> bytearray:
        """The next frame's payload, checked; FrameError if the check fails,
        EOFError/OSError if the connection closes."""
        head = _read_exact(self.sock, _HEADER + TAG_BYTES)
        header, tag = bytes(head[:_HEADER]), bytes(head[_HEADER:])
        seq = int.from_bytes(header[:8], "big")
        length = int.from_bytes(header[8:], "big")
        if length > MAX_FRAME_BYTES:
            raise FrameError(f"frame announces {length} bytes (at most {MAX_FRAME_BYTES})")
        payload = _read_exact(self.sock, length)
        mac = _frame_mac(self._recv_key, header)
        mac.update(memoryview(payload))
        try:
            mac.verify(tag)  # constant time
        except InvalidSignature:
            raise FrameError(
                f"frame {self._recv_seq} fails its MAC (tampered or forged)"
            ) from None
        if seq != self._recv_seq:
            raise FrameError(
                f"frame numbered {seq} where {self._recv_seq} was due (replayed, reordered "
                "or a frame dropped)"
            )
        self._recv_seq += 1
        return payload

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass


def _session_keys(key: bytes, hello: bytes, driver_nonce: bytes) -> tuple[bytes, bytes]:
    """The (driver->worker, worker->driver) frame keys of one connection."""
    return _mac(key, _TO_WORKER, hello, driver_nonce), _mac(key, _TO_DRIVER, hello, driver_nonce)


def worker_handshake(sock: socket.socket, key: bytes, timeout: float) -> FramedSocket:
    """The worker's side: send a fresh hello, verify the driver's proof, prove
    ourselves. ChannelAuthError (nothing sent) if the driver's proof is wrong."""
    sock.settimeout(timeout)
    hello = PROTOCOL + secrets.token_bytes(NONCE_BYTES)
    sock.sendall(hello)
    answer = _read_handshake(sock, NONCE_BYTES + PROOF_BYTES)
    driver_nonce, driver_proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if not hmac.compare_digest(driver_proof, _mac(key, _DRIVER_PROOF, hello, driver_nonce)):
        raise ChannelAuthError("the peer's proof of the channel key is wrong")
    sock.sendall(_mac(key, _WORKER_PROOF, hello, driver_nonce, driver_proof))
    sock.settimeout(None)
    to_worker, to_driver = _session_keys(key, hello, driver_nonce)
    return FramedSocket(sock, send=to_driver, receive=to_worker)


def driver_handshake(sock: socket.socket, key: bytes, timeout: float) -> FramedSocket:
    """The driver's side: read the worker's hello, prove ourselves, verify the
    worker's proof. ChannelAuthError if the peer is not a worker holding ``key``."""
    sock.settimeout(timeout)
    hello = _read_handshake(sock, len(PROTOCOL) + NONCE_BYTES)
    if hello[: len(PROTOCOL)] != PROTOCOL:
        raise ChannelAuthError(f"the peer does not speak {PROTOCOL.rstrip(bytes(1))!r}")
    driver_nonce = secrets.token_bytes(NONCE_BYTES)
    driver_proof = _mac(key, _DRIVER_PROOF, hello, driver_nonce)
    sock.sendall(driver_nonce + driver_proof)
    worker_proof = _read_handshake(sock, PROOF_BYTES)
    expected = _mac(key, _WORKER_PROOF, hello, driver_nonce, driver_proof)
    if not hmac.compare_digest(worker_proof, expected):
        raise ChannelAuthError("the worker's proof of the channel key is wrong")
    sock.settimeout(None)
    to_worker, to_driver = _session_keys(key, hello, driver_nonce)
    return FramedSocket(sock, send=to_worker, receive=to_driver)
