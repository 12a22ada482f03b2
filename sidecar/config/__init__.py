"""Configuration: the SidecarConfig settings, the key table, the TOML/env/flag layers and
their schema, `kv-sidecar config`."""
