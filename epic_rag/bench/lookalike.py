"""Look-alike records: many records of one shape spread over the chunks, one asked for, its near-duplicates in
other chunks (generated from a seed, never downloaded).

Directories, price lists, tables, logs, configuration and API references are this kind of content: a lookup
among records that differ by a letter or a digit. Each sample is a few office notes (ordinary prose) of about
`chunk_tokens` tokens each, with a handful of records of one kind set among the prose, as sentences or as a
Markdown table (half the samples each). The record asked for sits in one chunk; two look-alikes of its key (a
one-letter surname change and another first name on the same surname; a product code with two digits swapped
and one with its letters swapped; the next minor version of the same service and the same version of a sibling
service; the same call on another object and another call on the same object) sit in other chunks with values of
the same shape. The question asks for the one value; scored by substring.

Kinds: staff extensions (4 digits), part prices ($ddd.dd), service ports (4-5 digits) and API timeouts
(seconds), one kind per sample.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .datasets import Sample

FIRST = ["Alice", "Maria", "Tomas", "Priya", "Jonas", "Elena", "Marek", "Sofia", "Daniel", "Ingrid", "Kofi", "Lena"]
FIRST += ["Rahul", "Nadia", "Oskar", "Hana", "Victor", "Yara", "Felix", "Irene", "Samuel", "Clara", "Emil", "Dana"]
LAST = ["Marlow", "Brandt", "Okafor", "Lindqvist", "Castell", "Moreau", "Novak", "Halvorsen", "Ferreira", "Keller"]
LAST += ["Delacroix", "Sandoval", "Whitcombe", "Nakamura", "Petrov", "Albright", "Quintero", "Rasmussen", "Talbot"]
TEAMS = ["Billing", "Payroll", "Facilities", "Legal", "Procurement", "Support", "Research", "Logistics", "Audit"]
SERVICES = ["ledger", "invoice", "catalog", "payroll", "shipping", "identity", "search", "audit", "billing"]
SUFFIXES = ["api", "worker", "gateway", "sync", "store", "relay"]
CALLS = ["fetch", "post", "sync", "export", "render", "resolve", "archive", "validate"]
OBJECTS = ["invoice", "ledger", "order", "report", "account", "shipment", "contract", "batch"]

# Office prose the records sit among: sentences built from these parts (seeded, so a sample is the same text
# whatever else is generated).
_WHO = ["The facilities team", "Our finance group", "The quarterly review board", "Management", "The office manager"]
_WHO += ["The onboarding committee", "Everyone in the east wing", "The safety officer", "The IT helpdesk"]
_DID = ["reminds staff", "has decided", "wants everyone to know", "noted last week", "asked us to confirm"]
_DID += ["announced on Monday", "would like to stress", "has updated the guidance so"]
_WHAT = ["that the kitchen will be cleaned every Friday afternoon", "that the printers on floor two are replaced"]
_WHAT += ["that expense reports are due by the fifth working day", "that visitors must sign in at reception"]
_WHAT += ["that the parking permits for next year are ready", "that the fire drill is scheduled for Thursday"]
_WHAT += ["that meeting rooms should be booked through the portal", "that the old archive boxes go to storage"]
_WHAT += ["that the heating schedule changes in October", "that laptops must be locked when left unattended"]
_WHAT += ["that the summer party moves to the courtyard", "that travel requests need two approvals"]
_TAIL = ["Please plan accordingly.", "Questions can go to your line manager.", "Thank you for your patience."]
_TAIL += ["More details will follow in the newsletter.", "This applies to contractors as well.", ""]


def _prose(rng: random.Random, sentences: int) -> str:
    out = []
    for _ in range(sentences):
        s = f"{rng.choice(_WHO)} {rng.choice(_DID)} {rng.choice(_WHAT)}."
        tail = rng.choice(_TAIL)
        out.append(f"{s} {tail}".strip())
    return " ".join(out)


@dataclass(frozen=True, slots=True)
class _Record:
    key: str  # what the question names ("Alice Marlow in Billing", "part KX-4471-B", ...)
    value: str
    sentence: str  # the record as prose
    row: tuple[str, ...]  # the record as a table row


class _Kind:
    """One shape of record: how keys, look-alike keys and values are made, shown and asked for."""

    name = ""
    header: tuple[str, ...] = ()

    def key(self, rng: random.Random) -> tuple: ...
    def lookalikes(self, rng: random.Random, key: tuple) -> list[tuple]: ...
    def value(self, rng: random.Random) -> str: ...
    def record(self, key: tuple, value: str) -> _Record: ...
    def question(self, key: tuple) -> tuple[str, str]: ...  # (question, answer prefix)


def _one_letter(rng: random.Random, word: str) -> str:
    i = rng.randrange(1, len(word))
    vowels, cons = "aeiou", "bdlmnrst"
    pool = vowels if word[i] in vowels else cons
    return word[:i] + rng.choice([c for c in pool if c != word[i]]) + word[i + 1 :]


class _Staff(_Kind):
    name, header = "extension", ("Name", "Team", "Extension")

    def key(self, rng):
        return rng.choice(FIRST), rng.choice(LAST), rng.choice(TEAMS)

    def lookalikes(self, rng, key):
        first, last, team = key
        return [
            (first, _one_letter(rng, last), rng.choice(TEAMS)),
            (rng.choice([f for f in FIRST if f != first]), last, team),
        ]

    def value(self, rng):
        return str(rng.randrange(2000, 9999))

    def record(self, key, value):
        first, last, team = key
        s = f"{first} {last} ({team}) can be reached on extension {value}."
        return _Record(f"{first} {last} in {team}", value, s, (f"{first} {last}", team, value))

    def question(self, key):
        first, last, team = key
        return f"What is the phone extension of {first} {last}?", f"The extension of {first} {last} is"


class _Parts(_Kind):
    name, header = "price", ("Part", "Description", "Unit price")

    def key(self, rng):
        letters = "".join(rng.choice("BCDFGHKMNPRSTVXZ") for _ in range(2))
        return letters, f"{rng.randrange(1000, 9999)}", rng.choice("ABCDE")

    def lookalikes(self, rng, key):
        letters, digits, suffix = key
        swapped = (
            digits[:2] + digits[3] + digits[2]
            if digits[2] != digits[3]
            else digits[:3] + str((int(digits[3]) + 1) % 10)
        )
        return [
            (letters, swapped, suffix),
            (letters[::-1] if letters[0] != letters[1] else letters[0] + "Q", digits, suffix),
        ]

    def value(self, rng):
        return f"${rng.randrange(100, 999)}.{rng.randrange(0, 100):02d}"

    def record(self, key, value):
        code = "-".join(key)
        what = f"{rng_free_item(code)}"
        s = f"Part {code} ({what}) is listed at {value} per unit."
        return _Record(f"part {code}", value, s, (code, what, value))

    def question(self, key):
        code = "-".join(key)
        return f"What is the unit price of part {code}?", f"The unit price of part {code} is"


def rng_free_item(code: str) -> str:
    """A description fixed by the code (the same part always reads the same)."""
    items = ["hinge bracket", "cable gland", "hex bolt set", "gasket ring", "relay socket", "fan shroud"]
    return items[sum(map(ord, code)) % len(items)]


class _Ports(_Kind):
    name, header = "port", ("Service", "Version", "Port")

    def key(self, rng):
        return f"{rng.choice(SERVICES)}-{rng.choice(SUFFIXES)}", (
            rng.randrange(1, 4),
            rng.randrange(0, 20),
            rng.randrange(0, 9),
        )

    def lookalikes(self, rng, key):
        svc, (a, b, c) = key
        base, suf = svc.split("-")
        return [
            (svc, (a, b + 1, c)),
            (f"{base}-{rng.choice([s for s in SUFFIXES if s != suf])}", (a, b, c)),
        ]

    def value(self, rng):
        return str(rng.randrange(3000, 19999))

    def record(self, key, value):
        svc, (a, b, c) = key
        s = f"Service {svc} version {a}.{b}.{c} listens on port {value}."
        return _Record(f"{svc} {a}.{b}.{c}", value, s, (svc, f"{a}.{b}.{c}", value))

    def question(self, key):
        svc, (a, b, c) = key
        return (
            f"Which port does service {svc} version {a}.{b}.{c} listen on?",
            f"Service {svc} version {a}.{b}.{c} listens on port",
        )


class _Timeouts(_Kind):
    name, header = "timeout", ("Function", "Argument", "Default timeout (s)")

    def key(self, rng):
        return rng.choice(CALLS), rng.choice(OBJECTS), rng.choice(["", "_v2"])

    def lookalikes(self, rng, key):
        call, obj, ver = key
        return [
            (rng.choice([c for c in CALLS if c != call]), obj, ver),
            (call, rng.choice([o for o in OBJECTS if o != obj]), ver),
        ]

    def value(self, rng):
        return str(rng.randrange(11, 299))

    def record(self, key, value):
        call, obj, ver = key
        fn = f"{call}_{obj}{ver}()"
        s = f"The function {fn} waits {value} seconds by default before it gives up."
        return _Record(fn, value, s, (fn, "timeout", value))

    def question(self, key):
        call, obj, ver = key
        fn = f"{call}_{obj}{ver}()"
        return f"What is the default timeout of {fn} in seconds?", f"The default timeout of {fn} is"


KINDS = [_Staff(), _Parts(), _Ports(), _Timeouts()]


def _chunk_text(rng: random.Random, kind: _Kind, records: list[_Record], table: bool, target_words: int) -> str:
    """Office prose of about `target_words` words with the records set among it (as sentences, or one table)."""
    parts = [_prose(rng, 2)]
    if table:
        parts.append(
            "\n".join(
                [
                    "| " + " | ".join(kind.header) + " |",
                    "|" + "---|" * len(kind.header),
                    *("| " + " | ".join(r.row) + " |" for r in records),
                ]
            )
        )
        parts.append(_prose(rng, 3))
    else:
        for r in records:
            parts.append(r.sentence + " " + _prose(rng, 1))
    words = sum(len(p.split()) for p in parts)
    while words < target_words:
        extra = _prose(rng, 2)
        parts.insert(rng.randrange(0, len(parts) + 1) if not table else len(parts), extra)
        words += len(extra.split())
    return "\n\n".join(parts)


def lookalike_samples(
    tokenizer,
    n: int = 60,
    chunks: int = 5,
    chunk_tokens: int = 300,
    records: int = 2,
    lookalikes: int = 1,
    seed: int = 300,
) -> list[Sample]:
    """`n` samples, each from its own seeded generator (sample i is the same whatever n is); kinds and the
    prose/table form alternate. `tokenizer` only measures: the chunk texts are sized to about `chunk_tokens`."""
    words = max(40, int(chunk_tokens * 0.62))  # office prose tokenizes at ~1.6 tokens a word
    out = []
    for i in range(n):
        rng = random.Random(f"lookalike:{seed}:{i}")
        kind = KINDS[i % len(KINDS)]
        table = (i // len(KINDS)) % 2 == 1
        asked = kind.key(rng)
        near = kind.lookalikes(rng, asked)[:lookalikes]
        used = {asked, *near}
        keys_per_chunk: list[list[tuple]] = [[] for _ in range(chunks)]
        home = rng.randrange(chunks)
        keys_per_chunk[home].append(asked)
        others = [c for c in range(chunks) if c != home]
        for k, c in zip(near, rng.sample(others, len(near))):  # each look-alike in another chunk
            keys_per_chunk[c].append(k)
        for c in range(chunks):  # fill every chunk up to `records` records of the same kind
            while len(keys_per_chunk[c]) < records:
                k = kind.key(rng)
                if k not in used:
                    used.add(k)
                    keys_per_chunk[c].append(k)
            rng.shuffle(keys_per_chunk[c])
        values: dict[tuple, str] = {}
        taken: set[str] = set()
        for k in [k for ks in keys_per_chunk for k in ks]:
            v = kind.value(rng)
            while v in taken:  # every value distinct: a wrong answer is another record's value
                v = kind.value(rng)
            taken.add(v)
            values[k] = v
        texts = [_chunk_text(rng, kind, [kind.record(k, values[k]) for k in ks], table, words) for ks in keys_per_chunk]
        question, prefix = kind.question(asked)
        out.append(
            Sample(
                id=f"look-{kind.name}-{'table' if table else 'prose'}-{i}",
                task="lookalike",
                chunks=texts,
                question=question,
                answer=values[asked],
                answer_prefix=prefix,
                meta={
                    "kind": kind.name,
                    "form": "table" if table else "prose",
                    "home_chunk": home,
                    "lookalike_values": [values[k] for k in near],
                    "tokens": [len(tokenizer.encode(t, add_special_tokens=False)) for t in texts],
                },
            )
        )
    return out
