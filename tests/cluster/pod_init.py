"""The container runtime's last step for the local cluster's kubelet: set up, then exec.

Why a separate script: a pod's processes must start inside its own namespaces (the kubelet
runs `ip netns exec <ns> unshare --mount --propagation private --uts python pod_init.py
SPEC`), and the mounts, hostname and user switch have to happen in there, after the
namespaces exist and before the container's command replaces this process (so the pid the
kubelet holds is the container's main process).

SPEC is a JSON file the kubelet wrote:
- mode: "run" (a container start: mounts, hostname, then exec) or "exec" (an exec probe entered
  with nsenter into a running container's namespaces: only the user switch, cwd and exec);
- mounts: [{source, target, readOnly}] in mount order (parents before children): bind mounts,
  read-only ones remounted read-only;
- image: directories that stand in for the image (interpreter, venv, checkout), bound back
  wherever a volume mounted over a parent hid them;
- expose: {blocked, children, staging} or null: `blocked` is a host directory others cannot
  traverse (/root) holding what a non-root container needs (the venv's interpreter); it is
  covered with a tmpfs that holds bind mounts of just `children`, as an image would ship them;
- hostname, uid, gid, groups, noNewPrivs, workingDir, argv (argv[0] an absolute path), env.
- errorFile: where a failure before exec is written (the kubelet reports it as StartError,
  exit code 128, as container runtimes do).

Only the standard library: this runs with whatever interpreter the kubelet uses.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from typing import Any

MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
PR_SET_NO_NEW_PRIVS = 38

_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    rc = _libc.mount(
        source.encode() if source else None,
        target.encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} -> {target}: {os.strerror(err)}")


def _bind(source: str, target: str, read_only: bool) -> None:
    if not os.path.lexists(target):
        # Only where the kubelet could not create it on the host: under an exposed tmpfs.
        if os.path.isdir(source):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "a").close()
    _mount(source, target, None, MS_BIND | MS_REC)
    if read_only:
        # A bind mount is made read-only by remounting it; the flags already on the source's
        # mount (nosuid, nodev, noexec) must be kept or the kernel refuses in some setups.
        vfs = os.statvfs(target)
        keep = vfs.f_flag & (os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC)
        _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)


def _same(path: str, fd: int) -> bool:
    """Whether `path` still names the directory `fd` was opened on."""
    try:
        here, there = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _expose(blocked: str, children: list[str], staging: str) -> None:
    """Cover `blocked` with a world-traversable tmpfs that holds only `children`."""
    parked = []
    for i, child in enumerate(children):
        spot = os.path.join(staging, str(i))
        os.makedirs(spot, exist_ok=True)
        _mount(child, spot, None, MS_BIND | MS_REC)
        parked.append((spot, child))
    _mount("tmpfs", blocked, "tmpfs", 0, "mode=0755")
    for spot, child in parked:
        os.makedirs(child, exist_ok=True)
        _mount(spot, child, None, MS_MOVE)


def _sethostname(name: str) -> None:
    raw = name.encode()
    if _libc.sethostname(raw, len(raw)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sethostname {name}: {os.strerror(err)}")


def _become(spec: dict[str, Any]) -> None:
    uid, gid = spec.get("uid"), spec.get("gid")
    if spec.get("noNewPrivs"):
        _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if uid is None and gid is None and not spec.get("groups"):
        return
    os.setgroups([int(g) for g in spec.get("groups") or []])
    if gid is not None:
        os.setgid(int(gid))
    if uid is not None:
        os.setuid(int(uid))


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    # Opened while still root (the user switch may lose write access); closed by the exec.
    error_fd = -1
    if spec.get("errorFile"):
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        error_fd = os.open(spec["errorFile"], flags, 0o600)
    try:
        if spec["mode"] == "run":
            expose = spec.get("expose")
            if expose:
                _expose(expose["blocked"], expose["children"], expose["staging"])
            # Every source is opened before the first mount: a volume mounted over a parent of
            # the node's own directories (an emptyDir at /tmp, where the pod directories may
            # live) would otherwise hide the sources of the mounts after it.
            sources = [os.open(m["source"], os.O_PATH | os.O_CLOEXEC) for m in spec["mounts"]]
            image = [(p, os.open(p, os.O_PATH | os.O_CLOEXEC)) for p in spec.get("image", [])]
            for m, fd in zip(spec["mounts"], sources, strict=True):
                _bind(f"/proc/self/fd/{fd}", m["target"], bool(m.get("readOnly")))
                os.close(fd)
            for path, fd in image:  # an image's own files are never hidden by a volume
                if not _same(path, fd):
                    os.makedirs(path, exist_ok=True)
                    _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
                os.close(fd)
            _sethostname(spec["hostname"])
        _become(spec)
        os.chdir(spec.get("workingDir") or "/")
        argv = spec["argv"]
        os.execve(argv[0], argv, spec["env"])
    except OSError as e:
        message = f"failed to start container: {e}"
        if error_fd >= 0:
            os.write(error_fd, message.encode())
        print(message, file=sys.stderr, flush=True)
        sys.exit(128)


if __name__ == "__main__":
    main(sys.argv[1])
