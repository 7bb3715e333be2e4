"""OpenAI's Responses API (``/v1/responses``) on the chat path: protocol, the request read
as a chat request (inputs), output items (output), the event stream (events), the bounded
store (store), the handlers (serving) and their routes (:func:`add_responses_routes`)."""

from server.api.responses.routes import add_responses_routes

__all__ = ["add_responses_routes"]
