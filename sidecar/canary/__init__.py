"""A black-box canary for any OpenAI-compatible inference server.

For servers the sidecar cannot hook, the test is the one the seeds recommend: ask the same
question with the prefix cache and without it, at temperature 0 with logprobs, and compare.
The canary sends paired probes (a unique prompt twice: a guaranteed miss, then a hit; or a
hit against a ``cache_salt`` request that cannot hit), compares the top-k logprobs of every
generated position against a calibrated, dtype-aware tolerance, and audits the server's own
hit counters (``usage.prompt_tokens_details.cached_tokens`` and its ``/metrics``) against
what the pairs prove. Signals carry ``engine="canary"`` and the sidecar's signal names.

Modules, one job each: :mod:`.endpoint` (URLs, the loopback rule), :mod:`.client` (the
OpenAI-compatible client), :mod:`.probes` (prompts and pairs), :mod:`.compare` (logprob
divergence and tolerance), :mod:`.audit` (hit-counter audit), :mod:`.load` (rate limit as
a fraction of the server's load), :mod:`.exporter` (signals), :mod:`.runner` (the loop),
:mod:`.replay` (the optional replay proxy) and :mod:`.cli`.

The request path (endpoint, client, probes, compare, audit, load) is standard
library only; the exporter reuses the sidecar's :class:`~sidecar.export.metrics.Metrics`, so the
signals are the same series the in-process sidecar exports.
"""

from sidecar.canary.endpoint import CanaryError, Endpoint, parse_endpoint

__all__ = ["CanaryError", "Endpoint", "parse_endpoint"]
