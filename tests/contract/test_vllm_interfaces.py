"""The vLLM interfaces the rollout server's plugin and worker extension use, checked against
the installed vLLM: when an upgrade moves one, this fails here, by name, before any server
is started. The version is the one docker/versions.env pins for the images too."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def pinned(key: str) -> str:
    for line in (REPO / "docker" / "versions.env").read_text().splitlines():
        if line.startswith(f"{key}="):
            return line.partition("=")[2].strip()
    raise AssertionError(f"{key} is not in docker/versions.env")


def test_the_installed_vllm_is_the_pinned_one() -> None:
    from gspo_trainer.rollout.vllm_flags import installed_vllm

    installed = installed_vllm()
    assert installed and set(installed.values()) == {pinned("VLLM_VERSION")}, installed


def test_the_plugin_is_an_endpoint_plugin_under_its_entry_point() -> None:
    from vllm.plugins.endpoint_plugins.interface import EndpointPlugin

    from gspo_trainer.rollout.serve_command import PLUGIN_NAME
    from gspo_trainer.rollout.vllm_plugin import GSPOEndpoints

    (entry,) = [
        e
        for e in importlib.metadata.entry_points(group="vllm.endpoint_plugins")
        if e.name == PLUGIN_NAME
    ]
    assert entry.load() is GSPOEndpoints
    assert isinstance(GSPOEndpoints(), EndpointPlugin)
    assert GSPOEndpoints.required_tasks == ("generate",)


def test_the_engine_client_has_what_the_plugin_calls() -> None:
    from vllm.engine.protocol import EngineClient

    for name in ("collective_rpc", "reset_prefix_cache", "check_health"):
        assert inspect.iscoroutinefunction(getattr(EngineClient, name)), name
    assert callable(EngineClient.generate)  # an async iterator of outputs (warm_up)
    params = inspect.signature(EngineClient.collective_rpc).parameters
    assert {"method", "timeout", "kwargs"} <= set(params)


def test_the_server_takes_every_flag_the_command_line_gives() -> None:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from gspo_trainer.rollout.serve_command import SERVER_MODULE, ServeOptions, serve_argv

    assert importlib.util.find_spec(SERVER_MODULE) is not None
    opts = ServeOptions(
        model="m",
        served_name="builtin:tiny",
        max_model_len=128,
        enforce_eager=True,
        engine_args={"seed": 0, "enable_prefix_caching": True},
    )
    argv = serve_argv(opts)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
    assert args.worker_extension_cls.endswith("WeightSyncExtension")
    assert args.logprobs_mode == "processed_logprobs" and args.enforce_eager
    assert args.served_model_name == ["builtin:tiny"] and args.seed == 0
    assert args.enable_chunked_prefill is None  # vLLM's own default where the build allows it

    # The CPU build: no chunked prefill (a seeded prompt split over two steps kills its
    # engine), unless engineArgs says otherwise.
    cpu = dataclasses.replace(opts, chunked_prefill=False)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(serve_argv(cpu)[3:])
    assert args.enable_chunked_prefill is False
    unset = dataclasses.replace(cpu, engine_args={"enable_chunked_prefill": None})
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(serve_argv(unset)[3:])
    assert args.enable_chunked_prefill is False  # null leaves vLLM's default: on
    chosen = dataclasses.replace(cpu, engine_args={"enable_chunked_prefill": True})
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(serve_argv(chosen)[3:])
    assert args.enable_chunked_prefill is True


def test_the_generate_route_takes_the_clients_request_and_answers_what_it_reads() -> None:
    """The client's body validates as vLLM's GenerateRequest (token_ids and sampling_params
    are required there: a rename fails here) with the sampling the client asked for; a reply
    vLLM's own response models serialize reads back through the client's decoder; the route
    is where the client posts."""
    from vllm.entrypoints.scale_out.token_in_token_out import api_router, protocol

    from gspo_trainer.rollout.client import GENERATE_ROUTE, _parse_choices, generate_body
    from gspo_trainer.rollout.types import SamplingParams

    params = SamplingParams(
        n=2, max_tokens=3, temperature=0.7, top_p=0.9, seed=11, stop_token_ids=(1,)
    )
    request = protocol.GenerateRequest.model_validate(generate_body("m", [3, 4], params))
    sampling = request.sampling_params
    assert request.token_ids == [3, 4] and request.output_mode == "tokens"
    assert (sampling.n, sampling.max_tokens, sampling.seed, sampling.logprobs) == (2, 3, 11, 0)
    assert sampling.temperature == 0.7 and sampling.stop_token_ids == [1]
    assert sampling.detokenize is False  # vLLM builds no text nor token strings for it
    assert GENERATE_ROUTE in {route.path for route in api_router.router.routes}

    def choice(k: int) -> protocol.GenerateTokensChoice:
        content = [
            protocol.GenerateLogProbsContent(token_id=10 * k + t, logprob=-0.5 * t)
            for t in range(3)
        ]
        return protocol.GenerateTokensChoice(
            index=k,
            finish_reason="length",
            token_ids=[10 * k + t for t in range(3)],
            logprobs=protocol.GenerateLogProbs(content=content),
        )

    reply = protocol.GenerateTokensResponse(model="m", choices=[choice(1), choice(0)])
    out = _parse_choices(reply.model_dump_json().encode(), 2, "5", 5)
    assert [c["token_ids"] for c in out] == [[0, 1, 2], [10, 11, 12]]
    assert out[1]["logprobs"] == [0.0, -0.5, -1.0] and out[0]["policy_version"] == 5


def test_the_launcher_knows_the_platform_vllm_picks() -> None:
    """`gspo rollout-server` reads vLLM's platform from the installed distributions (no torch
    in a process that execs vLLM): the answer vLLM's own detection gives here."""
    from vllm.platforms import current_platform

    from gspo_trainer.rollout.launch import vllm_runs_on_cpu

    assert vllm_runs_on_cpu(dict(os.environ)) == current_platform.is_cpu()
