"""The core: the Monitor, the adapter contract (protocol, conformance), sampling, capture
and dispatch of hits, and the time limits on adapter calls."""
