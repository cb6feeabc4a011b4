"""The engine's pure inference core: block manager, scheduler, stopping, detokenisation and the
`EngineCore` facade, plus the simulated runner. No torch, grpc or asyncio here; public types are
in `engine.core.api`."""
