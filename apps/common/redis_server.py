"""A redis-server of the test's own, on a unix socket in a temporary directory.

Used by the applications' checks (apps/replay/check_replay.py,
apps/llama/check_llama.py): `with redis_server() as sock:` gives the socket's
path once the server listens, and stops the server and removes its directory however the
block ends. A missing server or one that does not start is a RuntimeError naming what to
install or what happened, never a skipped test.
"""

import contextlib
import os
import shutil
import subprocess
import tempfile
import time


@contextlib.contextmanager
def redis_server(start_timeout_s=10.0):
    server = shutil.which("redis-server")
    if server is None:
        raise RuntimeError("redis-server is missing. Run, as root: apt-get install -y redis-server libhiredis-dev")
    with tempfile.TemporaryDirectory() as tmp:
        sock = os.path.join(tmp, "redis.sock")
        proc = subprocess.Popen([server, "--port", "0", "--unixsocket", sock, "--save", "", "--appendonly", "no",
                                 "--dir", tmp], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + start_timeout_s
            while not os.path.exists(sock):
                if proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited at start (status {proc.returncode})")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not open its socket within {start_timeout_s:g} s")
                time.sleep(0.05)
            yield sock
        finally:
            proc.kill()
            proc.wait()
