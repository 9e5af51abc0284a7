"""Every random stream has an owner.

Two kinds of randomness run through a simulated federation (DESIGN.md, "Boundaries"):

* **Public streams** -- cohort sampling, data partitions, initial models, fault schedules,
  rotations, committee draws. Anyone may recompute them: they come from the run seed and a
  ``(round, kind)`` tuple through :func:`public_generator`.
* **Party-secret streams** -- a client's noise, masks and share randomness, a committee
  member's resharing randomness, the server's own noise. Each comes from that party's
  :class:`PartySecret` (32 bytes), never from the run seed, never from anything a message
  carries, never from a file the server writes.

A party's secret is either fresh OS randomness (:meth:`PartySecret.fresh`, the default: runs are
then not repeatable) or, for bit-reproducible simulation, derived from a :class:`RunSecret`: a
32-byte root read from a file that the user keeps *outside* the run directory
(:meth:`RunSecret.load_or_create`). The root derives one independent secret per party with
HMAC-SHA256 (RFC 2104) over the party's name, so no party's secret reveals another's or the
root. The simulation engine hands client ``i`` its own secret through the ClientApp's
``node_config`` (:data:`NODE_SECRET_KEY`); the server's strategy receives only
:meth:`RunSecret.server`.

A root serves one run: :meth:`RunSecret.for_run` mixes a public run nonce (:func:`new_nonce`,
written in the run directory's ``run.json``) into the root, and every party secret of the run
derives from the result. Two runs of one root thus draw independent noise; only ``--resume`` of
the same run (same nonce) or an explicit replay repeats the streams.

The engine's workers find their clients' secrets through a :class:`RootSource` (the root file's
path and the run nonce): each worker opens the file itself, so the driver process, which runs
the ServerApp, never holds the root or a client's secret; what it holds (:class:`RunKeys`) is
derived by a child process that reads the file (:mod:`fedsim.frontend.root_keys`).

Secrets refuse to be pickled (a checkpoint that reaches one fails loudly instead of storing it)
and hide themselves in ``repr``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from fedsim.config import ConfigError

if TYPE_CHECKING:
    import numpy as np

SECRET_BYTES = 32
NODE_SECRET_KEY = "fedsim.party-secret"
"""``node_config`` key under which the engine gives a client its own secret (hex); the
ServerApp's context gets the server's secret under the same key."""
SECRETS_DIR_ENV = "FEDSIM_SECRETS_DIR"
"""Environment variable naming the per-user directory of kept roots (:func:`kept_root_path`)."""


class Stream(IntEnum):
    """Names of the public streams: ``public_generator(seed, round, Stream.X, ...)``."""

    COHORT = 1
    PARTITION = 2
    INITIAL_MODEL = 3
    FAULTS = 4
    ROTATION = 5
    COMMITTEE = 6
    EVALUATION_SUBSET = 7
    CLIENT_ORDER = 8


class Purpose(IntEnum):
    """What a party draws a secret stream for: ``secret.generator(round, Purpose.X, ...)``."""

    NOISE = 1
    ROUNDING = 2
    SHARES = 3
    MASKS = 4
    RESHARE = 5
    KEYS = 6
    TRAINING = 7
    COHORT = 8


def public_generator(seed: int, *words: int) -> np.random.Generator:
    """The public stream ``(seed, *words)``: fine to recompute anywhere, never for a secret."""
    import numpy as np  # noqa: PLC0415  (numpy only when drawing: fedsim.frontend.root_keys is cheap)

    return np.random.default_rng([int(seed), *(int(w) for w in words)])


def _derive(key: bytes, *words: Any) -> bytes:
    """HMAC-SHA256(key, words): 32 bytes that only a holder of ``key`` can compute."""
    message = b"\x00".join(str(w).encode() for w in words)
    return hmac.new(key, b"fedsim/" + message, hashlib.sha256).digest()


class _Hidden:
    """Shared behaviour of secrets: no pickling, no repr of the key."""

    __slots__ = ()

    def __reduce__(self):
        raise TypeError(
            f"a {type(self).__name__} is never pickled: secrets stay with their party "
            "(checkpoints and messages must not carry them)"
        )

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


class PartySecret(_Hidden):
    """One party's secret (32 bytes) and the streams it owns.

    ``generator(round, purpose, *more)`` is the party's stream for that round and purpose: the same
    words always give the same stream, so nothing about it needs to be stored; different words,
    or a different secret, give independent streams (HMAC-SHA256 of the words, keyed by the
    secret, seeds the generator).
    """

    __slots__ = ("_key", "_seal", "party")

    def __init__(self, key: bytes, party: str) -> None:
        if not isinstance(key, bytes | bytearray) or len(key) != SECRET_BYTES:
            raise ValueError(f"a party secret is {SECRET_BYTES} bytes, got {type(key).__name__}")
        self._key = bytes(key)
        self._seal: ChaCha20Poly1305 | None = None
        self.party = str(party)

    @classmethod
    def fresh(cls, party: str) -> PartySecret:
        """A secret from OS randomness: private, and not repeatable."""
        return cls(os.urandom(SECRET_BYTES), party)

    @classmethod
    def from_token(cls, token: str, party: str) -> PartySecret:
        """The secret a :meth:`token` string carries."""
        try:
            key = bytes.fromhex(token)
        except (TypeError, ValueError):
            raise ValueError(f"{NODE_SECRET_KEY} must be {2 * SECRET_BYTES} hex digits") from None
        return cls(key, party)

    def token(self) -> str:
        """Hex form, for the party's own ``node_config`` only."""
        return self._key.hex()

    def derive(self, *words: Any) -> PartySecret:
        """A child secret of the same party (e.g. one per committee seat)."""
        return PartySecret(_derive(self._key, "child", *words), self.party)

    def seed_bytes(self, *words: Any) -> bytes:
        """32 secret bytes for ``words`` (keys, PRG seeds)."""
        return _derive(self._key, "bytes", *words)

    def generator(self, *words: Any) -> np.random.Generator:
        """The party's numpy stream for ``words`` (usually ``round, Purpose.X``)."""
        import numpy as np  # noqa: PLC0415

        entropy = int.from_bytes(_derive(self._key, "stream", *words), "little")
        return np.random.default_rng(np.random.SeedSequence(entropy))

    def seal(self, data: bytes, label: bytes) -> bytes:
        """``data`` encrypted and authenticated for this party alone (ChaCha20-Poly1305 under a
        key derived from the secret, random 96-bit nonce, ``label`` bound as associated data):
        what a party stores in files that others may hold (its state in the run directory)."""
        nonce = os.urandom(12)
        return nonce + self._aead().encrypt(nonce, data, label)

    def open(self, sealed: bytes, label: bytes) -> bytes:
        """The data :meth:`seal` sealed under ``label``; ``ValueError`` if it was altered, sealed
        by another party or under another label."""
        if len(sealed) < 12 + 16:
            raise ValueError("sealed state is too short to be a sealed record")
        view = memoryview(sealed)  # slices of a view: the ciphertext is not copied
        try:
            return self._aead().decrypt(view[:12], view[12:], label)
        except InvalidTag:
            raise ValueError(
                "sealed state failed authentication: altered, or sealed by another party"
            ) from None

    def _aead(self) -> ChaCha20Poly1305:
        """The cipher under the seal key, derived on first use (a pure function of the secret)."""
        if self._seal is None:
            self._seal = ChaCha20Poly1305(self.seed_bytes("seal"))
        return self._seal

    def __repr__(self) -> str:
        return f"PartySecret(party={self.party!r}, key=<hidden>)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PartySecret) and hmac.compare_digest(self._key, other._key)

    def __hash__(self) -> int:
        return hash(("PartySecret", self.party))


class RunSecret(_Hidden):
    """The simulation's secret root: derives every party's own :class:`PartySecret`.

    Only the simulation's engine (which plays all parties) holds it; a strategy gets
    :meth:`server`, a client its :meth:`client` secret through ``node_config``, a committee
    member its :meth:`member` secret on the actor that hosts it.
    """

    __slots__ = ("_key", "reproducible")

    def __init__(self, key: bytes, reproducible: bool = True) -> None:
        if not isinstance(key, bytes | bytearray) or len(key) != SECRET_BYTES:
            raise ValueError(f"a run secret is {SECRET_BYTES} bytes, got {type(key).__name__}")
        self._key = bytes(key)
        self.reproducible = bool(reproducible)

    @classmethod
    def fresh(cls) -> RunSecret:
        """A root from OS randomness (the default: the run's secrets cannot be replayed)."""
        return cls(os.urandom(SECRET_BYTES), reproducible=False)

    @classmethod
    def from_passphrase(cls, phrase: str) -> RunSecret:
        """A root from a string: for unit tests only (a phrase in a source file is no secret;
        studies and examples read their roots from files outside the repository)."""
        return cls(hashlib.sha256(b"fedsim-run-secret/" + phrase.encode()).digest())

    def for_run(self, nonce: str) -> RunSecret:
        """The root of the one run named by the public ``nonce`` (:func:`new_nonce`):
        HMAC-SHA256(root, "run", nonce), so that one root file gives every run independent
        party secrets."""
        return RunSecret(_derive(self._key, "run", checked_nonce(nonce)), self.reproducible)

    @classmethod
    def load_or_create(
        cls, path: str | Path, run_dir: str | Path | None = None, *, create: bool = True
    ) -> RunSecret:
        """The root in ``path`` (hex), created with OS randomness and mode 0600 if missing
        (with ``create``; otherwise a missing file is an error).

        ``path`` must lie outside ``run_dir``: whoever holds the run directory must not hold
        the parties' secrets.
        """
        path = root_file(path, run_dir, create=create)
        if not path.is_file():
            raise ConfigError("secrets", str(path), "a file holding 64 hex digits")
        text = path.read_text().strip()
        try:
            key = bytes.fromhex(text)
        except ValueError:
            key = b""
        if len(key) != SECRET_BYTES:
            raise ConfigError(
                "secrets", str(path), f"a file holding {2 * SECRET_BYTES} hex digits (one root)"
            )
        return cls(key)

    def derive(self, label: str) -> RunSecret:
        """An independent root for ``label`` (e.g. the driver's own store of client states),
        whose parties' secrets are not this root's."""
        return RunSecret(_derive(self._key, "sub-root", str(label)), self.reproducible)

    def client(self, partition_id: int) -> PartySecret:
        """Client ``partition_id``'s own secret (also its secret as a committee member)."""
        return PartySecret(_derive(self._key, "client", int(partition_id)), "client")

    def member(self, member_id: int) -> PartySecret:
        """The secret of committee member ``member_id`` when members are not clients."""
        return PartySecret(_derive(self._key, "member", int(member_id)), "member")

    def server(self) -> PartySecret:
        """The server's own secret (its central noise)."""
        return PartySecret(_derive(self._key, "server"), "server")

    def mac_key(self) -> bytes:
        """A key to authenticate files the run writes (never a party's secret)."""
        return _derive(self._key, "file-mac")

    def fingerprint(self) -> str:
        """A public label of the root (8 hex digits of a one-way hash), for records."""
        return hashlib.sha256(b"fedsim-fingerprint/" + self._key).hexdigest()[:8]

    def write(self, path: str | Path) -> Path:
        """Write this root (hex) to a new file ``path``, mode 0600; refuses an existing one."""
        path = Path(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IRUSR | stat.S_IWUSR)
        with os.fdopen(fd, "w") as fh:
            fh.write(self._key.hex() + "\n")
        return path

    def __repr__(self) -> str:
        return f"RunSecret(fingerprint={self.fingerprint()}, key=<hidden>)"


class RunKeys(_Hidden):
    """What the driver of ``fedsim run`` holds of a run's root: the keys the server may hold.

    :meth:`of` derives them from the root and keeps nothing else: the file key that
    authenticates ``config.json`` and the checkpoints (:meth:`RunSecret.mac_key`), the
    server's own :class:`PartySecret`, and the sub-roots (:meth:`RunSecret.derive`) that seal
    the run directory's state stores (the clients' states, the committee members' states),
    none of whose party secrets is a party's own. No client's or member's secret and no
    enrolment key derives from them; the public :meth:`fingerprint` is the base root's.
    """

    __slots__ = ("_mac", "_server", "client_states", "party_states", "_fingerprint")

    def __init__(
        self,
        mac: bytes,
        server: PartySecret,
        client_states: RunSecret,
        party_states: RunSecret,
        fingerprint: str,
    ) -> None:
        self._mac, self._server, self._fingerprint = bytes(mac), server, str(fingerprint)
        self.client_states, self.party_states = client_states, party_states

    @classmethod
    def of(cls, root: RunSecret, fingerprint: str | None = None) -> RunKeys:
        """The driver's keys of the run whose root is ``root`` (``fingerprint``: the base
        root's, default ``root``'s); the caller drops ``root``."""
        if not isinstance(root, RunSecret):
            raise ValueError(f"root is a {type(root).__name__}; allowed: RunSecret")
        return cls(
            root.mac_key(),
            root.server(),
            root.derive("client-state-store"),
            root.derive("party-state-stores"),
            root.fingerprint() if fingerprint is None else fingerprint,
        )

    def tokens(self) -> dict[str, Any]:
        """The keys in hex, for their one hand-over: from the child process that reads the
        root (:mod:`fedsim.frontend.root_keys`) to the driver, through a pipe; never for a file."""
        return {
            "mac": self._mac.hex(),
            "server": self._server.token(),
            "client_states": self.client_states._key.hex(),
            "party_states": self.party_states._key.hex(),
            "reproducible": self.client_states.reproducible,
            "fingerprint": self._fingerprint,
        }

    @classmethod
    def from_tokens(cls, tokens: Mapping[str, Any]) -> RunKeys:
        """The keys :meth:`tokens` gave (``ValueError`` naming the entry when one is bad)."""
        try:
            reproducible = bool(tokens["reproducible"])
            mac, client, party = (
                bytes.fromhex(tokens[k]) for k in ("mac", "client_states", "party_states")
            )
            server = PartySecret.from_token(tokens["server"], "server")
            return cls(
                mac,
                server,
                RunSecret(client, reproducible),
                RunSecret(party, reproducible),
                str(tokens["fingerprint"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"run keys handed over are incomplete or damaged ({err})") from None

    def mac_key(self) -> bytes:
        """The run's file key (:meth:`RunSecret.mac_key`)."""
        return self._mac

    def server(self) -> PartySecret:
        """The server's own secret (:meth:`RunSecret.server`)."""
        return self._server

    def fingerprint(self) -> str:
        return self._fingerprint

    def __repr__(self) -> str:
        return f"RunKeys(fingerprint={self._fingerprint}, keys=<hidden>)"


def outside_run_dir(path: str | Path, run_dir: str | Path | None) -> Path:
    """``path`` resolved; refused when it lies inside ``run_dir`` (whoever holds the run
    directory must not hold the parties' secrets)."""
    path = Path(path).expanduser().resolve()
    if run_dir is not None:
        run = Path(run_dir).expanduser().resolve()
        if path == run or run in path.parents:
            raise ConfigError("secrets", str(path), f"a file outside the run directory {run}")
    return path


def root_file(
    path: str | Path, run_dir: str | Path | None = None, *, create: bool = True
) -> Path:
    """``path`` resolved, checked to lie outside ``run_dir`` and, with ``create``, written with
    a fresh root (OS randomness, mode 0600) if missing -- without reading it: what a front end
    does before handing the file to the engine's workers (:class:`RootSource`)."""
    path = outside_run_dir(path, run_dir)
    if not path.exists():
        if not create:
            raise ConfigError("secrets", str(path), "the existing file holding this run's root")
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _write_fresh_root(path)
    return path


def _write_fresh_root(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IRUSR | stat.S_IWUSR)
    with os.fdopen(fd, "w") as fh:
        fh.write(os.urandom(SECRET_BYTES).hex() + "\n")


NONCE_BYTES = 16


def new_nonce() -> str:
    """A fresh public run nonce (128 bits of OS randomness, hex)."""
    return os.urandom(NONCE_BYTES).hex()


def checked_nonce(nonce: str) -> str:
    """``nonce`` if it is a run nonce fedsim writes (:func:`new_nonce`), else a ConfigError."""
    if not (isinstance(nonce, str) and len(nonce) == 2 * NONCE_BYTES and set(nonce) <= set(_HEX)):
        raise ConfigError(
            "nonce", nonce, f"{2 * NONCE_BYTES} lowercase hex digits (a run nonce fedsim wrote)"
        )
    return nonce


@dataclass(frozen=True)
class RootSource:
    """Where a run's parties find their root: a file and the run's public nonce.

    A source holds no secret: whoever opens it (:meth:`open`) reads the file, so the engine
    hands a source -- never the root -- to the processes that play the clients, and the
    driver, which plays the server, need not read the file at all. The file must be readable
    where the workers run (on a cluster: on every worker's machine). ``nonce`` None: the file
    holds the run's root itself (no mixing).
    """

    path: str
    nonce: str | None = None

    def __post_init__(self) -> None:
        if self.nonce is not None:
            checked_nonce(self.nonce)

    def open(self) -> RunSecret:
        """The run's root: the file's root mixed with the nonce (:meth:`RunSecret.for_run`)."""
        root = RunSecret.load_or_create(self.path, create=False)
        return root if self.nonce is None else root.for_run(self.nonce)

    @classmethod
    def fresh(cls, directory: str | Path | None = None) -> RootSource:
        """A source over a new file of OS randomness (mode 0600) in a new private directory
        (under ``directory``, default the system's temporary directory); whoever calls this
        writes the root without ever returning it."""
        where = Path(tempfile.mkdtemp(prefix="fedsim-root-", dir=directory))
        path = where / "run.root"
        _write_fresh_root(path)
        return cls(str(path))


def _own_secret(node_config: Mapping[str, Any], party: str) -> PartySecret:
    token = node_config.get(NODE_SECRET_KEY)
    if token is None:
        return PartySecret.fresh(party)
    return PartySecret.from_token(str(token), party)


def client_secret(node_config: Mapping[str, Any]) -> PartySecret:
    """The client's own secret from its ``node_config``, or fresh OS randomness when the
    runtime gave it none (Flower's runtime, deployments)."""
    return _own_secret(node_config, "client")


def server_secret(node_config: Mapping[str, Any]) -> PartySecret:
    """The server's own secret from the ServerApp context's ``node_config`` (fedsim's engine
    puts it there when the run has a :class:`RunSecret`), or fresh OS randomness."""
    return _own_secret(node_config, "server")


# -- roots kept per user, outside run directories --------------------------------------------


def user_secrets_dir() -> Path:
    """Where the roots of runs started without an explicit root file are kept:
    ``$FEDSIM_SECRETS_DIR``, else ``$XDG_DATA_HOME/fedsim/secrets`` (default
    ``~/.local/share/fedsim/secrets``)."""
    named = os.environ.get(SECRETS_DIR_ENV)
    if named:
        return Path(named).expanduser()
    data = os.environ.get("XDG_DATA_HOME") or str(Path("~/.local/share").expanduser())
    return Path(data) / "fedsim" / "secrets"


_HEX = "0123456789abcdef"


def new_run_id() -> str:
    """A random public run id (128 bits, hex) that names a kept root."""
    return os.urandom(16).hex()


def kept_root_path(run_id: str) -> Path:
    """The file in :func:`user_secrets_dir` that keeps run ``run_id``'s root."""
    if not (isinstance(run_id, str) and len(run_id) == 32 and set(run_id) <= set(_HEX)):
        raise ConfigError("run_id", run_id, "32 lowercase hex digits (a run id fedsim wrote)")
    return user_secrets_dir() / f"{run_id}.root"
