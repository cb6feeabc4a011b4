"""The KV prefix indexer: the pure index core, its backends, event decoders and sources, and
the `kv_indexer.v1.KVIndexer` server."""
