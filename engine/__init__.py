"""The bundled inference engine: OpenEngine and vllm.Generate over one inference core, with a
torch runner and a simulated runner. Only this package imports torch (lazily)."""
