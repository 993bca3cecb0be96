"""What a person watches: metrics, the console, and the report of a run.

Modules:
  metrics.py      metric sinks (console, JSONL, TensorBoard, wandb) and summary.json
  progress.py     setup phases, then the progress bar or plain step lines
  run_watch.py    warnings from consecutive step records, the nothing-trained verdict (pure)
  console_log.py  library output (Ray, vLLM, TransferQueue) into RUN_DIR/logs/
  cpu_usage.py    the per-step probe of CPU seconds per part of the run, from /proc
  resources.py    the per-step probe of buffer rows and Ray object-store bytes held
  slots.py        the per-step probe of container- and rollout-slot utilisation
  report_data.py  a run directory read back: step records, config, summary, series
  report.py       PNG plots and report.html (`python -m orchestrator.watch.report RUN_DIR`)
  alarms.py       health alarms from the step metrics (malformed tool calls, masked fraction, length bias)
  eval_report.py  the report of a mode=eval run: reward distribution, pass@k over k, the summary
"""
