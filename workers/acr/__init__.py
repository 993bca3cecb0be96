"""The ACR data plane as the rollout workers use it, and what bounds and cleans it up.

Modules and packages:
  client.py   AsyncAcrClient: invoke an agent runtime, stop its session, poll S3 for the result
  arn.py      the AgentCore Runtime ARN and S3 bucket names: their form, the region an ARN names
  limits/     the cluster-wide limits: request rate, open sessions, rollout slots, session rate
  journal.py  the run's open-session journal on disk (run_dir/acr_sessions/)
  sweep.py    stop the sessions a journal holds: what a run left open
"""
