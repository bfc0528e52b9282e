"""The ssh the MPI launcher runs in a rendezvous job: ``rdzv_ssh.py --socket PATH
[ssh options] HOST COMMAND...`` hands COMMAND for HOST to the rendezvous server in the
launcher's own process (:mod:`.rdzv_shell`, through a Unix socket only this user can reach)
and exits with the command's exit code, as ssh does: 255 when it could not run it.

The launcher starts one of these per node, so it starts fast: the script runs as
``python -S -E rdzv_ssh.py`` and imports nothing but the standard library (not even this
package, whose import would cost more than the rest; the two-frame exchange below is the
same length-prefixed JSON as :func:`.rdzv_wire.send_json`).
"""

from __future__ import annotations

import json
import shlex
import socket
import struct
import sys
from collections.abc import Sequence

SSH_FAILURE = 255  # ssh's own exit status when it could not run the command
_LENGTH = struct.Struct(">I")


def _split(argv: Sequence[str]) -> tuple[str, str, list[str]]:
    """``--socket PATH [ssh options] HOST COMMAND...`` -> (socket, host, command words).

    Raises:
        ValueError: a part is missing.
    """
    words = list(argv)
    if len(words) < 2 or words[0] != "--socket":
        raise ValueError("usage: rdzv_ssh.py --socket PATH [ssh options] HOST COMMAND...")
    path, words = words[1], words[2:]
    # Hydra puts ssh's -x (no X11 forwarding) before the host; ssh options take no value here.
    while words and words[0].startswith("-"):
        words.pop(0)
    if len(words) < 2:
        raise ValueError(f"no host and command in {shlex.join(argv)!r}")
    return path, words[0], words[1:]


def _exchange(path: str, request: dict[str, str]) -> dict[str, object]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        body = json.dumps(request).encode()
        sock.sendall(_LENGTH.pack(len(body)) + body)
        data = b""
        while len(data) < _LENGTH.size or len(data) < _LENGTH.size + _LENGTH.unpack(
                data[:_LENGTH.size])[0]:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("the rendezvous server hung up without an exit code")
            data += chunk
        answer = json.loads(data[_LENGTH.size:])
    if not isinstance(answer, dict):
        raise ValueError(f"not an answer: {answer!r:.100}")
    return answer


def main(argv: Sequence[str] | None = None) -> int:
    """Run COMMAND on HOST through the rendezvous; return its exit code (255: could not)."""
    try:
        path, host, words = _split(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        print(f"mpitrainrun (rendezvous ssh): {exc}", file=sys.stderr)
        return SSH_FAILURE
    try:
        # ssh joins its command words with spaces for the remote shell; so do we.
        answer = _exchange(path, {"host": host, "command": " ".join(words)})
        code = answer.get("code", SSH_FAILURE)
        return code if isinstance(code, int) else SSH_FAILURE
    except (OSError, ValueError) as exc:
        print(f"mpitrainrun (rendezvous ssh): cannot reach the rendezvous server through "
              f"{path}: {exc}", file=sys.stderr)
        return SSH_FAILURE


if __name__ == "__main__":
    sys.exit(main())
