"""Time limits for tests that assert what the verifier finds.

A sample whose adapter call outruns ``adapter_timeout_s`` is dropped (counted as
``adapter_timeout``), not verified: on a loaded 2-core machine a real-model recompute has
outrun the production default of 5 s, and a test that asserts a fault is flagged then failed
for the machine's load, not for the code. Tests that assert detection use this limit; tests
of the time limit itself set their own small one.
"""

DETECTION_TIMEOUT_S = 300.0
