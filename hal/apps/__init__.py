"""hal's applications: what runs *on* the API and the consumers, never imported by them.

``hal.apps.cli`` is the ``hal`` command line (tyro); ``hal.apps.benchmarks`` the benchmarks behind
``hal bench`` (they import nothing from the command line); ``hal.apps.errors``, ``hal.apps.shutdown`` and
``hal.apps.multiprocess`` (the process harness of benchmarks and tests) what both share. Imports point down only (``hal.apps`` > ``engines``, ``ckpt`` > ``hal`` > ``devices``), no module
imports another's private name, no circles; import-linter's contracts in ``pyproject.toml`` check it.
"""
