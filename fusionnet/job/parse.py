"""Job file text -> validated ``JobSpec``, or one ``JobError`` that names the key (or file and line).

YAML is read with two fixes over PyYAML's YAML 1.1 defaults, both of which otherwise turn a typo into
a silently different job: ``1e-3`` is a float (YAML 1.2; 1.1 reads it as a string) and a duplicate
key is an error (1.1 keeps the last one).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from fusionnet.errors import JobError
from fusionnet.job.schema import JobSpec, KeyProblem

_FLOAT_1_2 = re.compile(
    r"""^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$""",
)


class _JobYamlLoader(yaml.SafeLoader):
    """SafeLoader (no arbitrary objects) + YAML 1.2 exponent floats + duplicate keys refused."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str | int | float | bool) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {seen[key] + 1})", key_node.start_mark
                )
            if isinstance(key, str | int | float | bool):
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_JobYamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_1_2, list("-+0123456789"))


def read_yaml(path: Path) -> Any:
    """The parsed document; JobError naming the file (and line) when it cannot be read or parsed."""
    if not path.exists():
        raise JobError(f"{path}: job file not found")
    if not path.is_file():
        raise JobError(f"{path}: not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise JobError(f"{path}: cannot read job file: {e}") from e
    try:
        return yaml.load(text, Loader=_JobYamlLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e)
        raise JobError(f"{where}: YAML syntax error: {problem}") from e


def _describe(err: dict[str, Any]) -> tuple[tuple[str, ...], str]:
    """One pydantic error -> (key path, short message) in job-file words."""
    loc = tuple(str(p) for p in err["loc"])
    kind, ctx, got = err["type"], err.get("ctx") or {}, err.get("input")
    shown = repr(got) if len(repr(got)) <= 60 else repr(got)[:57] + "..."
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
        "string_too_short": "must not be empty",
        "literal_error": f"must be one of {ctx.get('expected')} (got {shown})",
    }
    if kind in texts:
        return loc, texts[kind]
    msg = str(ctx["error"]) if kind == "value_error" and "error" in ctx else err["msg"]
    return loc, msg[:1].lower() + msg[1:]


def spec_from_document(doc: Any, source: str) -> JobSpec:
    """Validates a parsed job document. One JobError: the first problem, then how many more."""
    if not isinstance(doc, dict):
        raise JobError(f"{source}: a job file must be a YAML mapping of keys (got {type(doc).__name__})")
    try:
        return JobSpec.model_validate(doc)
    except ValidationError as e:
        problems = [_describe(err) for err in e.errors(include_url=False)]
        first_key, first_text = problems[0]
        message = f"{'.'.join(first_key) or source}: {first_text}"
        if len(problems) > 1:
            rest = "; ".join(f"{'.'.join(k)}: {t}" for k, t in problems[1:])
            message += f" (also: {rest})"
        raise JobError(message) from None


def load_job_spec(path: str | Path) -> JobSpec:
    """Parses and validates a job file (no files opened besides it, no user code run)."""
    path = Path(path)
    return spec_from_document(read_yaml(path), str(path))
