"""The learner's client for the rollout fleet: load-balanced generation and weight sync.

The servers are vLLM's own OpenAI server with the gspo plugin (`vllm_plugin.py`). `generate`
cuts a batch into chunks of prompts and sends each chunk to the eligible server with the
least outstanding work, as one request per prompt to vLLM's token-in/token-out route
(`/inference/v1/generate`; each prompt its own seed; the plugin's header names the policy
version of each reply). A chunk whose server fails goes to
another one, and the failed server is reported in `RolloutBatch.servers_failed`; a 400 is
the request's fault, not the server's (every server would refuse it), so it benches no
server and raises `RequestRefused` naming the batch's prompt at fault. A server is eligible
only when it is alive and holds the client's current policy version, so a server that
restarts gets no traffic until `sync_weights` has brought it up to the learner's weights.

`sync_weights` runs pause -> (re)form the sync group -> update (the HTTP call and the
broadcast together) -> resume, each step bounded by a timeout. The group is re-formed
whenever the set of live servers changes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec

from gspo_api import ports
from gspo_trainer import device
from gspo_trainer.rollout.types import Completion, RolloutBatch, SamplingParams

if TYPE_CHECKING:
    import torch

    from gspo_trainer.rollout.weight_sync import SyncGroup, TensorSource

log = logging.getLogger("gspo.rollout.client")


class RolloutError(RuntimeError):
    """No server could serve a request, or the fleet could not be synced."""


class RequestRefused(RolloutError):
    """A server refused the request itself (400): every server would, so none is benched.
    `prompt_index`: the batch's prompt at fault, when one is."""

    def __init__(self, message: str, prompt_index: int | None = None) -> None:
        super().__init__(message)
        self.prompt_index = prompt_index


class ServerError(Exception):
    """A server answered, but not with a usable result; try another server."""

    def __init__(self, message: str, status: int | None = None, payload: Any = None) -> None:
        super().__init__(message)
        self.status, self.payload = status, payload


# Control routes a second request repeats harmlessly.
IDEMPOTENT_CONTROL = ("/control/pause", "/control/resume")
# Control routes that must not be sent again, each sent on a connection of its own: a pooled
# kept-alive one (the pool keeps those a step's many generation requests opened) that the
# server closes as the request goes out (vLLM's uvicorn closes one idle for
# VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s) loses it with no reply, and a server that never got
# /control/sync/update never joins the broadcast the learner then waits on for
# weightSync.timeoutSeconds (10 minutes by default).
NEW_CONNECTION_CONTROL = ("/control/sync/init", "/control/sync/update", "/control/sync/load")
# How long the shared pool keeps an idle connection: under vLLM's 5 s, so that no request
# (generation ones included) goes out on a connection the server may be closing.
KEEPALIVE_S = 3.0


@dataclass
class Server:
    url: str
    alive: bool = True
    policy_version: int | None = None
    workers: int = 1
    outstanding: int = 0  # prompts x samples in flight
    model: str | None = None  # the name vLLM serves the model under (from /health)
    paused: bool = False  # as /health last said: held for a weight sync


@dataclass(frozen=True)
class SyncOptions:
    """Where the servers reach learner rank 0 for the weight broadcast."""

    master_addr: str  # address of this process as the servers see it
    master_port: int = ports.WEIGHT_SYNC_PORT
    backend: str = "gloo"  # "nccl" when learner and servers have GPUs
    bucket_mb: float = 256.0
    timeout_s: float = 300.0
    # "filesystem": write each version under `directory` (a volume the servers mount at
    # their --weights-dir) and have them load it; no collective group is formed.
    method: str = "broadcast"
    directory: str | None = None


@dataclass(frozen=True)
class SyncReport:
    version: int
    servers: list[str]  # servers that now hold `version`
    servers_failed: list[str]  # every other known server (dead, or lost during this sync)
    bytes_total: int
    seconds: float
    broadcast_seconds: float
    regrouped: bool


@dataclass
class _Group:
    members: tuple[str, ...]
    group: SyncGroup
    sender: Any = field(default=None)


class RolloutClient:
    def __init__(
        self,
        urls: Sequence[str],
        token: str | None = None,
        timeout_s: float = 600.0,
        *,
        chunk_prompts: int = 8,
        sync: SyncOptions | None = None,
        probe_timeout_s: float = 5.0,
    ) -> None:
        if not urls:
            raise ValueError(
                f"RolloutClient needs at least one server URL (${ports.ENV_ROLLOUT_URLS})"
            )
        self.servers = {u.rstrip("/"): Server(u.rstrip("/")) for u in urls}
        self.token = token
        self.timeout_s = timeout_s
        self.chunk_prompts = max(1, chunk_prompts)
        self.sync_options = sync
        self.probe_timeout_s = probe_timeout_s
        self.policy_version: int | None = None  # the learner's version, once synced
        self._session: aiohttp.ClientSession | None = None
        self._fresh_session: aiohttp.ClientSession | None = None  # one connection a request
        self._store: Any = None
        self._group: _Group | None = None
        self._generation = 0

    # --- plumbing ----------------------------------------------------------------------

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        for session in (self._session, self._fresh_session):
            if session is not None:
                await session.close()
        self._session = self._fresh_session = None
        self._drop_group(abort=False)
        self._store = None

    def _drop_group(self, *, abort: bool) -> None:
        """Shut the weight-sync group down (healthy: a regroup, or closing) or abort it (a
        collective failed: NCCL's abort frees what a dead peer left waiting) and forget it."""
        old, self._group = self._group, None
        if old is not None:
            old.group.close(abort=abort)

    def _http(self, *, fresh: bool = False) -> aiohttp.ClientSession:
        """The client's session; `fresh`: the one that opens a new connection for every
        request and closes it after the reply (NEW_CONNECTION_CONTROL)."""
        session = self._fresh_session if fresh else self._session
        if session is None:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            session = aiohttp.ClientSession(
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                connector=aiohttp.TCPConnector(
                    force_close=fresh,
                    keepalive_timeout=None if fresh else KEEPALIVE_S,
                ),
            )
            if fresh:
                self._fresh_session = session
            else:
                self._session = session
        return session

    async def _control(self, url: str, path: str, body: dict[str, Any], timeout_s: float) -> Any:
        """A control request; pause and resume once more when the server closed or reset the
        connection before answering (a kept-alive connection it was closing as the request
        went out): both are idempotent, and a resume lost so leaves the server paused."""
        try:
            return await self._post(url, path, body, timeout_s)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            # ClientConnectorError: no connection at all, the server is down, not racing.
            if path not in IDEMPOTENT_CONTROL or isinstance(exc, aiohttp.ClientConnectorError):
                raise
            log.info("%s%s: the server closed the connection; sending it again", url, path)
            return await self._post(url, path, body, timeout_s)

    async def _post(self, url: str, path: str, body: dict[str, Any], timeout_s: float) -> Any:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        http = self._http(fresh=path in NEW_CONNECTION_CONTROL)
        async with http.post(url + path, json=body, timeout=timeout) as resp:
            payload = await resp.json(content_type=None)
            if resp.status in (401, 403):
                raise RolloutError(f"{url}{path}: {resp.status} {_error_text(payload)}")
            if resp.status != 200:
                raise ServerError(
                    f"{url}{path}: {resp.status} {_error_text(payload)}", resp.status, payload
                )
            return payload

    # --- health ------------------------------------------------------------------------

    async def refresh(self, only_down: bool = False) -> None:
        """Probe servers' /health; record who is alive and which version each holds."""
        targets = [s for s in self.servers.values() if not (only_down and s.alive)]
        await asyncio.gather(*(self._probe(s) for s in targets))

    async def _probe(self, server: Server) -> None:
        timeout = aiohttp.ClientTimeout(total=self.probe_timeout_s)
        try:
            async with self._http().get(server.url + "/health", timeout=timeout) as resp:
                body = await resp.json(content_type=None)
            if not isinstance(body, dict):  # an empty or foreign body: not our server's health
                raise ValueError(f"/health answered {resp.status} with {body!r:.100}")
            server.alive = resp.status == 200
            server.policy_version = body.get("policy_version")
            server.workers = int(body.get("workers", 1))
            server.model = body.get("model")
            server.paused = bool(body.get("paused"))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            server.alive = False

    async def discover(self) -> list[str]:
        """A fixed list of URLs: nothing to re-resolve (FleetDiscovery resolves DNS names)."""
        return []

    def server_versions(self) -> dict[str, int | None]:
        """The policy version each server held when last heard from (None: not synced)."""
        return {url: s.policy_version for url, s in list(self.servers.items())}

    async def fleet_state(self) -> tuple[int, int]:
        """(servers that can serve the current version, live servers that need a sync first).

        Probes only the servers not known to serve the current version (down, never probed,
        or stale), so a healthy fleet costs nothing."""
        targets = [s for s in self.servers.values() if not self._eligible(s)]
        await asyncio.gather(*(self._probe(s) for s in targets))
        ready = sum(self._eligible(s) for s in self.servers.values())
        stale = sum(s.alive and not self._eligible(s) for s in self.servers.values())
        return ready, stale

    def _eligible(self, server: Server) -> bool:
        if not server.alive or server.policy_version is None:
            return False
        return self.policy_version is None or server.policy_version == self.policy_version

    # --- generation --------------------------------------------------------------------

    async def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> RolloutBatch:
        """n completions for each prompt, in prompt order, from whichever servers are up."""
        if any(s.policy_version is None or not s.alive for s in self.servers.values()):
            await self.refresh(only_down=False)
        failed: list[str] = []
        await self._resume_left_paused(failed)
        groups: list[list[Completion]] = [[] for _ in prompts]
        starts = range(0, len(prompts), self.chunk_prompts)
        await asyncio.gather(*(self._run_chunk(prompts, s, params, groups, failed) for s in starts))
        return RolloutBatch([list(p) for p in prompts], groups, servers_failed=failed)

    async def _run_chunk(
        self,
        prompts: Sequence[Sequence[int]],
        start: int,
        params: SamplingParams,
        groups: list[list[Completion]],
        failed: list[str],
    ) -> None:
        chunk = [list(p) for p in prompts[start : start + self.chunk_prompts]]
        work = len(chunk) * params.n
        tried: set[str] = set()
        while True:
            candidates = [
                s for s in self.servers.values() if self._eligible(s) and s.url not in tried
            ]
            if not candidates:
                raise RolloutError(
                    f"no rollout server left for prompts {start}..{start + len(chunk) - 1} "
                    f"(tried {sorted(tried)}; servers: {self._describe()})"
                )
            server = min(candidates, key=lambda s: s.outstanding)
            server.outstanding += work
            try:
                results = await self._complete(server, chunk, start, params)
            except (aiohttp.ClientError, TimeoutError, ServerError, ValueError) as exc:
                log.warning("Rollout server %s failed a request: %s", server.url, exc)
                tried.add(server.url)
                if server.url not in failed:
                    failed.append(server.url)
                await self._probe(server)  # dead, or alive but stale: either way not eligible
                if server.alive and self._eligible(server):
                    server.alive = False  # answered badly while claiming health: bench it
                continue
            finally:
                server.outstanding -= work
            for offset, completions in enumerate(results):
                groups[start + offset] = [
                    Completion(prompt_index=start + offset, **c) for c in completions
                ]
            return

    async def _complete(
        self, server: Server, chunk: list[list[int]], start: int, params: SamplingParams
    ) -> list[list[dict[str, Any]]]:
        """A chunk through vLLM's token-in/token-out route (/inference/v1/generate): one
        request per prompt, each with its own seed (vLLM's /v1/completions would give a
        batched request's prompts one seed, so one random stream, and detokenize every
        token besides)."""
        if server.model is None:
            raise ServerError(f"{server.url} did not name its model on /health")
        return list(
            await asyncio.gather(
                *(
                    self._complete_one(server, prompt, start + i, params.for_prompt(start + i))
                    for i, prompt in enumerate(chunk)
                )
            )
        )

    async def _complete_one(
        self, server: Server, prompt: list[int], index: int, params: SamplingParams
    ) -> list[dict[str, Any]]:
        body = generate_body(server.model or "", prompt, params)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        url = server.url + GENERATE_ROUTE
        async with self._http().post(url, json=body, timeout=timeout) as resp:
            raw = await resp.read()
            version = resp.headers.get(ports.VERSION_HEADER)
        if resp.status == 200:
            return _parse_choices(raw, params.n, version, self.policy_version)
        payload = _json_or_text(raw)
        if resp.status in (401, 403):
            raise RolloutError(f"{url}: {resp.status} {_error_text(payload)}")
        if resp.status == 400:  # the prompt's fault (too long, ...): every server would refuse
            raise RequestRefused(f"{url}: 400 {_error_text(payload)}", index)
        raise ServerError(f"{url}: {resp.status} {_error_text(payload)}", resp.status, payload)

    def _describe(self) -> str:
        return ", ".join(
            f"{s.url} (alive={s.alive}, version={s.policy_version})" for s in self.servers.values()
        )

    # --- weight sync -------------------------------------------------------------------

    async def sync_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | TensorSource, version: int
    ) -> SyncReport:
        """Pause every live server, broadcast the weights once, load them, resume.

        `named_tensors` may be a transformers model's `named_parameters()` or a TensorSource
        that gathers them layer by layer (the learner's ParamStream); fused MoE expert
        tensors are renamed to the checkpoint names the engine loads.
        """
        if self.sync_options is None:
            raise RolloutError("sync_weights needs RolloutClient(..., sync=SyncOptions(...))")
        from gspo_trainer.rollout.weight_sync import CheckpointNamed, tensor_source

        opts = self.sync_options
        tensors = CheckpointNamed(tensor_source(named_tensors))
        if opts.method == "filesystem":
            return await self._sync_files(tensors, version)
        start = time.perf_counter()
        failed: list[str] = []
        for attempt in (1, 2):  # a server lost mid-sync breaks the group: re-form it once
            # Probe everyone: a server that failed the first attempt only because a peer
            # vanished is alive (and unsynced), and must be in the second group.
            await self.refresh()
            live = [s for s in self.servers.values() if s.alive]
            body = {"timeout_s": opts.timeout_s}
            paused = await self._control_all(live, "/control/pause", body, failed)
            try:
                regrouped = await self._ensure_group(paused, failed)
                # _ensure_group formed the group (or raised).
                members = [self.servers[u] for u in self._group.members]  # type: ignore[union-attr]
                bytes_total, bcast_s = await self._update(members, tensors, version, failed)
                break
            except RolloutError:
                if attempt == 2:
                    raise
                log.warning("Weight sync to version %s failed; re-forming the group", version)
            finally:
                await self._resume([s for s in paused if s.alive], failed)
        synced = [s.url for s in members if s.policy_version == version]
        return self._synced(version, synced, bytes_total, start, bcast_s, regrouped or attempt > 1)

    def _synced(
        self,
        version: int,
        synced: list[str],
        bytes_total: int,
        start: float,
        moved_s: float,
        regrouped: bool,
    ) -> SyncReport:
        """Record `version` as the learner's and report who holds it."""
        self.policy_version = version
        return SyncReport(
            version=version,
            servers=synced,
            servers_failed=[u for u in self.servers if u not in synced],
            bytes_total=bytes_total,
            seconds=time.perf_counter() - start,
            broadcast_seconds=moved_s,
            regrouped=regrouped,
        )

    async def _sync_files(
        self, tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> SyncReport:
        """Write the version to the shared volume, then have every live server load it (each
        pauses and drains its own generation around the load; the learner generates nothing
        meanwhile, so no batch sees two versions)."""
        from gspo_trainer.rollout import weight_files

        opts = self.sync_options
        assert opts is not None
        if not opts.directory:
            raise RolloutError("weightSync.method filesystem needs SyncOptions(directory=...)")
        start = time.perf_counter()
        path, bytes_total = await device.to_thread(  # reads (gathers) on the rank's GPU
            weight_files.write_version,
            tensors,
            Path(opts.directory),
            version,
            int(opts.bucket_mb * 2**20),
        )
        failed: list[str] = []
        await self.refresh()
        live = [s for s in self.servers.values() if s.alive]
        if not live:
            raise RolloutError(f"no live rollout server to sync: {self._describe()}")
        t0 = time.perf_counter()
        body = {"name": path.name, "version": version, "timeout_s": opts.timeout_s}
        loaded = await self._control_all(live, "/control/sync/load", body, failed)
        for server in live:
            server.policy_version = version if server in loaded else None
        synced = [s.url for s in loaded]
        return self._synced(version, synced, bytes_total, start, time.perf_counter() - t0, False)

    async def _resume_left_paused(self, failed: list[str]) -> None:
        """Resume the servers a weight sync left paused. Generation and a sync never overlap
        (the collector's fleet lock), so a server that says it is paused here is one whose
        resume failed (the server dropped the connection, say): it would hold every request
        sent to it until its admission timeout, and the step with it."""
        stuck = [s for s in self.servers.values() if s.alive and s.paused]
        for server in stuck:
            log.warning("%s is still paused after a weight sync: resuming it", server.url)
        await self._resume(stuck, failed)

    async def _resume(self, servers: list[Server], failed: list[str]) -> None:
        for server in await self._control_all(servers, "/control/resume", {}, failed):
            server.paused = False

    async def _control_all(
        self, servers: list[Server], path: str, body: dict[str, Any], failed: list[str]
    ) -> list[Server]:
        timeout = float(body.get("timeout_s", self.probe_timeout_s)) + 5
        outcomes = await asyncio.gather(
            *(self._control(s.url, path, body, timeout) for s in servers),
            return_exceptions=True,
        )
        ok = []
        for server, outcome in zip(servers, outcomes, strict=True):
            if isinstance(outcome, RolloutError):
                raise outcome
            if isinstance(outcome, BaseException):
                log.warning("%s%s failed: %s", server.url, path, outcome)
                server.alive = False
                failed.append(server.url)
            else:
                ok.append(server)
        return ok

    async def _ensure_group(self, servers: list[Server], failed: list[str]) -> bool:
        from gspo_trainer.rollout import weight_sync

        members = tuple(s.url for s in servers)
        if self._group is not None and self._group.members == members:
            return False
        self._drop_group(abort=False)  # every regroup ends the group before it
        if not servers:
            raise RolloutError(f"no live rollout server to sync: {self._describe()}")
        opts = self.sync_options
        assert opts is not None
        if self._store is None:
            self._store = await asyncio.to_thread(
                weight_sync.connect_store,
                opts.master_addr,
                opts.master_port,
                is_master=True,
                timeout_s=opts.timeout_s,
            )
        self._generation += 1
        name = f"g{self._generation}-{int(time.time())}"
        world_size = 1 + sum(s.workers for s in servers)
        offsets = [1 + sum(s.workers for s in servers[:i]) for i in range(len(servers))]
        joins = [
            self._post(
                s.url,
                "/control/sync/init",
                {
                    "master_addr": opts.master_addr,
                    "master_port": opts.master_port,
                    "rank_offset": offset,
                    "world_size": world_size,
                    "group_name": name,
                    "backend": opts.backend,
                    "timeout_s": opts.timeout_s,
                },
                opts.timeout_s + 10,
            )
            for s, offset in zip(servers, offsets, strict=True)
        ]
        root = device.to_thread(  # an NCCL group binds to the thread's GPU
            weight_sync.open_group,
            self._store,
            name,
            0,
            world_size,
            backend=opts.backend,
            timeout_s=opts.timeout_s,
        )
        outcomes = await asyncio.gather(root, *joins, return_exceptions=True)
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if errors:
            for s, o in zip(servers, outcomes[1:], strict=True):
                if isinstance(o, BaseException):
                    s.alive = False
                    failed.append(s.url)
            if isinstance(outcomes[0], weight_sync.SyncGroup):  # formed here, not there
                outcomes[0].close(abort=True)
            raise RolloutError(f"forming the weight-sync group failed: {errors[0]}")
        group = outcomes[0]
        assert not isinstance(group, BaseException)  # none raised
        self._group = _Group(
            members, group, weight_sync.WeightSender(group, bucket_mb=opts.bucket_mb)
        )
        log.info("Formed weight-sync group %s with %s", name, ", ".join(members))
        return True

    async def _update(
        self,
        servers: list[Server],
        tensors: TensorSource,
        version: int,
        failed: list[str],
    ) -> tuple[int, float]:
        assert self._group is not None and self.sync_options is not None
        timeout_s = self.sync_options.timeout_s
        sender = self._group.sender
        t0 = time.perf_counter()
        send_ended = threading.Event()

        def send_all() -> Any:
            try:
                return sender.send(tensors, version)
            finally:
                send_ended.set()

        send = device.to_thread(send_all)  # gathers on the rank's GPU
        calls = [
            asyncio.ensure_future(
                self._post(s.url, "/control/sync/update", {"timeout_s": timeout_s}, timeout_s + 10)
            )
            for s in servers
        ]
        for s, call in zip(servers, calls, strict=True):
            # A server that answers with an error before the broadcast finished never joins
            # it: end the send now, not after weightSync.timeoutSeconds (600 s by default).
            call.add_done_callback(functools.partial(_cancel_on_refusal, self._group.group, s.url))
        try:
            outcomes = await asyncio.gather(send, *calls, return_exceptions=True)
        except asyncio.CancelledError:  # the learner stops: nobody waits on this broadcast
            self._group.group.cancel("the learner cancelled the update")
            self._drop_group(abort=True)
            # The sender's thread ends at its next poll; until it has, the learner's ranks
            # could run collectives from two threads (its ZeRO-3 gathers, the caller's
            # ParamStream.finish) and deadlock the other ranks.
            await asyncio.to_thread(send_ended.wait, timeout_s)
            raise
        bcast_s = time.perf_counter() - t0
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        for s, o in zip(servers, outcomes[1:], strict=True):
            if isinstance(o, BaseException):
                s.alive, s.policy_version = False, None
                failed.append(s.url)
            else:
                s.policy_version = int(o["policy_version"])
        if errors:
            self._drop_group(abort=True)  # a broken collective leaves it unusable: re-form it
            raise RolloutError(f"weight update to version {version} failed: {errors[0]}")
        sent = outcomes[0]
        assert not isinstance(sent, BaseException)  # none raised
        return sent.bytes_total, bcast_s


def _cancel_on_refusal(group: SyncGroup, url: str, call: asyncio.Future[Any]) -> None:
    if not call.cancelled() and (exc := call.exception()) is not None:
        group.cancel(f"{url} failed its part of the update: {exc}")


def _error_text(payload: Any) -> str:
    """The message of an error body: ours ({"error": "..."}) or vLLM's
    ({"error": {"message": "..."}})."""
    error = payload.get("error") if isinstance(payload, dict) else payload
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error)


GENERATE_ROUTE = "/inference/v1/generate"  # vLLM's, with --enable-scale-out (serve_command)


def generate_body(model: str, prompt: list[int], params: SamplingParams) -> dict[str, Any]:
    """One prompt's request to vLLM's generate route: token ids in, `n` samples of token ids
    and each sampled token's log-prob out (logprobs 0: the sampled token only), no text."""
    sampling = {
        "n": params.n,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "seed": params.seed,
        "stop_token_ids": list(params.stop_token_ids),
        "logprobs": 0,
        # The learner decodes what it scores itself: vLLM's incremental detokenizer and the
        # log-probs' token strings would be front-end work on the server's core for nothing.
        "detokenize": False,
    }
    return {
        "model": model,
        "token_ids": prompt,
        "sampling_params": sampling,
        "output_mode": "tokens",
    }


class _Step(msgspec.Struct):
    logprob: float


class _Logprobs(msgspec.Struct):
    content: list[_Step]


class _Choice(msgspec.Struct):
    index: int
    token_ids: list[int]
    finish_reason: str | None
    logprobs: _Logprobs


class _Reply(msgspec.Struct):
    """The fields the client reads of a /inference/v1/generate reply (output_mode "tokens",
    logprobs 0): decoded and checked in one pass, about 4x faster than json plus dicts (what
    the learner's process pays per completion: bench/bench_rollout_client.py)."""

    choices: list[_Choice]


_REPLY = msgspec.json.Decoder(_Reply)


def _json_or_text(raw: bytes) -> Any:
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return raw.decode(errors="replace")


def _parse_choices(
    raw: bytes, n: int, version: str | None, expected_version: int | None
) -> list[dict[str, Any]]:
    """One prompt's n completions from a /inference/v1/generate reply (output_mode tokens),
    checked whole and from the expected version (the plugin's header); ServerError if not."""
    if version is None or not version.isdigit():
        raise ServerError(f"no policy version header ({ports.VERSION_HEADER}) on the reply")
    if expected_version is not None and int(version) != expected_version:
        raise ServerError(f"server answered with version {version}, expected {expected_version}")
    try:
        choices = _REPLY.decode(raw).choices
    except msgspec.DecodeError as exc:  # ValidationError included
        shape = f"a reply not of the generate route's shape ({exc}): {raw[:200]!r}"
        raise ServerError(shape) from exc
    if len(choices) != n:
        raise ServerError(f"expected {n} choices, got {len(choices)}: {raw[:200]!r}")
    out = []
    for choice in sorted(choices, key=lambda c: c.index):
        if choice.finish_reason not in ("stop", "length"):
            raise ServerError(f"a completion ended with {choice.finish_reason!r}")
        logprobs = [step.logprob for step in choice.logprobs.content]
        if len(logprobs) != len(choice.token_ids):
            raise ServerError(f"{len(logprobs)} log-probs for {len(choice.token_ids)} tokens")
        out.append(
            {
                "token_ids": choice.token_ids,
                "logprobs": logprobs,
                "finish_reason": choice.finish_reason,
                "policy_version": int(version),
            }
        )
    return out
