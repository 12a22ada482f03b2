"""``python -m sidecar.adapters.vllm``: see :mod:`sidecar.adapters.vllm.cli`."""

import sys

from sidecar.adapters.vllm.cli import main

sys.exit(main())
