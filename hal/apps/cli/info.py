"""``hal info``: which device kind resolves here, its backend, every known kind and every checkpoint engine
with its availability (and the reason when unavailable)."""

from __future__ import annotations

import dataclasses
import json
import sys
from importlib import metadata
from typing import Any

import hal
from hal.apps.cli.helptext import flowing_help


@flowing_help
@dataclasses.dataclass
class Info:
    """Show the resolved device kind, its collective backend and visible-devices variable, the torch
    (and vendor plugin) versions, and every known kind with available / reason."""

    device: str | None = None
    """Kind to resolve (default: $HAL_DEVICE, else the first available)."""
    json: bool = False
    """Print one JSON object instead of a table."""


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def collect(device: str | None = None) -> dict[str, Any]:
    """The facts ``hal info`` prints, as plain data. Raises what :func:`hal.resolve_device` raises."""
    import torch

    import ckpt

    spec = hal.resolve_device(device)
    kinds = [hal.describe(k) for k in hal.known_kinds()]
    return {
        "device": spec.kind,
        "device_name": spec.name,
        "dist_backend": spec.dist_backend,
        "visible_devices_env": spec.visible_devices_env,
        "ray_resource": spec.ray_resource,
        "torch": torch.__version__,
        "vendor_packages": {k["vendor_package"]: _version(k["vendor_package"])
                            for k in kinds if k["vendor_package"]},
        "python": sys.version.split()[0],
        "kinds": kinds,
        "plugin_errors": hal.plugin_errors(),
        "checkpoint_engines": ckpt.checkpoint_engine_status(spec.kind),
    }


def run(args: Info) -> int:
    info = collect(args.device)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # piped or logged: do not squeeze the table into 80 columns
        console = Console(width=140)
    console.print(f"[bold]device[/bold] {info['device']} (torch.device type {info['device_name']!r})  "
                  f"[bold]backend[/bold] {info['dist_backend']}  "
                  f"[bold]visible devices[/bold] {info['visible_devices_env'] or '-'}")
    vendors = "  ".join(f"{name} {version or '-'}" for name, version in info["vendor_packages"].items())
    console.print(f"torch {info['torch']}  {vendors}  python {info['python']}")
    table = Table("kind", "device", "backend", "visible devices", "available", "reason")
    for k in info["kinds"]:
        table.add_row(k["kind"], k["name"], k["dist_backend"], k["visible_devices_env"] or "-",
                      f"yes ({k['device_count']})" if k["available"] else "no", k["reason"])
    console.print(table)
    engines = Table("checkpoint engine", "available", "reason")
    for e in info["checkpoint_engines"]:
        engines.add_row(e["name"], "yes" if e["available"] else "no", e["reason"])
    console.print(engines)
    for name, err in info["plugin_errors"].items():
        console.print(f"[red]plugin {name!r} failed to load:[/red] {err}")
    return 0
