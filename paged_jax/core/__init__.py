"""The engine: requests in, tokens out. Scheduling and bookkeeping (scheduler, sequence, policy, block
manager over the block pool and prefix cache), the jitted step (batch, buckets, model_runner, sampling),
requests' checks (validation) and outputs (detokenizer, output_text, stop_checker, output_processor),
and the two front doors built on them, `LLMEngine` (engine.py) and the offline `LLM` (llm.py)."""
