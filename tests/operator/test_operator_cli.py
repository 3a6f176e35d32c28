"""`gspo operator` takes the flags the Helm chart's Deployment passes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gspo_api import ports
from gspo_operator.run import parse_args

REPO = Path(__file__).resolve().parents[2]


def test_chart_arguments_parse() -> None:
    template = (REPO / "charts/gspo-operator/templates/deployment.yaml").read_text()
    flags = set(re.findall(r"- (--[a-z-]+)", template))
    assert flags == {
        "--log-level",
        "--metrics-port",
        "--progress-writes-per-minute",
        "--namespace",
        "--all-namespaces",
        "--leader-elect",
        "--leader-election-namespace",
        "--leader-election-id",
    }
    args = parse_args(["--log-level=info", "--metrics-port=9000", "--namespace=a", "--namespace=b"])
    assert (args.log_level, args.metrics_port, args.namespace) == ("info", 9000, ["a", "b"])
    assert parse_args(["--all-namespaces"]).all_namespaces
    elect = parse_args(
        ["--leader-elect", "--leader-election-namespace=ops", "--leader-election-id=gspo"]
    )
    assert (elect.leader_elect, elect.leader_election_namespace) == (True, "ops")
    assert elect.leader_election_id == "gspo"
    defaults = parse_args([])
    assert defaults.metrics_port == ports.OPERATOR_METRICS_PORT
    assert defaults.health_port == ports.OPERATOR_HEALTH_PORT


def test_namespace_and_all_namespaces_exclude_each_other() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--namespace=a", "--all-namespaces"])
