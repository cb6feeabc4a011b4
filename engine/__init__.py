"""The bundled inference engine: OpenEngine and vllm.Generate over one inference core, with a
torch runner and a simulated runner. Only this package imports torch (lazily).

- `engine.core`: the pure core (block manager, scheduler, stopping, detokenisation,
  `EngineCore`/`EngineLoop`) and the sim runner; no torch, grpc or asyncio.
  Public types: `engine.core.api`.
- `engine.torch_runner`: Llama/Qwen2-family models over the paged KV cache (imports torch).
- `engine.server`: the gRPC servers, KV event log and publishers, metrics.
"""
