"""A MkDocs hook: ``<!-- quantities -->`` in a page becomes the table of every per-step quantity,
made from hostavg's one declaration of them (``hostavg.core.schema.QUANTITIES``)."""

from hostavg.core import schema

MARKER = "<!-- quantities -->"


def table() -> str:
    """The quantities as a Markdown table: name, kind, where kept, TensorBoard tag, meaning."""
    rows = ["| quantity | kind | History | TensorBoard | what it is |", "|---|---|---|---|---|"]
    for q in schema.QUANTITIES:
        tag = "" if q.tag is None else f"`{q.tag}`" + (
            "`/<variable>`" if q.kind is schema.Kind.VARIABLE else "")
        rows.append(f"| `{q.name}` | {q.kind.said.removeprefix('a ')} | {'yes' if q.history else 'Record only'} "
                    f"| {tag} | {q.doc.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)


def on_page_markdown(markdown, **kwargs):
    return markdown.replace(MARKER, table()) if MARKER in markdown else markdown
