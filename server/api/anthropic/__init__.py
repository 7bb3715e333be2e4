"""Anthropic's Messages API (``/v1/messages``), served by the chat path."""

from server.api.anthropic.routes import add_anthropic_routes

__all__ = ["add_anthropic_routes"]
