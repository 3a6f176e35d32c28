"""Runs a Python program inside the sandbox and says how it ended (stdlib only).

`python -I -S harness.py program.py [test.py entry_point]`: compiles the program (a syntax
error exits COMPILE_ERROR, told apart from a program that raises), runs it as __main__, and
with a test file runs the test code in the program's namespace, then `check(entry_point)`
when the test defines check (HumanEval's convention; MBPP's tests are bare asserts; a
program without that function fails). A MemoryError, from the address-space limit, exits
MEMORY_ERROR; a failed assert ASSERTION_FAILED (a wrong answer, not a crash).

Assert-style tests pass on a clean exit only after the harness has printed the run's token
(GSPO_SANDBOX_DONE, taken out of the environment before the program runs): a program that
calls os._exit(0) before the asserts run does not pass. A program that reads the harness's
own memory can still find it: that is a reward hack, not an escape, and scores only itself.
"""

import os
import sys
import traceback

COMPILE_ERROR, MEMORY_ERROR, ASSERTION_FAILED = 96, 97, 98


def main() -> None:
    done = os.environ.pop("GSPO_SANDBOX_DONE", "")
    source_path = sys.argv[1]
    with open(source_path, encoding="utf-8", errors="replace") as f:
        source = f.read()
    try:
        code = compile(source, source_path, "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(COMPILE_ERROR)
    namespace = {"__name__": "__main__", "__file__": source_path, "__builtins__": __builtins__}
    try:
        exec(code, namespace)
        if len(sys.argv) > 2:
            with open(sys.argv[2], encoding="utf-8") as f:
                exec(compile(f.read(), sys.argv[2], "exec"), namespace)
            check = namespace.get("check")
            if callable(check):
                if sys.argv[3] not in namespace:  # the program lacks the function checked
                    raise NameError(f"name {sys.argv[3]!r} is not defined")
                check(namespace[sys.argv[3]])
            sys.stdout.write("\n" + done + "\n")
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


if __name__ == "__main__":
    main()
