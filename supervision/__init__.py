"""The supervisor's parts (supervisor.py is the entry point and the watch loop):

- policy.py: when a stage is restarted, after what delay, and when the run gives up (pure);
- health.py: when a live stage counts as hung, from its heartbeats (pure);
- stages.py: the stage processes: spawn, kill-and-wait, reap (ray_stages.py: the same on Ray;
  backends.py picks one);
- live_settings.py: the settings a hot reload may change, declared once;
- reload.py: the config file, watched and read again for a hot reload;
- transition.py: a change of the run's topology, carried out against the stage set;
- autoscale.py: how many engine groups the groups' loads ask for (pure); group_scaler.py carries
  its decisions out through transition.py, audited and exported as metrics;
- run.py: the run's resources (run dir, run.json, gateway port, rings, network plan);
- preflight.py: refusing a layout or model the engine cannot run, before anything spawns;
- status.py: the status files (one row shape, services/stage_rows.py) and `python supervisor.py status`.

The run's topology (which stages, in which order) is `ipc/topology.py`; the model is converted
in a child process, `python -m services.gpu_worker.prepare`, so the supervisor never imports torch.
"""
