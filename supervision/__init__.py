"""The supervisor's parts (supervisor.py is the entry point and the watch loop):

- policy.py: when a stage is restarted, after what delay, and when the run gives up (pure);
- health.py: when a live stage counts as hung, from its heartbeats (pure);
- stages.py: the stage processes: planning, spawn, kill-and-wait, reap;
- live_settings.py: the settings a hot reload may change, declared once;
- preflight.py: refusing a layout or model the engine cannot run, before anything spawns;
- prepare_model.py: converting the model in a child process (`python -m supervision.prepare_model`);
- status.py: `python supervisor.py status`.
"""
