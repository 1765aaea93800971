"""The ``hal`` console script (tyro subcommands: info, launch, sync, bench)."""
