"""Run control: what starts, guards and stops a run, and what lets it resume.

Modules:
  stopping.py        SIGINT/SIGTERM from the driver's first line: unwind once, exit at the second
  reaper.py          a process of its own: nothing the driver started outlives it, however it died
  preflight.py       the file-system checks of a validated config, before anything starts
  preflight_aws.py   rollout=aws: credentials, the bucket, reachability of the gateway from ACR
  ray_cluster.py     which Ray cluster a run uses and whether it answers
  supervise.py       replica and local-server supervision, the actor directory, trainer-loss verdicts
  checkpoint.py      the checkpoint format: staged, manifest-checked, `latest` replaced atomically
  run_checkpoint.py  when to save, the resumable prompt source, where a resumed loop starts
  trainer_restart.py trainer.max_restarts: a dead trainer rank restarts the run's actors from the last checkpoint
  run_lock.py        one run per run directory: a lock held for the life of the run
  resume_config.py   a resume into a changed config is refused, naming the keys
  lora_targets.py    model.lora.target_modules checked against the model (meta device) before any part starts
  disk_full.py       a full disk named as one: the path and what was being written
"""
