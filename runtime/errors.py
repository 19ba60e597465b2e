"""Errors shared by every layer: a request failure carries the HTTP status the front end answers with.

Top level (not in managers/ or entrypoints/) so that the layer that raises it and the layer that turns it
into an HTTP answer both import it downward.
"""

from __future__ import annotations


class RequestError(Exception):
    """A request failed; `status` is the HTTP status the front end should answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status
