"""Run a GSPOJob on the local cluster by hand: `python tests/cluster/run.py [FILE]`.

Starts the local cluster (local_cluster.py: API stand-in, JobSet and Job controllers, a node
that runs pods as processes, the operator), applies FILE (default examples/local-cluster.yaml)
with the real kubectl, prints `kubectl get gspo,jobsets,pods` as the job moves, and stops when
the job has finished (or on Ctrl-C). Pod logs and the claims' directories stay under --workdir.
With `--kueue QUEUES` Kueue's stand-in runs too and QUEUES (e.g. a CPU variant of
examples/kueue.yaml) is applied first.
Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [
    str(HERE),
    str(REPO / "tests/operator"),
    str(REPO / "tests"),
    str(REPO / "operator"),
    str(REPO / "trainer"),
]

import yaml  # noqa: E402
from local_cluster import local_cluster  # noqa: E402


async def main(args: argparse.Namespace) -> int:
    docs = list(yaml.safe_load_all(args.file.read_text()))
    (name,) = [d["metadata"]["name"] for d in docs if d and d.get("kind") == "GSPOJob"]
    async with local_cluster(args.workdir, kueue=None if args.kueue is None else {}) as cluster:
        if args.kueue is not None:
            queues = str(args.kueue.resolve())
            print(await cluster.kubectl("apply", "--validate=false", "-f", queues))
        print(await cluster.kubectl("apply", "--validate=false", "-f", str(args.file.resolve())))
        while cluster.status(name).get("phase") not in ("Succeeded", "Failed"):
            await asyncio.sleep(args.every)
            print(await cluster.kubectl("get", "gspo,jobsets,pods", ok=False), flush=True)
        print(await cluster.kubectl("describe", "gspo", name))
        print(f"Pod logs: {args.workdir / 'logs'}; claims: {args.workdir / 'pvc'}")
        return 0 if cluster.status(name)["phase"] == "Succeeded" else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("file", nargs="?", type=Path, default=REPO / "examples/local-cluster.yaml")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/gspo-local-cluster"))
    p.add_argument("--every", type=float, default=10.0, help="seconds between printouts")
    p.add_argument(
        "--kueue",
        type=Path,
        default=None,
        metavar="QUEUES",
        help="run Kueue's stand-in and apply QUEUES (ResourceFlavors, ClusterQueues, "
        "LocalQueues) first; the job then needs runPolicy.scheduling.queue",
    )
    sys.exit(asyncio.run(main(p.parse_args())))
