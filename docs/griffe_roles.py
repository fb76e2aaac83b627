"""A griffe extension for the API reference: Sphinx roles in hostavg's docstrings as code.

hostavg's docstrings are Google style with a few Sphinx cross-reference roles
(``:class:`~hostavg.Accumulator```, ``:func:`split```) and reST double
backticks. mkdocstrings renders Markdown, where a role would show as
literal text: each becomes a code span of the name it shows (the last dotted
part after a ``~``, as Sphinx shows it) and each double-backtick span a
single-backtick one. An ``Example:`` or ``Example::`` heading becomes Google
style's ``Examples:`` section, so that its code renders as code. A placeholder
in prose, such as "val_<metric>", is escaped, so that Markdown shows it rather
than taking it for an HTML tag; code (spans, ``>>>`` examples) shows it as
written already.
"""

import re

import griffe

ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):`(~?)([^`]+)`")
DOUBLE = re.compile(r"``(.+?)``", re.S)
EXAMPLE = re.compile(r"^(\s*)Example::?[ \t]*$", re.M)
#: Code, left as it is (a doctest up to its blank line, a code span), or a placeholder in
#: prose: ``<`` a name ``>``.
PLACEHOLDER = re.compile(r"(?P<code>^[ \t]*>>>.*?(?=\n[ \t]*\n|\Z)|`[^`]*`)"
                         r"|<(?P<name>[A-Za-z_][\w ]*)>", re.S | re.M)


def markdown(text: str) -> str:
    """``text`` with Sphinx roles and reST literals as Markdown code spans, and placeholders in
    prose escaped."""
    text = ROLE.sub(lambda m: f"`{m[2].rsplit('.', 1)[-1] if m[1] else m[2]}`", text)
    text = EXAMPLE.sub(r"\1Examples:", text)
    text = DOUBLE.sub(lambda m: f"`{m[1]}`", text)
    return PLACEHOLDER.sub(lambda m: m["code"] or f"&lt;{m['name']}&gt;", text)


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
