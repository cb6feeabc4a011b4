"""kvplane: a KV-aware routing and indexing control plane for LLM inference fleets.

This package holds what every kvplane process shares: the CLI root, configuration loading,
the gRPC server scaffolding and the error root. The components live beside it: `indexer`,
`controller`, `planner` and `engine`.
"""

import os

__version__ = "0.1.0"

# Before anything imports gRPC: its core writes some failures (a refused TLS handshake) to
# stderr as INFO lines of its own, besides the error the call returns, which kvplane reports
# itself (the CLI as one line). Only gRPC's errors, unless GRPC_VERBOSITY says otherwise.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
