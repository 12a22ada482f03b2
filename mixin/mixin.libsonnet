// kv-sidecar monitoring mixin (kubernetes-mixin layout):
//   prometheusAlerts, prometheusRules, grafanaDashboards, and _config (selectors, thresholds).
// Re-target: (import 'mixin.libsonnet') + {_config+:: {kvSidecarSelector: 'job="x"'}}
(import 'config.libsonnet') +
(import 'alerts.libsonnet') +
(import 'rules.libsonnet') +
(import 'dashboards.libsonnet')
