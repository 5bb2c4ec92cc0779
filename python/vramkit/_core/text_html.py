"""``TextAsHtml``: the HTML form a notebook shows for a report whose ``str()`` is a text table.

Jupyter displays an object's ``_repr_html_()`` when it has one, else its ``repr()``: for the
dataclass reports (a ``FitReport``, a ``Prediction``) that is every field on one line. The text
form is already laid out in columns, so the HTML form is that text, escaped, in ``<pre>``.
"""

from __future__ import annotations

import html

__all__ = ["TextAsHtml", "text_as_html"]


def text_as_html(text: str) -> str:
    """`text` escaped in a ``<pre>`` block that keeps its columns in a notebook's output area."""
    # Notebook themes style <pre> in outputs already; only wrapping is turned off, so a wide
    # table scrolls instead of folding its columns.
    return f'<pre style="white-space:pre;overflow-x:auto">{html.escape(text)}</pre>'


class TextAsHtml:
    """Mixin for reports: ``_repr_html_`` shows ``str(self)`` as preformatted text."""

    __slots__ = ()

    def _repr_html_(self) -> str:
        return text_as_html(str(self))
