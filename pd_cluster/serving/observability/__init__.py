"""What the cluster exports about itself: Prometheus metrics (pd_ and vLLM names) and the
periodic stats log line."""
