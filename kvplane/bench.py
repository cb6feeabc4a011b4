"""`kvplane bench ...`: the benchmark command group. Each component adds its benchmarks here."""

from __future__ import annotations

from typing import Annotated

import typer

from kvplane.cli_common import OutputFormat, OutputOption, emit, usage_error_for

bench_app = typer.Typer(no_args_is_help=True)


@bench_app.command("index")
def bench_index(
    output: OutputOption = OutputFormat.table,
    backend: Annotated[
        str, typer.Option("--backend", help="Index backend URL: memory, redis://..., ...")
    ] = "memory",
    quick: Annotated[bool, typer.Option("--quick", help="About a tenth of the full size.")] = False,
) -> None:
    """The prefix index against Dynamo's RadixTree, and the KVIndexer service."""
    import uvloop

    from indexer.backends import check_backend_url
    from indexer.bench import render_table, run_index_bench

    with usage_error_for("--backend"):
        check_backend_url(backend)

    # The service figures come from a server on this process's loop: uvloop, as
    # `kvplane indexer serve` runs.
    result = uvloop.run(run_index_bench(backend, quick=quick))
    emit(result, output, render_table)


def _register_component_benchmarks() -> None:
    from controller.bench import bench_route
    from controller.e2e_bench import bench_e2e
    from controller.gateway_bench import bench_gateway
    from engine.guided_bench import bench_guided
    from engine.handoff_bench import bench_handoff
    from engine.sim_bench import bench_sim
    from engine.torch_runner.bench import bench_engine  # imports torch only when run
    from planner.bench import bench_planner

    bench_app.command("route")(bench_route)
    bench_app.command("gateway")(bench_gateway)
    bench_app.command("e2e")(bench_e2e)
    bench_app.command("engine")(bench_engine)
    bench_app.command("sim")(bench_sim)
    bench_app.command("handoff")(bench_handoff)
    bench_app.command("guided")(bench_guided)
    bench_app.command("planner")(bench_planner)


_register_component_benchmarks()
