"""One LlamaIndex instrumentation helper for the tests: an event handler on the root dispatcher that keeps every
event, and a context manager that adds it (with a span handler) and removes both afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from llama_index.core.bridge.pydantic import Field
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.span_handlers import SimpleSpanHandler


class EventCatcher(BaseEventHandler):
    """Keeps every instrumentation event it is handed, in order."""

    events: list = Field(default_factory=list)

    @classmethod
    def class_name(cls) -> str:
        return "EventCatcher"

    def handle(self, event: Any, **kwargs: Any) -> None:
        self.events.append(event)


@contextmanager
def caught() -> Iterator[tuple[list, SimpleSpanHandler]]:
    """The events and spans LlamaIndex's root dispatcher emits inside the block."""
    root, catcher, spans = get_dispatcher(), EventCatcher(), SimpleSpanHandler()
    root.add_event_handler(catcher)
    root.add_span_handler(spans)
    try:
        yield catcher.events, spans
    finally:
        root.event_handlers.remove(catcher)
        root.span_handlers.remove(spans)
