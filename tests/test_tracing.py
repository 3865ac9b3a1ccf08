"""One run is one trace: a two-step run with two train ranks and two engines, its span tree as
written to traces.jsonl, and the same spans received over OTLP/HTTP on loopback by a receiver
that decodes the protobuf payload (the standard exporter, set up only by OTEL_* variables)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from .conftest import TRACED_ENGINES as ENGINES
from .conftest import TRACED_RANKS as RANKS
from .conftest import TRACED_STEPS as STEPS
from .conftest import read_jsonl


def _tree(spans: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    by_id = {s["span_id"]: s for s in spans}
    children: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in spans:
        if s["parent_span_id"]:
            children[s["parent_span_id"]].append(s)
    return by_id, children


def _service(span: dict[str, Any]) -> str:
    return str(span["resource"]["service.name"])


def _under(children: dict[str, list[dict[str, Any]]], span: dict[str, Any], name: str) -> list:
    return [c for c in children[span["span_id"]] if c["name"] == name]


def test_the_span_tree_of_a_two_step_run(traced_run: tuple[Path, list[Any]]) -> None:
    spans = read_jsonl(traced_run[0] / "traces.jsonl")
    by_id, children = _tree(spans)
    assert len({s["trace_id"] for s in spans}) == 1  # one run, one trace
    orphans = [s["name"] for s in spans if s["parent_span_id"] and s["parent_span_id"] not in by_id]
    assert not orphans, f"spans whose parent is missing: {orphans}"
    (root,) = [s for s in spans if not s["parent_span_id"]]
    assert (root["name"], _service(root)) == ("miles.run", "miles.controller")

    steps = _under(children, root, "miles.step")
    assert sorted(s["attributes"]["step"] for s in steps) == [0, 1]
    for step in steps:
        n = step["attributes"]["step"]
        assert {_service(s) for s in _under(children, step, "miles.take")} == {
            "miles.rollout_manager"
        }
        # Every train rank trains under the controller's step, and recomputes logprobs inside.
        trains = _under(children, step, "miles.train_step")
        assert sorted(_service(t) for t in trains) == list(RANKS), n
        for t in trains:
            assert t["attributes"]["step"] == n
            assert _under(children, t, "miles.logprobs")
        # The weight sync: every rank sends, every engine receives, under the step's sync span.
        (sync,) = _under(children, step, "miles.weight_sync")
        assert sorted(
            _service(s) for s in _under(children, sync, "miles.weight_sync.send")
        ) == list(RANKS)
        received = _under(children, sync, "miles.weight_sync.receive")
        assert sorted(_service(s) for s in received) == list(ENGINES)

    # Rollouts are produced in the background of the run (the buffer decides when a batch
    # starts): one per step, in the rollout manager, with every engine generating under them.
    rollouts = _under(children, root, "miles.rollout")
    assert sorted(r["attributes"]["step"] for r in rollouts) == [0, 1]
    engines_seen = set()
    for rollout in rollouts:
        assert _service(rollout) == "miles.rollout_manager"
        groups = _under(children, rollout, "miles.rollout_group")
        assert len(groups) == 4  # rollout.prompts_per_step
        assert len(_under(children, rollout, "miles.reward")) == 4
        for group in groups:
            engines_seen |= {_service(g) for g in _under(children, group, "miles.generate")}
    assert engines_seen == set(ENGINES)

    checkpoints = _under(children, root, "miles.checkpoint")
    assert len(checkpoints) == STEPS
    for ckpt in checkpoints:
        ranks = _under(children, ckpt, "miles.checkpoint.train")
        assert sorted(_service(r) for r in ranks) == list(RANKS)

    # Children start inside their parents (one clock: every actor runs on this machine).
    for s in spans:
        if s["parent_span_id"]:
            assert s["start_ns"] >= by_id[s["parent_span_id"]]["start_ns"], s["name"]


def test_the_same_spans_arrive_over_otlp_http(traced_run: tuple[Path, list[Any]]) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    run_dir, bodies = traced_run
    assert bodies, "no OTLP request reached the receiver"
    received: dict[str, tuple[str, str, str]] = {}
    for path, content_type, body in bodies:
        assert path == "/v1/traces" and content_type == "application/x-protobuf"
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}[
                "service.name"
            ]
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    received[s.span_id.hex()] = (s.trace_id.hex(), s.name, service)
    written = {s["span_id"]: (s["trace_id"], s["name"], _service(s)) for s in read_jsonl(
        run_dir / "traces.jsonl"
    )}  # fmt: skip
    # Every process's exporter flushed before the run ended: the collector saw every span.
    assert received == written
    assert {service for _, _, service in received.values()} >= {
        "miles.controller", "miles.rollout_manager", *RANKS, *ENGINES,
    }  # fmt: skip
