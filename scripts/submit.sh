#!/usr/bin/env bash
# Submit the main job to a running Ray cluster, follow its logs, exit non-zero unless it SUCCEEDED.
#
#   scripts/submit.sh [hydra overrides ...]
#   RAY_ADDRESS=http://HEAD:8265 scripts/submit.sh cluster=disaggregated trainer.total_steps=100
#
# Runs `ray job submit --address ... --working-dir . -- $PYTHON -m orchestrator.main "$@"` from the
# repo root (the working dir is uploaded without .gitignore'd paths and .git). Environment:
#   RAY_ADDRESS    the head's dashboard/job server (default http://127.0.0.1:8265); when nothing answers
#                  there, one line names it and the script exits 2 before submitting
#   PYTHON         python on the cluster nodes that has the project installed (default: python); on GPU nodes
#                  install it with `make install-gpu VENV=DIR` (scripts/sky/train.yaml's setup does) and pass
#                  PYTHON=DIR/bin/python
#   SUBMISSION_ID  job id (default: orch-<UTC time>-<pid>); Ctrl-C stops the job with `ray job stop`
#   RAY            the ray CLI (default: ray)
# Token auth (Ray >= 2.52, on by default for new clusters): the head's token is read from
# RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token (where `ray start` and
# `ray get-auth-token --generate` keep it); when one exists and RAY_AUTH_MODE is unset, this script
# sets RAY_AUTH_MODE=token so the job client sends it. Set RAY_AUTH_MODE=disabled to send none.
# Forwarded to the job when set here: ORCH_CACHE_DIR, WANDB_API_KEY, WANDB_MODE, HF_TOKEN. AWS settings
# are not: the job's driver forwards its own AWS_* to its actors (orchestrator/main.py), and Ray
# refuses a job whose runtime env and driver both set one variable.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"
RAY="${RAY:-ray}"
JOB_PYTHON="${PYTHON:-python}"
ID="${SUBMISSION_ID:-orch-$(date -u +%Y%m%d-%H%M%S)-$$}"

if [[ -z "${RAY_AUTH_MODE:-}" ]] && { [[ -n "${RAY_AUTH_TOKEN:-}" ]] || [[ -n "${RAY_AUTH_TOKEN_PATH:-}" ]] \
    || [[ -f "${HOME}/.ray/auth_token" ]]; }; then
  export RAY_AUTH_MODE=token
fi

RUNTIME_ENV="$(python3 - <<'PY'
import json, os
keys = ("ORCH_CACHE_DIR", "WANDB_API_KEY", "WANDB_MODE", "HF_TOKEN")
print(json.dumps({"excludes": [".git"], "env_vars": {k: os.environ[k] for k in keys if os.environ.get(k)}}))
PY
)"

# one line, not the job client's tracebacks, when nothing answers at the address (any HTTP answer,
# a 401 of token auth included, counts as a job server; a scheme other than http(s) is left to ray)
if ! python3 - "$ADDRESS" <<'PY'
import ssl, sys, urllib.error, urllib.request
address = sys.argv[1]
url = address if "://" in address else f"http://{address}"
if url.startswith(("http://", "https://")):
    try:
        urllib.request.urlopen(f"{url.rstrip('/')}/api/version", timeout=5)
    except urllib.error.HTTPError:
        pass
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        if not isinstance(reason, ssl.SSLError):
            sys.exit(f"submit.sh: no Ray job server answers at {address} ({reason}); set RAY_ADDRESS to the head's "
                     "dashboard address (RAY_ADDRESS=http://HEAD:8265; default http://127.0.0.1:8265) or start a "
                     "head here with `ray start --head`")
PY
then
  exit 2
fi

stop_job() {
  echo "submit.sh: stopping job ${ID}" >&2
  "$RAY" job stop --address "$ADDRESS" "$ID" >&2 || true
  exit 130
}
trap stop_job INT TERM

echo "submit.sh: job ${ID} -> ${ADDRESS} (auth: ${RAY_AUTH_MODE:-disabled})" >&2
# follows the logs until the job ends (exits 1 itself when the job FAILED)
"$RAY" job submit --address "$ADDRESS" --submission-id "$ID" --working-dir . --runtime-env-json "$RUNTIME_ENV" \
  -- "$JOB_PYTHON" -m orchestrator.main "$@" || true
trap - INT TERM

STATUS="$("$RAY" job status --address "$ADDRESS" "$ID" 2>&1 | tail -n 20)" || true  # e.g. the head went away
if grep -qF "Job '${ID}' succeeded" <<<"$STATUS"; then  # what `ray job status` prints for SUCCEEDED
  echo "submit.sh: job ${ID} SUCCEEDED" >&2
  exit 0
fi
echo "submit.sh: job ${ID} did not succeed:" >&2
echo "$STATUS" >&2
exit 1
