"""A Griffe extension (mkdocs.yml: mkdocstrings' `extensions`): an attribute's comment read as its docstring, so that
the API pages describe every field of a config dataclass (`ViTConfig`) and every table (`VARIANTS`) as the source does.

The source keeps the house's form (nanoGPT's): a field's comment at the end of its line, or, where it is longer, in
the comment lines right above it. An attribute docstring (a string on the next line), where one is written, wins.
Only names bound in a class's or a module's body are read: the comments beside `self.x = ...` in a method are about
the code.
"""

from __future__ import annotations

import ast
from typing import Any

from griffe import Attribute, Docstring, Extension


def comment_of(lines: list[str], node: ast.stmt) -> str | None:
    """The comment of a statement: what follows `  # ` on its line where it is one line, else the comment lines
    directly above it, joined; None without either."""
    if node.lineno == node.end_lineno:
        code, sep, trailing = lines[node.lineno - 1].partition("  # ")  # PEP 8's two spaces before an inline comment
        if sep and code.strip() and trailing.strip():
            return trailing.strip()
    above = []
    for prev in reversed(lines[: node.lineno - 1]):
        if not prev.lstrip().startswith("#"):
            break
        above.append(prev.lstrip()[1:].strip())
    return " ".join(reversed(above)) or None


def _names_bound(node: Any) -> bool:
    """`name: type = value` or `name = value` (not `self.name = ...`)."""
    targets = [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
    return isinstance(node, ast.stmt) and bool(targets) and all(isinstance(t, ast.Name) for t in targets)


class FieldComments(Extension):
    def on_attribute_instance(self, *, node: ast.AST | Any, attr: Attribute, agent: Any, **kwargs: Any) -> None:
        in_body = attr.parent is not None and (attr.parent.is_class or attr.parent.is_module)
        if attr.docstring is not None or not in_body or not _names_bound(node):
            return
        text = comment_of(agent.code.splitlines(), node)
        if text:
            attr.docstring = Docstring(
                text,
                lineno=node.lineno,
                endlineno=node.end_lineno,
                parent=attr,
                parser=agent.docstring_parser,
                parser_options=agent.docstring_options,
            )
