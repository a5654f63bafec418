"""What serves the engine over HTTP: an asyncio front (async_engine.py) over the engine's narrow surface,
OpenAI's protocol and its serving (openai_protocol.py, openai_serving.py), the FastAPI app (server.py),
the command line (cli.py), and metrics."""
