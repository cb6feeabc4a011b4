"""The metrics a dashboard is built from, as the docs name them against what a live fleet's
/metrics serve: one `kvplane up` of every component (an engine, an indexer following it, a
controller with `router.replica_sync` on Redis, a planner with an engine of its own), each
member's /metrics scraped as Prometheus reads it (the text format), once a generation has run
on the engine and through the controller and the planner has sized its pool: labels are read
from series, which a labelled family has none of before its first use. Every family served is
documented (docs/*.md, README.md: its name, `_total` exactly on counters, and its labels as the
docs give them, in braces or a table's labels column; given nowhere: none but the component's
common ones), and every name the docs give is served, but the old names listed under "Renamed
metrics", which must not be."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.foundation.test_up import MEMBER_LINE, _kill_leftovers, _up
from tests.redis_servers import RedisServer, running_redis

REPO = Path(__file__).resolve().parents[2]
COMPONENTS = ("engine", "indexer", "controller", "planner")
# A backticked metric: `kvplane_<component>_...` or, in a component's own doc, `..._rest`.
_QUOTED = re.compile(r"`((?:kvplane_|\.\.\._)[^`]*)`")
_METRICS_LINE = re.compile(r"fleet member (\S+) metrics on (http://\S+)")
_PREFIXES = tuple(f"kvplane_{component}_" for component in COMPONENTS)
# Labels every series of a component has, said once in its docs ("all labelled with model").
_COMMON_LABELS = {"engine": {"model"}}
# The header of a table of metrics whose second column gives each row's labels (planner.md).
_LABELS_TABLE = re.compile(r"\|\s*metric\s*\|\s*labels\s*\|")


def _expand(quoted: str, component: str) -> list[tuple[str, frozenset[str] | None]]:
    """The metric names a quoted mention stands for, each with the labels it gives (None: none
    given): `a_{b,c}_total{x,y}` is a_b_total and a_c_total labelled x and y (a brace after
    `_` is part of the name); a selector's `{k="v"}` gives none; `..._rest` is
    `kvplane_<component>_rest`."""
    text = re.sub(r"\s+", "", quoted)
    if text.startswith("..._"):
        text = f"kvplane_{component}_{text.removeprefix('..._')}"
    names, labels, at = [""], None, 0
    while at < len(text):
        if text[at] == "{":
            end = text.index("}", at)
            inside = text[at + 1 : end]
            if text[at - 1] == "_":
                names = [name + part for name in names for part in inside.split(",")]
                at = end + 1
                continue
            if "=" not in inside:
                labels = frozenset(inside.split(","))
            break
        if not re.match(r"[a-z0-9_]", text[at]):
            break
        names = [name + text[at] for name in names]
        at += 1
    return [(name, labels) for name in names]


def _documented() -> tuple[dict[str, set[frozenset[str] | None]], set[str]]:
    """Every kvplane metric the docs name (name -> the label sets given), and the old names
    of their "Renamed metrics" paragraphs."""
    documented: dict[str, set[frozenset[str] | None]] = {}
    renamed: set[str] = set()
    for path in [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]:
        own = path.stem if path.stem in COMPONENTS else "?"
        for paragraph in path.read_text().split("\n\n"):
            old_names = re.split(r"\sare\snow\s", paragraph)[0]
            is_rename = paragraph.startswith("Renamed metrics")
            for match in _QUOTED.finditer(paragraph):
                for name, labels in _expand(match.group(1), own):
                    if is_rename and match.start() < len(old_names):
                        renamed.add(name)
                    elif name.startswith(_PREFIXES) and not name.endswith("_"):  # `x_*`: many
                        documented.setdefault(name, set()).add(labels)
            for name, labels in _table_rows(paragraph, own):
                documented.setdefault(name, set()).add(labels)
    return documented, renamed


def _table_rows(paragraph: str, component: str) -> list[tuple[str, frozenset[str]]]:
    """Each metric of a `| metric | labels | ... |` table with the labels its row gives (an
    empty cell: none)."""
    lines = paragraph.strip().splitlines()
    if not lines or not _LABELS_TABLE.match(lines[0]):
        return []
    rows = []
    for line in lines[2:]:  # past the header and its rule
        cells = line.split("|")
        labels = frozenset(re.findall(r"`(\w+)`", cells[2]))
        for match in _QUOTED.finditer(cells[1]):
            rows += [(name, labels) for name, _ in _expand(match.group(1), component)]
    return rows


def _served(url: str) -> dict[str, tuple[str, frozenset[str] | None, str]]:
    """Name (a counter's with `_total`, as queried) -> (type, labels (None without series),
    HELP) of every family at `url`, as Prometheus parses the text format."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    served: dict[str, tuple[str, frozenset[str] | None, str]] = {}
    for family in text_string_to_metric_families(text):
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {key for sample in family.samples for key in sample.labels} - {"le"}
        labelled = frozenset(labels) if family.samples else None
        served[name] = (family.type, labelled, family.documentation)
    return served


def _fleet(redis_url: str) -> str:
    return (
        "members:\n"
        "  - {name: engine-0, kind: engine,"
        "     config: {model: sim, metrics_listen: '127.0.0.1:0'}}\n"
        "  - name: indexer\n"
        "    kind: indexer\n"
        "    config:\n"
        "      metrics_listen: '127.0.0.1:0'\n"
        "      sources: [{kind: openengine, target: '${engine-0}', hash: canonical}]\n"
        "  - name: controller\n"
        "    kind: controller\n"
        "    config:\n"
        f"      index: {{backend: '{redis_url}'}}\n"
        "      router: {replica_sync: true}\n"
        "      engines: [{address: '${engine-0}'}]\n"
        "  - name: planner\n"
        "    kind: planner\n"
        "    config:\n"
        "      sla: {ttft_ms: 1000, itl_ms: 40}\n"
        "      pools: [{name: default, min_engines: 1, max_engines: 1}]\n"
        "      live: {metrics_listen: '127.0.0.1:0', engine_args: ['--model', 'sim']}\n"
    )


@pytest.fixture(scope="module")
def redis_of_its_own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """An empty redis-server for the fleet, not the session's (which earlier tests wrote)."""
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, redis_of_its_own: RedisServer
) -> dict[str, dict[str, tuple[str, frozenset[str] | None, str]]]:
    """Member name -> its /metrics' families, scraped from a running fleet."""
    tmp_path = tmp_path_factory.mktemp("fleet")
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(_fleet(redis_of_its_own.url))
    proc = _up(fleet, tmp_path)
    members: dict[str, tuple[str, int]] = {}  # name -> (address, pid)
    urls: dict[str, str] = {}
    said: list[str] = []  # up's stderr so far, for the failure's message
    try:
        assert proc.stderr is not None
        while len(urls) < len(COMPONENTS):  # up names each member, then its /metrics
            line = proc.stderr.readline()
            said.append(line)
            assert line or proc.poll() is None, "kvplane up ended before its fleet served:\n" + (
                "".join(said[-40:])
            )
            if match := MEMBER_LINE.search(line):
                members[match.group(1)] = (match.group(3), int(match.group(4)))
            if match := _METRICS_LINE.search(line):
                urls[match.group(1)] = match.group(2)
        _generate(members["engine-0"][0])
        _generate(members["controller"][0])
        _wait_for_series(urls["planner"], "kvplane_planner_engines_wanted")
        return {name: _served(url) for name, url in urls.items()}
    finally:
        proc.send_signal(signal.SIGINT)  # up stops the planner (and its engine), then the rest
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
        _kill_leftovers(proc, [pid for _, pid in members.values()])


def _generate(address: str) -> None:
    """One generation at `address` (an engine or the controller), run to its end."""
    request = pb.GenerateRequest(
        request_id=f"metrics-{address}",
        model="sim",
        token_ids=pb.TokenIds(ids=list(range(1, 33))),
        stopping=pb.StoppingOptions(max_tokens=4, ignore_eos=True),
    )
    with grpc.insecure_channel(address) as channel:
        replies = list(pb_grpc.OpenEngineStub(channel).Generate(request, timeout=60))
    assert replies and replies[-1].WhichOneof("event") == "finished", replies[-1:]


def _wait_for_series(url: str, name: str) -> None:
    """Until the family `name` at `url` has a series (a gauge its component sets later)."""
    deadline = time.monotonic() + 60
    while _served(url)[name][1] is None:
        assert time.monotonic() < deadline, f"no series of {name} at {url}"
        time.sleep(0.2)


def _component(name: str) -> str:
    return name.split("_")[1]


@pytest.mark.timeout(180)
def test_every_served_metric_is_documented_with_its_type_and_labels(
    served: dict[str, dict[str, tuple[str, frozenset[str] | None, str]]],
) -> None:
    documented, _ = _documented()
    problems = []
    for member, families in served.items():
        if "process_start_time_seconds" not in families:  # the standard process_* metrics
            problems.append(f"{member}: no process_start_time_seconds")
        for name, (kind, labels, _) in sorted(families.items()):
            if name.startswith("process_"):
                continue
            if name not in documented:
                problems.append(f"{member}: {name} ({kind}) is not documented")
                continue
            if name.endswith("_total") != (kind == "counter"):
                problems.append(f"{member}: {name} is a {kind}")
            common = frozenset(_COMMON_LABELS.get(_component(name), set()))
            # Labels given nowhere: the metric has none but its component's common ones.
            given = {g | common for g in documented[name] if g is not None} or {common}
            if labels is None:  # no series to read them from
                continue
            problems.extend(
                f"{member}: {name}{set(labels)}, documented {set(g)}" for g in given if g != labels
            )
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(180)
def test_every_documented_metric_is_served_and_renamed_ones_are_not(
    served: dict[str, dict[str, tuple[str, frozenset[str] | None, str]]],
) -> None:
    documented, renamed = _documented()
    every = {name for families in served.values() for name in families}
    assert renamed  # the parsing still finds them
    missing = sorted(set(documented) - every)
    assert not missing, "\n".join(missing)
    assert sorted(renamed & every) == []


@pytest.mark.timeout(180)
def test_the_gateways_request_counters_say_they_count_generations_only(
    served: dict[str, dict[str, tuple[str, frozenset[str] | None, str]]],
) -> None:
    """`requests_total` and `route_decisions_total` count generations; an SRE reading their
    HELP ("Gateway requests") took Embed, Classify and Score to be among them."""
    controller = served["controller"]
    for name in ("kvplane_controller_requests_total", "kvplane_controller_route_decisions_total"):
        help_text = controller[name][2]
        assert "Generations" in help_text or "generations" in help_text, help_text
        assert "pooling tasks" in help_text, help_text
