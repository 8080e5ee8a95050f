"""Sizing and steering a P/D cluster: a cost model measured on this machine
(profiler.py -> profile_table.py), the capacity arithmetic over it (perf_model.py), `pd-cluster
plan` (plan.py), an SLO controller acting through an Actuator (controller.py, actuator.py) and a
discrete-event simulator that implements the Actuator (simulator.py).

Not to be confused with pd_cluster/serving/routing/planner.py, which plans one request's legs
(P then D) through the cluster; this package decides how many engines of each role run."""
