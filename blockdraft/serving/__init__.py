"""Serving: the continuous-batching scheduler, the OpenAI-compatible server, chat."""
