"""Engine adapters: the only place engine-specific code lives."""
