"""Runs a Python program inside the sandbox and says how it ended (stdlib only).

`python -I -S harness.py program.py`: compiles the program (a syntax error exits
COMPILE_ERROR, told apart from a program that raises) and runs it as __main__; its stdout is
judged outside the sandbox. A MemoryError, from the address-space limit, exits MEMORY_ERROR.

`python -I -S harness.py program.py test.py entry_point done`: assert-style tests (MBPP,
HumanEval), judged in the harness's process, out of the program's reach. The harness keeps
the tests and the run's token (the file `done`) to itself: it opens and unlinks both, makes
its memory unreadable to its own uid (not dumpable: no ptrace, no /proc/<pid>/mem or fd),
then forks the program's process, which closes them and runs the program. The tests run
in the harness: each name the program defines is a proxy there, and a call crosses a pipe
as data (None, bool, int, float, complex, str, bytes, and lists, tuples, dicts, sets of
them), so nothing the program does (patching builtins, reading the harness's frames, the
test file or memory, returning objects equal to anything) reaches the tests or the token.
On success the harness kills the program's process and prints the token: the runner passes
a case only on it. A failed assert exits ASSERTION_FAILED (a wrong answer); a program
process that ends before the tests are done ends the harness the same way (its exit code or
signal), so an early os._exit(0) prints no token. Functions that return objects of their
own classes, generators or functions cannot be tested this way (their value is not data):
a runtime error.
"""

import builtins
import contextlib
import json
import os
import signal
import sys
import traceback

COMPILE_ERROR, MEMORY_ERROR, ASSERTION_FAILED = 96, 97, 98
PR_SET_DUMPABLE = 4
MAX_MESSAGE = 64 << 20
TAGS = {"tuple": tuple, "set": set, "frozenset": frozenset}


class CompileError(Exception):
    pass


class ProgramEnded(BaseException):
    """The program's process ended before the tests were done."""


class Garbled(BaseException):
    """The program's process wrote what the harness never sends: it is killed."""


def encode(value, names=None):
    """`value` as JSON-able data, or TypeError. `names` maps the program's functions back
    to their names (a test may pass one to another)."""
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [encode(v, names) for v in value]
    if kind in (tuple, set, frozenset):
        return {kind.__name__: [encode(v, names) for v in value]}
    if kind is dict:
        return {"dict": [[encode(k, names), encode(v, names)] for k, v in value.items()]}
    if kind in (bytes, bytearray):
        return {kind.__name__: value.decode("latin-1")}
    if kind is complex:
        return {"complex": [value.real, value.imag]}
    if names is not None and isinstance(value, Function):
        return {"name": value.__name__}
    raise TypeError(f"a {kind.__name__} is not data (plain values and containers only)")


def decode(data, namespace=None):
    """Data as encode() wrote it: only plain values come out, whatever the bytes said.
    `namespace`: where {"name": ...} is looked up (the program's side only)."""
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is list:
        return [decode(v, namespace) for v in data]
    if type(data) is dict and len(data) == 1:
        ((tag, body),) = data.items()
        if tag in TAGS and type(body) is list:
            return TAGS[tag](decode(v, namespace) for v in body)
        if tag == "dict" and type(body) is list:
            return {decode(k, namespace): decode(v, namespace) for k, v in body}
        if tag in ("bytes", "bytearray") and type(body) is str:
            return (bytes if tag == "bytes" else bytearray)(body.encode("latin-1"))
        if tag == "complex" and type(body) is list and len(body) == 2:
            return complex(float(body[0]), float(body[1]))
        if tag == "name" and namespace is not None and type(body) is str:
            return namespace[body]
    raise ValueError("not data")


def send(fd, message) -> None:
    data = json.dumps(message).encode()
    data = len(data).to_bytes(8, "big") + data
    while data:
        data = data[os.write(fd, data) :]


def receive(fd):
    """The next message, or None at the end of the pipe."""
    head = read_exactly(fd, 8)
    if head is None:
        return None
    size = int.from_bytes(head, "big")
    if size > MAX_MESSAGE:
        raise ValueError(f"a message of {size} bytes")
    body = read_exactly(fd, size)
    return None if body is None else json.loads(body)


def read_exactly(fd, size):
    out = b""
    while len(out) < size:
        chunk = os.read(fd, min(size - len(out), 1 << 20))
        if not chunk:
            return None
        out += chunk
    return out


def read_fd(fd) -> str:
    out = b""
    while chunk := os.read(fd, 1 << 16):
        out += chunk
    os.close(fd)
    return out.decode("utf-8", errors="replace")


def compile_program(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        source = f.read()
    try:
        return compile(source, path, "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise CompileError(f"{type(exc).__name__}: {exc}") from None


def run_program(path) -> None:
    """stdin/stdout: the program here, as __main__."""
    try:
        code = compile_program(path)
    except CompileError as exc:
        print(exc, file=sys.stderr)
        sys.exit(COMPILE_ERROR)
    namespace = {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__}
    try:
        exec(code, namespace)
    except MemoryError:
        sys.stderr.write("MemoryError\n")
        os._exit(MEMORY_ERROR)
    except SystemExit:
        raise
    except AssertionError:
        traceback.print_exc()
        sys.exit(ASSERTION_FAILED)
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    sys.stdout.flush()


def exit_code(exc: SystemExit) -> int:
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def end(code) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def serve(path, requests, replies) -> None:
    """The program's process: never returns into the harness's frames it was forked in."""
    try:
        serve_calls(path, requests, replies)
    except BaseException:  # the harness's pipe closed, or the program broke its own exception
        end(1)
    end(0)


def serve_calls(path, requests, replies) -> None:
    """Run the program, say what it defined, then answer calls until the pipe closes."""

    def outcome(run):
        try:
            return ["value", encode(run())]
        except SystemExit as exc:
            end(exit_code(exc))
        except BaseException as exc:
            return ["raise", type(exc).__name__, str(exc)[:2000], traceback.format_exc()[-4000:]]

    try:
        code = compile_program(path)
    except CompileError as exc:
        send(replies, ["compile", str(exc)])
        end(0)
    namespace = {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__}
    loaded = outcome(lambda: exec(code, namespace))
    if loaded[0] == "raise":
        send(replies, loaded)
        end(0)
    names: dict[str, object] = {}  # "function", or ["value", data]
    for name, value in list(namespace.items()):
        if name.startswith("__"):
            continue
        if callable(value):
            names[name] = "function"
        else:  # a module or an object is not data: not visible to the tests
            with contextlib.suppress(TypeError, ValueError, RecursionError):
                names[name] = ["value", encode(value)]
    send(replies, ["names", names])
    while (request := receive(requests)) is not None:
        try:
            name = request[1]
            args, kwargs = decode(request[2], namespace), decode(request[3], namespace)
            fn = namespace[name]
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            send(replies, ["raise", "RuntimeError", f"a bad call: {exc}", ""])
            continue
        send(replies, outcome(lambda fn=fn, args=args, kwargs=kwargs: fn(*args, **kwargs)))


class Function:
    """A function (or class) of the program, called across the pipe."""

    def __init__(self, remote, name) -> None:
        self.remote, self.__name__ = remote, name

    def __call__(self, *args, **kwargs):
        return self.remote.call(self.__name__, args, kwargs)

    def __repr__(self) -> str:
        return f"<the program's {self.__name__}>"


class Remote:
    """The harness's side of the program's process."""

    def __init__(self, pid, requests, replies) -> None:
        self.pid, self.requests, self.replies = pid, requests, replies

    def reply(self):
        try:
            message = receive(self.replies)
        except (ValueError, RecursionError):
            raise Garbled from None
        if message is None:
            raise ProgramEnded
        if type(message) is not list or not message:
            raise Garbled
        return message

    def names(self, entry_point) -> dict:
        """What the program defined, for the tests: a built-in's name (`abs`, `sorted`) only
        as the function checked, or the program would answer the tests' own calls."""
        message = self.reply()
        if message[0] == "compile":
            raise CompileError(str(message[1]))
        if message[0] == "raise":
            self.rethrow(message)
        out = {}
        for name, what in dict(message[1]).items():
            if name.startswith("__") or (hasattr(builtins, name) and name != entry_point):
                continue  # __builtins__ too: the message is the program's to forge
            out[name] = Function(self, name) if what == "function" else decode(what[1])
        return out

    def call(self, name, args, kwargs):
        try:
            request = ["call", name, encode(args, names=True), encode(kwargs, names=True)]
        except TypeError as exc:
            raise TypeError(f"assert-style tests pass data to the program: {exc}") from None
        try:
            send(self.requests, request)
        except OSError:
            raise ProgramEnded from None
        message = self.reply()
        if message[0] == "value":
            try:
                return decode(message[1])
            except (ValueError, TypeError, RecursionError):
                raise Garbled from None
        self.rethrow(message)

    def rethrow(self, message):
        """The program's exception, as the same built-in type where there is one."""
        if message[0] != "raise" or len(message) != 4:
            raise Garbled
        kind, text, where = (str(m) for m in message[1:])
        sys.stderr.write(where)
        if kind == "MemoryError":
            raise MemoryError
        builtin = getattr(builtins, kind, None)
        if isinstance(builtin, type) and issubclass(builtin, Exception):
            try:
                error = builtin(text)
            except Exception:
                error = RuntimeError(f"{kind}: {text}")
        else:
            error = RuntimeError(f"{kind}: {text}")
        raise error

    def stop(self) -> int:
        """Kill the program's process; its wait status."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        return os.waitpid(self.pid, 0)[1]

    def end_as_it_did(self) -> None:
        """The program's process ended early: end the same way, without the token."""
        try:
            _, status = os.waitpid(self.pid, 0)
        except ChildProcessError:
            os._exit(1)
        sys.stdout.flush()
        sys.stderr.flush()
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        os._exit(os.waitstatus_to_exitcode(status) % 256 if os.WIFEXITED(status) else 1)


def hide_memory() -> None:
    """Not dumpable: a process of the same uid without CAP_SYS_PTRACE (the program's) may not
    ptrace this one or open its /proc/<pid>/mem, fd or environ."""
    import ctypes

    if ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError("prctl(PR_SET_DUMPABLE, 0) failed")


def run_tests(program, test_path, entry_point, done_path) -> None:
    test_fd, done_fd = os.open(test_path, os.O_RDONLY), os.open(done_path, os.O_RDONLY)
    os.unlink(test_path)
    os.unlink(done_path)
    hide_memory()
    requests_r, requests_w = os.pipe()
    replies_r, replies_w = os.pipe()
    sys.stdout.flush()
    try:
        pid = os.fork()
    except OSError as exc:
        print(
            f"assert-style tests run the program in a process of its own: {exc} (the "
            "harness, it and the sandbox's init are 3 processes: reward.sandbox.processes "
            "must allow them)",
            file=sys.stderr,
        )
        sys.exit(1)
    if pid == 0:
        for fd in (test_fd, done_fd, requests_w, replies_r):
            os.close(fd)
        serve(program, requests_r, replies_w)
    os.close(requests_r)
    os.close(replies_w)
    test, done = read_fd(test_fd), read_fd(done_fd).strip()
    remote = Remote(pid, requests_w, replies_r)
    try:
        names = remote.names(entry_point)
        namespace = {"__name__": "__main__", "__builtins__": __builtins__, **names}
        exec(compile(test, test_path, "exec"), namespace)
        check = namespace.get("check")  # HumanEval's, defined by the tests (not the program)
        if callable(check) and not isinstance(check, Function):
            if entry_point not in names:  # the program lacks the function checked
                raise NameError(f"name {entry_point!r} is not defined")
            check(names[entry_point])
    except ProgramEnded:
        remote.end_as_it_did()
    except Garbled:
        print("the program's process garbled the harness's pipe", file=sys.stderr)
        remote.stop()
        sys.exit(1)
    except CompileError as exc:
        print(exc, file=sys.stderr)
        remote.stop()
        sys.exit(COMPILE_ERROR)
    except MemoryError:
        sys.stderr.write("MemoryError\n")
        remote.stop()
        os._exit(MEMORY_ERROR)
    except AssertionError:
        traceback.print_exc()
        remote.stop()
        sys.exit(ASSERTION_FAILED)
    except BaseException:
        traceback.print_exc()
        remote.stop()
        sys.exit(1)
    remote.stop()
    sys.stdout.write("\n" + done + "\n")
    sys.stdout.flush()


def main() -> None:
    if len(sys.argv) > 2:
        run_tests(*sys.argv[1:5])
    else:
        run_program(sys.argv[1])


if __name__ == "__main__":
    main()
