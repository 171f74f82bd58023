"""``nodeagent timeline``: the recorded decisions drawn as the seeds draw incidents.

``picture.py`` turns timeline records into lanes, gate spans and VF bars
(pure); ``text.py`` and ``html.py`` draw them; ``cli.py`` reads the records.
"""

from nodeagent.timeline_view.html import render_html
from nodeagent.timeline_view.picture import Picture, build_picture
from nodeagent.timeline_view.text import render_text

__all__ = ["Picture", "build_picture", "render_html", "render_text"]
