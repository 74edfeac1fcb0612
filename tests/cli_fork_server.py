"""A process that imported ``ftexp.cli`` once and runs each request as a fresh fork of itself.

A bad-input case of ``python -m ftexp`` spends ~4 CPU-seconds importing torch, Ray, Hydra and
ftexp before it refuses its input in a fraction of that. Here the imports happen once: for every
request (one JSON line on stdin: ``argv``, ``cwd``, ``stdout`` and ``stderr`` file paths) the server
forks, and the child runs the real ``ftexp.cli.main`` with that argv in that directory, its output in
those files, and exits with the exit code ``python -m ftexp`` would give; the server answers one JSON
line, ``{"returncode": ...}``. Each case still runs in a process of its own, from a state no case
touched. Used by ``ftexp_runner.ForkedCli``.
"""

import json
import os
import sys
import traceback

import ftexp.cli


def _child(request: dict) -> int:
    os.chdir(request["cwd"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the requests' pipe is the server's alone
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        file_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file_fd, fd)
        os.close(file_fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.argv = ["ftexp", *request["argv"]]
    try:
        ftexp.cli.main()
        return 0
    except SystemExit as e:  # as the interpreter maps it: None is 0, an int itself, anything else printed and 1
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def main() -> None:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os._exit(_child(request))
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")


if __name__ == "__main__":
    main()
