"""kvplane: a KV-aware routing and indexing control plane for LLM inference fleets.

This package holds what every kvplane process shares: the CLI root, configuration loading,
the gRPC server scaffolding and the error root. The components live beside it: `indexer`,
`controller`, `planner` and `engine`.
"""

__version__ = "0.1.0"
