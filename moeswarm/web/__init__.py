"""The volunteer page: a browser tab as a relay device (issue 18).

``static/`` holds the page (``index.html``, ES modules under ``js/``) and the vendored
onnxruntime-web and @msgpack/msgpack (``vendor/``, see ``vendor/VENDOR.md``). Served by the relay
at ``/volunteer/`` (``add_volunteer_routes``) and by ``moeswarm bridge --web`` for a private swarm.
"""

from .volunteer import STATIC, VolunteerSite, add_volunteer_routes

__all__ = ["STATIC", "VolunteerSite", "add_volunteer_routes"]
