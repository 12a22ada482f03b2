"""kv-sidecar inside the process that runs ``vllm.LLM``: the same probe, event audit and
metrics bridge as beside the server, with vLLM's metrics read from this process.

    python examples/vllm/inprocess.py --model /tmp/kvsidecar-tiny --dtype float32

With ``--reference engine`` (default) the salted recomputes go through this very ``LLM``,
which only its owner thread may drive, so samples are verified between ``generate`` calls
(``sidecar.verify_pending()``); with ``--reference hf`` they are verified on the sidecar's
worker thread as they arrive. ``--port`` serves /metrics while it runs.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--reference", default="engine", choices=("engine", "hf"))
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--sample-every", type=int, default=4)
    p.add_argument("--port", type=int, default=0, help="serve /metrics here (0: do not)")
    p.add_argument("--summary-json", help="also write the summary to this file")
    a = p.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from sidecar.adapters.vllm.engine_config import llm_kwargs, llm_submit
    from sidecar.adapters.vllm.metrics_bridge import registry_source
    from sidecar.adapters.vllm.service import VllmSidecar, VllmSidecarConfig
    from sidecar.core.monitor import SidecarConfig

    run = tempfile.mkdtemp(prefix="kvsidecar-")
    probe, events, replay = (f"ipc://{run}/{n}.sock" for n in ("probe", "events", "replay"))
    engine_ref = a.reference == "engine"
    llm_box: dict[str, Any] = {}
    sidecar = VllmSidecar(
        VllmSidecarConfig(model_dir=a.model, dtype=a.dtype, block_size=a.block_size,
                          probe_endpoint=probe, events_endpoint=events,
                          replay_endpoint=replay, reference=a.reference,
                          deferred=engine_ref, allocator_every_s=1.0,
                          sidecar=SidecarConfig(sample_every=1, adapter_timeout_s=30.0)),
        submit=(lambda tokens, salt: llm_box["submit"](tokens, salt)) if engine_ref else None,
        metrics_source=registry_source()).start()
    if a.port:
        from sidecar.export.server import SidecarServer

        SidecarServer(sidecar.metrics.registry, sidecar.summary, port=a.port).start()

    llm = LLM(model=a.model, dtype=a.dtype, block_size=a.block_size, enforce_eager=True,
              max_model_len=1024, skip_tokenizer_init=True,
              **llm_kwargs(probe, events, replay, sample_every=a.sample_every))
    llm_box["submit"] = llm_submit(llm)

    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 500) for _ in range(n)] for n in (70, 100, 130, 200)]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    for start in range(0, a.requests, len(prefixes)):
        batch = [TokensPrompt(prompt_token_ids=prefixes[i % len(prefixes)]
                              + [rng.randrange(3, 500) for _ in range(12)])
                 for i in range(start, min(a.requests, start + len(prefixes)))]
        llm.generate(batch, params, use_tqdm=False)
        if engine_ref:
            sidecar.verify_pending()  # between generate calls: the engine is ours to use
    if engine_ref:
        sidecar.verify_pending()  # samples of the last batch
    sidecar.quiesce()
    sidecar.monitor.drain(30.0)
    sidecar.monitor.poll_allocator()
    summary = sidecar.summary()
    sidecar.stop()
    shutil.rmtree(run, ignore_errors=True)  # the ipc sockets
    text = json.dumps(summary, indent=1, default=str)
    print(text)
    if a.summary_json:
        with open(a.summary_json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
