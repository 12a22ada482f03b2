"""The docs site's generated parts (``python -m kvtestbed.docs``).

Every number, name and table a page shows that the code or a run owns is written by this
package, never by hand: reference pages from the code (signals, configuration keys, CLI
``--help``, faults, capabilities), the alert list and the runbook copies from ``alerts/``, and
benchmark tables from the JSON a recorded bench run left in ``docs/bench/``.

Two shapes of output (:mod:`.regions`): a whole page (``reference/signals.md``), or a region
between ``<!-- generated:NAME:start -->`` and ``<!-- generated:NAME:end -->`` inside a page whose
prose is written by hand. :mod:`.page_list` lists them all; ``--check`` exits 1 naming every
stale one, and ``tests/test_docs_generated.py`` runs that check like the dashboards' staleness
test. After a merge that changed code, regenerating is one rerun.
"""
