"""Adapters for the testbed's reference engines (the paged one and the hybrid one)."""
