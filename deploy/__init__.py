"""Deployment artefacts (Kubernetes manifests, prometheus-operator resources, the monitoring
mixin) and the generator that keeps them equal to ``alerts/``, ``dashboards/`` and
``sidecar/signals/``. Not part of the installed package."""
