"""The metrics sources: Prometheus (PromQL over windows), scrape (each backend's ``/metrics``), push
(gRPC), and Envoy's own view (the access log)."""
