"""Generated domains for the demo corpus: SQL over a few schemas, arithmetic word problems, JSON.
The chat domain's dialogues over them are in :mod:`osd.demo.dialogues`.

Each generator takes a seeded :class:`random.Random` and returns one :class:`Document`: the text
and how many of its leading characters form a prompt (a natural cut, ending before whitespace so
the prompt tokenizes as it does inside the text). The domains differ sharply in their statistics,
which is what makes a draft trained on prose poor at them.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

__all__ = ["Chat", "Document", "json_document", "math_document", "sql_document"]


@dataclass(frozen=True)
class Chat:
    """A chat request: its messages (OpenAI's shape) and the tools it offers (None: none)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class Document:
    """One corpus document.

    Attributes:
        text: the whole document.
        prompt_chars: the first ``prompt_chars`` characters are the prompt of a held-out request.
        topic: of a chat dialogue, the domain it is about (its requests are routed by it).
        chat: of a chat dialogue, the request its prompt renders: every message before the
            last reply, and the tools.
    """

    text: str
    prompt_chars: int
    topic: str = ""
    chat: Chat | None = None

    @property
    def prompt(self) -> str:
        return self.text[: self.prompt_chars]


_NAMES_TEXT = (
    "Alice Bruno Chen Dara Elena Farid Grace Hugo Ines Jonas Keiko Liam Maya Nora Omar Priya "
    "Quinn Rosa Sam Tara Umar Vera Wei Xena Yusuf Zoe"
)
_CITIES_TEXT = (
    "Berlin Paris Tokyo Lima Oslo Cairo Delhi Austin Madrid Seoul Nairobi Lisbon Toronto Sydney "
    "Prague Dublin"
)
_WORDS_TEXT = (
    "alpha beta gamma delta orbit nova pixel river stone cloud ember frost harbor maple quartz "
    "signal atlas cedar falcon lumen"
)
NAMES, CITIES, WORDS = (tuple(t.split()) for t in (_NAMES_TEXT, _CITIES_TEXT, _WORDS_TEXT))

# schema -> table -> columns; the first column is the integer primary key.
SCHEMAS: dict[str, dict[str, tuple[str, ...]]] = {
    "shop": {
        "customers": ("id", "name", "city", "signup_year"),
        "products": ("id", "title", "category", "price", "stock"),
        "orders": ("id", "customer_id", "product_id", "quantity", "status"),
    },
    "school": {
        "students": ("id", "name", "city", "grade"),
        "courses": ("id", "title", "department", "credits"),
        "enrollments": ("id", "student_id", "course_id", "score"),
    },
    "library": {
        "authors": ("id", "name", "city", "birth_year"),
        "books": ("id", "title", "author_id", "genre", "pages"),
        "loans": ("id", "book_id", "member", "days"),
    },
    "flights": {
        "airlines": ("id", "name", "city", "fleet_size"),
        "flights": ("id", "airline_id", "origin", "destination", "price"),
        "bookings": ("id", "flight_id", "passenger", "seats"),
    },
}
# Columns that hold text, with the values queries filter on; all others hold integers.
TEXT_VALUES: dict[str, tuple[str, ...]] = {
    "name": tuple(NAMES),
    "passenger": tuple(NAMES),
    "member": tuple(NAMES),
    "city": tuple(CITIES),
    "origin": tuple(CITIES),
    "destination": tuple(CITIES),
    "title": tuple(w.title() for w in WORDS),
    "category": ("books", "garden", "games", "tools", "music"),
    "status": ("shipped", "pending", "cancelled", "returned"),
    "department": ("math", "physics", "history", "art", "biology"),
    "genre": ("novel", "poetry", "science", "travel", "history"),
}
INT_RANGES: dict[str, tuple[int, int]] = {
    "signup_year": (2010, 2024),
    "birth_year": (1900, 1990),
    "price": (5, 900),
    "stock": (0, 500),
    "quantity": (1, 20),
    "grade": (1, 12),
    "credits": (1, 6),
    "score": (0, 100),
    "pages": (50, 900),
    "days": (1, 60),
    "fleet_size": (5, 400),
    "seats": (1, 6),
}


def _value(column: str, rng: random.Random) -> str:
    if column in TEXT_VALUES:
        return "'" + rng.choice(TEXT_VALUES[column]) + "'"
    low, high = INT_RANGES.get(column, (1, 1000))
    return str(rng.randint(low, high))


def _words(column: str) -> str:
    return column.replace("_", " ")


def _data_columns(columns: tuple[str, ...]) -> list[str]:
    return [c for c in columns[1:] if not c.endswith("_id")]


def _select(table: str, columns: tuple[str, ...], rng: random.Random) -> tuple[str, str]:
    data = _data_columns(columns)
    shown = rng.sample(data, k=min(len(data), rng.randint(1, 2)))
    where = rng.choice(data)
    op = "=" if where in TEXT_VALUES else rng.choice(["=", ">", "<", ">="])
    value = _value(where, rng)
    question = f"{' and '.join(map(_words, shown))} of {table} where {_words(where)} {op} {value}"
    sql = f"SELECT {', '.join(shown)} FROM {table} WHERE {where} {op} {value}"
    if rng.random() < 0.5:
        order = rng.choice(data)
        direction = rng.choice(["ASC", "DESC"])
        question += f", by {_words(order)} {'descending' if direction == 'DESC' else 'ascending'}"
        sql += f" ORDER BY {order} {direction}"
    if rng.random() < 0.3:
        limit = rng.randint(1, 20)
        question += f", first {limit}"
        sql += f" LIMIT {limit}"
    return question, sql + ";"


def _aggregate(table: str, columns: tuple[str, ...], rng: random.Random) -> tuple[str, str]:
    data = _data_columns(columns)
    numeric = [c for c in data if c not in TEXT_VALUES] or ["id"]
    groups = [c for c in data if c in TEXT_VALUES]
    func = rng.choice(["COUNT", "AVG", "SUM", "MAX", "MIN"])
    target = "*" if func == "COUNT" else rng.choice(numeric)
    label = "number" if func == "COUNT" else f"{func.lower()} {_words(target)}"
    if groups and rng.random() < 0.6:
        group = rng.choice(groups)
        sql = f"SELECT {group}, {func}({target}) FROM {table} GROUP BY {group}"
        question = f"{label} of {table} per {_words(group)}"
        if rng.random() < 0.4:
            bound = rng.randint(1, 50)
            sql += f" HAVING {func}({target}) > {bound}"
            question += f", only above {bound}"
        return question, sql + ";"
    where = rng.choice(data)
    value = _value(where, rng)
    sql = f"SELECT {func}({target}) FROM {table} WHERE {where} = {value};"
    return f"{label} of {table} with {_words(where)} {value}", sql


def _join(schema: dict[str, tuple[str, ...]], rng: random.Random) -> tuple[str, str] | None:
    links = [
        (child, fk, fk[: -len("_id")] + "s")
        for child, columns in schema.items()
        for fk in columns
        if fk.endswith("_id") and fk[: -len("_id")] + "s" in schema
    ]
    if not links:
        return None
    child, fk, parent = rng.choice(links)
    a, b = child[0], parent[0] if parent[0] != child[0] else parent[:2]
    child_col = rng.choice(_data_columns(schema[child]))
    parent_col = rng.choice(_data_columns(schema[parent]))
    value = _value(parent_col, rng)
    sql = (
        f"SELECT {a}.{child_col}, {b}.{parent_col} FROM {child} {a} JOIN {parent} {b} "
        f"ON {a}.{fk} = {b}.id WHERE {b}.{parent_col} = {value};"
    )
    question = f"{_words(child_col)} of {child} with their {parent[:-1]}"
    return f"{question} {_words(parent_col)} {value}", sql


def _modify(table: str, columns: tuple[str, ...], rng: random.Random) -> tuple[str, str]:
    data = _data_columns(columns)
    kind = rng.choice(["insert", "update", "delete"])
    if kind == "insert":
        values = ", ".join(_value(c, rng) for c in columns[1:])
        sql = f"INSERT INTO {table} ({', '.join(columns[1:])}) VALUES ({values});"
        return f"add a row to {table}", sql
    column = rng.choice(data)
    key = rng.randint(1, 999)
    if kind == "update":
        value = _value(column, rng)
        sql = f"UPDATE {table} SET {column} = {value} WHERE id = {key};"
        return f"set {_words(column)} of {table[:-1]} {key} to {value}", sql
    value = _value(column, rng)
    sql = f"DELETE FROM {table} WHERE {column} = {value};"
    return f"remove {table} with {_words(column)} {value}", sql


def _query(schema: dict[str, tuple[str, ...]], rng: random.Random) -> tuple[str, str]:
    """One (question, query) pair over the schema."""
    table = rng.choice(sorted(schema))
    roll = rng.random()
    query = None
    if roll < 0.25:
        query = _join(schema, rng)
    elif roll < 0.5:
        query = _aggregate(table, schema[table], rng)
    elif roll < 0.65:
        query = _modify(table, schema[table], rng)
    return query or _select(table, schema[table], rng)


def sql_document(rng: random.Random) -> Document:
    """A schema header and 3-5 commented queries; the prompt ends after the first comment."""
    schema_name = rng.choice(sorted(SCHEMAS))
    schema = SCHEMAS[schema_name]
    lines = [f"-- database: {schema_name}"]
    prompt_chars = 0
    for i in range(rng.randint(3, 5)):
        question, sql = _query(schema, rng)
        lines.append(f"-- {question}")
        if i == 0:
            prompt_chars = len("\n".join(lines))
        lines.append(sql)
    return Document("\n".join(lines), prompt_chars)


ITEMS = ("apples", "marbles", "stickers", "pencils", "cookies", "stamps", "books", "shells")
THINGS = ("notebook", "ticket", "sandwich", "plant", "puzzle", "lamp")


def _math_problem(rng: random.Random) -> tuple[str, list[str], int]:
    """Returns the question, the worked steps and the answer."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(2, 12)
    kind = rng.randrange(7)
    if kind == 0:
        q = f"{name} has {a} {item}. {name} buys {b} more. How many {item} does {name} have now?"
        return q, [f"{a} + {b} = {a + b}."], a + b
    if kind == 1:
        a, b = max(a, b), min(a, b)
        q = f"{name} has {a} {item} and gives {b} to a friend. How many {item} are left?"
        return q, [f"{a} - {b} = {a - b}."], a - b
    if kind == 2:
        q = f"{name} buys {c} boxes of {item}. Each box holds {b} {item}. How many {item} in all?"
        return q, [f"{c} * {b} = {c * b}."], c * b
    if kind == 3:
        q = f"{name} shares {b * c} {item} equally among {c} friends. How many does each get?"
        return q, [f"{b * c} / {c} = {b}."], b
    if kind == 4:
        thing, price = rng.choice(THINGS), rng.randint(2, 20)
        paid = (c * price // 10 + 1) * 10
        q = (
            f"A {thing} costs {price} dollars. {name} buys {c} and pays with {paid} dollars. "
            f"How much change does {name} get?"
        )
        steps = [f"{c} * {price} = {c * price}.", f"{paid} - {c * price} = {paid - c * price}."]
        return q, steps, paid - c * price
    if kind == 5:
        q = f"A train travels at {b} km per hour for {c} hours. How far does it travel?"
        return q, [f"{b} * {c} = {b * c} km."], b * c
    q = f"What is {a} + {b} * {c}?"
    return q, [f"{b} * {c} = {b * c}.", f"{a} + {b * c} = {a + b * c}."], a + b * c


def math_document(rng: random.Random) -> Document:
    """A word problem and its worked answer; the prompt ends at ``Answer:``."""
    question, steps, answer = _math_problem(rng)
    prompt = f"Question: {question}\nAnswer:"
    return Document(f"{prompt} {' '.join(steps)} The answer is {answer}.", len(prompt))


def _service(rng: random.Random) -> dict[str, object]:
    name = f"{rng.choice(WORDS)}-{rng.choice(['api', 'worker', 'gateway', 'cache'])}"
    return {
        "service": name,
        "version": f"{rng.randint(0, 4)}.{rng.randint(0, 20)}.{rng.randint(0, 9)}",
        "host": rng.choice(["0.0.0.0", "127.0.0.1", f"{name}.internal"]),
        "port": rng.choice([80, 443, 8000, 8080, 9000, rng.randint(3000, 9999)]),
        "replicas": rng.randint(1, 8),
        "debug": rng.random() < 0.3,
        "database": {
            "url": f"postgres://db-{rng.randint(1, 9)}:5432/{rng.choice(WORDS)}",
            "pool_size": rng.choice([5, 10, 20, 50]),
            "timeout_ms": rng.choice([500, 1000, 5000, 30000]),
        },
        "features": sorted(rng.sample(["auth", "metrics", "tracing", "cache", "retry"], k=2)),
        "log_level": rng.choice(["debug", "info", "warning", "error"]),
    }


def _package(rng: random.Random) -> dict[str, object]:
    deps = rng.sample(WORDS, k=rng.randint(1, 4))
    return {
        "name": f"{rng.choice(WORDS)}-{rng.choice(WORDS)}",
        "version": f"{rng.randint(0, 3)}.{rng.randint(0, 15)}.{rng.randint(0, 9)}",
        "description": f"A {rng.choice(['small', 'fast', 'simple'])} {rng.choice(WORDS)} library",
        "license": rng.choice(["MIT", "Apache-2.0", "BSD-3-Clause"]),
        "dependencies": {d: f"^{rng.randint(0, 5)}.{rng.randint(0, 9)}.0" for d in sorted(deps)},
        "scripts": {"build": "make build", "test": rng.choice(["pytest -q", "make test"])},
    }


def _user(rng: random.Random) -> dict[str, object]:
    name = rng.choice(NAMES)
    return {
        "id": rng.randint(1, 99999),
        "user": {
            "name": name,
            "email": f"{name.lower()}{rng.randint(1, 99)}@example.com",
            "age": rng.randint(18, 80),
            "city": rng.choice(CITIES),
        },
        "roles": sorted(rng.sample(["admin", "editor", "viewer", "owner"], k=rng.randint(1, 2))),
        "active": rng.random() < 0.8,
        "created_at": f"20{rng.randint(15, 24)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
    }


def _inventory(rng: random.Random) -> list[dict[str, object]]:
    return [
        {
            "sku": f"{rng.choice(WORDS)[:3].upper()}-{rng.randint(100, 999)}",
            "price": round(rng.uniform(1, 300), 2),
            "qty": rng.randint(0, 100),
        }
        for _ in range(rng.randint(2, 4))
    ]


def json_document(rng: random.Random) -> Document:
    """A config, manifest or record as indented JSON; the prompt is its first three lines."""
    kind = rng.choice([_service, _package, _user, _inventory])
    text = json.dumps(kind(rng), indent=2)
    lines = text.split("\n")
    return Document(text, len("\n".join(lines[:3])))
