"""The cluster: its config, placement of roles on Ray nodes, the Ray runtime, model sources,
launch/status/stop (launcher, CLI, launch record) and the Ray actor hosting the proxy."""
