"""docs/configuration.md, generated from the cluster config's pydantic models.

Every key of the cluster YAML with its type, default and one line: the field's ``description``
if it has one, else the comment on (or the comment block just above) the field's line in its
model's source. A key added to any section appears here without further work;
``pd-cluster config-reference --out docs/configuration.md`` rewrites the file and
tests/test_config_reference.py checks it is current.
"""
from __future__ import annotations

import ast
import inspect
import io
import json
import re
import tokenize
import types
import typing
from typing import Any, Iterator

from pydantic import BaseModel
from pydantic.fields import FieldInfo

DOC_PATH = "docs/configuration.md"
REGENERATE = "pd-cluster config-reference --out docs/configuration.md"
# Keys the YAML never sets although the models have them (the cluster sets them per engine).
_HIDDEN = {"engine": {"tensor_parallel_size"}, "kv_transfer": {"role"}}
MISSING = "(undocumented)"  # tests/test_config_reference.py fails on it: comment the field
_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))

_HEADER = """# Cluster configuration reference

<!-- Generated from the config models by `{regen}`; do not edit by hand
     (tests/test_config_reference.py checks it is current). -->

One YAML file configures a cluster: `pd-cluster launch --config FILE`. Every key may also be set
on the command line with `--set KEY=VALUE` (e.g. `--set decode.replicas=2`), and
`pd-cluster serve MODEL` builds the same config from its flags (`pd-cluster serve --help` names
the key behind each flag). Unknown keys and bad values are errors that name the key.
Examples: `configs/`.
"""


def render() -> str:
    """The whole reference as Markdown."""
    from pd_cluster.serving.cluster.cluster_config import ClusterConfig
    out = [_HEADER.format(regen=REGENERATE)]
    sections = list(_subsections(ClusterConfig))
    nested = {n for names, _, _ in sections for n in names}
    out += _section("Top level", "", ClusterConfig, hidden=nested)
    for names, model, fields in sections:
        title = ", ".join(f"`{n}`" for n in names)
        out += _section(title, names[0], model, hidden=_HIDDEN.get(names[0], set()),
                        notes=_default_notes(names, fields, model))
    return "\n".join(out).rstrip() + "\n"


def _subsections(root: type[BaseModel]) -> Iterator[tuple[list[str], type[BaseModel],
                                                           list[FieldInfo]]]:
    """Top-level keys that are sections, those sharing a model together (prefill, decode...)."""
    from pd_cluster.config import EngineArgs
    groups: dict[type[BaseModel], list[str]] = {}
    for name, field in root.model_fields.items():
        model = EngineArgs if name == "engine" else _model_of(field.annotation)
        if model is not None:
            groups.setdefault(model, []).append(name)
    for model, names in groups.items():
        yield names, model, [root.model_fields[n] for n in names]


def _default_notes(names: list[str], fields: list[FieldInfo], model: type[BaseModel]
                   ) -> list[str]:
    """A section whose default is not its model's defaults (colocated: 2 replicas) says so."""
    notes = []
    for name, field in zip(names, fields):
        if field.default_factory is None:
            continue
        value = field.default_factory()
        if not isinstance(value, model):
            continue
        changed = {k: getattr(value, k) for k in model.model_fields
                   if getattr(value, k) != _default(model.model_fields[k])}
        for key, v in changed.items():
            notes.append(f"`{name}.{key}` defaults to `{_yaml(v)}`.")
    return notes


def all_keys() -> list[str]:
    """Every dotted key the cluster YAML takes (for `serve`'s did-you-mean)."""
    return re.findall(r"^\| `([\w.]+)`", render(), re.M)


def _flag_note(path: str) -> str:
    """`pd-cluster serve`'s flag(s) for this key, as the reference shows them."""
    from pd_cluster.serving.cluster.serve_flags import flags_by_key
    by_key = flags_by_key()
    parts = path.split(".")  # a flag for a section (a JSON object) shows on its keys
    flags = next((by_key[k] for k in (".".join(parts[:i]) for i in range(len(parts), 0, -1))
                  if k in by_key), None)
    return f" (`serve {' / '.join(flags)}`)" if flags else ""


def _section(title: str, prefix: str, model: type[BaseModel], hidden: set[str],
             notes: list[str] | None = None) -> list[str]:
    out = [f"## {title}", ""]
    doc = model.__dict__.get("__doc__")  # the model's own, not one inherited
    if doc and prefix:
        out += [" ".join(inspect.cleandoc(doc).split("\n\n")[0].split()), ""]
    out += [*(notes or []), ""] if notes else []
    out += ["| key | type | default | description |", "|---|---|---|---|"]
    for key, field, comment in _rows(model, hidden):
        path = f"{prefix}.{key}" if prefix else key
        default = "required" if field.is_required() else f"`{_yaml(_default(field))}`"
        out.append(f"| `{path}` | {_type(field)} | {default} | "
                   f"{_cell(comment + _flag_note(path))} |")
    return out + [""]


def _rows(model: type[BaseModel], hidden: set[str]) -> Iterator[tuple[str, FieldInfo, str]]:
    from pd_cluster.serving.cluster.schema import FLATTENED
    comments = _field_comments(model)
    for key, field in model.model_fields.items():
        if key in hidden:
            continue
        nested = _model_of(field.annotation)
        if key in FLATTENED and nested is not None:  # written flat in the YAML (pipe keys)
            yield from _rows(nested, set())
            continue
        if nested is not None:  # a sub-section: its own keys, dotted
            for sub, sub_field, text in _rows(nested, set()):
                yield f"{key}.{sub}", sub_field, text
            continue
        yield key, field, field.description or comments.get(key) or MISSING


def _field_comments(model: type[BaseModel]) -> dict[str, str]:
    """Field name -> its comment, for the model and its bases (a subclass's comment wins)."""
    out: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if cls is BaseModel or not issubclass(cls, BaseModel):
            continue
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        out.update(_comments_in(source))
    return out


def _comments_in(source: str) -> dict[str, str]:
    source = inspect.cleandoc("\n" + source) if source.startswith(" ") else source
    by_line: dict[int, str] = {}
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            by_line[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.add(tok.start[0])
    cls_def = ast.parse(source).body[0]
    out = {}
    for node in getattr(cls_def, "body", []):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        trailing = [by_line[ln] for ln in range(node.lineno, node.end_lineno + 1)
                    if ln in by_line]
        above, ln = [], node.lineno - 1
        while ln in by_line and ln not in code_lines:
            above.insert(0, by_line[ln])
            ln -= 1
        out[node.target.id] = " ".join(above + trailing)
    return out


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel a field holds (also inside ``X | None``), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation)
                  if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if len(models) == 1 else None
    return None


def _default(field: FieldInfo) -> Any:
    if field.default_factory is not None:
        return field.default_factory()
    return field.default


def _yaml(value: Any) -> str:
    if isinstance(value, BaseModel):
        return "{...}"
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value)


def _type(field: FieldInfo) -> str:
    text = _type_name(field.annotation)
    bounds = [f"{sym} {getattr(m, attr)}" for m in field.metadata for attr, sym in _BOUNDS
              if getattr(m, attr, None) is not None]
    return text + (f" ({', '.join(bounds)})" if bounds else "")


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin in (dict, list, tuple):
        return {dict: "mapping", list: "list", tuple: "list"}[origin]
    if annotation is typing.Any:
        return "any"
    return {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(
        getattr(annotation, "__name__", ""), getattr(annotation, "__name__", str(annotation)))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
