"""The demo corpus: prose and code from the Python standard library, plus generated domains.

Every machine with Python has the standard library, so nothing is downloaded. Its docstrings
(via :mod:`ast`), comment blocks and the reference manual's help topics (``pydoc_data``) are
the prose domain (paragraphs of English; examples and tables dropped); its source, with
docstrings removed and normalised by ``ast.unparse`` (which also drops comments), is the code
domain. SQL, arithmetic word problems and JSON are generated (:mod:`osd.demo.synthetic`). The
chat domain is dialogues over the others, rendered with the chat template (:mod:`osd.demo.chat`):
generated questions answered with SQL, worked answers and JSON (:mod:`osd.demo.dialogues`), and
requests for a standard library function (its signature and the first sentence of its docstring)
answered with its code. Files are read in sorted order, documents shuffled with a seeded generator
and capped, so a recipe always yields the same corpus on the same Python version.

Held-out documents come from held-out stdlib files (every ``heldout_every``-th sorted file) or a
separate random stream, and are never in the training split.
"""

from __future__ import annotations

import ast
import io
import json
import os
import random
import re
import sysconfig
import tokenize
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from osd.demo.dialogues import dialogue_document, json_dialogue, math_dialogue, sql_dialogue
from osd.demo.recipe import CHAT_TOPICS, DOMAINS, CorpusRecipe
from osd.demo.synthetic import Chat, Document, json_document, math_document, sql_document
from osd.demo.tool_dialogues import tool_dialogue

__all__ = [
    "Corpus",
    "build_corpus",
    "heldout_dialogues",
    "heldout_prompts",
    "load_corpus_split",
    "save_corpus",
    "stdlib_files",
]

# Folders of the standard library that are tests, demos or vendored: not representative.
_SKIPPED_DIRS = frozenset(
    {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "__pycache__"}
)
_MIN_PROSE_CHARS = 80
_MIN_CODE_LINES = 5
_GENERATORS: dict[str, Callable[[random.Random], Document]] = {
    "sql": sql_document,
    "math": math_document,
    "json": json_document,
}
_DIALOGUES: dict[str, Callable[[random.Random], Document]] = {
    "sql": sql_dialogue,
    "math": math_dialogue,
    "json": json_dialogue,
}
_MAX_CHAT_CODE_CHARS = 1200  # a chat reply with a function: its first lines up to this
_TOOL_SHARE = 0.4  # of the generated dialogues, those that offer tools (osd.demo.tool_dialogues)

# domain -> split ("train" or "heldout") -> documents
Corpus = dict[str, dict[str, list[Document]]]


def stdlib_files(max_files: int | None = None) -> list[Path]:
    """The standard library's ``.py`` files outside test and vendored folders, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIPPED_DIRS]  # prune: never walk site-packages
        files.extend(Path(folder) / name for name in names if name.endswith(".py"))
    files.sort()
    return files[:max_files] if max_files is not None else files


def _clean_docstring(doc: str) -> str:
    """Keeps the prose paragraphs of a docstring, each reflowed onto one line."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", doc):
        lines = block.split("\n")
        if any(line.startswith((" ", "\t")) or ">>>" in line for line in lines):
            continue  # examples, tables and argument lists, not prose
        text = " ".join(line.strip() for line in lines).strip()
        letters = sum(ch.isalpha() or ch == " " for ch in text)
        if len(text) >= 20 and letters >= 0.85 * len(text):
            paragraphs.append(text)
    return "\n\n".join(paragraphs)


def _prose_document(text: str) -> Document | None:
    if len(text) < _MIN_PROSE_CHARS:
        return None
    # Cut the prompt before a space (so it tokenizes as it does inside the text), near 60 chars.
    cut = text.rfind(" ", 20, 70)
    return Document(text, cut) if cut > 0 else None


def _strip_docstrings(node: ast.AST) -> None:
    for child in ast.walk(node):
        body = getattr(child, "body", None)
        if (
            isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Module)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            child.body = body[1:] or [ast.Pass()]


def _code_document(node: ast.AST, max_chars: int) -> Document | None:
    _strip_docstrings(node)
    lines = ast.unparse(node).split("\n")
    text = ""
    for line in lines:  # cut long definitions at a line boundary
        if len(text) + len(line) + 1 > max_chars:
            break
        text += ("\n" if text else "") + line
    num_lines = text.count("\n") + 1
    if num_lines < _MIN_CODE_LINES:
        return None
    # The prompt is the first lines, without the newline that starts the next one.
    prompt = "\n".join(lines[: min(3, num_lines - 2)]).rstrip()
    return Document(text, len(prompt))


def _code_dialogue(
    node: ast.FunctionDef | ast.AsyncFunctionDef, docstring: str, code: str
) -> Document | None:
    """A user asks for the function by its signature and docstring's first sentence; the
    assistant answers with its code (docstring removed). None without a prose sentence."""
    summary = _clean_docstring(docstring).split("\n\n")[0]
    sentence = re.split(r"(?<=\.)\s", summary, maxsplit=1)[0].strip()
    if not 20 <= len(sentence) <= 200:
        return None
    reply = _clip_lines(code, _MAX_CHAT_CODE_CHARS)
    ask = f"Write a Python function {node.name}({ast.unparse(node.args)}). {sentence}"
    messages = [{"role": "user", "content": ask}, {"role": "assistant", "content": reply}]
    return dialogue_document(messages, "code")


def _clip_lines(text: str, max_chars: int) -> str:
    """The first lines of ``text`` within ``max_chars`` (at least one)."""
    lines = text.split("\n")
    kept = lines[:1]
    for line in lines[1:]:
        if sum(len(x) + 1 for x in kept) + len(line) > max_chars:
            break
        kept.append(line)
    return "\n".join(kept)


def _clip(text: str, max_chars: int) -> str:
    """Cuts prose at the last space within ``max_chars``."""
    if len(text) <= max_chars:
        return text
    cut = text.rfind(" ", 0, max_chars)
    return text[: cut if cut > 0 else max_chars]


def _comment_blocks(source: str) -> Iterator[str]:
    """Runs of comment lines on consecutive lines, joined into one paragraph each."""
    block: list[str] = []
    last_line = -2
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type != tokenize.COMMENT:
                continue
            if token.start[0] != last_line + 1 and block:
                yield " ".join(block)
                block = []
            block.append(token.string.lstrip("#").strip())
            last_line = token.start[0]
    except (tokenize.TokenError, SyntaxError):
        pass
    if block:
        yield " ".join(block)


def _prose_texts(path: Path, source: str, tree: ast.Module) -> Iterator[str]:
    """Docstrings, comment blocks, and for ``pydoc_data/topics.py`` its help topics."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node)
            if docstring:
                yield _clean_docstring(docstring)
    yield from (_clean_docstring(block) for block in _comment_blocks(source))
    if path.parent.name == "pydoc_data":  # the reference manual's text, as a dict of strings
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                yield from _clean_docstring(node.value).split("\n\n")


def _stdlib_documents(path: Path, max_doc_chars: int) -> Iterator[tuple[str, Document]]:
    """Yields (domain, document) for one source file; unparsable files yield nothing."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    for text in _prose_texts(path, source, tree):
        prose = _prose_document(_clip(text, max_doc_chars))
        if prose is not None:
            yield "prose", prose
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            docstring = ast.get_docstring(node)  # before _code_document strips it
            code = _code_document(node, max_doc_chars)
            if code is not None:
                yield "code", code
                if docstring and not isinstance(node, ast.ClassDef):
                    dialogue = _code_dialogue(node, docstring, code.text)
                    if dialogue is not None:
                        yield "chat", dialogue


def _cap(documents: list[Document], max_chars: int, rng: random.Random) -> list[Document]:
    """Shuffles, then keeps documents while the total stays within ``max_chars``."""
    documents = list(documents)
    rng.shuffle(documents)
    kept, total = [], 0
    for doc in documents:
        if total + len(doc.text) > max_chars:
            continue
        kept.append(doc)
        total += len(doc.text)
    return kept


def _generated(
    domain: str, max_chars: int, exclude: set[str], rng: random.Random, max_docs: int
) -> list[Document]:
    generate = _GENERATORS[domain]
    documents: list[Document] = []
    total, attempts = 0, 0
    while total < max_chars and len(documents) < max_docs and attempts < 50 * max_docs:
        attempts += 1
        doc = generate(rng)
        if doc.text in exclude:
            continue
        exclude.add(doc.text)  # also keeps the split free of duplicates
        documents.append(doc)
        total += len(doc.text)
    return documents


def _dialogues(
    code_pool: list[Document],
    max_chars: int,
    exclude: set[str],
    rng: random.Random,
    max_docs: int,
) -> list[Document]:
    """Dialogues on topics drawn uniformly from :data:`CHAT_TOPICS`: code ones from the pool
    (standard library functions, in a seeded order), the others generated, a share of them
    offering tools."""
    pool = list(code_pool)
    rng.shuffle(pool)
    documents: list[Document] = []
    total, attempts = 0, 0
    while total < max_chars and len(documents) < max_docs and attempts < 50 * max_docs:
        attempts += 1
        topic = rng.choice(CHAT_TOPICS)
        if topic == "code":
            if not pool:
                continue
            doc = pool.pop()
        elif rng.random() < _TOOL_SHARE:
            doc = tool_dialogue(topic, rng)
        else:
            doc = _DIALOGUES[topic](rng)
        if doc.text in exclude:
            continue
        exclude.add(doc.text)
        documents.append(doc)
        total += len(doc.text)
    return documents


def build_corpus(recipe: CorpusRecipe) -> Corpus:
    """Builds every domain's training and held-out documents, deterministically.

    Args:
        recipe: sizes, caps and seed.

    Returns:
        ``corpus[domain]["train" | "heldout"]``: lists of documents.
    """
    stdlib: dict[str, dict[str, list[Document]]] = {
        d: {"train": [], "heldout": []} for d in ("prose", "code", "chat")
    }
    for index, path in enumerate(stdlib_files(recipe.max_stdlib_files)):
        split = "heldout" if index % recipe.heldout_every == 0 else "train"
        for domain, doc in _stdlib_documents(path, recipe.max_doc_chars):
            stdlib[domain][split].append(doc)
    corpus: Corpus = {}
    for offset, domain in enumerate(DOMAINS):
        rng = random.Random(recipe.seed * 1000 + offset)
        seen: set[str] = set()
        if domain == "chat":  # the code dialogues come from stdlib files, the others generated
            heldout = _dialogues(stdlib[domain]["heldout"], 10**12, seen, rng, recipe.num_heldout)
            train = _dialogues(
                stdlib[domain]["train"], recipe.max_train_chars[domain], seen, rng, 10**9
            )
        elif domain in stdlib:
            train = _cap(stdlib[domain]["train"], recipe.max_train_chars[domain], rng)
            heldout = _cap(stdlib[domain]["heldout"], 10**12, rng)[: recipe.num_heldout]
        else:
            heldout = _generated(domain, 10**12, seen, rng, recipe.num_heldout)
            train = _generated(domain, recipe.max_train_chars[domain], seen, rng, 10**9)
        if not train or not heldout:
            raise ValueError(
                f"domain {domain!r} got {len(train)} training and {len(heldout)} held-out "
                f"documents; raise max_stdlib_files ({recipe.max_stdlib_files}) or the caps"
            )
        corpus[domain] = {"train": train, "heldout": heldout}
    return corpus


def save_corpus(corpus: Corpus, directory: Path) -> None:
    """Writes ``<domain>/<split>.jsonl`` files: one ``{"text", "prompt_chars"}`` per line, and
    a dialogue's ``topic``, prompt ``messages`` and ``tools``."""
    for domain, splits in corpus.items():
        (directory / domain).mkdir(parents=True, exist_ok=True)
        for split, documents in splits.items():
            with open(directory / domain / f"{split}.jsonl", "w", encoding="utf-8") as f:
                for doc in documents:
                    row: dict[str, object] = {"text": doc.text, "prompt_chars": doc.prompt_chars}
                    if doc.topic:
                        row["topic"] = doc.topic
                    if doc.chat is not None:
                        row["messages"] = doc.chat.messages
                        if doc.chat.tools:
                            row["tools"] = doc.chat.tools
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")


def load_corpus_split(directory: Path | str, domain: str, split: str) -> list[Document]:
    """Reads one domain's split written by :func:`save_corpus`.

    Raises:
        ValueError: if the domain or split does not exist there.
    """
    path = Path(directory) / domain / f"{split}.jsonl"
    if not path.is_file():
        raise ValueError(f"no {split!r} split for domain {domain!r} at {path}")
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [
        Document(
            row["text"],
            int(row["prompt_chars"]),
            row.get("topic", ""),
            Chat(row["messages"], row.get("tools")) if "messages" in row else None,
        )
        for row in rows
    ]


# Longest prompt the demo traffic uses: a few code prompts are one very long line, and with the
# demo's 64 new tokens they would not fit the models' 256 positions (a 400, not a request).
MAX_PROMPT_CHARS = 400
# A prompt offering tools: their compact JSON tokenizes at about 3.3 characters a token, so 600
# characters stay under 170 tokens.
MAX_TOOL_PROMPT_CHARS = 600


def heldout_prompts(
    directory: Path | str, domains: Iterable[str], max_chars: int = MAX_PROMPT_CHARS
) -> dict[str, list[str]]:
    """Domain -> the prompts of its held-out documents, those over `max_chars` left out."""
    return {
        domain: [
            doc.prompt
            for doc in load_corpus_split(directory, domain, "heldout")
            if len(doc.prompt) <= max_chars
        ]
        for domain in domains
    }


def heldout_dialogues(
    directory: Path | str,
    max_chars: int = MAX_PROMPT_CHARS,
    max_tool_chars: int = MAX_TOOL_PROMPT_CHARS,
) -> dict[str, list[Chat]]:
    """Topic -> the chat domain's held-out requests (every message before the last reply, and
    the tools offered), those whose rendered prompt is over `max_chars` (with tools:
    `max_tool_chars`) left out."""
    out: dict[str, list[Chat]] = {}
    for doc in load_corpus_split(directory, "chat", "heldout"):
        if doc.chat is None:
            raise ValueError(f"{directory}: the chat split predates stored messages; rebuild it")
        limit = max_tool_chars if doc.chat.tools else max_chars
        if len(doc.prompt) <= limit:
            out.setdefault(doc.topic, []).append(doc.chat)
    return out
