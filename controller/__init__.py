"""The fleet controller: registry, health, load, the KV-aware router, the OpenEngine gateway for
a fleet, and the admin API and CLI."""
