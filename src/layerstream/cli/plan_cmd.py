"""`layerstream plan MODEL`: print what offload would do with each component, without enabling anything. The plan
is made on the pipeline's skeleton (`layerstream.models.skeleton`), so no weight is read (a Hub id's configs and
headers come from the Hub); only ``--measure`` needs the weights, and a lossless DiT reads a sample of them."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from layerstream.cli.common import CliError, add_config_argument, add_model_arguments, add_work_cap_argument, component_files, parse_config_arg
from layerstream.cli.plan_machine import add_machine_arguments, lossless_fraction, planned_generation_of, run_machine_plan, wants_machine_plan
from layerstream.plan.resolved import ResolvedComponent, ResolvedOffloadPlan
from layerstream.wording import format_bytes

_COLUMNS = ("component", "category", "source", "action", "blocks", "max block", "streamed", "resident")
_NUMERIC = frozenset({"blocks", "max block", "streamed", "resident"})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of the ``plan`` subcommand."""
    add_model_arguments(
        parser,
        'a Hugging Face Hub id (planned from its metadata: nothing is downloaded; without the Hub, a published model '
        "from layerstream's catalogue of their dimensions), a local diffusers-format folder, "
        'or an embedded tiny model ("tiny-wan")',
    )
    parser.add_argument(
        "--download", action="store_true",
        help="with a Hub id and --measure: download the model first (--measure runs its weights)",
    )  # fmt: skip
    add_config_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the resolved plan as JSON instead of a table")
    add_work_cap_argument(parser)
    add_machine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Resolve the plan for ``args.model`` and print it; user errors raise `CliError` (exit code 2)."""
    if wants_machine_plan(args):  # --device-memory and --host-memory: the plan for that machine
        pipeline, origin = _weights(args) if args.measure else _skeleton(args)
        _print_origin(origin, args.json)
        return run_machine_plan(args, pipeline, origin)
    if args.download:
        raise CliError("--download: only used with --measure (a plan needs no weights; --measure runs them)")
    config = parse_config_arg(args.diffusion_offload_config)  # before loading: a bad config fails fast
    pipeline, origin = _skeleton(args)

    # imported here, not at the top: the parser imports every subcommand, and `--help` should not load torch
    from layerstream.plan.offload_plan import OffloadPlanError
    from layerstream.plan.resolved import OffloadPlanResolutionError
    from layerstream.plan.resolver import resolve_offload_plan

    try:
        plan = resolve_offload_plan(pipeline, config)
    except (OffloadPlanResolutionError, OffloadPlanError) as e:
        raise CliError(_one_line(e)) from e
    from layerstream.runtime.packing.lossless_code import ESTIMATED, pricing_at

    generation, work = planned_generation_of(args, pipeline)  # what host budget "auto" keeps a reserve for
    coded = any(c.storage_dtype == "lossless" for c in plan.streamed)
    fraction = lossless_fraction(pipeline, origin, args.variant) if coded else ESTIMATED
    with pricing_at(fraction):  # a skeleton's lossless blocks: the checkpoint's sampled figure where it was read
        placement, why_not = _placement(pipeline, plan, generation)
    residency = residency_lines(plan, placement, why_not)
    if args.json:
        placed = placement.to_dict() if placement is not None else {"undecided": why_not}
        document = {**plan.to_dict(), "generation": generation.to_dict(), "placement": placed, "residency": residency}
        priced = {"lossless_fraction": dataclasses.asdict(fraction)} if coded else {}
        print(json.dumps({**document, "model_source": origin, **priced}, indent=2))
    else:
        _print_origin(origin, False)
        print(format_plan(plan, placement))
        if coded:
            print(f"lossless priced at {fraction.describe()}")
        print(work)
        if residency:
            print("residency:")
            for path, text in residency.items():
                print(f"  {path}: {text}")
        if placement is not None and placement.host_budget is not None:  # "auto": what it chose, and from what
            print(f"host budget: {placement.host_budget.describe()}")
        if placement is not None and placement.host_tier is not None:
            print("\n".join(host_tier_lines(plan, placement)))
    return 0


def _placement(pipeline: Any, plan: ResolvedOffloadPlan, generation):
    """(the placement enabling would use for `generation`, ""), or (None, why it is decided later)."""
    from layerstream.errors import OffloadError
    from layerstream.offload import plan_placement

    if plan.config.mode != "layer":
        return None, "module mode streams no blocks"
    try:
        return plan_placement(pipeline, plan, generation=generation), ""
    except OffloadError as e:  # "auto" on a machine without device memory to read and no budget given
        return None, _one_line(e)


def residency_lines(plan: ResolvedOffloadPlan, placement, why_not: str = "") -> dict[str, str]:
    """Per streamed DiT with resident_layers: what enabling keeps resident, and why."""
    asked = [c for c in plan.streamed if c.category == "dit" and c.resident_layers != 0]
    if placement is None:
        return {c.display_path: f"decided at enable time: {why_not}" for c in asked}
    return {c.display_path: placement.residency[c.path].describe() for c in asked}


def host_tier_lines(plan: ResolvedOffloadPlan, placement) -> list[str]:
    """Which streamed blocks live in host memory and which on disk (with `host_budget_gb`), and why."""
    tier = placement.host_tier
    sizes = placement.block_slot_nbytes
    lines = [f"host tier: {tier.reason}"]
    for comp in plan.streamed:
        mine = [p for c in placement.chains if c.component == comp.path for p in c.block_paths]
        on_disk = [p for p in mine if tier.on_disk(p)]
        pooled = [p for p in mine if tier.pooled(p)]
        on_host = [p for p in mine if not tier.on_disk(p) and not tier.pooled(p)]
        if mine:
            in_pool = f", {len(pooled)} in the host pool ({format_bytes(sum(sizes[p] for p in pooled))})" if pooled else ""
            lines.append(
                f"  {comp.display_path}: {len(on_host)} blocks on the host ({format_bytes(sum(sizes[p] for p in on_host))})"
                f"{in_pool}, {len(on_disk)} on disk ({format_bytes(sum(sizes[p] for p in on_disk))})"
            )
        if on_disk:
            lines.append(f"    on disk: {', '.join(on_disk)}")
    if tier.pool is not None:
        lines.append(
            f"  host pool: {len(tier.pool.entries)} entries, {format_bytes(tier.pool.nbytes)}, shared by "
            f"{' and '.join(tier.pool.members)}: entry j holds the j-th pooled block of whichever runs"
        )
    return lines


def _skeleton(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """(the pipeline's skeleton, where its metadata came from), by `load_skeleton`."""
    from layerstream.models import loading

    try:
        return loading.load_skeleton(args.model, revision=args.revision, variant=args.variant, components=component_files(args))
    except loading.ModelLoadError as e:
        raise CliError(_one_line(e)) from e


def _weights(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """(the pipeline with its weights, where they came from), for --measure."""
    from layerstream.models import loading
    from layerstream.models.hub import names_hub_repo

    cache_only = names_hub_repo(args.model) and not args.download
    try:  # a Hub id without --download: only what the cache holds, since --measure downloads nothing unasked
        source = loading.resolve_model(
            args.model, revision=args.revision, variant=args.variant, offline=cache_only, from_files=frozenset(component_files(args))
        )
        return loading.load_pipeline(source, components=component_files(args)), source.to_dict()
    except loading.ModelLoadError as e:
        if cache_only:
            raise CliError(f"--measure runs the model's weights and {args.model} is not downloaded: add --download to fetch it") from e
        raise CliError(_one_line(e)) from e


def _print_origin(origin: dict[str, Any], as_json: bool) -> None:
    """Where a Hub id was planned from its metadata or the catalogue: say so, and what a download is."""
    if as_json:
        return
    if origin.get("origin") == "catalogue":
        print(f"{origin['model']}: planned from {origin['from']}, nothing downloaded")
        return
    if "download_bytes" not in origin:
        return
    print(
        f"{origin['model']} @ {origin['revision']} (commit {origin['commit']}): planned from {origin['from']}, nothing "
        f"downloaded; the download is {format_bytes(origin['total_download_bytes'])} "
        f"({format_bytes(origin['download_bytes'])} not yet in the cache)"
    )


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def format_plan(plan: ResolvedOffloadPlan, placement=None) -> str:
    """The resolved plan as a table: one row per component, totals, and the device estimate."""
    config = plan.config
    rows = [_row(comp, placement) for comp in plan.components]
    rows += [_skipped_row(a.path, "declared", "declared, absent") for a in plan.absent]  # an optional one left None
    rows += [_skipped_row(u.path, "undeclared", "undeclared, untouched") for u in plan.untouched]  # in no total
    streamed = sum(_split_bytes(c, placement)[0] for c in plan.components)
    resident = sum(_split_bytes(c, placement)[1] for c in plan.components)
    totals = {"component": "total", "streamed": format_bytes(streamed), "resident": format_bytes(resident)}
    rows.append(dict.fromkeys(_COLUMNS, "") | totals)

    lines = [f"{plan.pipeline_class}: mode {config.mode!r}, components {', '.join(config.components)}", ""]
    lines += _table(rows)
    lines.append("")
    lines.append("why:")
    paths = [c.display_path for c in plan.components] + [a.path for a in plan.absent] + [u.path for u in plan.untouched]
    width = max(map(len, paths), default=0)
    lines += [f"  {c.display_path:<{width}}  {c.action}: {c.reason}" for c in plan.components if c.reason]
    lines += [f"  {a.path:<{width}}  declared, absent: declared in {a.declared_in}, but {a.why}; skipped" for a in plan.absent]
    lines += [
        f"  {u.path:<{width}}  undeclared, untouched: the pipeline declares its roles (_dit_modules, _encoder_modules, "
        "_vae_modules) and names it in none of its declarations; enabling leaves it where it is"
        for u in plan.untouched
    ]
    lines.append("")
    lines.append("streamed: bytes kept on the host and copied in when needed (blocks; whole components in module mode)")
    lines.append("resident: bytes kept on the device")
    if placement is not None and placement.num_slots:
        lines.append(
            f"device estimate: resident {format_bytes(resident)} + {placement.num_slots} slots x "
            f"{format_bytes(placement.slot_nbytes)} (largest streamed block, as packed) = "
            f"{format_bytes(resident + placement.ring_nbytes)}"
        )
    return "\n".join(lines)


def _row(comp: ResolvedComponent, placement=None) -> dict[str, str]:
    streamed, resident = _split_bytes(comp, placement)
    all_blocks = [b for stack in comp.stacks for b in stack.block_bytes]
    blocks = str(comp.num_blocks) if comp.stacks else "-"
    if comp.action == "stream" and comp.resident_layers != 0:
        kept = len(placement.resident_block_paths(comp.path)) if placement is not None else comp.resident_layers
        blocks += f" ({kept} resident)"
    return {
        "component": comp.display_path,
        "category": comp.category,
        "source": comp.source,
        "action": comp.action,
        "blocks": blocks,
        "max block": format_bytes(max(all_blocks)) if all_blocks else "-",
        "streamed": format_bytes(streamed),
        "resident": format_bytes(resident),
    }


def _skipped_row(path: str, source: str, action: str) -> dict[str, str]:
    return dict.fromkeys(_COLUMNS, "-") | {"component": path, "source": source, "action": action}


def _split_bytes(comp: ResolvedComponent, placement=None) -> tuple[int, int]:
    """(streamed, resident) bytes of a component (no placement: every block of a stream streams)."""
    if comp.action in ("swap", "on_demand"):
        return comp.total_bytes, 0
    if comp.action != "stream":
        return 0, comp.total_bytes
    kept = set(placement.resident_block_paths(comp.path)) if placement is not None else set()
    streamed = sum(n for s in comp.stacks for p, n in zip(s.block_paths, s.block_bytes) if p not in kept)
    return streamed, comp.total_bytes - streamed


def _table(rows: list[dict[str, str]]) -> list[str]:
    widths = {col: max(len(col), *(len(r[col]) for r in rows)) for col in _COLUMNS}

    def line(cells: dict[str, str]) -> str:
        parts = [cells[c].rjust(widths[c]) if c in _NUMERIC else cells[c].ljust(widths[c]) for c in _COLUMNS]
        return "  ".join(parts).rstrip()

    header = line({c: c for c in _COLUMNS})
    return [header, "-" * len(header), *(line(r) for r in rows[:-1]), "-" * len(header), line(rows[-1])]
