"""Synthetic PII records and canaries for membership audits (minority vs random canaries).

Minority-aware unlearning / auditing (ICML 2025; "minority" canaries after the reference
code of Jesson-Wei/Minority_Aware_LLM_Unlearning): a canary is a record with PII that the
model should not memorise; the rarest values of a PII field (a rare name origin, a rare email,
phone or ID format) are the "minority" canaries, and records drawn like the rest of the data
are the random control. Everything is generated locally from a seeded ``numpy`` generator:
names come from per-origin name lists whose origin frequencies are skewed (the rarest
origins use letters outside ASCII, as real minority names do), emails, phone numbers and ID
numbers from weighted formats with random digits.

A record renders as one line of text (one of a few templates). :func:`base_corpus` gives each
client its own records; :func:`insert_canaries` adds canaries, each repeated, to chosen
clients' texts.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: origin -> (population share, first names, family names)
ORIGINS: dict[str, tuple[float, tuple[str, ...], tuple[str, ...]]] = {
    "english": (
        0.50,
        (
            "James",
            "Mary",
            "John",
            "Patricia",
            "Robert",
            "Jennifer",
            "Michael",
            "Linda",
            "William",
            "Elizabeth",
            "David",
            "Barbara",
            "Richard",
            "Susan",
            "Joseph",
            "Sarah",
        ),
        (
            "Smith",
            "Johnson",
            "Williams",
            "Brown",
            "Jones",
            "Miller",
            "Davis",
            "Wilson",
            "Anderson",
            "Taylor",
            "Moore",
            "Martin",
            "Jackson",
            "White",
            "Harris",
            "Clark",
        ),
    ),
    "spanish": (
        0.22,
        (
            "Jose",
            "Maria",
            "Juan",
            "Carmen",
            "Luis",
            "Ana",
            "Carlos",
            "Rosa",
            "Jorge",
            "Elena",
            "Miguel",
            "Lucia",
        ),
        (
            "Garcia",
            "Rodriguez",
            "Martinez",
            "Hernandez",
            "Lopez",
            "Gonzalez",
            "Perez",
            "Sanchez",
            "Ramirez",
            "Torres",
            "Flores",
            "Rivera",
        ),
    ),
    "german": (
        0.12,
        (
            "Hans",
            "Anna",
            "Peter",
            "Ursula",
            "Klaus",
            "Monika",
            "Dieter",
            "Sabine",
            "Wolfgang",
            "Petra",
        ),
        (
            "Schmidt",
            "Schneider",
            "Fischer",
            "Weber",
            "Meyer",
            "Wagner",
            "Becker",
            "Schulz",
            "Hoffmann",
            "Koch",
        ),
    ),
    "chinese": (
        0.09,
        ("Wei", "Fang", "Lei", "Jing", "Min", "Xiu", "Jun", "Yan", "Hui", "Ming"),
        ("Wang", "Li", "Zhang", "Liu", "Chen", "Yang", "Huang", "Zhao", "Wu", "Zhou"),
    ),
    "indian": (
        0.05,
        (
            "Aarav",
            "Priya",
            "Rohan",
            "Ananya",
            "Vikram",
            "Kavya",
            "Arjun",
            "Deepa",
            "Rahul",
            "Meera",
        ),
        ("Sharma", "Patel", "Singh", "Kumar", "Gupta", "Reddy", "Iyer", "Nair", "Rao", "Mehta"),
    ),
    "icelandic": (
        0.015,
        (
            "Guðrún",
            "Sigríður",
            "Þórunn",
            "Björk",
            "Ragnheiður",
            "Hafþór",
            "Þorsteinn",
            "Guðmundur",
            "Ásgeir",
            "Eyjólfur",
            "Snæbjörn",
            "Áslaug",
        ),
        (
            "Sigurðardóttir",
            "Þórsdóttir",
            "Guðmundsson",
            "Jónsson",
            "Ólafsdóttir",
            "Einarsson",
            "Hjálmarsson",
            "Þorvaldsson",
            "Ásgeirsdóttir",
            "Björnsson",
            "Kristjánsdóttir",
            "Gunnarsson",
        ),
    ),
    # The rarest origin's names are composed from Hawaiian syllables (consonants h k l m n p w
    # and the ʻokina, vowels with and without kahakō), so nearly every such name is unique.
    "hawaiian": (0.005, (), ()),
}

#: format name -> (share, pattern); in patterns ``N`` is a random digit, ``A`` a capital
#: letter, and ``{f}``, ``{first}``, ``{last}``, ``{domain}`` are filled from the record.
EMAIL_FORMATS: dict[str, tuple[float, str]] = {
    "first.last": (0.55, "{first}.{last}@{domain}"),
    "flastNN": (0.30, "{f}{last}NN@{domain}"),
    "last_first": (0.12, "{last}_{first}@{domain}"),
    "plus-tag": (0.03, "{first}+ANNNN@{rare_domain}"),
}
PHONE_FORMATS: dict[str, tuple[float, str]] = {
    "us-paren": (0.60, "(NNN) NNN-NNNN"),
    "us-dash": (0.30, "NNN-NNN-NNNN"),
    "uk": (0.08, "+44 20 NNNN NNNN"),
    "iceland": (0.02, "+354 NNN NNNN"),
}
ID_FORMATS: dict[str, tuple[float, str]] = {
    "ssn": (0.60, "NNN-NN-NNNN"),
    "passport": (0.30, "ANNNNNNNN"),
    "licence": (0.08, "DL-ANNNNNNN"),
    "kennitala": (0.02, "NNNNNN-NNNN"),
}
DOMAINS = ("gmail.com", "yahoo.com", "outlook.com", "hotmail.com")
RARE_DOMAINS = ("simnet.is", "posteo.de", "riseup.net", "hawaiiantel.net")
TEMPLATES = (
    "Name: {name}. Email: {email}. Phone: {phone}. ID: {id}.",
    "{name} can be reached at {email} or {phone} (ID {id}).",
    "Contact {name}, phone {phone}, email {email}, ID {id}.",
)
#: the fields a canary can take its rarest value in, and their categories with shares
FIELDS: dict[str, dict[str, float]] = {
    "origin": {k: v[0] for k, v in ORIGINS.items()},
    "email": {k: v[0] for k, v in EMAIL_FORMATS.items()},
    "phone": {k: v[0] for k, v in PHONE_FORMATS.items()},
    "id": {k: v[0] for k, v in ID_FORMATS.items()},
}


@dataclass(frozen=True)
class PIIRecord:
    """One synthetic person: name (with its origin), email, phone and ID number, each with the
    category it was drawn from, and the template that renders it."""

    name: str
    origin: str
    email: str
    email_format: str
    phone: str
    phone_format: str
    id_number: str
    id_format: str
    template: int

    def text(self) -> str:
        """The record as one line of text."""
        return TEMPLATES[self.template].format(
            name=self.name, email=self.email, phone=self.phone, id=self.id_number
        )


HAWAIIAN_CONSONANTS = ("h", "k", "l", "m", "n", "p", "w", "ʻ", "")
HAWAIIAN_VOWELS = ("a", "e", "i", "o", "u", "ā", "ē", "ī", "ō", "ū", "ai", "ao", "ei")


def _syllable_name(rng: np.random.Generator) -> str:
    syllables = int(rng.integers(3, 6))
    parts = [
        HAWAIIAN_CONSONANTS[int(rng.integers(len(HAWAIIAN_CONSONANTS)))]
        + HAWAIIAN_VOWELS[int(rng.integers(len(HAWAIIAN_VOWELS)))]
        for _ in range(syllables)
    ]
    name = "".join(parts).lstrip("ʻ") or "ka"
    return name[0].upper() + name[1:]


def rarest(field: str) -> str:
    """The category of ``field`` with the smallest population share."""
    if field not in FIELDS:
        raise ValueError(f"field = {field!r} is not allowed: one of {', '.join(FIELDS)}")
    shares = FIELDS[field]
    return min(shares, key=shares.__getitem__)


def _ascii(text: str) -> str:
    folded = unicodedata.normalize("NFKD", text.replace("Þ", "Th").replace("þ", "th"))
    return "".join(c for c in folded.replace("ð", "d") if c.isascii() and c.isalnum()).lower()


def _fill(pattern: str, rng: np.random.Generator) -> str:
    out = []
    for c in pattern:
        if c == "N":
            out.append(str(rng.integers(10)))
        elif c == "A":
            out.append(chr(ord("A") + int(rng.integers(26))))
        else:
            out.append(c)
    return "".join(out)


def _pick(shares: dict[str, float], rng: np.random.Generator, forced: str | None) -> str:
    if forced is not None:
        return forced
    names = list(shares)
    p = np.array([shares[n] for n in names])
    return names[int(rng.choice(len(names), p=p / p.sum()))]


def sample_record(rng: np.random.Generator, forced: dict[str, str] | None = None) -> PIIRecord:
    """One record from the population; ``forced`` fixes categories, e.g. ``{"origin": ...}``."""
    forced = dict(forced or {})
    for field, category in forced.items():
        if field not in FIELDS or category not in FIELDS[field]:
            allowed = ", ".join(f"{f}: {'/'.join(c)}" for f, c in FIELDS.items())
            raise ValueError(f"forced[{field!r}] = {category!r} is not allowed: {allowed}")
    origin = _pick(FIELDS["origin"], rng, forced.get("origin"))
    _, firsts, lasts = ORIGINS[origin]
    if firsts:
        first, last = firsts[int(rng.integers(len(firsts)))], lasts[int(rng.integers(len(lasts)))]
    else:
        first, last = _syllable_name(rng), _syllable_name(rng)
    email_format = _pick(FIELDS["email"], rng, forced.get("email"))
    local = EMAIL_FORMATS[email_format][1].format(
        first=_ascii(first),
        last=_ascii(last),
        f=_ascii(first)[:1],
        domain=DOMAINS[int(rng.integers(len(DOMAINS)))],
        rare_domain=RARE_DOMAINS[int(rng.integers(len(RARE_DOMAINS)))],
    )
    phone_format = _pick(FIELDS["phone"], rng, forced.get("phone"))
    id_format = _pick(FIELDS["id"], rng, forced.get("id"))
    return PIIRecord(
        name=f"{first} {last}",
        origin=origin,
        email=_fill(local, rng),
        email_format=email_format,
        phone=_fill(PHONE_FORMATS[phone_format][1], rng),
        phone_format=phone_format,
        id_number=_fill(ID_FORMATS[id_format][1], rng),
        id_format=id_format,
        template=int(rng.integers(len(TEMPLATES))),
    )


def sample_records(n: int, rng: np.random.Generator) -> list[PIIRecord]:
    """``n`` records from the population (the random canaries are drawn this way)."""
    if not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n = {n!r} is not allowed: an integer >= 0")
    return [sample_record(rng) for _ in range(n)]


def minority_records(
    n: int, rng: np.random.Generator, fields: Sequence[str] = ("origin", "email", "phone", "id")
) -> list[PIIRecord]:
    """``n`` records whose ``fields`` take their rarest category (the minority canaries)."""
    if not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n = {n!r} is not allowed: an integer >= 0")
    forced = {f: rarest(f) for f in fields}
    return [sample_record(rng, forced) for _ in range(n)]


def base_corpus(
    num_clients: int, rows_per_client: int, rng: np.random.Generator
) -> list[list[str]]:
    """Each client's texts: ``rows_per_client`` population records."""
    if num_clients < 1 or rows_per_client < 0:
        raise ValueError(
            f"num_clients = {num_clients} (>= 1) and rows_per_client = {rows_per_client} "
            "(>= 0) are not allowed"
        )
    return [[r.text() for r in sample_records(rows_per_client, rng)] for _ in range(num_clients)]


def insert_canaries(
    client_texts: Sequence[Sequence[str]],
    canaries: Sequence[str],
    clients: Sequence[int],
    repeats: int,
    rng: np.random.Generator,
) -> list[list[str]]:
    """A copy of ``client_texts`` with canary ``i`` repeated ``repeats`` times in client
    ``clients[i % len(clients)]``; each changed client's texts are then shuffled."""
    if repeats < 1:
        raise ValueError(f"repeats = {repeats!r} is not allowed: an integer >= 1")
    if not clients and canaries:
        raise ValueError("clients must name at least one client to hold the canaries")
    bad = [c for c in clients if not 0 <= c < len(client_texts)]
    if bad:
        raise ValueError(f"clients = {bad} are not allowed: indices in [0, {len(client_texts)})")
    out = [list(t) for t in client_texts]
    for i, canary in enumerate(canaries):
        out[clients[i % len(clients)]] += [canary] * repeats
    for k in set(clients):
        order = rng.permutation(len(out[k]))
        out[k] = [out[k][j] for j in order]
    return out
