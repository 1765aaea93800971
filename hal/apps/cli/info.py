"""``hal info``: the device kind that resolves here, its backend, every kind and checkpoint engine with its
availability."""

from __future__ import annotations

import dataclasses
import json
import sys
from importlib import metadata
from typing import Annotated, Any

import hal
from hal.errors import HalError
from hal.apps.cli.helptext import DEVICE_DEFAULT, flowing_help, optional


@flowing_help
@dataclasses.dataclass
class Info:
    """Show the resolved device kind, its collective backend and visible-devices variable, the torch
    (and vendor plugin) versions, and every known kind with available / reason."""

    device: Annotated[str | None, optional("KIND", DEVICE_DEFAULT)] = None
    """Kind to resolve (npu, cuda, cpu, npu-sim, a plugin kind)."""
    json: bool = False
    """Print one JSON object instead of a table."""


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def collect(device: str | None = None) -> dict[str, Any]:
    """The facts ``hal info`` prints, as plain data; where the kind asked for is unusable, ``device`` is ``None``
    and ``device_error`` says why."""
    import torch

    import ckpt

    try:
        spec, error = hal.resolve_device(device), None
    except HalError as exc:
        spec, error = None, str(exc)
    kinds = [hal.describe(k) for k in hal.known_kinds()]
    return {
        "device": spec and spec.kind,
        "device_error": error,
        "device_name": spec and spec.name,
        "dist_backend": spec and spec.dist_backend,
        "visible_devices_env": spec and spec.visible_devices_env,
        "ray_resource": spec and spec.ray_resource,
        "auto_order": [k["kind"] for k in kinds if k["auto_probe"]],
        "torch": torch.__version__,
        "vendor_packages": {k["vendor_package"]: _version(k["vendor_package"])
                            for k in kinds if k["vendor_package"]},
        "python": sys.version.split()[0],
        "kinds": kinds,
        "plugin_errors": hal.plugin_errors(),
        "checkpoint_engines": ckpt.checkpoint_engine_status(spec.kind) if spec else [],
    }


def run(args: Info) -> int:
    """``hal info``: print :func:`collect`'s facts; exit status 0, or 2 when the kind asked for cannot be used."""
    info = collect(args.device)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0 if info["device"] else 2
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # piped or logged: do not squeeze the table into 80 columns
        console = Console(width=140)
    if info["device"]:
        console.print(f"[bold]device[/bold] {info['device']} (torch.device type {info['device_name']!r})  "
                      f"[bold]backend[/bold] {info['dist_backend']}  "
                      f"[bold]visible devices[/bold] {info['visible_devices_env'] or '-'}")
    else:
        console.print(f"[bold]device[/bold] [red]none[/red]: {info['device_error']}")
    vendors = "  ".join(f"{name} {version or '-'}" for name, version in info["vendor_packages"].items())
    console.print(f"torch {info['torch']}  {vendors}  python {info['python']}")
    table = Table("kind", "device", "backend", "visible devices", "available", "auto", "reason",
                  caption="auto: the order automatic resolution tries the kinds in (no --device and no "
                          "$HAL_DEVICE; the first available is used); 'named': used only when named")
    order = {kind: i + 1 for i, kind in enumerate(info["auto_order"])}
    for k in info["kinds"]:
        auto = str(order[k["kind"]]) if k["kind"] in order else "named"
        if k["kind"] == info["device"]:
            auto += " <- resolved"
        table.add_row(k["kind"], k["name"], k["dist_backend"], k["visible_devices_env"] or "-",
                      f"yes ({k['device_count']})" if k["available"] else "no", auto, k["reason"])
    console.print(table)
    if info["checkpoint_engines"]:  # judged on the resolved kind: none without one
        engines = Table("checkpoint engine", "available", "reason")
        for e in info["checkpoint_engines"]:
            engines.add_row(e["name"], "yes" if e["available"] else "no", e["reason"])
        console.print(engines)
    for name, err in info["plugin_errors"].items():
        console.print(f"[red]plugin {name!r} failed to load:[/red] {err}")
    if not info["device"]:
        print(f"hal: error: {info['device_error']}", file=sys.stderr)
        return 2
    return 0
