"""moto's S3 server on 127.0.0.1, on a port it binds itself and reports through a ready file.

`python -m workers.embedded.moto_s3 --ready-file PATH [--host 127.0.0.1] [--port 0]` runs moto's
`ThreadedMotoServer` on port 0 (the kernel picks a free port at bind time, so no other process can
take it between picking and binding), writes `{"endpoint": "http://HOST:PORT", "pid": PID}` to PATH
(workers.embedded.ready_file) once it listens, and serves until SIGTERM or SIGINT, then shuts the
server down and exits 0.

Invariant: the server holds what its buckets hold, nothing per request. moto itself does not: its
`BaseModel` appends every model object it ever creates to its class's `instances_tracked` (the
data of its /moto-api dashboard), so each request's key, ACL and grant objects stay reachable after
the key is overwritten or deleted. `stop_tracking_instances` turns that off before the server
starts (the stand-in serves no dashboard).

Caller: workers.embedded.local_stack.LocalStack starts it as a subprocess.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from workers.embedded.ready_file import write_ready_file

STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def stop_tracking_instances() -> None:
    """Make moto's models stop recording every instance in `instances_tracked`.

    Measured on moto 5.2.5 (put, head, get of small objects): RSS +5 KB per cycle whether or not the
    keys were deleted, and 77 -> 756 MB over a soak's 150k rollouts (scripts/soak.py); with this
    call the objects of deleted and overwritten keys are freed. Objects are created exactly as
    moto's `BaseModel.__new__` creates them, minus the append."""
    from moto.core.common_models import BaseModel

    def untracked_new(cls: type, *args: object, **kwargs: object) -> object:
        return super(BaseModel, cls).__new__(cls)

    BaseModel.__new__ = staticmethod(untracked_new)  # type: ignore[method-assign, assignment]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="moto S3 server on a port it binds itself")
    p.add_argument("--ready-file", required=True, help="where to write the bound endpoint as JSON")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 (default): a free port; a restart asks for its old one")
    args = p.parse_args(argv)

    # Block the stop signals before the server thread starts (threads inherit the mask), so that
    # only the sigwait below receives them.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    from moto.server import ThreadedMotoServer

    stop_tracking_instances()

    server = ThreadedMotoServer(ip_address=args.host, port=args.port, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ["MOTO_PORT"] = str(port)  # what moto's own services read as "my port"
    write_ready_file(args.ready_file, {"endpoint": f"http://{host}:{port}", "pid": os.getpid()})
    print(f"moto S3 ready on http://{host}:{port}", flush=True)
    signal.sigwait(STOP_SIGNALS)
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
