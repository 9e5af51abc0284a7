"""Streams with owners: public streams repeat from the seed, party secrets stay with their party."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

from fedsim.config import ConfigError
from fedsim.randomness import (
    NODE_SECRET_KEY,
    SECRETS_DIR_ENV,
    Purpose,
    RootSource,
    RunSecret,
    Stream,
    client_secret,
    kept_root_path,
    new_nonce,
    new_run_id,
    public_generator,
    root_file,
    server_secret,
    user_secrets_dir,
)


def test_public_streams_repeat_and_differ_by_words():
    a = public_generator(7, 3, Stream.COHORT).random(4)
    assert np.array_equal(a, public_generator(7, 3, Stream.COHORT).random(4))
    assert not np.array_equal(a, public_generator(7, 4, Stream.COHORT).random(4))
    assert not np.array_equal(a, public_generator(7, 3, Stream.FAULTS).random(4))


def test_party_streams_are_repeatable_and_independent():
    root = RunSecret.from_passphrase("test")
    one, two = root.client(1), root.client(2)
    x = one.generator(3, Purpose.NOISE).random(5)
    assert np.array_equal(x, root.client(1).generator(3, Purpose.NOISE).random(5))
    assert not np.array_equal(x, two.generator(3, Purpose.NOISE).random(5))
    assert not np.array_equal(x, one.generator(3, Purpose.SHARES).random(5))
    assert not np.array_equal(x, root.server().generator(3, Purpose.NOISE).random(5))
    # a different root gives different secrets for the same party
    other = RunSecret.from_passphrase("other")
    assert other.client(1) != one
    assert root.client(1) == one


def test_secret_streams_do_not_come_from_the_run_seed():
    secret = RunSecret.fresh().client(0)
    x = secret.generator(1, Purpose.NOISE).random(8)
    for seed in range(50):
        for words in ((seed,), (seed, 1), (seed, 1, 0), (seed, 1, Purpose.NOISE)):
            assert not np.array_equal(x, np.random.default_rng(list(map(int, words))).random(8))


def test_secrets_refuse_pickling_and_hide_in_repr():
    root = RunSecret.from_passphrase("x")
    for secret in (root, root.client(3), root.server()):
        with pytest.raises(TypeError, match="never pickled"):
            pickle.dumps(secret)
        with pytest.raises(TypeError, match="never pickled"):
            pickle.dumps({"nested": [secret]})
        assert root._key.hex() not in repr(secret)
        assert copy.deepcopy(secret) is secret
    assert root.client(3).token() not in repr(root.client(3))


def test_client_secret_from_node_config_and_fresh_without_one():
    root = RunSecret.from_passphrase("x")
    token = root.client(5).token()
    assert client_secret({NODE_SECRET_KEY: token}) == root.client(5)
    assert client_secret({}) != client_secret({})
    with pytest.raises(ValueError, match=NODE_SECRET_KEY):
        client_secret({NODE_SECRET_KEY: "zz"})


def test_root_file_is_created_private_and_refused_inside_the_run_directory(tmp_path):
    path = tmp_path / "keys" / "root.hex"
    first = RunSecret.load_or_create(path, run_dir=tmp_path / "run")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    again = RunSecret.load_or_create(path)
    assert first.client(0) == again.client(0)
    with pytest.raises(ConfigError, match="outside the run directory"):
        RunSecret.load_or_create(tmp_path / "run" / "root.hex", run_dir=tmp_path / "run")
    bad = tmp_path / "bad.hex"
    bad.write_text("1234")
    with pytest.raises(ConfigError, match="64 hex digits"):
        RunSecret.load_or_create(bad)


def test_a_root_that_must_exist_is_never_created(tmp_path):
    missing = tmp_path / "missing.hex"
    with pytest.raises(ConfigError, match="existing file"):
        RunSecret.load_or_create(missing, create=False)
    assert not missing.exists()


def test_kept_roots_live_in_the_users_directory_under_a_checked_run_id(tmp_path, monkeypatch):
    monkeypatch.setenv(SECRETS_DIR_ENV, str(tmp_path / "mine"))
    run_id = new_run_id()
    assert kept_root_path(run_id) == tmp_path / "mine" / f"{run_id}.root"
    assert new_run_id() != run_id
    for bad in ("../../etc/passwd", run_id.upper(), run_id[:-1], 7):
        with pytest.raises(ConfigError, match="run_id"):
            kept_root_path(bad)
    monkeypatch.delenv(SECRETS_DIR_ENV)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert user_secrets_dir() == tmp_path / "data" / "fedsim" / "secrets"


def test_server_secret_from_the_server_apps_node_config():
    root = RunSecret.from_passphrase("x")
    assert server_secret({NODE_SECRET_KEY: root.server().token()}) == root.server()
    assert server_secret({}) != server_secret({})


def test_a_root_serves_one_run_per_nonce(tmp_path):
    root = RunSecret.from_passphrase("x")
    one, two = new_nonce(), new_nonce()
    assert one != two
    assert root.for_run(one).client(2) == root.for_run(one).client(2)
    assert root.for_run(one).client(2) != root.for_run(two).client(2)
    assert root.for_run(one).server() != root.server()
    with pytest.raises(ConfigError, match="nonce"):
        root.for_run("not-a-nonce")


def test_a_root_source_is_opened_where_it_is_used(tmp_path):
    path = root_file(tmp_path / "keys" / "run.root", tmp_path / "results")
    nonce = new_nonce()
    source = RootSource(str(path), nonce)
    assert pickle.loads(pickle.dumps(source)) == source  # it carries no secret
    opened = RunSecret.load_or_create(path, create=False).for_run(nonce)
    assert source.open().client(3) == opened.client(3)
    assert path.read_text().strip() not in repr(source)
    with pytest.raises(ConfigError, match="outside the run directory"):
        root_file(tmp_path / "results" / "run.root", tmp_path / "results")


def test_sealed_state_opens_only_for_its_party_and_label():
    root = RunSecret.from_passphrase("x")
    sealed = root.client(1).seal(b"momentum", b"state/1")
    assert b"momentum" not in sealed
    assert root.client(1).open(sealed, b"state/1") == b"momentum"
    for who, label in ((root.client(2), b"state/1"), (root.client(1), b"state/2")):
        with pytest.raises(ValueError, match="authentication"):
            who.open(sealed, label)
    flipped = sealed[:-1] + bytes([sealed[-1] ^ 1])
    with pytest.raises(ValueError, match="authentication"):
        root.client(1).open(flipped, b"state/1")


def test_sealed_state_is_the_nonce_then_the_aead_under_the_seal_key():
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    secret = RunSecret.from_passphrase("x").client(3)
    data = bytes(range(256)) * 1000
    for _ in range(2):  # the second seal reuses the secret's cipher: the same format
        sealed = secret.seal(data, b"state/1")
        cipher = ChaCha20Poly1305(secret.seed_bytes("seal"))
        assert cipher.decrypt(sealed[:12], sealed[12:], b"state/1") == data
        assert sealed[:12] + cipher.encrypt(sealed[:12], data, b"state/1") == sealed
        assert secret.open(bytearray(sealed), b"state/1") == data
    with pytest.raises(ValueError, match="too short"):
        secret.open(sealed[:27], b"state/1")
