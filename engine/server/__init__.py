"""The engine's adapters: the gRPC servicers (OpenEngine, vllm.Generate), KV event publishing
(gRPC stream and vLLM-compatible ZMQ) and the process that runs them (`service.run_engine`)."""
