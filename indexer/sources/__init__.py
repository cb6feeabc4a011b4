"""Event sources: each adapter turns an engine's KV events into index batches."""
