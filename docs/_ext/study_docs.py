"""The ``study-report`` directive: a part of the committed ``attn-ref study`` results.

``study-report PATH`` with option ``:part:`` (``verdict``, ``fidelity``, ``layers``,
``run``) renders :func:`attn_ref.models.study.report_markdown` of the JSON at ``PATH``
(relative to the docs folder) as Markdown, so the study page is regenerated from the
committed results on every build and never edited by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective


class StudyReport(SphinxDirective):
    required_arguments = 1
    option_spec = {"part": directives.unchanged_required}

    def run(self):
        from attn_ref.models import study

        path = Path(self.env.srcdir) / self.arguments[0]
        self.env.note_dependency(str(path))
        text = study.report_markdown(json.loads(path.read_text()), self.options.get("part", "verdict"))
        box = nodes.container()
        self.state.nested_parse(StringList(text.splitlines(), source=str(path)), self.content_offset, box)
        return box.children


def setup(app):
    app.add_directive("study-report", StudyReport)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
