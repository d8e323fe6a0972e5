"""Reports for people and machines: text, JSON, Prometheus gauges, figures."""
