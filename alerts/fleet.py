"""Fleet rules: many replicas of one model, one monitoring stack, and the bad replica named.

Silent corruption in fleets concentrates on a few machines ("Cores that don't count": a few
bad cores per several thousand machines, found by where the reports concentrate). Every
replica runs its own sidecar and already pages on its own anomalies
(``KVCacheContentAnomaly``); what a fleet adds is *where*: one replica far above the rest
is a GPU, a node or a process, while most replicas failing the same check is a rollout.

A fleet is the replicas of one model on one engine (``MixinConfig.fleet_labels``: job,
engine, model). Two pages come out of the comparison, and the example Alertmanager config
lets each replace the per-replica pages it explains, so one bad replica pages once:

* ``KVCacheAnomalyLocalised`` -- one replica holds more than ``fleet_anomaly_share`` of its
  fleet's summed anomaly rate (its anomalous / verified ratio above all the other replicas'
  together). Named by instance, engine, model, cache group and kind, plus the target labels
  a scrape config adds (``replica``, ``gpu``) so the page can name the GPU.
* ``KVCacheAnomalyFleetWide`` -- more than ``fleet_wide_replicas_ratio`` of the replicas
  fail the same check in the same cache group: paged once for the fleet.

Both need ``fleet_min_replicas`` replicas: with two, one bad replica is as much a half-done
rollout (a canary) as a bad GPU, and the per-replica page stands alone.
"""

from __future__ import annotations

from alerts.rule_parts import (
    _Q,
    ANOMALIES_RECENT,
    PAGE,
    Alert,
    MixinConfig,
    Recording,
    _name,
)
from sidecar import signals as S
from sidecar.signals import THRESHOLDS

INSTANCE_VERIFIED_RECENT = _name("instance", S.VERIFIED, "increase10m")
INSTANCE_ANOMALIES_RECENT = _name("instance", S.ANOMALIES, "increase10m")
INSTANCE_ANOMALY_RATIO_RECENT = _name("instance", S.ANOMALIES, "ratio_increase10m")
FLEET_ANOMALY_RATIO_SUM = _name("fleet", S.ANOMALIES, "ratio_increase10m_sum")
INSTANCE_ANOMALY_SHARE = _name("instance", S.ANOMALIES, "fleet_share10m")
FLEET_REPLICAS = _name("fleet", S.BUILD_INFO, "replicas")
FLEET_REPLICAS_AFFECTED = _name("fleet_group_kind", S.ANOMALIES, "replicas10m")
FLEET_REPLICAS_AFFECTED_RATIO = _name("fleet_group_kind", S.ANOMALIES, "replicas_ratio10m")

LOCALISED = S.ALERT_ANOMALY_LOCALISED
FLEET_WIDE = S.ALERT_ANOMALY_FLEET_WIDE
# The per-replica pages each fleet page explains (and the example Alertmanager inhibits).
PER_REPLICA_PAGES = (S.ALERT_CONTENT_ANOMALY, S.ALERT_HIGH_HIT_RATE_WITH_ANOMALIES)


def recording_rules(cfg: MixinConfig) -> list[Recording]:
    """Per-instance anomaly ratios over the event window and their fleet comparison; they
    read :data:`alerts.rules.ANOMALIES_RECENT`, so they follow it in the rule group."""
    q = _Q(cfg)
    fleet = ", ".join(cfg.fleet_labels)
    inst = q.by
    ew = cfg.event_window
    return [
        Recording(INSTANCE_VERIFIED_RECENT,
                  f"sum by ({inst}) (increase({q.sel(S.VERIFIED)}[{ew}]))"),
        # Over the event window, like the page, so a single anomaly counts here as there.
        Recording(INSTANCE_ANOMALIES_RECENT, f"sum by ({inst}) ({ANOMALIES_RECENT})"),
        # Anomalies are a subset of verified blocks: clamping at one block only matters for
        # a series born non-zero that increase() has not seen grow yet.
        Recording(INSTANCE_ANOMALY_RATIO_RECENT,
                  f"{INSTANCE_ANOMALIES_RECENT}\n/ on ({inst})\n"
                  f"clamp_min({INSTANCE_VERIFIED_RECENT}, 1)"),
        Recording(FLEET_ANOMALY_RATIO_SUM,
                  f"sum by ({fleet}) ({INSTANCE_ANOMALY_RATIO_RECENT})"),
        # Ratios, not counts: a replica that serves twice the traffic does not look twice as
        # bad. One bad replica among clean ones holds 100%; N equally bad ones 1/N each.
        Recording(INSTANCE_ANOMALY_SHARE,
                  f"{INSTANCE_ANOMALY_RATIO_RECENT}\n/ on ({fleet}) group_left\n"
                  f"{FLEET_ANOMALY_RATIO_SUM}"),
        # Replicas scraped (max by drops the version label of a replica mid-upgrade).
        Recording(FLEET_REPLICAS,
                  f"count by ({fleet}) (max by ({inst}) ({q.sel(S.BUILD_INFO)}))"),
        Recording(FLEET_REPLICAS_AFFECTED,
                  f"count by ({fleet}, group, kind) ({ANOMALIES_RECENT})"),
        Recording(FLEET_REPLICAS_AFFECTED_RATIO,
                  f"{FLEET_REPLICAS_AFFECTED}\n/ on ({fleet}) group_left\n{FLEET_REPLICAS}"),
    ]


def _lookup(record: str, labels: tuple[str, ...], fmt: str) -> str:
    """An annotation fragment that reads one value of ``record`` for this alert's labels
    (Prometheus' ``query`` template function); empty when the series is absent."""
    matchers = ",".join(f"{k}=%q" for k in labels)
    args = " ".join(f"$labels.{k}" for k in labels)
    return (f'{{{{ with query (printf "{record}{{{matchers}}}" {args}) }}}}'
            f"{{{{ . | first | value | {fmt} }}}}{{{{ end }}}}")


_COUNT = 'printf "%.0f"'


def _indent(expr: str, by: str = "  ") -> str:
    return "\n".join(by + line for line in expr.splitlines())


def _share_now(cfg: MixinConfig) -> str:
    """:data:`INSTANCE_ANOMALY_SHARE`, computed from :data:`ANOMALIES_RECENT` itself.

    The alert group is evaluated apart from the recording group: an alert reading a chain
    of recordings can see a new anomaly one evaluation after ``KVCacheContentAnomaly``
    does, and then the page it must inhibit goes out first. Reading ``ANOMALIES_RECENT``
    (and inputs that exist long before any anomaly) keeps both in the same evaluation."""
    inst, fleet = ", ".join(cfg.instance_labels), ", ".join(cfg.fleet_labels)
    ratio = (f"sum by ({inst}) ({ANOMALIES_RECENT})\n/ on ({inst})\n"
             f"clamp_min({INSTANCE_VERIFIED_RECENT}, 1)")
    return (f"(\n{_indent(ratio)}\n)\n/ on ({fleet}) group_left\n"
            f"sum by ({fleet}) (\n{_indent(ratio)}\n)")


def _affected_ratio_now(cfg: MixinConfig) -> str:
    """:data:`FLEET_REPLICAS_AFFECTED_RATIO` from ``ANOMALIES_RECENT`` (see _share_now)."""
    fleet = ", ".join(cfg.fleet_labels)
    return (f"count by ({fleet}, group, kind) ({ANOMALIES_RECENT})\n"
            f"/ on ({fleet}) group_left\n{FLEET_REPLICAS}")


def alert_rules(cfg: MixinConfig) -> list[Alert]:
    t = THRESHOLDS
    q = _Q(cfg)
    fleet = ", ".join(cfg.fleet_labels)
    ew = cfg.event_window
    enough = f"and on ({fleet})\n{{0}}{FLEET_REPLICAS} >= {t.fleet_min_replicas:g}"
    target = ", ".join(cfg.target_labels)
    names_target = "".join(
        f"{{{{ if $labels.{k} }}}}, {k} {{{{ $labels.{k} }}}}{{{{ end }}}}"
        for k in cfg.target_labels)
    replicas = _lookup(FLEET_REPLICAS, cfg.fleet_labels, _COUNT)
    affected = _lookup(FLEET_REPLICAS_AFFECTED, (*cfg.fleet_labels, "group", "kind"), _COUNT)
    share = _lookup(INSTANCE_ANOMALY_SHARE, cfg.instance_labels, "humanizePercentage")
    return [
        Alert(LOCALISED,
              f"(\n  {ANOMALIES_RECENT}\n  and on ({q.by})\n  (\n"
              f"{_indent(_share_now(cfg), '    ')}\n  ) > {t.fleet_anomaly_share:g}\n"
              f"  {enough.format('  ')}\n)\n"
              f"* on (job, instance) group_left ({target})\n"
              f"max by (job, instance, {target}) ({q.sel(S.BUILD_INFO)})",
              "1m", PAGE,
              "One replica is serving wrong KV ({{ $labels.kind }}): {{ $labels.instance }}.",
              f'{{{{ printf "%.0f" $value }}}} sampled KV block(s) of cache group '
              f"{{{{ $labels.group }}}} failed the {{{{ $labels.kind }}}} check in the last "
              f"{ew} on {{{{ $labels.instance }}}} ({{{{ $labels.engine }}}}, "
              f"{{{{ $labels.model }}}}{names_target}). This replica holds {share} of the "
              f"fleet's anomaly rate; {affected} of {replicas} replicas failed this check. "
              "One replica, not a rollout: drain it and suspect its GPU, node or process."),
        Alert(FLEET_WIDE,
              f"(\n{_indent(_affected_ratio_now(cfg))}\n) > {t.fleet_wide_replicas_ratio:g}\n"
              f"{enough.format('')}",
              "1m", PAGE,
              "Most replicas of {{ $labels.model }} are serving wrong KV "
              "({{ $labels.kind }}).",
              f"{affected} of {replicas} replicas ({{{{ $value | humanizePercentage }}}}) of "
              "{{ $labels.model }} on {{ $labels.engine }} failed the {{ $labels.kind }} "
              f"check in cache group {{{{ $labels.group }}}} in the last {ew}. All replicas, "
              "not one: a rollout or a fleet-wide config change; the per-replica pages are "
              "folded into this one."),
    ]
