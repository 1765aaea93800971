"""hal's applications: what runs *on* the API and the consumers, never imported by them.

Layers (imports point down only; import-linter's contracts in ``pyproject.toml`` check it, with the two rules
below):

* ``hal.apps`` (this package): may import ``hal``, ``engines``, ``ckpt`` and ``devices``. Inside it:

  - ``hal.apps.cli``: the ``hal`` command line (tyro): ``info``, ``launch``, ``sync``, ``bench``;
  - ``hal.apps.benchmarks``: the benchmarks behind ``hal bench`` (its one entry point); they import nothing
    from the command line, and reach the weight-sync job through one call (``benchmarks.job``); their
    ranks start through torch.distributed's elastic launcher (``benchmarks.ranks``), not the test harness;
  - ``hal.apps.errors``: what both share about arguments (``UsageError``, sizes in MiB);
  - ``hal.apps.shutdown``: how a command ends (its temporary directories removed, Ctrl-C as exit status 130).

* ``engines``, ``ckpt``: consumers of the API; import ``hal`` only (not ``devices``, not each other).
* ``hal`` (every module outside ``hal.apps``): the API; imports ``devices`` only.
* ``devices``: hardware knowledge; imports nothing from the packages above.

Across all of them: no module imports a private (``_name``) name or module of another, and no import circle.
"""
