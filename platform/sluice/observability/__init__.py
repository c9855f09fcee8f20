"""What Sluice says about itself: spans and JSON logs (telemetry.py), one served request
observed the same way on every protocol (observe.py), Prometheus metrics and /metrics
(metrics.py; what the apps know of the cluster is added by the composition root)."""
