"""What serves the engine over HTTP: an asyncio front (async_engine.py: the engine's thread in
engine_loop.py, each request's outputs in request_stream.py) over the engine's narrow surface, OpenAI's
protocol and its serving (openai_protocol.py, openai_serving.py and the openai_* modules it is made
of), the FastAPI app (server.py), the command line (cli.py), and metrics."""
