"""Tenants: API keys, their exact limits, fair share of a model's workers between them, and their storage tally,
as Redis state and scripts that every edge and worker run alike."""
