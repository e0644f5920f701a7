"""`python -m harness.analysis --help`: every key, its default and its meaning.

A key's meaning is written once, as the comment after its field in the config dataclass
(AnalyticConfig, ModelConfig, Hardware); this module reads those comments from the source, so the
help cannot drift from the schema. The defaults are the dataclass's own and, for the config groups
(model=, hardware=, strategy=), the defaults list of conf/analytic.yaml.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
from pathlib import Path

import yaml

GROUPS = ("model", "hardware", "strategy")  # keys that pick a file of conf/<group>/


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment that ends its line (or its last line) in the class's source."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    body = ast.parse(source).body[0].body
    fields = {field.name for field in dataclasses.fields(cls)}  # not the ClassVars
    return {node.target.id: comments.get(node.end_lineno, "") for node in body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in fields}


def group_defaults(config_file: Path) -> dict[str, str]:
    """The option each config group defaults to, from the defaults list of `config_file`."""
    defaults = yaml.safe_load(config_file.read_text()).get("defaults", [])
    return {key: value for entry in defaults if isinstance(entry, dict) for key, value in entry.items()}


def _default(field: dataclasses.Field) -> str:
    """A field's default as an override would write it (null for None)."""
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "(required)"
    return "null" if value is None else str(value)


def usage(config: type, config_file: Path, options: dict[str, list[str]], presets: dict[str, type]) -> str:
    """The help text: the top-level keys of `config` with their defaults, then the fields of the
    presets (`presets`: group -> its dataclass), each with its comment."""
    meanings, groups = field_comments(config), group_defaults(config_file)
    keys = []
    for field in dataclasses.fields(config):
        if field.name in GROUPS:
            choices = ", ".join(options[field.name])
            keys.append((f"{field.name}={groups.get(field.name, '')}", f"{meanings[field.name]}; one of: {choices}"))
        else:
            keys.append((f"{field.name}={_default(field)}", meanings[field.name]))
    fields = [(f"{group}.{name}", meaning) for group, schema in presets.items()
              for name, meaning in field_comments(schema).items()]
    fields.append(("strategy.<option>", "an option of the chosen strategy, e.g. strategy=paged strategy.block_size=256"))
    width = max(len(key) for key, _ in keys + fields)
    return "\n".join([
        "usage: python -m harness.analysis [key=value ...]", "",
        "The analytic model of one decode point: FLOPs, bytes and roofline times, what fits in each",
        "device's memory, and the cost of the tokens. Overrides use Hydra's syntax, as in the runner.", "",
        "Keys, as key=default, and what they mean:",
        *(f"  {key:<{width}}  {meaning}" for key, meaning in keys), "",
        "A preset's fields, each overriding one value of the chosen file (e.g. model.n_layers=1):",
        *(f"  {key:<{width}}  {meaning}" for key, meaning in fields), "",
        "format=table is for people (ms, GB, TFLOP); format=json prints exact SI numbers.",
        "Bad input prints one line `<key>: <what is allowed>` on stderr and exits 2."])
