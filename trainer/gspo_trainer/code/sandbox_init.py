"""The first process of a sandbox: isolates itself, then runs the program (stdlib only).

Run as `python -I -S sandbox_init.py <plan.json>` by sandbox.py (never imported: it must not
load the learner's packages into a process the program inherits). With isolation
"namespaces" it enters new user, mount, PID, network, IPC and UTS namespaces, maps one user
(the learner's own uid, or nobody when the learner is root), builds a root of its own (the
program's files copied to a small tmpfs at /work, the Python install and system libraries
read-only, a fresh /proc, /dev/null and friends, a small /tmp) and pivots into it, so the
job's files, its token, the network and the host's processes are out of sight. Then it forks
the PID namespace's init, which forks the program with resource limits, no capabilities and
no_new_privs, waits for it, and exits with its status: the kernel then kills whatever the
program left behind in the namespace (children that setsid or sleep past it).

It reports on fd `status_fd` (closed before the program starts): b"ok" once the program is
about to run, or b"fail: <why>" when isolation could not be set up (sandbox_failure; never
blamed on the program).
"""

import contextlib
import ctypes
import errno
import json
import os
import re
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
PR_SET_CHILD_SUBREAPER = 36
SYS_PIVOT_ROOT, SYS_CAPSET = 155, 126  # x86_64
NOBODY = 65534
# statvfs flags -> the mount flags a bind remount must keep (a user namespace may not drop
# the flags of a mount it inherited: the remount fails with EPERM).
KEPT_FLAGS = {
    1: MS_RDONLY,
    2: MS_NOSUID,
    4: MS_NODEV,
    8: MS_NOEXEC,
    1024: 1024,
    2048: 2048,
    4096: 1 << 21,
}

libc = ctypes.CDLL(None, use_errno=True)


def check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None):
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    check(
        libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)),
        f"mount {dst}",
    )


def write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def enter_namespaces(uid: int, gid: int) -> None:
    """New user, mount, PID, network, IPC and UTS namespaces, `uid` mapped to root in them."""
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    check(libc.unshare(flags), "unshare")
    write("/proc/self/setgroups", "deny")
    write("/proc/self/uid_map", f"0 {uid} 1")
    write("/proc/self/gid_map", f"0 {gid} 1")
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)


def become_nobody() -> None:
    """A root learner's program runs as nobody: it owns nothing of the host's, and root's
    groups do not follow it."""
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
    libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # the uid change made /proc/self root's


def bind(src: str, dst: str, writable: bool) -> None:
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    try:  # this tree alone: a volume mounted under /usr or the Python install stays out
        mount(src, dst, None, MS_BIND)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        # In a user namespace a tree with mounts under it binds only whole (they are locked
        # to it): bind it whole, then cover each of them with an empty mount.
        mount(src, dst, None, MS_BIND | MS_REC)
        cover_mounts_under(dst)
    kept = 0
    for st, ms in KEPT_FLAGS.items():
        if os.statvfs(dst).f_flag & st:
            kept |= ms
    mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_NOSUID | kept | (0 if writable else MS_RDONLY))


def cover_mounts_under(top: str) -> None:
    """An empty read-only tmpfs over each directory mounted under `top`, /dev/null over each
    file (a volume, a secret, a driver library bound in by the runtime)."""
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        points = {octal_unescape(line.split()[4]) for line in f}
    covered: list[str] = []
    for point in sorted(p for p in points if p.startswith(top + "/")):
        if any(point.startswith(c + "/") for c in covered):
            continue  # hidden with the mount above it
        if os.path.isdir(point):
            mount("tmpfs", point, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0555")
        else:
            mount("/dev/null", point, None, MS_BIND)
        covered.append(point)


def octal_unescape(text: str) -> str:
    """/proc/self/mountinfo writes space, tab, newline and backslash as \\ooo."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def tmpfs_options(plan: dict, size: int, mode: str) -> str:
    # Files and directories are capped too: an empty file takes no room but kernel memory.
    return f"size={size},nr_inodes={plan['inodes']},mode={mode}"


def work_dir(plan: dict, work: str, owner: int | None) -> None:
    """The program's directory: a tmpfs of its own (size and file count capped) holding a copy
    of the files it was given. Not the host's directory: what the program writes there takes
    none of the learner's disk, and whatever tree it leaves (too deep to walk, unreadable to
    its owner) goes with its mount namespace instead of staying for the learner to remove."""
    os.makedirs(work, exist_ok=True)
    options = tmpfs_options(plan, plan["work_bytes"], "0755")
    mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, options)
    for name in os.listdir(plan["workdir"]):
        path = os.path.join(work, name)
        src = os.open(os.path.join(plan["workdir"], name), os.O_RDONLY)
        dst = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:  # in the kernel: the tests' text never passes through the program's memory
            while os.sendfile(dst, src, None, 1 << 20):
                pass
        finally:
            os.close(src)
            os.close(dst)
        if owner is not None:
            os.chown(path, owner, owner)
    if owner is not None:
        os.chown(work, owner, owner)


def build_root(plan: dict, fresh_proc: bool, owner: int | None = None) -> None:
    """A root of the program's own, then pivot into it (the host's tree is detached).
    `fresh_proc`: mount the new PID namespace's /proc now; otherwise bind the host's, for the
    namespace's init to mount its own over (a user namespace may mount proc only where one is
    already fully visible). `owner`: the host uid the program will run as, when that is not
    the uid building the root (a root learner's program runs as nobody)."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = plan["root"]
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path in plan["read_only"]:
        if os.path.islink(path):
            os.makedirs(os.path.dirname(root + path), exist_ok=True)
            os.symlink(os.readlink(path), root + path)
        elif os.path.exists(path):
            bind(path, root + path, writable=False)
    for dev in ("null", "zero", "urandom", "random"):
        bind(f"/dev/{dev}", f"{root}/dev/{dev}", writable=True)
    work_dir(plan, root + "/work", owner)
    os.makedirs(root + "/tmp", exist_ok=True)
    tmp = tmpfs_options(plan, plan["tmp_bytes"], "1777")
    mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, tmp)
    os.makedirs(root + "/proc", exist_ok=True)
    if fresh_proc:
        mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    else:
        mount("/proc", root + "/proc", None, MS_BIND)
    os.makedirs(root + "/.old", exist_ok=True)
    check(libc.syscall(SYS_PIVOT_ROOT, root.encode(), (root + "/.old").encode()), "pivot_root")
    os.chdir("/")
    check(libc.umount2(b"/.old", MNT_DETACH), "umount old root")
    os.rmdir("/.old")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def drop_privileges() -> None:
    """No capability now or after exec (an in-namespace root would regain them), none ever."""
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()
    check(libc.syscall(SYS_CAPSET, header, data), "capset")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def tasks_of(uid: int) -> int:
    """Processes and threads of `uid` now (what RLIMIT_NPROC counts outside a namespace)."""
    count = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{pid}/task"))
    return count


def set_limits(plan: dict) -> None:
    """The program's rlimits. RLIMIT_NPROC counts every process and thread of the real uid in
    the user namespace: with namespaces that is the program's own; with isolation none it is
    the learner's uid, whose threads (dozens) would leave the program no fork at all, so
    there it is `processes` more than that uid runs now (loose: concurrent runs count each
    other; root is exempt from it)."""
    cpu = int(plan["cpu_seconds"])
    processes = plan["processes"]
    if plan["isolation"] != "namespaces" and os.getuid() != 0:
        processes += tasks_of(os.getuid())
    for limit, value in (
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (plan["memory_bytes"],) * 2),
        (resource.RLIMIT_NPROC, (processes,) * 2),
        (resource.RLIMIT_FSIZE, (plan["file_bytes"],) * 2),
        (resource.RLIMIT_NOFILE, (plan["open_files"],) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(limit, value)


def run_program(plan: dict, status_fd: int) -> None:
    """In the process that becomes the program: limits, report ready, exec."""
    isolated = plan["isolation"] == "namespaces"
    os.chdir("/work" if isolated else plan["workdir"])
    if isolated:
        drop_privileges()
    set_limits(plan)
    argv = plan["argv"]
    if plan.get("same_python") and argv[:3] == [sys.executable, "-I", "-S"]:
        # This interpreter, started with the same flags: run the script here and save an
        # interpreter start-up (the costliest part of a sandboxed run).
        os.environ.clear()
        os.environ.update(plan["env"])
        sys.argv = argv[3:]
        sys.path[0] = os.path.dirname(os.path.abspath(argv[3]))
        os.write(status_fd, b"ok")
        os.close(status_fd)
        import runpy

        try:
            runpy.run_path(argv[3], run_name="__main__")
        except SystemExit:
            raise
        except BaseException:  # as the interpreter ends on an uncaught exception
            import traceback

            traceback.print_exc()
            sys.exit(1)
        sys.exit(0)
    os.set_inheritable(status_fd, False)  # closed by a successful exec
    os.write(status_fd, b"ok")
    os.execve(argv[0], argv, plan["env"])


def wait_for(pid: int) -> int:
    """Reap everything (as a namespace's init must) until `pid` ends; its shell-style code."""
    while True:
        try:
            got, status = os.wait()
        except ChildProcessError:
            return 1
        if got == pid:
            return (
                os.waitstatus_to_exitcode(status) % 256
                if os.WIFEXITED(status)
                else (128 + os.WTERMSIG(status))
            )


def can_become_nobody() -> bool:
    """Root, with nobody's uid and gid mapped in its user namespace (a rootless container's
    root maps often only itself: chown to nobody fails there with EINVAL)."""
    if os.geteuid() != 0:
        return False
    for kind in ("uid", "gid"):
        with open(f"/proc/self/{kind}_map", encoding="ascii") as f:
            ranges = [tuple(map(int, line.split())) for line in f if line.strip()]
        if not any(inside <= NOBODY < inside + count for inside, _, count in ranges):
            return False
    return True


def isolate(plan: dict) -> None:
    """Everything before the namespace's init starts. A root learner builds the new root
    while it still can read what it binds (its Python may sit under /root), then drops to
    nobody; any other learner (and a root that cannot become nobody) does it all inside its
    user namespace (in the init)."""
    if plan["root_built"]:
        check(libc.unshare(CLONE_NEWNS), "unshare mount namespace")
        build_root(plan, fresh_proc=False, owner=NOBODY)
        become_nobody()
    enter_namespaces(os.geteuid(), os.getegid())


def start_init(plan: dict, status_fd: int) -> None:
    """PID 1 of the new namespace: finish the root, fork the program, wait, exit."""
    try:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if plan["root_built"]:
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        else:
            build_root(plan, fresh_proc=True)
        program = os.fork()
        if program == 0:
            try:
                run_program(plan, status_fd)
            except Exception as exc:
                os.write(status_fd, f" fail: {exc}".encode())
            os._exit(1)
    except Exception as exc:
        os.write(status_fd, f"fail: {exc}".encode())
        os._exit(1)
    os.close(status_fd)
    os._exit(wait_for(program))  # the kernel kills what is left in the namespace


def first_to_go() -> None:
    """oom_score_adj 1000, for this process and all it starts: no cgroup caps a program's
    processes together, so when the pod or the machine runs out of memory the kernel must
    kill a program, not the learner (the largest process, its usual pick). Set with
    CAP_SYS_RESOURCE (a root learner's, where the machine grants it), it is also the floor
    the program cannot go under; otherwise a program may lower it back to the learner's."""
    with contextlib.suppress(OSError):
        write("/proc/self/oom_score_adj", "1000")


def descendants() -> set[int]:
    """Every process below this one now (from each process's parent in /proc)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{name}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(name))
    found: set[int] = set()
    todo = [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def kill_descendants() -> None:
    for pid in descendants():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def end_descendants() -> None:
    """Kill and reap until no child is left: then nothing is left below (an orphan comes to
    its subreaper), even a process that forked while the others were being killed."""
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0]:
                continue
        except ChildProcessError:
            return
        kill_descendants()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(-1, 0)


def run_unisolated(plan: dict, status_fd: int) -> None:
    """isolation none: no PID namespace ends the program's leftovers with it, so this process
    is their subreaper (an orphan, a child that setsid and double-forked, comes to it, not to
    the pod's or the machine's init) and kills everything below it when the program ends or
    the sandbox's SIGTERM says time or output is up."""
    check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl child subreaper")
    program = os.fork()
    if program == 0:
        try:
            run_program(plan, status_fd)
        except Exception as exc:
            os.write(status_fd, f" fail: {exc}".encode())
        os._exit(1)
    os.close(status_fd)
    signal.signal(signal.SIGTERM, lambda *_: kill_descendants())
    code = wait_for(program)
    end_descendants()
    sys.exit(code)


def main() -> None:
    first_to_go()
    with open(sys.argv[1], encoding="utf-8") as f:
        plan = json.load(f)
    status_fd = plan["status_fd"]
    try:
        if plan["isolation"] != "namespaces":
            run_unisolated(plan, status_fd)
        plan["root_built"] = can_become_nobody()
        isolate(plan)
    except Exception as exc:
        os.write(status_fd, f" fail: {exc}".encode())
        os._exit(1)
    init = os.fork()
    if init == 0:
        start_init(plan, status_fd)
    # SIGTERM from the sandbox (time or output is up): kill the namespace's init, whose exit
    # waits until the kernel has killed and reaped everything in the namespace.
    signal.signal(signal.SIGTERM, lambda *_: os.kill(init, signal.SIGKILL))
    os.close(status_fd)
    sys.exit(wait_for(init))


if __name__ == "__main__":
    main()
