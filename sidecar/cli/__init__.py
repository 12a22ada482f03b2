"""The ``kv-sidecar`` command line; the entry point is :func:`sidecar.cli.main.main`.

Nothing is imported here: every module that uses a flag type (:mod:`sidecar.cli.arg_types`)
runs this ``__init__`` first, and the CLI imports every command, so a re-export of ``main``
made each of them an import circle through the whole CLI.
"""
