"""Job file text -> validated ``JobSpec``, or one ``JobError`` that names the key (or file and line).

YAML is read with fixes over PyYAML's YAML 1.1 defaults, each of which otherwise turns a typo into a
silently different job. Numbers follow YAML 1.2's core schema: ``1e-3`` is a float (1.1 reads it as a
string), ``010`` is ten (1.1: octal 8; octal is written ``0o10``), and ``1:30`` is the string it looks
like (1.1: the base-60 number 90), so an integer key refuses it instead of running 90 steps. Underscores
between digits (``1_000``) and ``0b`` binary are still read as 1.1 reads them: neither is ambiguous. A
duplicate key is an error (1.1 keeps the last one).

A job file is untrusted text, so reading it is bounded before anything is built: the file's size,
the nesting depth (deep ``[[[...`` otherwise ends in a ``RecursionError``), the number of nodes and
of alias references (a "billion laughs" document is small as YAML but enormous as data), and every
value quoted in an error message (``repr`` of a huge structure would build it in full).
"""

from __future__ import annotations

import re
import reprlib
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from fusionnet.errors import JobError
from fusionnet.job.schema import JobSpec, KeyProblem

_INT_TAG = "tag:yaml.org,2002:int"
_FLOAT_TAG = "tag:yaml.org,2002:float"

# YAML 1.2 core integers: decimal (a leading zero is still decimal), 0o octal, 0x hex; plus 0b binary and
# ``_`` between digits, as PyYAML has always read them. No base-60 ``1:30``: that stays a string.
_INT_1_2 = re.compile(
    r"""^[-+]?(?:[0-9][0-9_]*|0o[0-7_]+|0x[0-9a-fA-F_]+|0b[01_]+)$""",
)
# YAML 1.2 core floats (a dot or an exponent, or .inf/.nan): ``1e-3`` without a dot is a float, ``-.5`` is
# too (1.1 reads both as strings), and there is no base-60 ``1:30.5``.
_FLOAT_1_2 = re.compile(
    r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
    re.X,
)


# Far above any real job file (the bundled ones are < 2 KiB, < 100 nodes, depth < 6, no aliases).
MAX_JOB_FILE_BYTES = 1 << 20
MAX_YAML_DEPTH = 32
MAX_YAML_NODES = 20_000
MAX_YAML_ALIASES = 100

_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 50
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 4
_SHORT.maxlevel = 2


def short_repr(value: Any) -> str:
    """``repr`` that never walks more than a few elements of a structure (bounded time and size)."""
    return _SHORT.repr(value)


class _Bounds(yaml.YAMLError):
    """The document exceeds one of the reading bounds (a message for the user, with the line)."""

    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(problem)
        self.problem = problem
        self.problem_mark = mark


class _JobYamlLoader(yaml.SafeLoader):
    """SafeLoader (no arbitrary objects) + YAML 1.2 exponent floats + duplicate keys refused + bounds."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0
        self._aliases = 0

    def compose_document(self) -> Any:
        root = super().compose_document()
        # Aliases share composed nodes, so the document as data can be exponentially larger than its
        # text; count it as data (memoised per node, so this is linear in the text) before building it.
        sizes: dict[int, int] = {}

        def expanded(node: yaml.Node) -> int:
            if id(node) not in sizes:
                children: list[yaml.Node] = []
                if isinstance(node, yaml.SequenceNode):
                    children = list(node.value)
                elif isinstance(node, yaml.MappingNode):
                    children = [part for pair in node.value for part in pair]
                sizes[id(node)] = min(1 + sum(expanded(c) for c in children), MAX_YAML_NODES + 1)
            return sizes[id(node)]

        if root is not None and expanded(root) > MAX_YAML_NODES:
            raise _Bounds(f"expands to more than {MAX_YAML_NODES} values (aliases)", root.start_mark)
        return root

    def compose_node(self, parent: Any, index: Any) -> Any:
        # Composition is where PyYAML recurses and where aliases are resolved: bounding it here bounds
        # both the Python stack and the size of what construction will later build.
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_YAML_ALIASES:
                raise _Bounds(f"more than {MAX_YAML_ALIASES} alias references (*name)", event.start_mark)
        self._nodes += 1
        if self._nodes > MAX_YAML_NODES:
            raise _Bounds(f"more than {MAX_YAML_NODES} values; a job file is small", event.start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise _Bounds(f"nested deeper than {MAX_YAML_DEPTH} levels", event.start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str | int | float | bool) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {short_repr(key)} (first on line {seen[key] + 1})",
                    key_node.start_mark,
                )
            if isinstance(key, str | int | float | bool):
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    """An int as YAML 1.2 reads it (``010`` is ten; PyYAML's 1.1 constructor makes it octal 8); also for an
    explicit ``!!int``, whose text no resolver has checked: anything else is a YAML error with the line,
    not a ValueError from inside the parser (nor Python's 4300-digit limit on ``int()``)."""
    text = str(loader.construct_scalar(node))
    digits = text.replace("_", "")
    sign = -1 if digits[:1] == "-" else 1
    digits = digits[1:] if digits[:1] in ("+", "-") else digits
    try:
        if digits[:2].lower() in ("0o", "0x", "0b"):
            return sign * int(digits, 0)
        if not digits.isascii() or not digits.isdigit():
            raise ValueError("not decimal digits")
        return sign * int(digits, 10)
    except ValueError as e:
        problem = f"{short_repr(text)} is not an integer ({str(e)[:80]})"
        raise yaml.constructor.ConstructorError(None, None, problem, node.start_mark) from None


def _construct_float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
    """A float as YAML 1.2 reads it; an explicit ``!!float`` that is none is a YAML error with the line (no
    base-60 ``1:30``: PyYAML's 1.1 constructor would compute it)."""
    text = str(loader.construct_scalar(node))
    value = text.replace("_", "").lower()
    sign = -1.0 if value[:1] == "-" else 1.0
    value = value[1:] if value[:1] in ("+", "-") else value
    if value == ".inf":
        return sign * float("inf")
    if value == ".nan":
        return float("nan")
    try:
        if ":" in value:  # float() does not read it, but refuse it by name rather than by accident
            raise ValueError("base-60 numbers are YAML 1.1")
        return sign * float(value)
    except ValueError as e:
        problem = f"{short_repr(text)} is not a number ({str(e)[:80]})"
        raise yaml.constructor.ConstructorError(None, None, problem, node.start_mark) from None


# SafeLoader's YAML 1.1 int and float resolvers are dropped, not just added to: the first resolver that
# matches wins, and 1.1's would still read ``010`` as octal and ``1:30`` as base 60.
_JobYamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_JobYamlLoader.add_implicit_resolver(_INT_TAG, _INT_1_2, list("-+0123456789"))
_JobYamlLoader.add_implicit_resolver(_FLOAT_TAG, _FLOAT_1_2, list("-+0123456789."))
_JobYamlLoader.add_constructor(_INT_TAG, _construct_int)
_JobYamlLoader.add_constructor(_FLOAT_TAG, _construct_float)


def read_yaml(path: Path) -> Any:
    """The parsed document; JobError naming the file (and line) when it cannot be read or parsed."""
    shown = str(path) if str(path).isprintable() and len(str(path)) <= 200 else short_repr(str(path))
    try:
        if not path.exists():
            raise JobError(f"{shown}: job file not found")
        if not path.is_file():
            raise JobError(f"{shown}: not a file")
        size = path.stat().st_size
        if size > MAX_JOB_FILE_BYTES:
            raise JobError(f"{shown}: job file is {size} bytes; at most {MAX_JOB_FILE_BYTES} are read")
        text = path.read_text(encoding="utf-8")
    except JobError:
        raise
    except OSError as e:
        raise JobError(f"{shown}: cannot read job file: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise JobError(f"{shown}: a job file must be UTF-8 text (byte {e.start} is not)") from None
    except ValueError as e:  # e.g. an embedded NUL byte in the path
        raise JobError(f"{shown}: not a usable path: {e}") from None
    return parse_yaml_text(text, str(path))


def parse_yaml_text(text: str, source: str) -> Any:
    """The parsed document of ``text``; JobError naming ``source`` (and line) when it cannot be parsed."""
    try:
        return yaml.load(text, Loader=_JobYamlLoader)
    except yaml.YAMLError as e:
        mark = e.problem_mark if isinstance(e, yaml.MarkedYAMLError | _Bounds) else None
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = (e.problem if isinstance(e, yaml.MarkedYAMLError | _Bounds) else None) or str(e)
        if isinstance(e, yaml.reader.ReaderError):  # a character YAML refuses (NUL, most controls)
            where = f"{source}:{text.count(chr(10), 0, e.position) + 1}"
            char = e.character if isinstance(e.character, int) else ord(str(e.character)[:1] or " ")
            problem = f"character #x{char:04x} is not allowed in YAML"
        problem = " ".join(str(problem).split())  # one line, whatever the parser's message looked like
        kind = "refused" if isinstance(e, _Bounds) else "YAML syntax error"
        raise JobError(f"{where}: {kind}: {str(problem)[:200]}") from None


def key_path(loc: tuple[Any, ...], doc: Any) -> str:
    """A location in the job document as messages and the README write it: ``placement.cuts[0]``, list
    positions in brackets, mapping keys after dots. Why the document: pydantic's location holds a list
    position and an integer mapping key (``5: 3``) alike as an int; only the document tells them apart."""
    text, node = "", doc
    for part in loc:
        if isinstance(part, int) and isinstance(node, list):
            text += f"[{part}]"
            node = node[part] if -len(node) <= part < len(node) else None
            continue
        shown = part[:60] if isinstance(part, str) else short_repr(part)
        text += f".{shown}" if text else shown
        node = node.get(part) if isinstance(node, dict) else None
    return text


def _describe(err: dict[str, Any]) -> tuple[tuple[Any, ...], str]:
    """One pydantic error -> (key path as pydantic locates it, short message) in job-file words."""
    loc = tuple(err["loc"])
    kind, ctx, got = err["type"], err.get("ctx") or {}, err.get("input")
    shown = short_repr(got)
    if kind == "value_error" and isinstance(ctx.get("error"), KeyProblem):
        problem: KeyProblem = ctx["error"]
        return loc + problem.key, problem.text
    texts = {
        "missing": "required key missing",
        "extra_forbidden": "unknown key",
        "int_type": f"must be an integer (got {shown})",
        "int_from_float": f"must be an integer (got {shown})",
        "float_type": f"must be a number (got {shown})",
        "float_parsing": f"must be a number (got {shown})",
        "finite_number": f"must be a finite number (got {shown})",
        "string_type": f"must be a string (got {shown})",
        "dict_type": f"must be a mapping (got {shown})",
        "model_type": f"must be a mapping (got {shown})",
        "model_attributes_type": f"must be a mapping (got {shown})",
        "greater_than": f"must be > {ctx.get('gt')} (got {shown})",
        "greater_than_equal": f"must be >= {ctx.get('ge')} (got {shown})",
        "less_than": f"must be < {ctx.get('lt')} (got {shown})",
        "less_than_equal": f"must be <= {ctx.get('le')} (got {shown})",
        "string_too_long": f"must be at most {ctx.get('max_length')} characters (got {len(str(got))})",
        "string_too_short": "must not be empty",
        "literal_error": f"must be one of {ctx.get('expected')} (got {shown})",
    }
    if kind in texts:
        return loc, texts[kind]
    msg = str(ctx["error"]) if kind == "value_error" and "error" in ctx else err["msg"]
    return loc, (msg[:1].lower() + msg[1:])[:200]


def spec_from_document(doc: Any, source: str) -> JobSpec:
    """Validates a parsed job document. One JobError: the first problem, then how many more."""
    if not isinstance(doc, dict):
        raise JobError(f"{source}: a job file must be a YAML mapping of keys (got {type(doc).__name__})")
    # Pydantic builds an error per bad element: a huge list under one key would make a huge message.
    try:
        return JobSpec.model_validate(doc)
    except ValidationError as e:
        problems = [_describe(err) for err in e.errors(include_url=False)[:5]]
        first_key, first_text = problems[0]
        message = f"{key_path(first_key, doc) or source}: {first_text}"
        if len(problems) > 1:
            rest = "; ".join(f"{key_path(k, doc)}: {t}" for k, t in problems[1:])
            message += f" (also: {rest})"
        raise JobError(message) from None


def load_job_spec(path: str | Path) -> JobSpec:
    """Parses and validates a job file (no files opened besides it, no user code run)."""
    path = Path(path)
    return spec_from_document(read_yaml(path), str(path))
