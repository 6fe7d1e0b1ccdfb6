"""The tests' command server: imports what ``seqpar`` commands load, then runs each request in a forked copy.

Started and spoken to by ``tests._commands`` (Note [forked commands]); it ends when its standard input closes.
"""

from __future__ import annotations

import array
import gc
import json
import os
import selectors
import socket
import sys
import traceback

MAX_FDS = 3  # the command's stdin, stdout and stderr


def _preload() -> None:
    """What a ``seqpar train`` run imports, in its launcher and in its ranks (they are forked from it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot
    import torch.utils.tensorboard  # noqa: F401
    import transformers
    from transformers.models.llama import modeling_llama  # noqa: F401

    import seqpar.cli
    import seqpar.train.launch
    import seqpar.train.loop

    transformers.logging  # noqa: B018
    seqpar.cli.main  # noqa: B018
    gc.freeze()  # the imports' objects are never collected: a collection in a command walks only its own


def _receive(conn: socket.socket) -> tuple[dict, list[int]] | None:
    """One request on ``conn`` (a JSON object and the command's three descriptors), None once the client closed."""
    fds = array.array("i")
    message, ancillary, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(MAX_FDS * fds.itemsize))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return (json.loads(message), list(fds)) if message else None


def _run(request: dict, fds: list[int]) -> None:
    """In the forked copy: the command's descriptors and environment, then ``seqpar`` with its arguments."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the server's sockets and selector are not the command's
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["seqpar", *request["argv"]]
    code = 1
    try:
        from seqpar.cli import main

        result = main(request["argv"])
        code = result if isinstance(result, int) else 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, int | None):
            print(stop.code, file=sys.stderr)
    except BaseException:  # reported as a fresh interpreter reports it, then the exit code
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(path: str) -> None:
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(sys.stdin, selectors.EVENT_READ, "stdin")
    while True:
        for key, _ in selector.select():
            if key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 4096):
                    return  # the test session ended
            elif key.data == "accept":
                conn, _ = listener.accept()
                selector.register(conn, selectors.EVENT_READ, "request")
            elif key.data == "request":
                _start(key.fileobj, selector)
            else:  # a command's pidfd: it ended
                conn, pid = key.data
                selector.unregister(key.fileobj)
                os.close(key.fileobj)
                _, status = os.waitpid(pid, 0)
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                conn.close()


def _start(conn: socket.socket, selector: selectors.BaseSelector) -> None:
    """Fork the command ``conn`` asks for; tell the client its pid, and watch for its end."""
    selector.unregister(conn)
    received = _receive(conn)
    if received is None:
        conn.close()
        return
    request, fds = received
    pid = os.fork()
    if pid == 0:
        _run(request, fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    selector.register(os.pidfd_open(pid), selectors.EVENT_READ, (conn, pid))


if __name__ == "__main__":
    serve(sys.argv[1])
