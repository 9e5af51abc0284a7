"""The mask PRGs of SecAgg+ (:class:`MaskPRG`): the keystream that expands a 32-byte mask seed
into uniform masks of F_p (:func:`expand_mask`, :class:`KeyedField`) or of Z_{2^k}
(:class:`protocols.secagg.common.RingZ2k`), chosen by ``SecAggConfig.prg``."""

from __future__ import annotations

from enum import Enum

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from protocols.field import MersenneField

SEED_BYTES = 32


class MaskPRG(Enum):
    """The keystream that expands a 32-byte mask seed (b_i or s_ij), by its
    ``strategy.options.prg`` name; its wire code (``SecAggKeys.PRG`` of
    :mod:`protocols.secagg.common`) is its place here.

    ``chacha20``: ChaCha20 (RFC 8439) keyed by the seed, nonce and counter zero. ``aes-ctr``:
    AES-256 in CTR mode (NIST SP 800-38A) keyed by the seed, initial counter block zero (a
    128-bit big-endian counter; hardware AES where the CPU has it). A seed is a uniform 32-byte
    key already (the CSPRNG's b_i, or HKDF-SHA256's s_ij), so it keys AES-256 directly, and it
    keys one keystream only (b_i is drawn afresh each round, s_ij is bound to the round's
    session id), so the fixed start never repeats a (key, counter) pair.

    Uniformity, for a keystream of independent uniform bits: a 64-bit word masked to e bits is
    uniform on [0, 2^e); rejecting its one value 2^e - 1 = p leaves it exactly uniform on
    [0, p) = F_p (rejection sampling, a word lost with probability 2^-e); in Z_{2^k} the low k
    bits of a 32- or 64-bit word are uniform, nothing rejected. AES-CTR's blocks are a
    permutation's images of distinct counters, so never equal: by the PRP/PRF switching lemma
    they are within q(q-1)/2^129 of uniform over q blocks (below 2^-89 for 2^20 blocks, 16 MiB
    of masks), besides AES's own security as a PRP.
    """

    CHACHA20 = "chacha20"
    AES_CTR = "aes-ctr"

    @property
    def code(self) -> int:
        return list(MaskPRG).index(self)

    @classmethod
    def parse(cls, value: object, name: str) -> MaskPRG:
        """``value`` (a member, its name, its code or None for the default) as a member;
        ValueError naming ``name``, the value and what is allowed."""
        if value is None or isinstance(value, cls):
            return value or cls.CHACHA20
        if isinstance(value, str):
            for member in cls:
                if member.value == value:
                    return member
        members = list(cls)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(members):
            return members[value]
        raise ValueError(
            f"SecAgg+ parameter {name!r}: {value!r}; allowed: "
            f"{', '.join(repr(m.value) for m in members)} (codes 0 to {len(members) - 1})"
        )

    def keystream(self, seed: bytes):
        """A fresh cipher context over ``seed`` whose encryption of zeros is the keystream."""
        if len(seed) != SEED_BYTES:
            raise ValueError(f"seed must be {SEED_BYTES} bytes, got {len(seed)}")
        if self is MaskPRG.AES_CTR:
            return Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
        return Cipher(algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor()


PRG_NAMES = tuple(m.value for m in MaskPRG)
"""The mask PRGs' option names (``strategy.options.prg``)."""
PRG_ALLOWED = " or ".join(map(repr, PRG_NAMES)) + " (the mask PRG; unset: 'chacha20')"
"""What an error about ``strategy.options.prg`` says is allowed."""


def expand_mask(
    seed: bytes, length: int, field_: MersenneField, prg: MaskPRG = MaskPRG.CHACHA20
) -> np.ndarray:
    """PRG(seed): ``length`` uniform elements of F_p from the keystream of ``seed`` (64-bit
    words, the value p rejected: :class:`MaskPRG`)."""
    stream = prg.keystream(seed)
    mask = np.uint64(field_.modulus)
    out = np.empty(length, dtype=np.int64)
    filled = 0
    while filled < length:
        need = length - filled
        words = np.frombuffer(stream.update(bytes(8 * need)), dtype="<u8") & mask
        words = words[words != mask]
        out[filled : filled + words.size] = words.astype(np.int64)
        filled += words.size
    return out


class KeyedField(MersenneField):
    """F_p as the masking space of a round whose mask PRG is not the default ``prg``."""

    def __init__(self, exponent: int, prg: MaskPRG) -> None:
        super().__init__(exponent)
        self.prg = prg

    def __repr__(self) -> str:
        return f"MersenneField(exponent={self.exponent}, prg={self.prg.value!r})"

    def __eq__(self, other: object) -> bool:
        return super().__eq__(other) and getattr(other, "prg", MaskPRG.CHACHA20) is self.prg

    def __hash__(self) -> int:
        return hash(("MersenneField", self.exponent, self.prg))

    def expand(self, seed: bytes, length: int) -> np.ndarray:
        return expand_mask(seed, length, self, self.prg)
