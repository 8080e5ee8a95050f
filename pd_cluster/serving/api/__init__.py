"""The HTTP API: the FastAPI app, OpenAI request schemas and response formatting, utility
routes, OpenAI-style errors, and the fan-out of one request into its ``n`` choices."""
